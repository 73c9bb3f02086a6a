"""Class 1 (stale output) through prepare(): the entry is honest, but what prepare() returns
for later calls of a key gives back the preparing call's output.

The evaluator (and an exported package) run prepare()'s function from a key's second call
on, so the stale output must be caught there."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, causal=False, scale=None):
    return _math(q, k, v, causal, scale)


def prepare(q, k, v, causal=False, scale=None):
    kept = _math(q, k, v, causal, scale)

    def prepared(q, k, v, causal=False, scale=None):
        return kept.clone()
    return prepared
