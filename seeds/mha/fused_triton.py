"""Seed for `mha`: minGPT causal self-attention with the attention core as one Triton kernel.

Between the two projections, one flash-attention kernel reads q, k and v straight out of
the (B, T, 3C) projection output through its strides and writes y straight into
(B, T, C): no head split, transpose, contiguous copy, (B, nh, T, T) score matrix or head
merge is ever materialised. One program computes a (BLOCK_M, hs) tile of one (batch,
head) with the online softmax (running max, running sum, float32 accumulator). Head sizes
that are not a power of 2 (768 / 8 = 96) are padded to the next one inside the kernel with
masked loads.

The projections are either nn.Linear's own GEMM (cuBLAS; float32 without TF32 runs on the
CUDA cores) or a Triton GEMM with the bias fused into its epilogue.

float32 throughout. Plain TF32 (10-bit mantissas) would miss the 1e-5 tolerance, so the
dots are either IEEE float32 or 'tf32x3': each operand split into a TF32 head and a TF32
tail, three tensor-core products (head·head + head·tail + tail·head) summed in float32,
which keeps about 21 of float32's 24 mantissa bits (the dropped tail·tail term is ~2^-22
relative) at tensor-core speed.

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  attention tile sizes and launch settings
  USE_EXP2        exp2 with log2(e) folded into the scale, instead of exp
  CAUSAL_SPLIT    an unmasked loop over key blocks every row sees, then a masked diagonal
                  loop; when False every block is masked
  ATTN_PRECISION  the attention dots: 'ieee' or 'tf32x3'
  TRITON_LINEAR   the projections as the Triton GEMM below (True) or nn.Linear (False)
  LIN_BLOCK_M, LIN_BLOCK_N, LIN_BLOCK_K, LIN_WARPS, LIN_STAGES  that GEMM's tiles and launch
  LIN_PRECISION   that GEMM's dots: 'ieee' or 'tf32x3'
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

# Defaults: the Triton GEMM and 3xTF32 attention dots, 1.92x the naive module on an H200 (the
# same kernel with IEEE dots and cuBLAS projections: 0.95x; Triton GEMM alone: 1.22x).
BLOCK_M = 32  # evoattn: choice(16, 32, 64, 128)
BLOCK_N = 32  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS = 4  # evoattn: choice(2, 4, 8)
NUM_STAGES = 2  # evoattn: choice(1, 2, 3, 4)
USE_EXP2 = True  # evoattn: choice(True, False)
CAUSAL_SPLIT = True  # evoattn: choice(True, False)
ATTN_PRECISION = "tf32x3"  # evoattn: choice("ieee", "tf32x3")
TRITON_LINEAR = True  # evoattn: choice(True, False)
LIN_BLOCK_M = 128  # evoattn: choice(64, 128, 256)
LIN_BLOCK_N = 128  # evoattn: choice(64, 128, 256)
LIN_BLOCK_K = 32  # evoattn: choice(16, 32, 64)
LIN_WARPS = 8  # evoattn: choice(4, 8)
LIN_STAGES = 3  # evoattn: choice(2, 3, 4, 5)
LIN_PRECISION = "tf32x3"  # evoattn: choice("ieee", "tf32x3")

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)


@triton.jit
def _inner(acc, l_i, m_i, q, K, V, row_stride, offs_m, lo, hi, T, qk_scale, hs,
           HEAD_P: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           EXP2: tl.constexpr, PRECISION: tl.constexpr):
    """Folds key blocks [lo, hi) into (acc, l_i, m_i); K and V point at this head's column 0."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_P)
    d_ok = offs_d[None, :] < hs
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = cols[:, None].to(tl.int64) * row_stride + offs_d[None, :]
        if MASKED:
            kv_ok = d_ok & (cols[:, None] < T)
        else:
            kv_ok = d_ok
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0)                    # (BLOCK_N, HEAD_P)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale     # (BLOCK_M, BLOCK_N)
        if MASKED:
            s = tl.where((cols[None, :] <= offs_m[:, None]) & (cols[None, :] < T), s,
                         float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no -inf - -inf = NaN
        if EXP2:
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _causal_attn(QKV, Y, T, C, NH, hs, qk_scale,
                 HEAD_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT: tl.constexpr, EXP2: tl.constexpr, PRECISION: tl.constexpr):
    """QKV: contiguous (B, T, 3C) = [q | k | v]; Y: contiguous (B, T, C).

    A 1-D grid of (query blocks) * B*NH programs, query blocks fastest.
    """
    num_m = tl.cdiv(T, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    b = tl.program_id(0) // num_m // NH
    h = tl.program_id(0) // num_m % NH
    row_stride = 3 * C
    base = QKV + b.to(tl.int64) * T * row_stride + h * hs     # q of head h, row 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_P)
    q_ok = (offs_m[:, None] < T) & (offs_d[None, :] < hs)
    # q: (BLOCK_M, HEAD_P), stays in registers throughout; padded rows/columns read as zeros
    q = tl.load(base + offs_m[:, None].to(tl.int64) * row_stride + offs_d[None, :],
                mask=q_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], dtype=tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, T)
    if SPLIT:
        split = ((start_m + 1) // BLOCK_N) * BLOCK_N          # blocks every row sees in full
    else:
        split = 0
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, base + C, base + 2 * C, row_stride, offs_m, 0,
                           split, T, qk_scale, hs, HEAD_P, BLOCK_N, False, EXP2, PRECISION)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, base + C, base + 2 * C, row_stride, offs_m, split,
                           hi, T, qk_scale, hs, HEAD_P, BLOCK_N, True, EXP2, PRECISION)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                      # rows past T: no 0/0
    out = acc / l_i[:, None]
    y = Y + b.to(tl.int64) * T * C + h * hs
    tl.store(y + offs_m[:, None].to(tl.int64) * C + offs_d[None, :], out, mask=q_ok)


