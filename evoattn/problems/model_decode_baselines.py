"""The `model_decode` problem's baselines: transformers' attention implementations over a cache.

A model's layer hands its attention function the cache it holds, as long as the longest
sequence (kv_len = max(cache_seqlens)), and the mask of the step: padding, causality among
the new tokens and the window. Here the cache is sliced to kv_len in every call (a view) and
the mask, made from the config's lengths, is built on a config's first call (an untimed
warm-up) and cached, as a model builds it once per step for all its layers. The attention
math is the prefill baselines' (model_baselines.py): eager's softcap and concatenated sinks,
FlexAttention's softcap score_mod and log-sum-exp renormalisation.

Rows that see no key (a length below T) are outside what these paths define (eager spreads
them over the masked keys, SDPA returns NaN): the contract's zeros come from the reference.
"""
from __future__ import annotations

from typing import Any

from .common import sdpa
from .model_baselines import ModelBaselines, _key, repeat_kv

Config = dict[str, Any]


def _keep(inputs: dict[str, Any]) -> Any:
    """Returns the step's boolean mask (B, 1, T, kv_len): key j visible to new token t of
    sequence b (inputs already sliced)."""
    import torch
    from .model_prefill import visible
    q, lens = inputs["q"], inputs["cache_seqlens"].long()
    T, kv_len = q.shape[2], inputs["k"].shape[2]
    pos = lens[:, None, None] - T + torch.arange(T, device=q.device)[None, :, None]  # (B, T, 1)
    j = torch.arange(kv_len, device=q.device)[None, None, :]
    return visible(pos, j, inputs["window"])[:, None]


class ModelDecodeBaselines(ModelBaselines):
    """The prefill baselines' math on the step's mask, plus flash_attn_with_kvcache."""

    def _sliced(self, inputs: dict[str, Any], cfg: Config) -> dict[str, Any]:
        """Returns the inputs with k and v cut to the longest sequence (views). The length is
        read once per config: a model's cache knows it on the host, no call waits for it."""
        def make() -> int:
            return max(1, int(inputs["cache_seqlens"].max()))
        kv_len = self._cache.get(_key(inputs, cfg, "kv_len"), make)
        return {**inputs, "k": inputs["k"][:, :, :kv_len], "v": inputs["v"][:, :, :kv_len]}

    FLASH_FN = "flash_attn_with_kvcache"
    FLASH_ROW = "flash_kvcache"

    # ---- the step's masks, built once per config ----------------------------------------
    def _additive_mask(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns transformers' eager mask (B, 1, T, kv_len): 0 where visible, the dtype's
        min elsewhere."""
        def make() -> Any:
            import torch
            q = inputs["q"]
            zero = torch.zeros((), dtype=q.dtype, device=q.device)
            return torch.where(_keep(inputs), zero, torch.finfo(q.dtype).min)
        return self._cache.get(_key(inputs, cfg, "eager_mask"), make)

    def _bool_mask(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns SDPA's mask (B, 1, T, kv_len), or None where transformers passes none (one
        new token, no padding, no window inside the cache)."""
        def make() -> Any:
            lens, T, kv_len = inputs["cache_seqlens"], inputs["q"].shape[2], inputs["k"].shape[2]
            W = inputs["window"]
            if T == 1 and bool((lens == kv_len).all()) and not 0 < W < kv_len:
                return None
            return _keep(inputs)
        return self._cache.get(_key(inputs, cfg, "bool_mask"), make)

    def _flex_mods(self, inputs: dict[str, Any], cfg: Config) -> tuple[Any, Any]:
        """Returns the config's BlockMask (B, 1, T, kv_len) from the lengths and window, and
        the softcap score_mod (None without a cap), made once per config."""
        def make() -> tuple[Any, Any]:
            import torch
            from torch.nn.attention.flex_attention import create_block_mask
            q, W, cap = inputs["q"], inputs["window"], inputs["softcap"]
            lens = inputs["cache_seqlens"]
            B, T, kv_len = q.shape[0], q.shape[2], inputs["k"].shape[2]

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                pos = lens[b] - T + q_idx
                keep = kv_idx <= pos
                return keep & (kv_idx > pos - W) if W else keep

            def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return cap * torch.tanh(score / cap)
            return (create_block_mask(mask_mod, B, None, T, kv_len, device=str(q.device)),
                    softcap if cap else None)
        return self._cache.get(_key(inputs, cfg, "flex"), make)

    # ---- the rows -------------------------------------------------------------------------
    def eager(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """eager_attention_forward over the cache sliced to the longest sequence."""
        return super().eager(self._sliced(inputs, cfg), cfg)

    def flex(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """flex_attention_forward over the cache sliced to the longest sequence."""
        return super().flex(self._sliced(inputs, cfg), cfg)

    def sdpa(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """sdpa_attention_forward: enable_gqa where there is no mask, else the boolean mask
        and repeat_kv (transformers' use_gqa_in_sdpa)."""
        inputs = self._sliced(inputs, cfg)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        G = q.shape[1] // k.shape[1]
        mask = self._bool_mask(inputs, cfg)
        if mask is None:
            kw = {"enable_gqa": True} if G > 1 else {}
            return sdpa(q, k, v, scale=inputs["scale"], **kw)
        return sdpa(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask, scale=inputs["scale"])

    def flash(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """flash_attn_with_kvcache on (B, S, H, D) views, causal (bottom-right aligned, as the
        contract's new tokens are), window_size=(W - 1, 0), the softcap."""
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        W = inputs["window"]
        out = self._flash(t(inputs["q"]), t(inputs["k"]), t(inputs["v"]),
                          cache_seqlens=inputs["cache_seqlens"], softmax_scale=inputs["scale"],
                          causal=True, window_size=(W - 1, 0) if W else (-1, -1),
                          softcap=inputs["softcap"])
        return out.transpose(1, 2)
