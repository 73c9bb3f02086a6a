"""Seed for `sdpa`: a FlashAttention-2 style forward kernel in Triton.

One program computes one (BLOCK_M, D) tile of the output for one (batch, head):
it keeps the query tile in registers, streams key/value tiles of BLOCK_N rows,
and keeps a running row maximum `m_i`, row sum `l_i` and an unnormalised float32
accumulator `acc` (the online softmax); it divides by `l_i` once at the end.

The module-level lines marked `# evoattn: choice(...)` are the knobs the offline
mutator rewrites. Every combination is either correct or raises a clear error:
  BLOCK_M_*, BLOCK_N_*, NUM_WARPS_*, NUM_STAGES_*  tile sizes and launch settings, per head dim
                      (BLOCK_M and NUM_STAGES for non-causal calls, BLOCK_N for sequences
                      shorter than LONG_SEQ)
  CAUSAL_SPLIT        causal only: an unmasked loop over the key blocks every query row of
                      the tile sees in full, then a masked loop over the diagonal band; when
                      False, one loop masks every block
  USE_EXP2            exp2 with log2(e) folded into the scale, instead of exp
  USE_TMA             Hopper tensor descriptors (TMA) for Q, K, V and O; used only on a CUDA
                      device of capability >= 9 (elsewhere the pointer path runs, see below)
  WARP_SPECIALIZE     tl.range(..., warp_specialize=True) on the key loops; capability >= 9
                      only (elsewhere ignored). Where Triton cannot compile it the call raises
                      WarpSpecializeError instead of quietly running the plain loop: a silent
                      fallback would give the search two genomes that time the same code.
  PERSISTENT          a grid of PROGRAMS_PER_SM programs per SM that stride over all
                      (query block, batch, head) work items, instead of one program per item
  HEAD_MAJOR          consecutive work items share a head (its K/V stays hot in L2), or share
                      a query block
  CAUSAL_HEAVY_FIRST  causal only: start the query blocks with the most keys (the last ones)
                      first, so the long tiles do not trail at the end of the grid
  BLOCK_M_D*_CAUSAL, NUM_STAGES_D*_CAUSAL   the query tile and pipeline depth for causal calls
  LONG_SEQ, BLOCK_N_D*_LONG   the key tile for sequences of LONG_SEQ or more: long loops
                      amortise a larger tile's pipeline start, short ones do not
  NUM_STAGES_SMALL_GRID  the pipeline depth when the whole grid fits in one wave (at most one
                      program per SM, e.g. (1,8,512,64)): no second program on the SM hides
                      the load latency, so a deeper pipeline can pay where it costs elsewhere
  BLOCK_N_D64_SMALL_GRID  the key tile for D=64 in such a one-wave grid (it takes precedence
                      over BLOCK_N_D64 and BLOCK_N_D64_LONG there)

Correct for any S >= 1: key columns past S get a score of -inf and query rows past S are
never stored (the pointer path masks loads and stores; the TMA path uses 4-D descriptors of
shape (B, H, S, D), so out-of-range rows of a head read as zeros and stores are clipped at
that head's S, never spilling into the next head). float32 inputs use IEEE dots (no TF32).
"""
from __future__ import annotations

