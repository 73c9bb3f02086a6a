"""Class 4f (hidden work, GPU only): a Triton launch hook that starts the work early.

Triton calls `triton.knobs.runtime.launch_enter_hook` before every kernel it launches. While
the timer's spin was a Triton launch, that hook ran right after the inputs were refilled in
place and before the spin and the start event: work started there on a side stream ran
beside the spin, and the call itself only waited for it. The timer now replays the spin
from a CUDA graph captured before any candidate was imported, so the hook never fires in a
timed repetition and this candidate computes, and is timed, like an honest one.
"""
import torch
import triton

_side = None
_state = {}


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _on_launch(*args, **kwargs):
    """Starts the last call's attention again, on the side stream (the inputs were refilled
    in place, at the same addresses)."""
    last = _state.get("args")
    if last is None:
        return
    with torch.cuda.stream(_side):
        _state["early"] = (_math(*last), [t.data_ptr() for t in last[:3]])


def attention(q, k, v, causal=False, scale=None):
    global _side
    if _side is None:
        _side = torch.cuda.Stream()
        triton.knobs.runtime.launch_enter_hook.add(_on_launch)
    early = _state.pop("early", None)
    _state["args"] = (q, k, v, causal, scale)
    if early is not None and early[1] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]:
        _side.synchronize()
        return early[0]
    return _math(q, k, v, causal, scale)
