"""Class 5 (library attention): tries SDPA by a hidden name and falls back to math if refused.

The tripwire records the attempt, so swallowing its exception does not help."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import torch.nn.functional as F


def attention(q, k, v, causal=False, scale=None):
    try:
        fn = getattr(F, "".join(["scaled", "_dot", "_product", "_attention"]))
        return fn(q, k, v, is_causal=causal, scale=scale)
    except Exception:  # noqa: BLE001
        return _math(q, k, v, causal, scale)
