"""Seed for `strided`: a flash-attention Triton kernel that loads only the visible keys.

Query i sees keys j <= i with j % stride == 0. The kernel works in *compressed* key
indices c = j / stride: key block [c0, c0 + BLOCK_N) holds keys c0*stride, (c0+1)*stride, ...,
gathered from K and V with a row step of stride*D elements, so no hidden key is ever
loaded or multiplied. One program computes a (BLOCK_M, D) output tile for one (batch,
head) with the online softmax (running max `m_i`, running sum `l_i`, float32 `acc`).

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  tile sizes and launch settings
  USE_EXP2      exp2 with log2(e) folded into the scale, instead of exp
  SPLIT_MASK    an unmasked loop over the compressed key blocks every row of the tile sees
                in full, then a masked loop over the rest; when False every block is masked
Correct for any S >= 1 and stride >= 1 (stride 1 is plain causal attention).
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
SPLIT_MASK = True  # evoattn: choice(True, False)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _inner(acc, l_i, m_i, q, K, V, head, offs_m, lo, hi, S, stride, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Folds compressed key blocks [lo, hi) into (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        keys = (start_n + offs_n) * stride                       # real key indices (BLOCK_N,)
        kv_off = head + keys[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=keys[:, None] < S, other=0.0)
        else:
            k = tl.load(K + kv_off)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = (keys[None, :] <= offs_m[:, None]) & (keys[None, :] < S)
            s = tl.where(keep, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        if EXP2:
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(V + kv_off, mask=keys[:, None] < S, other=0.0)
        else:
            v = tl.load(V + kv_off)
        p = p.to(v.dtype)           # the precision cut every flash kernel makes before P·V
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


# Sequence lengths are not specialised: one compiled kernel serves every S (a
# candidate compiles 2-4 kernels, not one per divisibility class of S).
@triton.jit(do_not_specialize=["S"])
def _strided_fwd(Q, K, V, O, S, stride, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EXP2: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Q, K, V, O: contiguous (B, H, S, D); a 1-D grid of (query blocks) * B*H programs, query
    blocks fastest (1-D: B*H may exceed the 65535 limit of a second grid axis)."""
    num_m = tl.cdiv(S, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    head = (tl.program_id(0) // num_m).to(tl.int64) * S * HEAD_DIM      # element offset of this (b, h)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # q: (BLOCK_M, HEAD_DIM), stays in registers throughout; rows past S read as zeros
    q = tl.load(Q + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < S, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(start_m + BLOCK_M, S) - 1              # the tile's last real query
    hi = last // stride + 1                                  # compressed keys any row sees
    if SPLIT:
        # Compressed keys c <= start_m // stride are visible to every row of the tile.
        split = ((start_m // stride + 1) // BLOCK_N) * BLOCK_N
    else:
        split = 0
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, 0, split, S, stride, qk_scale,
                           HEAD_DIM, BLOCK_N, False, EXP2, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, split, hi, S, stride, qk_scale,
                           HEAD_DIM, BLOCK_N, True, EXP2, DOT_PRECISION, UPCAST)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                     # rows past S: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    tl.store(O + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < S)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stride: int = 1,
              scale: float | None = None) -> torch.Tensor:
    """Returns strided causal attention of contiguous (B, H, S, D) inputs (see the contract)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"expected q, k, v of one shape (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected one dtype among float16/bfloat16/float32, got {q.dtype}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    B, H, S, D = q.shape
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)                                # (B, H, S, D)
    # Triton 3.6's interpreter multiplies bfloat16 tiles wrongly; there, and only there, the
    # dots take bfloat16 values widened to float32 (the GPU's numerics).
    upcast = _interpreting() and q.dtype == torch.bfloat16
    grid = (triton.cdiv(S, BLOCK_M) * B * H,)
    _strided_fwd[grid](q, k, v, out, S, int(stride), scale * LOG2E if USE_EXP2 else scale,
                       HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXP2=USE_EXP2,
                       SPLIT=SPLIT_MASK,
                       DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                       UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
