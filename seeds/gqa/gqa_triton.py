"""Seed for `gqa`: a flash-attention Triton kernel where query head h reads key/value head h // G.

q is (B, Hq, S, D), k and v are (B, Hkv, S, D) with G = Hq // Hkv query heads per key
head. Nothing is repeated in memory: each program computes one (BLOCK_M, D) output tile
of one (batch, query head) and streams the tiles of its shared key/value head. The grid
runs every query block of a head before the next head, and the G query heads of a group
are consecutive heads, so a key/value head stays hot in L2 while its group runs. Online
softmax with a running max, running sum and float32 accumulator. The kernel is the `sdpa`
seed's (seeds/sdpa/flash_triton.py) with the key/value head looked up per query head.

Knobs (the lines marked `# evoattn: choice(...)`); every combination is correct or raises a
clear error:
  BLOCK_M_*, BLOCK_N_*, NUM_WARPS_*, NUM_STAGES_*  tile sizes and launch settings, per head dim
  CAUSAL_SPLIT        causal only: an unmasked loop over the key blocks every query row of
                      the tile sees in full, then a masked loop over the diagonal band; when
                      False, one loop masks every block
  USE_EXP2            exp2 with log2(e) folded into the scale, instead of exp
  USE_TMA             Hopper tensor descriptors (TMA) for Q, K, V and O; used only on a CUDA
                      device of capability >= 9 (elsewhere the pointer path runs)
  CAUSAL_HEAVY_FIRST  causal only: start each head's query blocks with the most keys (the
                      last ones) first, so the long tiles do not trail at the end of the grid
  BLOCK_M_D*_CAUSAL, NUM_STAGES_D*_CAUSAL   the query tile and pipeline depth for causal calls
                      (BLOCK_M_* and NUM_STAGES_* are then the non-causal ones)
  LONG_SEQ, BLOCK_N_D*_LONG   the key tile for sequences of LONG_SEQ or more (BLOCK_N_* below)

Correct for any S >= 1 and Hq % Hkv == 0: key columns past S get a score of -inf and query
rows past S are never stored (the pointer path masks loads and stores; the TMA path uses 3-D
descriptors of shape (B*Hq, S, D) for Q, O and (B*Hkv, S, D) for K, V, so out-of-range rows of
a head read as zeros and stores are clipped at that head's S, never spilling into the next
head). float32 inputs use IEEE dots (no TF32).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
    HAS_TENSOR_DESC = True
except ImportError:  # Triton older than 3.3
    HAS_TENSOR_DESC = False

# ---- knobs (one per line; the mutator rewrites only the value) ------------------------
# Defaults: the best setting of the `sdpa` seed on an H200 (per-causality D=128 tiles, 64x128 D=64
# tiles from S = 2048 on, 2 stages for D=64).
BLOCK_M_D64 = 64  # evoattn: choice(32, 64, 128, 256)
BLOCK_N_D64 = 64  # evoattn: choice(32, 64, 128)
NUM_WARPS_D64 = 4  # evoattn: choice(4, 8)
NUM_STAGES_D64 = 2  # evoattn: choice(1, 2, 3, 4, 5)
BLOCK_M_D128 = 128  # evoattn: choice(32, 64, 128, 256)
BLOCK_N_D128 = 64  # evoattn: choice(32, 64, 128)
NUM_WARPS_D128 = 4  # evoattn: choice(4, 8)
NUM_STAGES_D128 = 2  # evoattn: choice(1, 2, 3, 4, 5)
CAUSAL_SPLIT = True  # evoattn: choice(True, False)
USE_EXP2 = True  # evoattn: choice(True, False)
USE_TMA = True  # evoattn: choice(True, False)
CAUSAL_HEAVY_FIRST = True  # evoattn: choice(True, False)
BLOCK_M_D64_CAUSAL = 64  # evoattn: choice(32, 64, 128, 256)
NUM_STAGES_D64_CAUSAL = 2  # evoattn: choice(1, 2, 3, 4, 5)
BLOCK_M_D128_CAUSAL = 64  # evoattn: choice(32, 64, 128, 256)
NUM_STAGES_D128_CAUSAL = 3  # evoattn: choice(1, 2, 3, 4, 5)
LONG_SEQ = 2048  # evoattn: choice(1024, 2048, 4096, 8192)
BLOCK_N_D64_LONG = 128  # evoattn: choice(32, 64, 128)
BLOCK_N_D128_LONG = 64  # evoattn: choice(32, 64, 128)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- capability helpers ---------------------------------------------------------------
def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _supports_tma(device: torch.device) -> bool:
    """Returns True on a real (not interpreted) CUDA device of capability >= 9."""
    return (HAS_TENSOR_DESC and device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)


# ---- kernel -------------------------------------------------------------------------
@triton.jit
def _inner(acc, l_i, m_i, q, K, V, kv_head, off_kv, offs_m, lo, hi, S, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           CAUSAL: tl.constexpr, SCALE_NONNEG: tl.constexpr, EXP2: tl.constexpr,
           TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Folds key blocks [lo, hi) of one key/value head into (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                           # key indices
        # -- k: (BLOCK_N, HEAD_DIM), streamed; rows past S read as zeros
        if TMA:
            k = K.load([off_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k_ptrs = K + kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=cols[:, None] < S, other=0.0)
            else:
                k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)               # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = cols[None, :] < S
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            # Mask after scaling: a negative scale would turn a -inf mask into +inf.
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)           # no -inf - -inf = NaN
            s = s - m_sub[:, None]
        else:
            # Every score is finite here, and the row max of qk·scale is max(qk)·scale for
            # scale >= 0 (min(qk)·scale otherwise): the scale stays fused into the subtraction.
            if SCALE_NONNEG:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            m_sub = m_ij
            s = qk * qk_scale - m_sub[:, None]
        if EXP2:
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_sub)                            # rescales the old state
        else:
            p = tl.exp(s)
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # -- v: (BLOCK_N, HEAD_DIM); p is cast to v's dtype for the tensor cores
        if TMA:
            v = V.load([off_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            v_ptrs = V + kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
            if MASKED:
                v = tl.load(v_ptrs, mask=cols[:, None] < S, other=0.0)
            else:
                v = tl.load(v_ptrs)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


# Sequence lengths and group sizes are not specialised: one compiled kernel serves every S
# and G (a candidate compiles 2-4 kernels, not one per divisibility class of S).
@triton.jit(do_not_specialize=["S", "G"])
def _gqa_fwd(Q, K, V, O, S, G, qk_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, SCALE_NONNEG: tl.constexpr,
             EXP2: tl.constexpr, TMA: tl.constexpr, HEAVY_FIRST: tl.constexpr,
             DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Q, O: contiguous (B, Hq, S, D) and K, V: (B, Hkv, S, D) tensors, or (B*Hq, S, D) and
    (B*Hkv, S, D) tensor descriptors if TMA. A 1-D grid of (query blocks) * B*Hq programs,
    query blocks fastest (1-D: B*Hq may exceed the 65535 limit of a second grid axis)."""
    num_m = tl.cdiv(S, BLOCK_M)
    pid = tl.program_id(0)
    m_idx = pid % num_m
    if CAUSAL and HEAVY_FIRST:
        m_idx = num_m - 1 - m_idx
    off_hz = pid // num_m                           # flat query head b*Hq + h
    # Its key/value head b*Hkv + h // G: b*Hq + h == (b*Hkv)*G + h with h < Hkv*G, so one
    # division by G gives it.
    off_kv = off_hz // G
    start_m = m_idx * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)                              # query indices
    offs_d = tl.arange(0, HEAD_DIM)
    q_head = off_hz.to(tl.int64) * S * HEAD_DIM     # element offsets of the two head slices
    kv_head = off_kv.to(tl.int64) * S * HEAD_DIM
    # -- q: (BLOCK_M, HEAD_DIM); it stays in registers throughout. Rows past S read as zeros.
    if TMA:
        q = Q.load([off_hz, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                    mask=offs_m[:, None] < S, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)            # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                          # running row sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                # unnormalised output
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, S)     # keys past the tile's last row are all masked
        if CAUSAL_SPLIT:
            # Whole key blocks ending at or before the tile's first row start_m are visible to
            # every row (and lie inside S, since start_m < S): no mask needed.
            split = ((start_m + 1) // BLOCK_N) * BLOCK_N
        else:
            split = 0
    else:
        hi = S
        split = (S // BLOCK_N) * BLOCK_N          # only the last, partial block needs the mask
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, off_kv, offs_m, 0, split, S,
                           qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, SCALE_NONNEG, EXP2,
                           TMA, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, off_kv, offs_m, split, hi, S,
                           qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, SCALE_NONNEG, EXP2,
                           TMA, DOT_PRECISION, UPCAST)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                         # rows past S: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    if TMA:
        O.store([off_hz, start_m, 0], out.reshape(1, BLOCK_M, HEAD_DIM))  # clipped at S
    else:
        tl.store(O + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], out,
                 mask=offs_m[:, None] < S)


