"""Correct in float16, incorrect in bfloat16: it always rounds the answer to float16 and then
hands back those bits as the input's dtype (a kernel that treats bfloat16 as float16)."""
import torch


def attention(q, k, v, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = (torch.softmax(s, -1) @ v.float()).to(torch.float16)
    return out.view(q.dtype) if q.dtype.itemsize == 2 else out.to(q.dtype)
