"""Honest reference candidate: online softmax over key blocks in plain torch (no library attention).

Written independently of the seeds: keys and values are consumed in blocks of 32 with a
running row maximum and sum, as a flash kernel would, all in float32.
"""
import torch

BLOCK_N = 32


def attention(q, k, v, causal=False, scale=None):
    B, H, S, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    qf = q.float() * scale                                    # (B, H, S, D)
    m = torch.full((B, H, S, 1), float("-inf"), device=q.device)
    l = torch.zeros((B, H, S, 1), device=q.device)
    acc = torch.zeros((B, H, S, D), device=q.device)
    rows = torch.arange(S, device=q.device).view(S, 1)
    for start in range(0, S, BLOCK_N):
        kb = k[:, :, start:start + BLOCK_N].float()          # (B, H, n, D)
        vb = v[:, :, start:start + BLOCK_N].float()
        s = qf @ kb.transpose(-1, -2)                         # (B, H, S, n)
        if causal:
            cols = torch.arange(start, start + kb.shape[2], device=q.device).view(1, -1)
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row with every key masked so far keeps m = -inf; exp(-inf - -inf) would be NaN.
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(s - safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ vb
        m = m_new
    return (acc / l).to(q.dtype)
