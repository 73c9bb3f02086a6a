"""`sliding_window`: causal attention over the last W keys (query i sees keys i-W+1 .. i)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Config, OpDocs
from .common import CausalKeyMaskProblem

if TYPE_CHECKING:
    from .op import OpSpec


def _cfg(b: int, h: int, s: int, d: int, window: int) -> Config:
    return {"B": b, "H": h, "S": s, "D": d, "window": window}


def visible(i: Any, j: Any, window: int) -> Any:
    """Returns whether query i sees key j (index tensors): i - window < j <= i."""
    return (j <= i) & (j > i - window)


def visible_pairs(S: int, window: int) -> int:
    """Returns the number of (i, j) with max(0, i-W+1) <= j <= i < S."""
    return sum(min(i + 1, window) for i in range(S))


class SlidingWindow(CausalKeyMaskProblem):
    name = "sliding_window"
    summary = "causal sliding-window attention: query i sees keys max(0, i-W+1) .. i"
    contract = (
        "Compute out = softmax(q @ k^T * scale + M) @ v for q, k, v of shape (B, H, S, D), "
        "contiguous, dtype float16/bfloat16/float32, where M[i, j] = 0 if "
        "i - window < j <= i, else -inf: query i attends to the `window` keys "
        "max(0, i-window+1) .. i (itself included, so no row is empty). Call: "
        "attention(q, k, v, window=int, scale=float). The output has the shape, dtype and "
        "device of q. Must be correct for any S >= 1 and window >= 1 (window >= S is plain "
        "causal attention), D in {64, 128}. Inputs must not be modified. Accumulate in "
        "float32. FLOPs count only the visible pairs: 4 * B * H * D * sum_i min(i+1, window). "
        "Baselines: PyTorch SDPA with a boolean attn_mask (it computes the full S x S) and "
        "compiled FlexAttention with a BlockMask; fitness is the speedup over the faster."
    )
    default_configs = (_cfg(2, 32, 4096, 64, 512), _cfg(2, 32, 4096, 64, 1024),
                       _cfg(1, 32, 8192, 64, 512), _cfg(4, 16, 4096, 128, 256))
    cpu_configs = (_cfg(1, 2, 128, 64, 32),)
    domain_configs = (_cfg(1, 3, 77, 64, 16), _cfg(2, 2, 1000, 128, 100), _cfg(1, 1, 1, 64, 8),
                      _cfg(1, 2, 300, 64, 1), _cfg(1, 2, 200, 64, 512))
    cpu_domain_configs = (_cfg(1, 1, 77, 64, 10), _cfg(1, 1, 40, 128, 64), _cfg(1, 1, 20, 64, 1))
    domain = "any B, H >= 1; any S >= 1; any window >= 1; D in {64, 128}"
    implausible_speedup = 40.0      # a 512-of-8192 window skips 94% of the causal work

    op_docs = OpDocs(call="attention(q, k, v, window=512)",
                     replaces="an SDPA call with a window mask",
                     shapes="q, k, v: (B, H, S, D); query i sees keys i-511 .. i")

    param = "window"
    visible = staticmethod(visible)
    visible_pairs = staticmethod(visible_pairs)


PROBLEM = SlidingWindow


def op_spec() -> OpSpec:
    """Returns the op's spec: SDPA with the window's boolean mask falls back; transformers'
    causal calls pass the model's sliding_window (a plain causal call: the whole sequence)."""
    from .op import keep_mask, param_spec, repeat_kv, sdpa_mask

    def fallback(q: Any, k: Any, v: Any, window: int, scale: float | None = None) -> Any:
        keep = keep_mask(q.shape[2], q.device, lambda i, j: visible(i, j, window))
        return sdpa_mask(q, k, v, keep, scale)

    def hf_call(attention: Any, q: Any, k: Any, v: Any, mask: Any, scale: float | None,
                window: int | None, causal: bool) -> Any:
        if not causal:
            return None
        return attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]),
                         window=int(window or q.shape[2]), scale=scale)

    return param_spec("window", fallback, hf_call=hf_call, hf_window=True)
