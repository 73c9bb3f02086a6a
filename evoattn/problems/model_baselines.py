"""The `model` problem's baselines: the attention implementations transformers offers those models.

Each follows the transformers code path it names (eager_attention_forward of Gemma 2 and
GPT-OSS, flex_attention_forward, sdpa_attention_forward, the flash-attn call), on the
contract's (B, H, S, D) layout: the model's final transpose to (B, S, H, D) is left out of
every row alike. What a model builds once per forward and shares across its layers (the
additive mask, the BlockMask) is built on a config's first call, always an untimed warm-up
call, and cached per process.

SDPA cannot express softcap or sinks, nor flash_attn_func sinks: transformers raises there
and the user runs eager. Such a row says so through `applies(cfg)` and is not timed for that
config (evoattn/child/measure.py); called there anyway (a warm-up), it runs the eager path.
"""
from __future__ import annotations

from typing import Any, Callable

from .common import DeviceCache, sdpa

Config = dict[str, Any]
Fn = Callable[[dict[str, Any], Config], Any]


def repeat_kv(x: Any, n: int) -> Any:
    """transformers' repeat_kv: (B, Hkv, S, D) -> (B, Hkv*n, S, D), a copy."""
    if n == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)


def _key(inputs: dict[str, Any], cfg: Config, what: str) -> tuple[Any, ...]:
    q = inputs["q"]                # a tuple, not JSON: a few µs matter in a 0.1 ms call
    return (what, tuple(sorted(cfg.items())), q.device, q.dtype)


