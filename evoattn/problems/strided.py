"""`strided`: causal strided sparse attention, query i sees keys j <= i with j % stride == 0."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Config, OpDocs
from .common import CausalKeyMaskProblem, sdpa

if TYPE_CHECKING:
    from .op import OpSpec


def _cfg(b: int, h: int, s: int, d: int, stride: int) -> Config:
    return {"B": b, "H": h, "S": s, "D": d, "stride": stride}


def visible(i: Any, j: Any, stride: int) -> Any:
    """Returns whether query i sees key j (index tensors): j <= i and j % stride == 0."""
    return (j <= i) & (j % stride == 0)


def visible_pairs(S: int, stride: int) -> int:
    """Returns the number of (i, j) with j <= i < S and j % stride == 0."""
    return sum(i // stride + 1 for i in range(S))


class Strided(CausalKeyMaskProblem):
    name = "strided"
    summary = "strided sparse causal attention: query i sees keys j <= i with j % stride == 0"
    contract = (
        "Compute out = softmax(q @ k^T * scale + M) @ v for q, k, v of shape (B, H, S, D), "
        "contiguous, dtype float16/bfloat16/float32, where M[i, j] = 0 if j <= i and "
        "j % stride == 0, else -inf (query i attends only to keys 0, stride, 2*stride, ... up "
        "to i; key 0 is always visible, so no row is empty). Call: attention(q, k, v, "
        "stride=int, scale=float). The output has the shape, dtype and device of q. Must be "
        "correct for any S >= 1, stride >= 1, D in {64, 128}. Inputs must not be modified. "
        "Accumulate in float32. FLOPs count only the visible (query, key) pairs: "
        "4 * B * H * D * sum_i (i // stride + 1). Baselines: PyTorch SDPA with a boolean "
        "attn_mask (it computes the full S x S), compiled FlexAttention with a BlockMask, and "
        "SDPA on the gathered visible keys; fitness is the speedup over the fastest."
    )
    default_configs = tuple(_cfg(2, 32, 4096, 64, st) for st in (2, 4, 8)) + \
        (_cfg(4, 16, 2048, 128, 4),)
    cpu_configs = (_cfg(1, 2, 128, 64, 2), _cfg(1, 2, 128, 64, 8))
    domain_configs = (_cfg(1, 3, 77, 64, 3), _cfg(2, 2, 1000, 128, 8), _cfg(1, 1, 1, 64, 4),
                      _cfg(1, 2, 1000, 64, 5), _cfg(1, 2, 300, 64, 1))
    cpu_domain_configs = (_cfg(1, 1, 77, 64, 3), _cfg(1, 1, 33, 128, 1))
    domain = "any B, H >= 1; any S >= 1; any stride >= 1; D in {64, 128}"
    implausible_speedup = 40.0      # skipping (stride-1)/stride of the keys is a real win

    baseline_name = ("the fastest of SDPA with a boolean mask, compiled FlexAttention, and "
                     "SDPA on the gathered visible keys")
    baseline_names = ("sdpa_mask", "flex", "gather_sdpa")
    op_docs = OpDocs(call="attention(q, k, v, stride=4)",
                     replaces="an SDPA call with a strided causal mask",
                     shapes="q, k, v: (B, H, S, D); query i sees keys j <= i with j % 4 == 0")
    param = "stride"
    visible = staticmethod(visible)
    visible_pairs = staticmethod(visible_pairs)

    def baselines(self) -> dict[str, Any]:
        return {**super().baselines(), "gather_sdpa": self.gather_sdpa}

    def gather_sdpa(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Gathers the keys a stride makes visible (every stride-th), then runs SDPA with the
        causal part of the mask on them: 1/stride of the dense work."""
        q, stride = inputs["q"], inputs["stride"]
        k, v = inputs["k"][:, :, ::stride], inputs["v"][:, :, ::stride]
        S, Sk = q.shape[2], k.shape[2]

        def make() -> Any:
            import torch
            i = torch.arange(S, device=q.device)[:, None]
            m = torch.arange(Sk, device=q.device)[None, :]
            return m * stride <= i
        keep = self._masks.get(("gather", S, stride, str(q.device)), make)
        return sdpa(q, k, v, attn_mask=keep, scale=inputs["scale"])


PROBLEM = Strided


def op_spec() -> OpSpec:
    """Returns the op's spec: SDPA with the stride's boolean mask falls back; no transformers
    mapping (no model attends this way)."""
    from .op import keep_mask, param_spec, sdpa_mask

    def fallback(q: Any, k: Any, v: Any, stride: int, scale: float | None = None) -> Any:
        keep = keep_mask(q.shape[2], q.device, lambda i, j: visible(i, j, stride))
        return sdpa_mask(q, k, v, keep, scale)

    return param_spec("stride", fallback)
