"""Incorrect on purpose: ignores the scale argument (uses 1.0)."""
import torch


def attention(q, k, v, causal=False, scale=None):
    s = q.float() @ k.float().transpose(-1, -2)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
