"""Class 2 (leftover memory): writes only the first half of the rows of a torch.empty output.

Relies on the other half still holding a correct answer from a freed buffer of the same size."""
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
    out = torch.empty_like(q)
    half = q.shape[-2] // 2
    # Rows are independent (causal masks only look left), so the first half is honest.
    out[..., :half, :] = _math(q[..., :half, :], k, v, False, scale) if not causal else \
        _math(q, k, v, True, scale)[..., :half, :]
    return out
