"""Class 5 (library attention): honest in the checks, torch SDPA (name built at run time) only
under the timer, found by stack inspection. The tripwire raises, and the verdict must name the
policy, not a crash."""
import sys

import torch
import torch.nn.functional as F


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _timed():
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith("timing.py"):
            return True
        f = f.f_back
    return False


def attention(q, k, v, causal=False, scale=None):
    if not _timed():
        return _math(q, k, v, causal, scale)
    return getattr(F, "scaled_" + "dot_product_attention")(q, k, v, is_causal=causal, scale=scale)