import functools
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
# Defaults: the best setting measured (BENCHMARKS.md). The when(...) conditions matter only when
# this file runs inside seeds/sdpa/flash_hybrid.py: there a call whose CUDA_* routing knob sends
# it to the CUDA kernel on an H100/H200 (@target=sm90) runs none of this file's code, so the
# knobs it would use are left alone by the mutator. Run on its own, this file has no CUDA_*
# knobs, and a condition on a knob the program lacks always holds.
BLOCK_M_D64 = 64  # evoattn: choice(32, 64, 128, 256) when(CUDA_D64=False, @target!=sm90)
BLOCK_N_D64 = 64  # evoattn: choice(32, 64, 128) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, @target!=sm90)
NUM_WARPS_D64 = 4  # evoattn: choice(4, 8) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, @target!=sm90)
NUM_STAGES_D64 = 2  # evoattn: choice(1, 2, 3, 4, 5) when(CUDA_D64=False, @target!=sm90)
BLOCK_M_D128 = 128  # evoattn: choice(32, 64, 128, 256) when(CUDA_D128=False, @target!=sm90)
BLOCK_N_D128 = 64  # evoattn: choice(32, 64, 128) when(CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
NUM_WARPS_D128 = 4  # evoattn: choice(4, 8) when(CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
NUM_STAGES_D128 = 2  # evoattn: choice(1, 2, 3, 4, 5) when(CUDA_D128=False, @target!=sm90)
CAUSAL_SPLIT = True  # evoattn: choice(True, False) when(CUDA_D64_CAUSAL=False, CUDA_D128_CAUSAL=False, @target!=sm90)
USE_EXP2 = True  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
USE_TMA = True  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90) when(@target!=cpu)
WARP_SPECIALIZE = False  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90) when(@target!=cpu)
PERSISTENT = False  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
PROGRAMS_PER_SM = 2  # evoattn: choice(1, 2, 3, 4) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
HEAD_MAJOR = True  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
CAUSAL_HEAVY_FIRST = False  # evoattn: choice(True, False) when(CUDA_D64_CAUSAL=False, CUDA_D128_CAUSAL=False, @target!=sm90)
BLOCK_M_D64_CAUSAL = 64  # evoattn: choice(32, 64, 128, 256) when(CUDA_D64_CAUSAL=False, @target!=sm90)
NUM_STAGES_D64_CAUSAL = 2  # evoattn: choice(1, 2, 3, 4, 5) when(CUDA_D64_CAUSAL=False, @target!=sm90)
BLOCK_M_D128_CAUSAL = 64  # evoattn: choice(32, 64, 128, 256) when(CUDA_D128_CAUSAL=False, @target!=sm90)
NUM_STAGES_D128_CAUSAL = 3  # evoattn: choice(1, 2, 3, 4, 5) when(CUDA_D128_CAUSAL=False, @target!=sm90)
LONG_SEQ = 1024  # evoattn: choice(1024, 2048, 4096, 8192) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
BLOCK_N_D64_LONG = 128  # evoattn: choice(32, 64, 128) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, @target!=sm90)
BLOCK_N_D128_LONG = 64  # evoattn: choice(32, 64, 128) when(CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
NUM_STAGES_SMALL_GRID = 3  # evoattn: choice(1, 2, 3, 4, 5) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90)
BLOCK_N_D64_SMALL_GRID = 128  # evoattn: choice(32, 64, 128) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, @target!=sm90)
FAST_LAUNCH = True  # evoattn: choice(True, False) when(CUDA_D64=False, CUDA_D64_CAUSAL=False, CUDA_D128=False, CUDA_D128_CAUSAL=False, @target!=sm90) when(@target!=cpu)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
INPUT_LAYOUTS = ("strided", "gqa")  # attention() reads any strides, and k, v of fewer heads
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class WarpSpecializeError(RuntimeError):
    """Triton could not compile the kernel with WARP_SPECIALIZE=True for these settings."""


# ---- capability helpers ---------------------------------------------------------------
def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _hopper_or_newer(device: torch.device) -> bool:
    """Returns True on a real (not interpreted) CUDA device of capability >= 9."""
    return device.type == "cuda" and not _interpreting() and _major(device) >= 9


@functools.lru_cache(maxsize=None)
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _supports_tma(device: torch.device) -> bool:
    return HAS_TENSOR_DESC and _hopper_or_newer(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (asked once per device: every call needs it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so the persistent loop really strides


# ---- kernel -------------------------------------------------------------------------
@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, k_base, v_base, sks, svs, b, h_kv, offs_m, lo, hi,
                    S, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, SCALE_NONNEG: tl.constexpr, EXP2: tl.constexpr,
                    TMA: tl.constexpr, WARP_SPEC: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Folds key/value blocks [lo, hi) into (acc, l_i, m_i); MASKED applies the S and causal masks."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                           # key indices (BLOCK_N,)
        # -- k: (BLOCK_N, HEAD_DIM), streamed; rows past S read as zeros
        if TMA:
            k = K.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k_ptrs = K + k_base + cols[:, None] * sks + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=cols[:, None] < S, other=0.0)
            else:
                k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)               # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            keep = cols[None, :] < S
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            # Mask after scaling: a negative scale would turn a -inf mask into +inf.
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            s = s - m_sub[:, None]
        else:
            # Unmasked blocks give every row finite scores, and the row max of qk·scale is
            # max(qk)·scale for scale >= 0 (min(qk)·scale otherwise): the scale stays fused.
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
        # -- v: (BLOCK_N, HEAD_DIM), streamed; p is cast to v's dtype for the tensor cores (the
        # precision cut every flash kernel makes; float32 inputs keep p in float32)
        if TMA:
            v = V.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            v_ptrs = V + v_base + cols[:, None] * svs + offs_d[None, :]
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