# ---- wrapper ------------------------------------------------------------------------
def _settings(head_dim: int, causal: bool, seq_len: int) -> tuple[int, int, int, int]:
    """Returns (BLOCK_M, BLOCK_N, num_warps, num_stages) for a head dimension, causality and
    sequence length."""
    if head_dim == 64:
        m, m_causal, n, n_long = BLOCK_M_D64, BLOCK_M_D64_CAUSAL, BLOCK_N_D64, BLOCK_N_D64_LONG
        warps, stages, stages_causal = NUM_WARPS_D64, NUM_STAGES_D64, NUM_STAGES_D64_CAUSAL
    else:
        m, m_causal, n, n_long = BLOCK_M_D128, BLOCK_M_D128_CAUSAL, BLOCK_N_D128, BLOCK_N_D128_LONG
        warps, stages, stages_causal = NUM_WARPS_D128, NUM_STAGES_D128, NUM_STAGES_D128_CAUSAL
    return (m_causal if causal else m, n_long if seq_len >= LONG_SEQ else n, warps,
            stages_causal if causal else stages)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float | None, use_tma: bool) -> torch.Tensor:
    """Checks shapes and launches the kernel with the module's knobs (TMA as given)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q (B, Hq, S, D) and k, v (B, Hkv, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, HQ, S, D = q.shape
    HKV = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D) or HKV == 0 or HQ % HKV:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         f"(same B, S, D and Hq % Hkv == 0)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype among float16/bfloat16/float32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k and v must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError("gqa_triton needs a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors")
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    block_m, block_n, num_warps, num_stages = _settings(D, causal, S)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # no-ops for contiguous inputs
    out = torch.empty_like(q)                                  # (B, Hq, S, D), fresh
    # TMA descriptors need 16-byte aligned base addresses (a view may start anywhere)
    use_tma = use_tma and all(t.data_ptr() % 16 == 0 for t in (q, k, v, out))
    if use_tma:
        # 3-D views (heads, S, D): each head is its own box range, so TMA zero-fills loads past
        # S and clips stores at S per head. The descriptors need 16-byte aligned row strides.
        def desc(t: torch.Tensor, heads: int, rows: int) -> "TensorDescriptor":
            return TensorDescriptor(t, [heads, S, D], [S * D, D, 1], [1, rows, D])
        args = (desc(q, B * HQ, block_m), desc(k, B * HKV, block_n),
                desc(v, B * HKV, block_n), desc(out, B * HQ, block_m))
    else:
        args = (q, k, v, out)
    # Query blocks vary fastest: a head's blocks run together, then the next head's, and the
    # G heads of a group are consecutive, so their shared key/value head stays hot in L2.
    grid = (triton.cdiv(S, block_m) * B * HQ,)
    qk_scale = scale * LOG2E if USE_EXP2 else scale
    # Triton 3.6's interpreter multiplies bfloat16 tiles as their raw uint16 bits (garbage), so
    # there, and only there, the dots take bfloat16 values widened to float32.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    _gqa_fwd[grid](*args, S, HQ // HKV, qk_scale,
                   HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
                   CAUSAL_SPLIT=CAUSAL_SPLIT, SCALE_NONNEG=scale >= 0, EXP2=USE_EXP2,
                   TMA=use_tma, HEAVY_FIRST=CAUSAL_HEAVY_FIRST,
                   DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                   UPCAST=upcast, num_warps=num_warps, num_stages=num_stages)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """Returns grouped-query attention: q (B, Hq, S, D) against k, v (B, Hkv, S, D)."""
    return _forward(q, k, v, bool(causal), scale, use_tma=USE_TMA and _supports_tma(q.device))
