"""Honest candidate with a prepare(): later calls of a key skip the entry's argument handling
(the scale is worked out once per key), as the default seed's prepared launches do."""
import torch


def _math(q, k, v, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, causal=False, scale=None):
    return _math(q, k, v, bool(causal), q.shape[-1] ** -0.5 if scale is None else scale)


def prepare(q, k, v, causal=False, scale=None):
    fixed = (bool(causal), q.shape[-1] ** -0.5 if scale is None else scale)

    def prepared(q, k, v, causal=False, scale=None):
        return _math(q, k, v, *fixed)
    return prepared
