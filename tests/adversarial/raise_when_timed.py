"""Class 11 (crash): honest in the checks, raises an exception with an empty message under the
timer. The verdict must be a crash naming the exception, not an aborted evaluation."""
import sys

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
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith("timing.py"):
            raise RuntimeError()
        f = f.f_back
    return _math(q, k, v, causal, scale)
