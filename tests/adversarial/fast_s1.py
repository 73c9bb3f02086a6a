"""Class 12 (implausible speed, honest): exact shortcut for S = 1, plain math otherwise.

With one key, softmax is exactly 1 and the output is v; a copy of v beats SDPA's call
overhead by more than 10x, so the harness flags it and re-verifies on fresh inputs."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, causal=False, scale=None):
    if q.shape[-2] == 1:
        return v.clone()
    return _math(q, k, v, causal, scale)
