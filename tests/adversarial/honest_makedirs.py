"""Honest: asks for a directory that already exists outside its own (as libraries do)."""
import os

import torch


def attention(q, k, v, causal=False, scale=None):
    os.makedirs(os.path.dirname(torch.__file__), exist_ok=True)   # exists: changes nothing
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
