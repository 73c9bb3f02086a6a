"""Seed for the alibi problem: causal flash attention with the ALiBi bias computed in-kernel.

score(i, j) = q_i·k_j * scale - slope_h * (i - j) for j <= i. The bias is never
materialised: each tile adds it from the row and column indices. One program computes
one (BLOCK_M, D) output tile of one (batch, head) with the online softmax.

Knobs: BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, USE_EXP2 (exp2 with log2(e) folded into
the scale and the slope), CAUSAL_SPLIT (an unmasked loop over the blocks below the
diagonal, then a masked diagonal loop; False masks every block).
"""
import math
import os

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
BLOCK_N = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS = 4  # evoattn: choice(2, 4, 8)
NUM_STAGES = 2  # evoattn: choice(1, 2, 3, 4)
USE_EXP2 = True  # evoattn: choice(True, False)
CAUSAL_SPLIT = True  # evoattn: choice(True, False)

LOG2E = 1.44269504  # log2(e) = 1/ln 2


@triton.jit
def _inner(acc, l_i, m_i, q, K, V, head, offs_m, lo, hi, S, qk_scale, slope,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_off, mask=cols[:, None] < S, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = s - slope * (offs_m[:, None] - cols[None, :]).to(tl.float32)   # ALiBi, in-register
        if MASKED:
            s = tl.where((cols[None, :] <= offs_m[:, None]) & (cols[None, :] < S), s,
                         float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        if EXP2:
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + kv_off, mask=cols[:, None] < S, other=0.0)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _alibi_fwd(Q, K, V, O, SLOPES, S, H, qk_scale, slope_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SPLIT: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    slope = tl.load(SLOPES + bh % H) * slope_scale
    head = bh.to(tl.int64) * S * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < S, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, S)
    if SPLIT:
        split = ((start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        split = 0
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, 0, split, S, qk_scale, slope,
                           HEAD_DIM, BLOCK_N, False, EXP2, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, split, hi, S, qk_scale, slope,
                           HEAD_DIM, BLOCK_N, True, EXP2, DOT_PRECISION, UPCAST)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(out_dtype)
    tl.store(O + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < S)


def attention(q, k, v, slopes, scale=None):
    """Returns causal ALiBi attention of contiguous (B, H, S, D) inputs; slopes: float32 (H,)."""
    B, H, S, D = q.shape
    if k.shape != q.shape or v.shape != q.shape or D not in (64, 128):
        raise ValueError(f"expected q, k, v of one shape (B, H, S, D in {{64, 128}}), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty_like(q)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    upcast = interp and q.dtype == torch.bfloat16        # the interpreter's bf16 dot is wrong
    f = LOG2E if USE_EXP2 else 1.0
    grid = (triton.cdiv(S, BLOCK_M), B * H)
    _alibi_fwd[grid](q, k, v, out, slopes, S, H, scale * f, f,
                     HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=CAUSAL_SPLIT,
                     EXP2=USE_EXP2,
                     DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                     UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