@triton.jit
def _attn_fwd_tile(Q, K, V, O, m_idx, off_hz, S, H, GROUP, sqb, sqh, sqs, skb, skh, sks,
                   svb, svh, svs, sob, soh, sos, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, SCALE_NONNEG: tl.constexpr,
                   EXP2: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Computes output rows [m_idx*BLOCK_M, +BLOCK_M) of head `off_hz` (a flat b*H + h)."""
    start_m = m_idx * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)                              # query indices
    offs_d = tl.arange(0, HEAD_DIM)
    b, h = off_hz // H, off_hz % H
    h_kv = h // GROUP
    b64, h64, hkv64 = b.to(tl.int64), h.to(tl.int64), h_kv.to(tl.int64)
    q_base, o_base = b64 * sqb + h64 * sqh, b64 * sob + h64 * soh
    k_base, v_base = b64 * skb + hkv64 * skh, b64 * svb + hkv64 * svh
    # -- q: (BLOCK_M, HEAD_DIM); it stays in registers throughout. Rows past S read as zeros.
    if TMA:
        q = Q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + q_base + offs_m[:, None] * sqs + offs_d[None, :],
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
            # Off-band: whole key blocks ending at or before the tile's first row start_m are
            # visible to every row (and lie inside S, since start_m < S): no mask needed.
            split = ((start_m + 1) // BLOCK_N) * BLOCK_N
        else:
            split = 0
    else:
        hi = S
        split = (S // BLOCK_N) * BLOCK_N          # only the last, partial block needs the mask
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, k_base, v_base, sks, svs, b, h_kv,
                                    offs_m, 0, split, S, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL,
                                    SCALE_NONNEG, EXP2, TMA, WARP_SPEC, DOT_PRECISION, UPCAST)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, k_base, v_base, sks, svs, b, h_kv,
                                    offs_m, split, hi, S, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL,
                                    SCALE_NONNEG, EXP2, TMA, WARP_SPEC, DOT_PRECISION, UPCAST)
    # -- epilogue: normalise once. Top-left causal never leaves a row without keys, but a
    # zero row sum must not become 0/0 = NaN.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(out_dtype)
    if TMA:
        O.store([b, h, start_m, 0], out.reshape(1, 1, BLOCK_M, HEAD_DIM))  # clipped at S
    else:
        tl.store(O + o_base + offs_m[:, None] * sos + offs_d[None, :], out,
                 mask=offs_m[:, None] < S)


@triton.jit
def _tile_coords(tile, num_m, BH, CAUSAL: tl.constexpr, HEAD_MAJOR: tl.constexpr,
                 HEAVY_FIRST: tl.constexpr):
    """Maps a flat work-item index to (query block, flat head)."""
    if HEAD_MAJOR:
        m_idx = tile % num_m
        off_hz = tile // num_m
    else:
        m_idx = tile // BH
        off_hz = tile % BH
    if CAUSAL and HEAVY_FIRST:
        m_idx = num_m - 1 - m_idx
    return m_idx, off_hz


# Sequence lengths are not specialised: one compiled kernel serves every S (a
# candidate compiles 2-4 kernels, not one per divisibility class of S).
@triton.jit(do_not_specialize=["S", "BH", "H", "GROUP"])
def _attn_fwd(Q, K, V, O, qk_scale, S, BH, H, GROUP, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
              sob, soh, sos,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, SCALE_NONNEG: tl.constexpr,
              EXP2: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
              DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PERSISTENT: tl.constexpr,
              HEAD_MAJOR: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """Q, O: (B, H, S, D), K, V: (B, H // GROUP, S, D); strided pointers, or descriptors if TMA.
    O is laid out as torch.empty_like(Q): Q's own strides where Q is dense (transformers'
    (B, S, H, D) views give a (B, S, H, D) output, which it transposes back without a copy)."""
    num_m = tl.cdiv(S, BLOCK_M)
    if PERSISTENT:
        num_tiles = num_m * BH
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            m_idx, off_hz = _tile_coords(tile, num_m, BH, CAUSAL, HEAD_MAJOR, HEAVY_FIRST)
            _attn_fwd_tile(Q, K, V, O, m_idx, off_hz, S, H, GROUP, sqb, sqh, sqs, skb, skh, sks,
                           svb, svh, svs, sob, soh, sos, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                           CAUSAL, CAUSAL_SPLIT, SCALE_NONNEG, EXP2, TMA, WARP_SPEC,
                           DOT_PRECISION, UPCAST)
    else:
        m_idx, off_hz = _tile_coords(tl.program_id(0), num_m, BH, CAUSAL, HEAD_MAJOR,
                                     HEAVY_FIRST)
        _attn_fwd_tile(Q, K, V, O, m_idx, off_hz, S, H, GROUP, sqb, sqh, sqs, skb, skh, sks,
                       svb, svh, svs, sob, soh, sos, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                       CAUSAL, CAUSAL_SPLIT, SCALE_NONNEG, EXP2, TMA, WARP_SPEC, DOT_PRECISION,
                       UPCAST)


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


def _launch_settings(head_dim: int, causal: bool, seq_len: int, bh: int,
                     num_sms: int) -> tuple[int, int, int, int]:
    """Returns _settings' (BLOCK_M, BLOCK_N, num_warps, num_stages) for a grid of `bh` heads on
    `num_sms` SMs: when one program per SM covers every work item (a single partial wave, not
    persistent), NUM_STAGES_SMALL_GRID and, at D=64, BLOCK_N_D64_SMALL_GRID."""
    block_m, block_n, num_warps, num_stages = _settings(head_dim, causal, seq_len)
    if not PERSISTENT and triton.cdiv(seq_len, block_m) * bh <= num_sms:
        num_stages = NUM_STAGES_SMALL_GRID
        block_n = BLOCK_N_D64_SMALL_GRID if head_dim == 64 else block_n
    return block_m, block_n, num_warps, num_stages


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q is (B, H, S, D), k, v (B, Hkv, S, D), of one dtype and device."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[1] < 1 or \
            q.shape[1] % k.shape[1] or q[:, :k.shape[1]].shape != k.shape:
        raise ValueError(f"expected q (B, H, S, D) and k, v (B, H / n, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype among float16/bfloat16/float32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k and v must be on one device")


class _Desc:
    """What Triton's launcher reads of a TensorDescriptor (made per call: the base moves)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, base: torch.Tensor, shape: list[int], strides: list[int],
                 block_shape: list[int]) -> None:
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.padding = block_shape, "zero"


