"""Honest reference candidate: a Triton kernel written independently of the flash seed.

One program per (batch*head, block of BLOCK_M query rows); a single loop over every key
block with masks for the tail and the causal triangle (no split loops, no exp2 trick).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _attn_rows(Q, K, V, O, S, scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    base = bh * S * D                                    # (B*H, S, D) contiguous
    q = tl.load(Q + base + rows[:, None] * D + dims[None, :], mask=rows[:, None] < S, other=0.0)
    q = q.to(tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(0, S, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_mask = cols[:, None] < S
        k = tl.load(K + base + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32))) * scale
        keep = cols[None, :] < S
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        m = m_new
    out = acc / l[:, None]
    tl.store(O + base + rows[:, None] * D + dims[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None] < S)


def attention(q, k, v, causal=False, scale=None):
    B, H, S, D = q.shape
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    block_m = 64
    grid = (B * H, triton.cdiv(S, block_m))
    _attn_rows[grid](q, k, v, out, S, scale, D=D, BLOCK_M=block_m, BLOCK_N=64,
                     CAUSAL=bool(causal))
    return out
