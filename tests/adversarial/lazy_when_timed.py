"""Class 4 (hidden work): honest, except under the timer, where it returns a lazy subclass.

It looks for the evaluator's timing module on the call stack, so every correctness check
sees a plain, correct tensor; the timed calls return instantly and the work happens when
the harness later clones or compares the kept outputs."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import sys


class _Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def force(x):
            return _math(*x._args) if isinstance(x, _Lazy) else x
        args = tuple(force(a) for a in args)
        kwargs = {key: force(val) for key, val in (kwargs or {}).items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


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
    out = torch.empty_like(q).as_subclass(_Lazy)
    out._args = (q, k, v, causal, scale)
    return out
