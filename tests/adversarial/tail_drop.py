"""Class 7 (shape specialisation): handles whole 64-row tiles only and leaves the tail zero.

Right for S = 128 (the benchmark shape on CPU); wrong for S = 77 and 33."""
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
    S = q.shape[-2]
    full = S - S % 64
    out = torch.zeros_like(q)
    if full:
        out[..., :full, :] = _math(q, k, v, causal, scale)[..., :full, :]
    return out
