"""Call-mode hidden work: honest everywhere but under the call-mode timer (found by stack
inspection, as lazy_when_timed.py finds the timer), where it returns an empty output at once
and fills it in at the start of its next call. Each call then costs one call's work, but the
last call of a back-to-back batch is never finished: timing that did not check the batch's
last output would time it at the cost of the others."""
import sys

import torch

_pending = []


def _under_call_mode():
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_call_mode":
            return True
        f = f.f_back
    return False


def _math(q, k, v, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    back_to_back = _under_call_mode()
    while _pending:                      # finish what the previous call left undone
        out, args = _pending.pop()
        out.copy_(_math(*args))
    if back_to_back:
        out = torch.empty_like(q)
        _pending.append((out, (q.clone(), k.clone(), v.clone(), causal, scale)))
    else:
        out = _math(q, k, v, causal, scale)
    return out