class _Launch:
    """One call key's launch, prepared by its first call: every argument but the tensors."""

    __slots__ = ("run", "function", "packed", "grid", "descs", "ints", "constexprs", "raw",
                 "maps")

    def __init__(self, kernel, grid: int, descs: tuple | None,  # noqa: ANN001
                 ints: tuple, constexprs: tuple) -> None:
        self.run, self.function, self.packed = kernel.run, kernel.function, kernel.packed_metadata
        self.grid, self.descs = grid, descs
        self.ints, self.constexprs = ints, constexprs
        self.raw = _raw_launcher(kernel) if descs is not None else None
        self.maps: dict[tuple, tuple] = {}   # (operand, address) -> its encoded descriptor


# Triton versions whose C launcher takes the argument layout _launch_prepared passes (a private
# API: Triton 3.9's launcher takes another); any other version takes the Python launch path.
RAW_LAUNCH_TRITON = ((3, 6),)


def _raw_launcher(kernel) -> tuple | None:  # noqa: ANN001
    """Triton's C launcher beneath its Python wrapper (which re-encodes every TMA descriptor,
    a few µs each), with what it needs: (launcher, cooperative, pdl, encode, layouts); None
    on a Triton not in RAW_LAUNCH_TRITON or not laid out as expected, or where the kernel
    needs scratch memory."""
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in RAW_LAUNCH_TRITON:
        return None
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
        run, metas = kernel.run, kernel.metadata.tensordesc_meta
        cells = dict(zip(run.launch.__code__.co_freevars, run.launch.__closure__))
        if run.global_scratch_size or run.profile_scratch_size or len(metas) != 4 or \
                None in metas:
            return None
        return (cells["launcher"].cell_contents, run.launch_cooperative_grid, run.launch_pdl,
                make_tensordesc_arg, tuple(metas))
    except (ImportError, AttributeError, KeyError, TypeError):
        return None


