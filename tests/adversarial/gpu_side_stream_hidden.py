"""Class 4e (hidden work, GPU only): computes on a side stream that does not wait for the
caller's stream, so it can run while the timer's spin runs (before the start event), and
waits for it on the host before returning. The caller's stream sees no work, and the call
takes long on the host anyway, so the host cross-check has nothing to compare.

Against a one-thread spin the side work hid inside the spin's 0.5 ms; the timer's spin now
holds every SM (evoattn/child/spin.py), so the side work runs after the start event and is timed.
"""
import torch

SIDE_SLEEP_CYCLES = 400_000          # ~0.2 ms: lets the timer's input refill finish first


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
    with torch.cuda.stream(_side):                 # no wait_stream: free to start at once
        torch.cuda._sleep(SIDE_SLEEP_CYCLES)
        out.copy_(_math(q, k, v, causal, scale))
    _side.synchronize()                             # done before the call returns
    return out
