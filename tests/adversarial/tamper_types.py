"""Class 8 (harness tampering): replaces `Times.in_mode` in evoattn.contract.types, which scoring reads
every time from, so the candidate's time in the fitness mode is divided by 100. A module the
harness never calls through directly, but its stages do."""
import torch

import evoattn.contract.types

_real = evoattn.contract.types.Times.in_mode


def _faster(self, mode):
    t = _real(self, mode)
    return None if t is None else t / 100


evoattn.contract.types.Times.in_mode = _faster


def attention(q, k, v, causal=False, scale=None):
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)
