"""Class 8 (harness tampering): replaces the clocks, CUDA sync/events and the error check.

Returns zeros, which only "pass" if the patched max_abs_err is believed."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import time

import evoattn.child.checks

time.perf_counter = lambda: 0.0
torch.cuda.Event.elapsed_time = lambda self, end: 1e-6
torch.cuda.synchronize = lambda device=None: None
evoattn.child.checks.max_abs_err = lambda out, ref: 0.0


def attention(q, k, v, causal=False, scale=None):
    return torch.zeros_like(q)