# Launches prepared per call key: a known key skips Triton's argument binding and cache lookup
# (tens of µs of host time) for the compiled kernel's launcher. Launch hooks take the usual path.
_LAUNCHES: dict[tuple, _Launch] = {}
_MAX_LAUNCHES = 256


def _no_hook(hook) -> bool:  # noqa: ANN001
    """Whether a Triton launch hook is unset (None, or an empty HookChain in Triton >= 3.5)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _fast_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> bool:
    """Whether a call may use a prepared launch: a real GPU, no launch hooks, 16-byte aligned
    inputs (the compiled kernel assumed the first call's alignment)."""
    return (FAST_LAUNCH and device.type == "cuda" and not _interpreting()
            and _no_hook(triton.knobs.runtime.launch_enter_hook)
            and _no_hook(triton.knobs.runtime.launch_exit_hook)
            and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0)


def _launch_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device,
                causal: bool, use_tma: bool, warp_specialize: bool, scale: float) -> tuple:
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, device, causal,
            use_tma, warp_specialize, scale >= 0)


def _launch_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> bool:
    return v.shape == k.shape and k.dtype == q.dtype and v.dtype == q.dtype and \
        k.device == v.device == device


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             use_tma: bool, warp_specialize: bool, device: torch.device | None = None
             ) -> torch.Tensor:
    """Checks shapes and launches the kernel with the module's knobs (TMA and WS as given)."""
    device = q.device if device is None else device
    # a launch is prepared only for inputs passed as they lie (not the copies made below)
    fast = _fast_ok(q, k, v, device) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    key = _launch_key(q, k, v, device, causal, use_tma, warp_specialize, scale)
    launch = _LAUNCHES.get(key) if fast else None
    if launch is not None and _launch_fits(q, k, v, device):
        return _launch_prepared(launch, q, k, v, scale * LOG2E if USE_EXP2 else scale, device)
    _check_inputs(q, k, v)
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError("flash_triton needs a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors")
    B, H, S, D = q.shape
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    BH = B * H
    num_sms = _num_sms(q.device)
    block_m, block_n, num_warps, num_stages = _launch_settings(D, causal, S, BH, num_sms)
    num_tiles = triton.cdiv(S, block_m) * BH
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)         # q's layout where q is dense, as SDPA's output
    use_tma = use_tma and not any(  # TMA needs 16-byte aligned bases and strides
        t.data_ptr() % 16 or (t.stride(0) | t.stride(1) | t.stride(2)) * t.element_size() % 16
        for t in (q, k, v, out))
    descs = None
    if use_tma:
        # 4-D (B, H, S, D) views: TMA zero-fills loads past S and clips stores at S per head.
        descs = tuple((list(t.shape), list(t.stride()), [1, 1, rows, D])
                      for t, rows in ((q, block_m), (k, block_n), (v, block_n), (out, block_m)))
        args = tuple(TensorDescriptor(t, *d) for t, d in zip((q, k, v, out), descs))
    else:
        args = (q, k, v, out)
    ints = (S, BH, H, H // k.shape[1], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3])
    grid = (min(num_tiles, PROGRAMS_PER_SM * num_sms) if PERSISTENT else num_tiles,)
    qk_scale = scale * LOG2E if USE_EXP2 else scale
    # Triton 3.6's interpreter multiplies bfloat16 tiles as their raw uint16 bits (garbage), so
    # there, and only there, the dots take bfloat16 values widened to float32: exact products,
    # float32 sums, p still rounded to bfloat16 first, i.e. the GPU's numerics.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    fp32_dots = q.dtype == torch.float32 or upcast
    constexprs = dict(
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        CAUSAL_SPLIT=CAUSAL_SPLIT, SCALE_NONNEG=scale >= 0, EXP2=USE_EXP2, TMA=use_tma,
        WARP_SPEC=warp_specialize, DOT_PRECISION="ieee" if fp32_dots else "tf32",
        UPCAST=upcast, PERSISTENT=PERSISTENT, HEAD_MAJOR=HEAD_MAJOR,
        HEAVY_FIRST=CAUSAL_HEAVY_FIRST)
    try:
        kernel = _attn_fwd[grid](*args, qk_scale, *ints, **constexprs,
                                 num_warps=num_warps, num_stages=num_stages)
    except Exception as exc:
        if not warp_specialize:
            raise
        raise WarpSpecializeError(
            f"WARP_SPECIALIZE=True failed for BLOCK_M={block_m} BLOCK_N={block_n} "
            f"num_warps={num_warps} num_stages={num_stages} D={D} {q.dtype}: "
            f"{type(exc).__name__}: {exc}") from exc
    if fast and kernel is not None and hasattr(kernel, "packed_metadata"):
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = _Launch(kernel, grid[0], descs, ints,
                                 tuple(constexprs.values()))
    return out


def _launch_prepared(launch: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     qk_scale: float, device: torch.device) -> torch.Tensor:
    """Launches a prepared kernel on fresh inputs of its key (see _LAUNCHES). A descriptor
    depends only on its operand's address once the key is fixed: each is encoded once."""
    out = torch.empty_like(q)        # the strides the key's first call gave its output
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    if launch.raw is not None:
        raw, cooperative, pdl, encode, metas = launch.raw
        maps, args = launch.maps, []
        for i, t in enumerate((q, k, v, out)):
            encoded = maps.get((i, t.data_ptr()))
            if encoded is None:
                if len(maps) >= 1024:
                    maps.clear()
                encoded = maps[i, t.data_ptr()] = tuple(encode(_Desc(t, *launch.descs[i]),
                                                               metas[i]))
            args += encoded
        raw(launch.grid, 1, 1, stream, launch.function, cooperative, pdl, None, None,
            launch.packed, None, None, None, *args, qk_scale, *launch.ints, *launch.constexprs)
        return out
    if launch.descs is not None:
        args = tuple(_Desc(t, *d) for t, d in zip((q, k, v, out), launch.descs))
    else:
        args = (q, k, v, out)
    launch.run(launch.grid, 1, 1, stream, launch.function, launch.packed, None, None, None,
               *args, qk_scale, *launch.ints, *launch.constexprs)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale [+ top-left causal mask]) v for (B, H, S, D) inputs."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    device = q.device
    return _forward(q, k, v, bool(causal), float(scale),
                    use_tma=USE_TMA and _supports_tma(device),
                    warp_specialize=WARP_SPECIALIZE and _hopper_or_newer(device), device=device)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            scale: float | None = None):  # noqa: ANN201
    """attention() for later calls with this one's shapes, strides, dtypes, device, causal and
    scale: the launch this call prepared, without attention()'s checks; None where there is
    none. Unaligned inputs or a launch hook take attention()."""
    scale = float(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    device, hooks = q.device, triton.knobs.runtime
    if not (_fast_ok(q, k, v, device) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and _launch_fits(q, k, v, device)):
        return None
    launch = _LAUNCHES.get(_launch_key(q, k, v, device, bool(causal), USE_TMA and
                                       _supports_tma(device), WARP_SPECIALIZE and
                                       _hopper_or_newer(device), scale))
    qk_scale = scale * LOG2E if USE_EXP2 else scale

    def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 scale: float | None = None) -> torch.Tensor:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 or not (
                _no_hook(hooks.launch_enter_hook) and _no_hook(hooks.launch_exit_hook)):
            return attention(q, k, v, causal, scale)
        return _launch_prepared(launch, q, k, v, qk_scale, device)
    return prepared if launch is not None else None


# Notes. WARP_SPECIALIZE=True failed in Triton 3.6's NVGPUWarpSpecialization pass for the D=64
# settings above (it compiled, no faster, for D=128 with BLOCK_M=128 and 8 warps). PERSISTENT
# ran at 0.86-0.88x for long D=64 sequences with 3 programs per SM, about half speed with 1.
