"""Class 8 (harness tampering): slows the problem's own baseline, so an honest kernel looks fast.

The kernel is correct; only the speedup is forged, by replacing `Sdpa.baseline` (a method of
the problem class, not a module function) with a version that busy-waits 2 ms."""
import time

import torch

from evoattn.problems.sdpa import Sdpa

_baseline = Sdpa.baseline


def _slow(self, inputs, cfg):
    t = time.perf_counter()
    out = _baseline(self, inputs, cfg)
    while time.perf_counter() - t < 0.002:
        pass
    return out


Sdpa.baseline = _slow


def attention(q, k, v, causal=False, scale=None):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