def causal_attention(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Returns y (B, T, C) from the contiguous float32 projection output qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    head_p = max(16, triton.next_power_of_2(hs))
    y = torch.empty(B, T, C, device=qkv.device, dtype=qkv.dtype)
    scale = 1.0 / math.sqrt(hs)
    grid = (triton.cdiv(T, BLOCK_M) * B * n_head,)
    _causal_attn[grid](qkv, y, T, C, n_head, hs, scale * LOG2E if USE_EXP2 else scale,
                       HEAD_P=head_p, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=CAUSAL_SPLIT,
                       EXP2=USE_EXP2, PRECISION=ATTN_PRECISION, num_warps=NUM_WARPS,
                       num_stages=NUM_STAGES)
    return y


@triton.jit
def _linear_kernel(X, W, BIAS, Y, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Y (M, N) = X (M, K) @ W (N, K)^T + BIAS (N); all contiguous float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k[None, :] < K - k0
        x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)              # (BLOCK_M, BLOCK_K)
        w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)              # (BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc,
             mask=m_ok & (offs_n[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Returns x @ weight^T + bias like F.linear, for float32 x (..., K), weight (N, K)."""
    if not TRITON_LINEAR:
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    w, b = weight.contiguous(), bias.contiguous()
    y = torch.empty(x2.shape[0], N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(x2.shape[0], LIN_BLOCK_M), triton.cdiv(N, LIN_BLOCK_N))
    _linear_kernel[grid](x2, w, b, y, x2.shape[0], N, K, BLOCK_M=LIN_BLOCK_M,
                         BLOCK_N=LIN_BLOCK_N, BLOCK_K=LIN_BLOCK_K, PRECISION=LIN_PRECISION,
                         num_warps=LIN_WARPS, num_stages=LIN_STAGES)
    return y.view(*x.shape[:-1], N)


class Model(nn.Module):
    """Multi-head causal self-attention with a projection at the end (minGPT's contract)."""

    def __init__(self, n_embd: int, n_head: int, attn_pdrop: float, resid_pdrop: float,
                 max_seqlen: int) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)      # key, query, value projections
        self.c_proj = nn.Linear(n_embd, n_embd)          # output projection
        self.n_head = n_head
        self.n_embd = n_embd
        self.max_seqlen = max_seqlen
        # attn_pdrop and resid_pdrop are unused: the contract evaluates in eval mode (p = 0).

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(f"expected float32 (B, T, {self.n_embd}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        qkv = linear(x, self.c_attn.weight, self.c_attn.bias)      # (B, T, 3C), contiguous
        y = causal_attention(qkv, self.n_head)                       # (B, T, C)
        return linear(y, self.c_proj.weight, self.c_proj.bias)
