"""Seed for `sdpa`: attention as three plain torch ops (matmul, softmax, matmul).

Correct and slow: it materialises the full (B, H, S, S) score matrix in float32.
It runs on CPU and CUDA and uses no library attention kernel (no SDPA, flash-attn,
xformers or cuDNN attention), so it is allowed under the default policy.
"""
from __future__ import annotations

import math

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale [+ top-left causal mask]) v in q's dtype, computed in float32."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"expected q, k, v of one shape (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype among float16/bfloat16/float32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    S, D = q.shape[-2], q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    # .float() copies half inputs and returns float32 inputs as they are; nothing below
    # writes in place into these tensors, so the caller's inputs stay unmodified.
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale        # (B, H, S, S) float32
    if causal:
        # Top-left aligned: query i sees keys 0..i, so everything above the diagonal goes.
        above = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    probs = torch.softmax(scores, dim=-1)                           # (B, H, S, S) float32
    out = torch.matmul(probs, vf)                                   # (B, H, S, D) float32
    return out.to(q.dtype).contiguous()
