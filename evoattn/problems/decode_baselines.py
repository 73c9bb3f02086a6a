"""The `decode` problem's reference and baselines: what a PyTorch user would run for one
decode step.

What a model builds once per step and shares across its layers (transformers' padding mask,
FlexAttention's BlockMask) is built on a config's first call, which is always an untimed
warm-up call, and cached per process; what each layer's attention call does (slicing the
cache, packing or repeating heads for GQA, the attention itself) stays in every call.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from .common import DeviceCache, sdpa

Config = dict[str, Any]
Fn = Callable[[dict[str, Any], Config], Any]


def _key(inputs: dict[str, Any], cfg: Config, what: str) -> tuple[Any, ...]:
    lens = inputs["cache_seqlens"]
    return (what, json.dumps(cfg, sort_keys=True, default=str), str(lens.device),
            lens.data_ptr())


def decode_attention(q: Any, k: Any, v: Any, lens: list[int], scale: float,
                     round_p: Any = None) -> Any:
    """Returns the float32 answer, one sequence at a time over its valid prefix only (no
    repeated k/v: the G query heads of a key/value head are the rows of one matmul).

    With `round_p` (a dtype), the unnormalised probabilities are rounded to it before P·V
    and the output is returned in it: the rounding a flash kernel does (scores and sums in
    float32), which sets the tolerance."""
    import torch
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    pos = torch.arange(Sq, device=q.device).repeat(G)                 # row g*Sq + i -> i
    for b, L in enumerate(lens):
        if L == 0:
            continue
        qb = q[b].float().reshape(Hkv, G * Sq, D)                     # (Hkv, G*Sq, D)
        kb, vb = k[b, :, :L].float(), v[b, :, :L].float()             # (Hkv, L, D)
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale            # (Hkv, G*Sq, L)
        keep = torch.arange(L, device=q.device)[None, :] <= (L - Sq + pos)[:, None]
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)        # rows with no key
        p = torch.exp(s - m)                                          # 0 where hidden
        l = p.sum(-1, keepdim=True)
        if round_p is not None:
            p = p.to(round_p).float()
        o = torch.matmul(p, vb) / torch.where(l > 0, l, torch.ones_like(l))
        out[b] = o.reshape(Hq, Sq, D)
    return out if round_p is None else out.to(round_p)


class DecodeBaselines:
    """The baselines, with their per-config caches."""

    def __init__(self) -> None:
        from .flex import FlexBaseline, FlexPattern
        self._cache = DeviceCache()

        def pattern(inputs: dict[str, Any], cfg: Config) -> FlexPattern:
            q, k, lens = inputs["q"], inputs["k"], inputs["cache_seqlens"]
            B, Sq, Smax = q.shape[0], q.shape[2], k.shape[2]

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return kv_idx <= lens[b] - Sq + q_idx
            return FlexPattern(mask_mod, None, B, None, Sq, Smax)

        self.flex = FlexBaseline(pattern)
        self._flash: Any = None
        self._flash_why = ""

    # ---- which baselines exist here -------------------------------------------------------
    def _load_flash(self) -> None:
        """Imports flash-attn once (before any candidate is imported: the kernel-only policy
        blocks the import afterwards); keeps the reason when it cannot."""
        if self._flash is not None or self._flash_why:
            return
        try:
            from flash_attn import flash_attn_with_kvcache
            self._flash = flash_attn_with_kvcache
        except Exception as e:  # noqa: BLE001 - absent, or built for another torch
            self._flash_why = f"flash-attn is not importable ({type(e).__name__}: {e})"[:200]

    def available(self) -> dict[str, Fn]:
        """Returns the baselines that run here, by name."""
        self._load_flash()
        out: dict[str, Fn] = {"sdpa_hf": self.sdpa_hf, "flex": self.flex}
        if self._flash is not None:
            out["flash_kvcache"] = self.flash_kvcache
        return out

    def skipped(self) -> dict[str, str]:
        """Returns {name: why} for the baselines that cannot run here."""
        self._load_flash()
        return {"flash_kvcache": self._flash_why} if self._flash is None else {}

    # ---- SDPA -----------------------------------------------------------------------------
    def _hf_mask(self, inputs: dict[str, Any], cfg: Config) -> tuple[Any, int]:
        """Returns transformers' boolean mask (B, 1, Sq, kv_len) for the step, or None where
        it passes none (one new token and no padding), and kv_len: the dynamic cache's
        length, the longest sequence."""
        def make() -> tuple[Any, int]:
            import torch
            q, lens = inputs["q"], inputs["cache_seqlens"]
            Sq = q.shape[2]
            kv_len = max(1, int(lens.max()))
            if Sq == 1 and bool((lens == kv_len).all()):
                return None, kv_len
            j = torch.arange(kv_len, device=q.device)[None, None, :]
            i = torch.arange(Sq, device=q.device)[None, :, None]
            last = lens.long()[:, None, None] - Sq + i              # each query's last key
            return (j <= last)[:, None], kv_len
        return self._cache.get(_key(inputs, cfg, "hf_mask"), make)

    def sdpa_hf(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """SDPA as transformers' sdpa_attention_forward calls it over a dynamic cache: GQA by
        enable_gqa without a mask, by packing the query heads for one new token (the mask
        broadcasts over them), else by repeat_kv (a copy of the cache per query head)."""
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        mask, kv_len = self._hf_mask(inputs, cfg)
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        B, Hq, Sq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        kw: dict[str, Any] = {}
        if G > 1:
            if mask is None:
                kw["enable_gqa"] = True
            elif Sq == 1:
                q = q.reshape(B, Hkv, G, D)
            else:
                k, v = _repeat_kv(k, G), _repeat_kv(v, G)
        out = sdpa(q, k, v, attn_mask=mask, scale=inputs["scale"], **kw)
        return out.reshape(B, Hq, Sq, D)

    def sdpa_gqa_mask(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """SDPA with enable_gqa=True and the padding mask (a diagnostic: on CUDA a mask with
        enable_gqa takes the math kernel)."""
        mask, kv_len = self._hf_mask(inputs, cfg)
        k, v = inputs["k"][:, :, :kv_len], inputs["v"][:, :, :kv_len]
        return sdpa(inputs["q"], k, v, attn_mask=mask, scale=inputs["scale"], enable_gqa=True)

    def naive(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """The reference's loop over sequences in the inputs' dtype (a diagnostic)."""
        q = inputs["q"]
        return decode_attention(q, inputs["k"], inputs["v"], inputs["cache_seqlens"].tolist(),
                                inputs["scale"], round_p=q.dtype)

    # ---- flash-attn ---------------------------------------------------------------------------
    def flash_kvcache(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """flash_attn_with_kvcache on (B, S, H, D) views of the (B, H, S, D) tensors (it takes
        any row and head strides), causal: bottom-right aligned, as the contract's queries are."""
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        out = self._flash(t(inputs["q"]), t(inputs["k"]), t(inputs["v"]),
                          cache_seqlens=inputs["cache_seqlens"], softmax_scale=inputs["scale"],
                          causal=True)
        return out.transpose(1, 2)


def _repeat_kv(x: Any, n: int) -> Any:
    """transformers' repeat_kv: (B, Hkv, S, D) -> (B, Hkv*n, S, D), a copy."""
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)
