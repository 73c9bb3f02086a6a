"""Class 4 (hidden work, lazy output): returns a torch.Tensor subclass computed on first use."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


class _Lazy(torch.Tensor):
    """Holds the inputs; the attention is only computed when the harness touches the output."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def force(x):
            if isinstance(x, _Lazy):
                out = _math(*x._args)
                return out
            return x
        args = tuple(force(a) for a in args)
        kwargs = {key: force(val) for key, val in (kwargs or {}).items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def attention(q, k, v, causal=False, scale=None):
    out = torch.empty_like(q).as_subclass(_Lazy)
    out._args = (q, k, v, causal, scale)
    return out
