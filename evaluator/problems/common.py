"""Helpers shared by the attention-variant problems (child process only, except `pairs_*`)."""
from __future__ import annotations

import math
from typing import Any, Callable

NEG_INF = float("-inf")


def randn(shape: tuple[int, ...], gen: Any, device: Any, dtype: Any) -> Any:
    """Returns standard normal values drawn in float32 from `gen`, then cast to `dtype`."""
    import torch
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def check_dtype(problem: Any, dtype: Any) -> None:
    """Raises ValueError when the problem does not support `dtype`."""
    name = str(dtype).replace("torch.", "")
    if name not in problem.dtypes:
        raise ValueError(f"problem {problem.name} supports dtypes {', '.join(problem.dtypes)}, "
                         f"not {name}")


def masked_attention(q: Any, k: Any, v: Any, scale: float, keep: Any = None,
                     bias: Any = None, compute_dtype: Any = None) -> Any:
    """Returns softmax(q kᵀ·scale + bias, masked where `keep` is False) v.

    Computed in `compute_dtype` (float32 by default: the reference). k and v may have fewer
    heads than q (grouped-query): each key head serves Hq // Hkv consecutive query heads.
    """
    import torch
    dt = compute_dtype or torch.float32
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                   # (B, H, Sq, Sk)
    if bias is not None:
        s = s + bias.to(dt)
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    p = torch.softmax(s.float(), dim=-1).to(dt)
    return torch.matmul(p, v)


def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """Calls torch's scaled_dot_product_attention (the harness's baselines only)."""
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, **kw)


class DeviceCache:
    """Per-process cache of constant tensors (baseline masks) keyed by config and device."""

    def __init__(self) -> None:
        self._items: dict[tuple[Any, ...], Any] = {}

    def get(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._items:
            self._items[key] = make()
        return self._items[key]


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def flops_for_pairs(pairs: int, batch_heads: int, d: int) -> float:
    """Returns 4·D FLOPs (q·k and p·v, a multiply-add each) per visible (query, key) pair."""
    return 4.0 * batch_heads * pairs * d
