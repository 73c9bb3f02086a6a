"""Class 9 (sandbox): runs shell commands via subprocess, os.system and libc system().

Each command would create a marker file (__TOKEN__ is replaced by the test)."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import ctypes
import os
import subprocess

_TARGET = "/tmp/evoattn_escape___TOKEN__"


def _spawn():
    try:
        subprocess.run(["sh", "-c", f"touch {_TARGET}_subprocess"], check=False)
    except Exception:  # noqa: BLE001
        pass
    try:
        os.system(f"touch {_TARGET}_system")
    except Exception:  # noqa: BLE001
        pass
    try:
        ctypes.CDLL(None).system(f"touch {_TARGET}_libc".encode())
    except Exception:  # noqa: BLE001
        pass


def attention(q, k, v, causal=False, scale=None):
    _spawn()
    return _math(q, k, v, causal, scale)
