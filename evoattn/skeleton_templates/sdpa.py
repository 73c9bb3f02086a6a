"""${name}: an `sdpa` kernel for evoattn, in Python (written by `evoattn new-kernel`).

What it must compute (`evoattn problems`):
${contract}

Replace the body of attention() with yours (Triton, CUDA through a companion file, ...);
keep its signature. The body here is plain PyTorch: correct and slow. Check it with
`evoattn eval ${name}` (`--device cpu` runs it without a GPU).
"""
from __future__ import annotations

import math

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale [+ causal mask]) v for q, k, v of shape (B, H, S, D)."""
    # ---- your kernel's body: from here ----
    S, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale   # (B, H, S, S)
    if causal:        # query i sees keys 0..i (top-left aligned)
        above = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())            # (B, H, S, D)
    return out.to(q.dtype).contiguous()
    # ---- to here ----
