"""Seed for `masked`: a flash-attention Triton kernel that adds a user mask and skips dead blocks.

out = softmax(q kᵀ·scale + mask) v, with a 4-D additive mask broadcastable to
(B, H, Sq, Sk) (-inf hides a key). Each call first reduces the mask to a per-tile bitmap
"does this (BLOCK_M, BLOCK_N) tile hold any finite entry?" with a few torch ops on the
mask's own (unbroadcast) shape; this runs inside the call, every call, so it counts in
the kernel's time. One program then computes one (BLOCK_M, D) output tile of one
(batch, head): it walks the key blocks, skips those the bitmap marks dead, and folds the
others in with the online softmax (running max, running sum, float32 accumulator). The
mask is read through its broadcast strides (0 along size-1 dimensions): it is never
expanded in memory.

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  tile sizes and launch settings
  USE_EXP2     exp2 with log2(e) folded into the scale and the mask, instead of exp
  SKIP_EMPTY   skip tiles whose mask is all -inf (needs the bitmap); False visits every tile
Correct for any Sq, Sk >= 1 and any mask without a fully masked row.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
BLOCK_N = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS = 4  # evoattn: choice(2, 4, 8)
NUM_STAGES = 2  # evoattn: choice(1, 2, 3, 4)
USE_EXP2 = True  # evoattn: choice(True, False)
SKIP_EMPTY = True  # evoattn: choice(True, False)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _live_tiles(mask: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Returns int8 (b1, h1, nq, nk): 1 where a mask tile holds a finite entry.

    Works on the mask's own shape: a size-1 (broadcast) dimension stays size 1.
    """
    live = mask != float("-inf")                                  # (b1, h1, q1, k1)
    b1, h1, q1, k1 = live.shape
    bm = block_m if q1 > 1 else 1
    bn = block_n if k1 > 1 else 1
    nq, nk = triton.cdiv(q1, bm), triton.cdiv(k1, bn)
    live = F.pad(live, (0, nk * bn - k1, 0, nq * bm - q1), value=False)
    return live.view(b1, h1, nq, bm, nk, bn).any(dim=5).any(dim=3).to(torch.int8)


# Sq and Sk stay specialised: the mask's row stride is Sk, and without Triton knowing that
# it divides by 16 the mask loads lose their vector width (measured on an H200: the
# configs took 1.1-1.4x as long with do_not_specialize=["Sq", "Sk"]).
@triton.jit
def _masked_fwd(Q, K, V, M, LIVE, O, H, Sq, Sk, qk_scale, mask_scale,
                sm_b, sm_h, sm_q, sm_k, sl_b, sl_h, sl_q, sl_k,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SKIP: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """Q, O: contiguous (B, H, Sq, D); K, V: contiguous (B, H, Sk, D); M, LIVE: strided views."""
    m_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start_m = m_blk * BLOCK_M
    q_head = bh.to(tl.int64) * Sq * HEAD_DIM
    kv_head = bh.to(tl.int64) * Sk * HEAD_DIM
    mask_base = M + b.to(tl.int64) * sm_b + h.to(tl.int64) * sm_h
    live_base = LIVE + b * sl_b + h * sl_h + m_blk * sl_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # q: (BLOCK_M, HEAD_DIM), stays in registers throughout; rows past Sq read as zeros
    q = tl.load(Q + q_head + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < Sq, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, Sk, BLOCK_N):
        live = 1
        if SKIP:
            live = tl.load(live_base + (start_n // BLOCK_N) * sl_k)
        if live != 0:
            cols = start_n + offs_n
            in_k = cols < Sk
            kv_off = kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
            k = tl.load(K + kv_off, mask=in_k[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            # the mask tile (BLOCK_M, BLOCK_N), read through its broadcast strides
            bias = tl.load(mask_base + offs_m[:, None].to(tl.int64) * sm_q
                           + cols[None, :].to(tl.int64) * sm_k,
                           mask=(offs_m[:, None] < Sq) & in_k[None, :], other=float("-inf"))
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale \
                + bias.to(tl.float32) * mask_scale                   # (BLOCK_M, BLOCK_N)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no -inf - -inf = NaN
            if EXP2:
                p = tl.math.exp2(s - m_sub[:, None])
                alpha = tl.math.exp2(m_i - m_sub)
            else:
                p = tl.exp(s - m_sub[:, None])
                alpha = tl.exp(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(V + kv_off, mask=in_k[:, None], other=0.0)
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
            m_i = m_ij
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                           # rows past Sq: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    tl.store(O + q_head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < Sq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale + mask) v; q (B, H, Sq, D), k/v (B, H, Sk, D)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or mask.dim() != 4:
        raise ValueError(f"expected 4-D q, k, v, mask; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(mask.shape)}")
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, H, D):
        raise ValueError(f"k/v shape {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected one dtype among float16/bfloat16/float32, got {q.dtype}")
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask_full = mask.expand(B, H, Sq, Sk)                         # a view: strides 0 to broadcast
    live = _live_tiles(mask, BLOCK_M, BLOCK_N) if SKIP_EMPTY else \
        torch.ones(1, 1, 1, 1, dtype=torch.int8, device=q.device)
    live = live.expand(B, H, triton.cdiv(Sq, BLOCK_M), triton.cdiv(Sk, BLOCK_N))
    out = torch.empty_like(q)                                     # (B, H, Sq, D)
    upcast = _interpreting() and q.dtype == torch.bfloat16        # interpreter bf16 dot bug
    grid = (triton.cdiv(Sq, BLOCK_M), B * H)
    _masked_fwd[grid](q, k, v, mask_full, live, out, H, Sq, Sk,
                      scale * LOG2E if USE_EXP2 else scale, LOG2E if USE_EXP2 else 1.0,
                      *mask_full.stride(), *live.stride(),
                      HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SKIP=SKIP_EMPTY,
                      EXP2=USE_EXP2,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                      UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
