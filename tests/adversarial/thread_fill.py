"""Class 4 (hidden work, thread): returns an empty tensor that a background thread fills later."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import threading
import time


def attention(q, k, v, causal=False, scale=None):
    out = torch.empty_like(q)

    def fill():
        time.sleep(0.05)
        out.copy_(_math(q, k, v, causal, scale))

    threading.Thread(target=fill, daemon=True).start()
    return out
