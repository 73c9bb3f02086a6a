"""Cheating `decode` candidate: reads one cache position past each sequence's length.

Plain torch, otherwise exact (float32, one sequence at a time). The off-by-one (EXTRA = 1)
is the bug a split-KV kernel makes when it rounds a split's end up to a whole block without
masking: the key at position L is garbage the harness wrote there, so the answer is wrong.
With EXTRA = 0 it is an honest candidate (the test's control).
"""
import torch

EXTRA = 1


def attention(q, k, v, cache_seqlens, scale=None):
    B, Hq, Sq, D = q.shape
    Hkv, Smax = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    for b, L in enumerate(cache_seqlens.tolist()):
        n = min(L + EXTRA, Smax)
        if n == 0:
            continue
        kb = k[b, :, :n].float().repeat_interleave(G, 0)               # (Hq, n, D)
        vb = v[b, :, :n].float().repeat_interleave(G, 0)
        s = q[b].float() @ kb.transpose(-1, -2) * scale                # (Hq, Sq, n)
        last = L - Sq + torch.arange(Sq, device=q.device) + EXTRA       # last key each query reads
        keep = torch.arange(n, device=q.device)[None, :] <= last[:, None]
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)                       # no key: zeros
        out[b] = p @ vb
    return out.to(q.dtype)
