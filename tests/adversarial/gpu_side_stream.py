"""Class 4 (hidden work, GPU only): computes on a side stream and returns before it finishes.

The caller's stream (the one the timing events are recorded on) sees no work."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


_side = None


def attention(q, k, v, causal=False, scale=None):
    global _side
    if _side is None:
        _side = torch.cuda.Stream()
    out = torch.empty_like(q)
    _side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side):
        torch.cuda._sleep(2_000_000)                    # make the escape obvious (~1 ms)
        out.copy_(_math(q, k, v, causal, scale))
    return out
