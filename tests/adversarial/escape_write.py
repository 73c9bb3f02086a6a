"""Class 9 (sandbox): writes, renames and creates directories outside its temp dir.

__TOKEN__ is replaced by the test with a random string; the files must not exist afterwards."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import os

_TARGET = "/tmp/evoattn_escape___TOKEN__"


def _escape():
    try:
        with open(_TARGET, "w") as f:
            f.write("escaped")
    except OSError:
        pass
    try:
        with open("inside.txt", "w") as f:                 # allowed: its own directory
            f.write("escaped")
        os.rename("inside.txt", _TARGET + "_renamed")
    except OSError:
        pass
    try:
        os.mkdir(_TARGET + "_dir")
    except OSError:
        pass


def attention(q, k, v, causal=False, scale=None):
    _escape()
    return _math(q, k, v, causal, scale)