class _Row:
    """A baseline for the configs it can express (`applies`); the eager path elsewhere."""

    def __init__(self, fn: Fn, applies: Callable[[Config], bool], eager: Fn) -> None:
        self._fn, self.applies, self._eager = fn, applies, eager

    def __call__(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return (self._fn if self.applies(cfg) else self._eager)(inputs, cfg)


class ModelBaselines:
    """The baselines, with their per-config caches."""

    def __init__(self) -> None:
        self._cache = DeviceCache()
        self._flash: Any = None
        self._flash_why = ""
        self._lse: dict[str, Any] | None = None

    # ---- which baselines exist here -------------------------------------------------------
    FLASH_FN = "flash_attn_func"       # flash-attn's function for this phase, and its row
    FLASH_ROW = "flash_attn"

    def _load_flash(self) -> None:
        """Imports flash-attn once (before any candidate is imported: the kernel-only policy
        blocks the import afterwards); keeps the reason when it cannot."""
        if self._flash is not None or self._flash_why:
            return
        try:
            import flash_attn
            self._flash = getattr(flash_attn, self.FLASH_FN)
        except Exception as e:  # noqa: BLE001 - absent, or built for another torch
            self._flash_why = f"flash-attn is not importable ({type(e).__name__}: {e})"[:200]

    def available(self) -> dict[str, Fn]:
        """Returns the baselines that run here, by name."""
        self._load_flash()
        out: dict[str, Fn] = {"eager": self.eager, "flex_attention": self.flex,
                              "sdpa": _Row(self.sdpa, sdpa_applies, self.eager)}
        if self._flash is not None:
            out[self.FLASH_ROW] = _Row(self.flash, lambda cfg: not cfg["sinks"], self.eager)
        return out

    def skipped(self) -> dict[str, str]:
        """Returns {name: why} for the baselines that cannot run here."""
        self._load_flash()
        return {self.FLASH_ROW: self._flash_why} if self._flash is None else {}

    # ---- eager ----------------------------------------------------------------------------
    def _additive_mask(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns transformers' eager mask (1, 1, S, S): 0 where visible, the dtype's min
        elsewhere (it broadcasts over batch and heads as the model's (B, 1, S, S) one does)."""
        def make() -> Any:
            import torch
            from .model_prefill import visible
            q = inputs["q"]
            idx = torch.arange(q.shape[2], device=q.device)
            keep = visible(idx[:, None], idx[None, :], inputs["window"])
            return additive_mask(keep, q.dtype)[None, None]
        return self._cache.get(_key(inputs, cfg, "eager_mask"), make)

    def eager(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """eager_attention_forward (see eager_attention), with the config's cached mask."""
        return eager_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                               inputs["softcap"], self._additive_mask(inputs, cfg),
                               inputs["sinks"])

    # ---- SDPA -----------------------------------------------------------------------------
    def _bool_mask(self, inputs: dict[str, Any], cfg: Config) -> Any:
        def make() -> Any:
            import torch
            from .model_prefill import visible
            q = inputs["q"]
            idx = torch.arange(q.shape[2], device=q.device)
            return visible(idx[:, None], idx[None, :], inputs["window"])[None, None]
        return self._cache.get(_key(inputs, cfg, "bool_mask"), make)

    def sdpa(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """sdpa_attention_forward: without a window no mask, is_causal and enable_gqa; with
        one a boolean mask (1, 1, S, S) and repeat_kv (transformers keeps enable_gqa for
        calls without a mask)."""
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        G = q.shape[1] // k.shape[1]
        if not inputs["window"]:
            kw = {"enable_gqa": True} if G > 1 else {}
            return sdpa(q, k, v, is_causal=True, scale=inputs["scale"], **kw)
        return sdpa(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=self._bool_mask(inputs, cfg),
                    scale=inputs["scale"])

    # ---- flash-attn -----------------------------------------------------------------------
    def flash(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """flash_attn_func on (B, S, H, D) views, causal, window_size=(W - 1, 0): key j with
        i - (W - 1) <= j <= i, the contract's window."""
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        W = inputs["window"]
        out = self._flash(t(inputs["q"]), t(inputs["k"]), t(inputs["v"]),
                          softmax_scale=inputs["scale"], causal=True,
                          window_size=(W - 1, 0) if W else (-1, -1),
                          softcap=inputs["softcap"])
        return out.transpose(1, 2)

    # ---- FlexAttention --------------------------------------------------------------------
    def _flex_mods(self, inputs: dict[str, Any], cfg: Config) -> tuple[Any, Any]:
        """Returns the config's BlockMask and softcap score_mod (None without a cap), made once:
        the same function object on every call, so the compiled graph is reused."""
        def make() -> tuple[Any, Any]:
            import torch
            from torch.nn.attention.flex_attention import create_block_mask
            q, W, cap = inputs["q"], inputs["window"], inputs["softcap"]
            S = q.shape[2]

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                keep = kv_idx <= q_idx
                return keep & (kv_idx > q_idx - W) if W else keep

            def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return cap * torch.tanh(score / cap)
            return (create_block_mask(mask_mod, None, None, S, S, device=str(q.device)),
                    softcap if cap else None)
        return self._cache.get(_key(inputs, cfg, "flex"), make)

    def _lse_kwargs(self) -> dict[str, Any]:
        """Returns flex_attention's keyword for the log-sum-exp: return_aux from torch 2.9 on,
        return_lse before (as transformers' get_flex_attention_lse_kwargs)."""
        if self._lse is None:
            try:
                from torch.nn.attention.flex_attention import AuxRequest
                self._lse = {"return_aux": AuxRequest(lse=True)}
            except ImportError:
                self._lse = {"return_lse": True}
        return self._lse

    def flex(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """flex_attention_forward: a softcap score_mod, the BlockMask, enable_gqa for a power
        of two of query heads (repeat_kv otherwise), and the log-sum-exp that renormalises
        for the sinks. Compiled on CUDA, as transformers calls it; on the CPU, where the
        compiled kernel cannot return the log-sum-exp, uncompiled (CPU times are not
        benchmarks)."""
        import torch
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        H, sinks = q.shape[1], inputs["sinks"]
        gqa = H & (H - 1) == 0
        if not gqa:
            k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
        block_mask, score_mod = self._flex_mods(inputs, cfg)
        on_gpu = q.device.type != "cpu"
        want_lse = on_gpu or sinks is not None
        out = _flex_fn(on_gpu)(q, k, v, score_mod=score_mod, block_mask=block_mask,
                               enable_gqa=gqa, scale=inputs["scale"],
                               **(self._lse_kwargs() if want_lse else {}))
        if not want_lse:
            return out
        out, lse = out[0], _lse_of(out[1])
        if sinks is None:
            return out
        lse = lse.to(v.dtype)[..., None]                                # (B, H, S, 1)
        col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        combined = torch.logsumexp(torch.cat([lse, col.to(lse.dtype)], dim=-1), dim=-1,
                                   keepdim=True)
        return (out * torch.exp(lse - combined)).to(q.dtype)


def eager_attention(q: Any, k: Any, v: Any, scale: float, softcap: float, mask: Any,
                    sinks: Any) -> Any:
    """eager_attention_forward on (B, H, S, D): Gemma 2's (softcap, float32 softmax) or, with
    sinks, GPT-OSS's (the sinks concatenated as a last column, max subtracted, softmax in the
    scores' dtype, the sink column dropped). mask is additive, broadcasting to (B, H, S, S).
    The sinks are cast to q's dtype, as a model loaded in that dtype holds them."""
    import torch
    import torch.nn.functional as F
    G = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, G), repeat_kv(v, G)
    w = torch.matmul(q, k.transpose(2, 3)) * scale                      # (B, H, S, S)
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    w = w + mask
    if sinks is None:
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        col = sinks.to(q.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
        w = torch.cat([w, col], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
        w = F.softmax(w, dim=-1, dtype=w.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(w, v)


def additive_mask(keep: Any, dtype: Any) -> Any:
    """Returns transformers' eager mask for a boolean one: 0 where kept, the dtype's min
    elsewhere."""
    import torch
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def sdpa_applies(cfg: Config) -> bool:
    """Returns whether SDPA computes the config: no softcap and no sinks."""
    return not cfg["softcap"] and not cfg["sinks"]


def _flex_fn(compiled: bool) -> Any:
    if compiled:
        from .flex import compiled_flex
        return compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


def _lse_of(aux: Any) -> Any:
    return getattr(aux, "lse", aux)
