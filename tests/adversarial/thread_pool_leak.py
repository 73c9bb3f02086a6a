"""Cheat class 4 (background threads): each call starts a fresh worker pool that stays alive.

The workers run library code (concurrent.futures), not this file, so only the OS-thread
count betrays them: a candidate that parks work on threads between calls.
"""
import concurrent.futures
import threading

import torch

_pools = []
_never = threading.Event()


def attention(q, k, v, causal=False, scale=None):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=12)
    for _ in range(12):
        pool.submit(_never.wait)        # a stdlib function: no frame of this file runs there
    _pools.append(pool)                 # never shut down
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
