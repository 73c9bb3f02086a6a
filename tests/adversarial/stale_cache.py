"""Class 1 (stale output): caches results by (pointer, shape) and returns the cache on a hit.

Correct on every correctness trial (each trial has its own tensors; the repeat call sees
the same values), wrong in the timing pass, where inputs are refilled at the same addresses."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


_cache = {}


def attention(q, k, v, causal=False, scale=None):
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), causal)
    if key not in _cache:
        _cache[key] = _math(q, k, v, causal, scale)
    return _cache[key]
