"""Class 5 (library attention): imports flash-attn under a built-up name, math if missing."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import importlib

try:
    _lib = importlib.import_module("flash" + "_attn")
except ImportError:
    _lib = None


def attention(q, k, v, causal=False, scale=None):
    if _lib is not None:
        fn = getattr(_lib, "flash" + "_attn" + "_func")
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                  softmax_scale=scale).transpose(1, 2)
    return _math(q, k, v, causal, scale)
