"""Seed for `gqa`: a flash-attention Triton kernel where query head h reads key/value head h // G.

q is (B, Hq, S, D), k and v are (B, Hkv, S, D) with G = Hq // Hkv query heads per key
head. Nothing is repeated in memory: each program computes one (BLOCK_M, D) output tile
of one (batch, query head) and streams the tiles of its shared key/value head (the G
programs of a group run next to each other, so that head stays hot in L2). Online
softmax with a running max, running sum and float32 accumulator.

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  tile sizes and launch settings
  USE_EXP2      exp2 with log2(e) folded into the scale, instead of exp
  CAUSAL_SPLIT  causal only: an unmasked loop over the key blocks every row sees, then a
                masked loop over the diagonal band; when False every block is masked
Correct for any S >= 1 and Hq % Hkv == 0.
"""
from __future__ import annotations

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

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, lo, hi, S, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           CAUSAL: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
           UPCAST: tl.constexpr):
    """Folds key blocks [lo, hi) of one key/value head into (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=cols[:, None] < S, other=0.0)
        else:
            k = tl.load(K + kv_off)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = cols[None, :] < S
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)      # no -inf - -inf = NaN
        if EXP2:
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(V + kv_off, mask=cols[:, None] < S, other=0.0)
        else:
            v = tl.load(V + kv_off)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


# Sequence lengths are not specialised: one compiled kernel serves every S (a
# candidate compiles 2-4 kernels, not one per divisibility class of S).
@triton.jit(do_not_specialize=["S"])
def _gqa_fwd(Q, K, V, O, S, HQ, HKV, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, SPLIT: tl.constexpr, EXP2: tl.constexpr,
             DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Q, O: contiguous (B, Hq, S, D); K, V: (B, Hkv, S, D); grid (query blocks, B*Hq)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // HQ
    kvh = (bh % HQ) // (HQ // HKV)                               # the shared key/value head
    q_head = bh.to(tl.int64) * S * HEAD_DIM
    kv_head = (b * HKV + kvh).to(tl.int64) * S * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # q: (BLOCK_M, HEAD_DIM), stays in registers throughout; rows past S read as zeros
    q = tl.load(Q + q_head + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < S, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, S)
        if SPLIT:
            split = ((start_m + 1) // BLOCK_N) * BLOCK_N    # blocks every row sees in full
        else:
            split = 0
    else:
        hi = S
        split = (S // BLOCK_N) * BLOCK_N            # only the last, partial block is masked
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, 0, split, S, qk_scale,
                           HEAD_DIM, BLOCK_N, False, CAUSAL, EXP2, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, split, hi, S, qk_scale,
                           HEAD_DIM, BLOCK_N, True, CAUSAL, EXP2, DOT_PRECISION, UPCAST)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                         # rows past S: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    tl.store(O + q_head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < S)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """Returns grouped-query attention: q (B, Hq, S, D) against k, v (B, Hkv, S, D)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q (B, Hq, S, D) and k, v (B, Hkv, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, HQ, S, D = q.shape
    HKV = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D) or HQ % HKV:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected one dtype among float16/bfloat16/float32, got {q.dtype}")
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)                                    # (B, Hq, S, D)
    upcast = _interpreting() and q.dtype == torch.bfloat16       # interpreter bf16 dot bug
    grid = (triton.cdiv(S, BLOCK_M), B * HQ)
    _gqa_fwd[grid](q, k, v, out, S, HQ, HKV, scale * LOG2E if USE_EXP2 else scale,
                   HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=bool(causal),
                   SPLIT=CAUSAL_SPLIT, EXP2=USE_EXP2,
                   DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                   UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
