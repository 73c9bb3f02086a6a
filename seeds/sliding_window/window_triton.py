"""Seed for `sliding_window`: a flash-attention Triton kernel that visits only the window's tiles.

Query i sees keys max(0, i-W+1) .. i. For a query tile [start_m, start_m + BLOCK_M) the
keys any row sees lie in [start_m - W + 1, last]; the kernel loops over those key blocks
only, in up to three stages: a masked lower edge (keys that fall out of some rows'
windows), an unmasked middle (keys inside every row's window: j >= last - W + 1 and
j <= start_m), and a masked diagonal. One program computes one (BLOCK_M, D) output tile
of one (batch, head) with the online softmax (running max, running sum, float32 acc).

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  tile sizes and launch settings
  USE_EXP2     exp2 with log2(e) folded into the scale, instead of exp
  SPLIT_MASK   the three-stage loop above; when False every visited block is masked
Correct for any S >= 1 and window >= 1.
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

MAX_HEADS_PER_LAUNCH = 65535   # CUDA's limit on a grid's second axis
LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _inner(acc, l_i, m_i, q, K, V, head, offs_m, lo, hi, S, window, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Folds key blocks [lo, hi) into (acc, l_i, m_i); MASKED applies window, causal and S."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                  # key indices (BLOCK_N,)
        kv_off = head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=cols[:, None] < S, other=0.0)
        else:
            k = tl.load(K + kv_off)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = (cols[None, :] <= offs_m[:, None]) & \
                   (cols[None, :] > offs_m[:, None] - window) & (cols[None, :] < S)
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
def _window_fwd(Q, K, V, O, S, window, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EXP2: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """Q, K, V, O: contiguous (B, H, S, D); grid (query blocks, B*H)."""
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64) * S * HEAD_DIM
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
    last = tl.minimum(start_m + BLOCK_M, S) - 1                  # the tile's last real query
    lo = (tl.maximum(start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
    hi = last + 1
    if SPLIT:
        # Keys in [last - W + 1, start_m] are inside every row's window.
        mid_lo = tl.minimum(tl.maximum(lo, tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N)
                                       * BLOCK_N), hi)
        mid_hi = tl.maximum(mid_lo, ((start_m + 1) // BLOCK_N) * BLOCK_N)
    else:
        mid_lo = hi
        mid_hi = hi
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, lo, mid_lo, S, window,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EXP2, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, mid_lo, mid_hi, S, window,
                           qk_scale, HEAD_DIM, BLOCK_N, False, EXP2, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, head, offs_m, mid_hi, hi, S, window,
                           qk_scale, HEAD_DIM, BLOCK_N, True, EXP2, DOT_PRECISION, UPCAST)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                         # rows past S: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    tl.store(O + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < S)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 1,
              scale: float | None = None) -> torch.Tensor:
    """Returns sliding-window causal attention of contiguous (B, H, S, D) inputs."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"expected q, k, v of one shape (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected one dtype among float16/bfloat16/float32, got {q.dtype}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    B, H, S, D = q.shape
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)                                    # (B, H, S, D)
    upcast = _interpreting() and q.dtype == torch.bfloat16       # interpreter bf16 dot bug
    # The grid's second axis holds at most 65535 heads: launch per chunk of heads past that.
    # (A 1-D grid instead made this kernel ~10% slower on an H200.)
    qf, kf, vf, of = (t.view(B * H, S, D) for t in (q, k, v, out))
    for h0 in range(0, B * H, MAX_HEADS_PER_LAUNCH):
        h1 = min(B * H, h0 + MAX_HEADS_PER_LAUNCH)
        _window_fwd[(triton.cdiv(S, BLOCK_M), h1 - h0)](
            qf[h0:h1], kf[h0:h1], vf[h0:h1], of[h0:h1], S, int(min(window, S)),
            scale * LOG2E if USE_EXP2 else scale,
            HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXP2=USE_EXP2, SPLIT=SPLIT_MASK,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
            UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
