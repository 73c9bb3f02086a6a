"""Seed for `masked`: a flash-attention Triton kernel that adds a user mask and skips dead tiles.

out = softmax(q kᵀ·scale + mask) v, with a 4-D additive mask broadcastable to
(B, H, Sq, Sk) (-inf hides a key). Each call, inside the call (so it counts in the
kernel's time), two small kernels turn the mask into per-tile work lists, on the
mask's own (unbroadcast) shape:
  1. `_classify` reads every (BLOCK_M, BLOCK_N) tile of the mask once, all tiles in
     parallel, and labels it dead (no finite entry), full (every entry is 0 and the
     tile lies inside Sk: nothing to add, nothing to mask) or partial (anything else);
  2. `_compact` turns each row of labels into two lists of key-block indices, the full
     tiles and the partial ones, in key order (a prefix sum, no atomics).
The attention kernel then computes one (BLOCK_M, D) output tile of one (batch, head):
it loops over its full tiles without ever loading the mask (the dense inner loop, which
Triton software-pipelines like any flash kernel), then over its partial tiles, loading
the mask tile and the Sk bound there, with the online softmax (running max, running sum,
float32 accumulator) across both. Dead tiles cost nothing. The mask is read through its
broadcast strides (0 along size-1 dimensions): it is never expanded in memory.

Knobs (the lines marked `# evoattn: choice(...)`):
  BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES  tile sizes and launch settings
  USE_EXP2     exp2 with log2(e) folded into the scale and the mask, instead of exp
  FULL_TILES   treat all-zero tiles as full (no mask load); False sends every live tile
               down the partial path
  USE_TMA      Hopper tensor descriptors (TMA) for Q, K, V and O, used only on a CUDA device
               of capability >= 9 (elsewhere the pointer path runs): 3-D (B*H, S, D)
               views, so rows past a head's Sq/Sk read as zeros and stores clip there
Correct for any Sq, Sk >= 1 and any mask without a fully masked row.
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

# Defaults: the best of five settings evaluated on an H200 (BENCHMARKS.md): 2.92x SDPA with
# the mask, geometric mean; 3 stages 2.84x, pointer loads 2.53x, 128-row tiles 1.8x or less.
BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
BLOCK_N = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS = 4  # evoattn: choice(2, 4, 8)
NUM_STAGES = 2  # evoattn: choice(1, 2, 3, 4)
USE_EXP2 = True  # evoattn: choice(True, False)
FULL_TILES = True  # evoattn: choice(True, False)
USE_TMA = True  # evoattn: choice(True, False)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _supports_tma(device: torch.device) -> bool:
    """Returns True on a real (not interpreted) CUDA device of capability >= 9."""
    return (HAS_TENSOR_DESC and device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)


# ---- the work lists ---------------------------------------------------------------------
@triton.jit
def _classify(M, LABEL, H1, Sq, Sk, NK, NQ1, sm_b, sm_h, sm_q, sm_k,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, FULL_OK: tl.constexpr):
    """Labels one (ROWS, BLOCK_N) tile of the mask's own frame as 0 dead, 1 full, 2 partial.

    A 1-D grid of b1*h1*nq1*nk programs, key blocks fastest: program pid labels LABEL[pid].
    """
    pid = tl.program_id(0)
    kb = pid % NK
    qb = (pid // NK) % NQ1
    bh = pid // (NK * NQ1)
    rows = qb * ROWS + tl.arange(0, ROWS)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < Sq) & (cols[None, :] < Sk)
    base = M + (bh // H1).to(tl.int64) * sm_b + (bh % H1).to(tl.int64) * sm_h
    bias = tl.load(base + rows[:, None].to(tl.int64) * sm_q + cols[None, :].to(tl.int64) * sm_k,
                   mask=inside, other=float("-inf")).to(tl.float32)
    n_live = tl.sum((bias != float("-inf")).to(tl.int32))
    n_zero = tl.sum((inside & (bias == 0.0)).to(tl.int32))
    n_inside = tl.sum(inside.to(tl.int32))
    label = tl.where(n_live == 0, 0, 2)
    if FULL_OK:
        # every entry of the tile's in-range rows is 0, and no column lies past Sk
        full = (n_zero == n_inside) & ((kb + 1) * BLOCK_N <= Sk)
        label = tl.where(full & (n_live > 0), 1, label)
    tl.store(LABEL + pid, label.to(tl.int8))


@triton.jit
def _compact(LABEL, IDX, COUNT, NK, NK_P2: tl.constexpr):
    """Writes one row's full tiles, then its partial ones, as key-block lists; grid (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    kb = tl.arange(0, NK_P2)
    label = tl.load(LABEL + row * NK + kb, mask=kb < NK, other=0)
    is_full = (label == 1).to(tl.int32)
    is_part = (label == 2).to(tl.int32)
    pos_full = tl.cumsum(is_full, 0) - 1
    pos_part = tl.cumsum(is_part, 0) - 1
    n_full = tl.sum(is_full)
    tl.store(IDX + row * NK + pos_full, kb, mask=is_full != 0)
    tl.store(IDX + row * NK + n_full + pos_part, kb, mask=is_part != 0)
    tl.store(COUNT + row * 2, n_full)
    tl.store(COUNT + row * 2 + 1, tl.sum(is_part))


# ---- attention --------------------------------------------------------------------------
@triton.jit
def _fold(acc, l_i, m_i, q, K, V, bh, kv_head, mask_base, offs_m, IDX, lo, hi, Sq, Sk,
          qk_scale, mask_scale, sm_q, sm_k,
          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL_TILES: tl.constexpr,
          EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
          TMA: tl.constexpr):
    """Folds the key blocks IDX[lo:hi] into (acc, l_i, m_i); partial ones add the mask tile."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(lo, hi):
        start_n = tl.load(IDX + i) * BLOCK_N
        cols = start_n + offs_n
        kv_off = kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        in_k = cols < Sk
        if TMA:
            k = K.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)    # past Sk: zeros
        elif PARTIAL_TILES:
            k = tl.load(K + kv_off, mask=in_k[:, None], other=0.0)
        else:
            k = tl.load(K + kv_off)                   # a full tile lies inside Sk
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if PARTIAL_TILES:
            # the mask tile, read through its broadcast strides; past Sq/Sk reads as -inf
            bias = tl.load(mask_base + offs_m[:, None].to(tl.int64) * sm_q
                           + cols[None, :].to(tl.int64) * sm_k,
                           mask=(offs_m[:, None] < Sq) & in_k[None, :], other=float("-inf"))
            s = s + bias.to(tl.float32) * mask_scale
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no -inf - -inf = NaN
        else:
            m_ij = tl.maximum(m_i, tl.max(s, 1))      # every score finite
            m_sub = m_ij
        if EXP2:
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = V.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        elif PARTIAL_TILES:
            v = tl.load(V + kv_off, mask=in_k[:, None], other=0.0)
        else:
            v = tl.load(V + kv_off)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _masked_fwd(Q, K, V, M, IDX, COUNT, O, H, Sq, Sk, NK, qk_scale, mask_scale,
                sm_b, sm_h, sm_q, sm_k, sw_b, sw_h, sw_q,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                TMA: tl.constexpr):
    """Q, O: contiguous (B, H, Sq, D); K, V: contiguous (B, H, Sk, D); M: a strided view.

    With TMA, Q, K, V and O are tensor descriptors over (B*H, Sq or Sk, D) instead.

    IDX (rows, NK) and COUNT (rows, 2) are the work lists; row = b*sw_b + h*sw_h + m*sw_q
    (strides 0 along the mask's broadcast dimensions).
    """
    num_m = tl.cdiv(Sq, BLOCK_M)            # a 1-D grid, query blocks fastest (B*H may
    m_blk = tl.program_id(0) % num_m        # exceed a second grid axis's 65535)
    bh = tl.program_id(0) // num_m
    b = bh // H
    h = bh % H
    start_m = m_blk * BLOCK_M
    q_head = bh.to(tl.int64) * Sq * HEAD_DIM
    kv_head = bh.to(tl.int64) * Sk * HEAD_DIM
    mask_base = M + b.to(tl.int64) * sm_b + h.to(tl.int64) * sm_h
    row = (b * sw_b + h * sw_h + m_blk * sw_q).to(tl.int64)
    idx = IDX + row * NK
    n_full = tl.load(COUNT + row * 2)
    n_part = tl.load(COUNT + row * 2 + 1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # q: (BLOCK_M, HEAD_DIM), stays in registers throughout; rows past Sq read as zeros
    if TMA:
        q = Q.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        q = tl.load(Q + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                    mask=offs_m[:, None] < Sq, other=0.0)
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, bh, kv_head, mask_base, offs_m, idx, 0,
                          n_full, Sq, Sk, qk_scale, mask_scale, sm_q, sm_k, HEAD_DIM, BLOCK_N,
                          False, EXP2, DOT_PRECISION, UPCAST, TMA)
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, bh, kv_head, mask_base, offs_m, idx, n_full,
                          n_full + n_part, Sq, Sk, qk_scale, mask_scale, sm_q, sm_k, HEAD_DIM,
                          BLOCK_N, True, EXP2, DOT_PRECISION, UPCAST, TMA)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                           # rows past Sq: no 0/0
    out = (acc / l_i[:, None]).to(out_dtype)
    if TMA:
        O.store([bh, start_m, 0], out.reshape(1, BLOCK_M, HEAD_DIM))   # clipped at Sq
    else:
        tl.store(O + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], out,
                 mask=offs_m[:, None] < Sq)


def _work_lists(mask: torch.Tensor, Sq: int, Sk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Returns (IDX (b1, h1, nq1, nk) int32, COUNT (b1, h1, nq1, 2) int32, nk) for the mask.

    The frame is the mask's own: a size-1 (broadcast) dimension stays size 1, so a padding
    mask (B, 1, 1, Sk) gets one list per batch, shared by every head and query block.
    """
    b1, h1, q1, _ = mask.shape
    rows = BLOCK_M if q1 > 1 else 1          # a mask shared by every query row: one list
    nq1, nk = triton.cdiv(Sq, BLOCK_M) if q1 > 1 else 1, triton.cdiv(Sk, BLOCK_N)
    m = mask.expand(b1, h1, Sq, Sk)            # strides 0 along broadcast q / k dimensions
    label = torch.empty((b1, h1, nq1, nk), dtype=torch.int8, device=mask.device)
    _classify[(b1 * h1 * nq1 * nk,)](m, label, h1, Sq, Sk, nk, nq1, *m.stride(), ROWS=rows,
                                     BLOCK_N=BLOCK_N, FULL_OK=FULL_TILES, num_warps=4)
    idx = torch.empty((b1, h1, nq1, nk), dtype=torch.int32, device=mask.device)
    count = torch.empty((b1, h1, nq1, 2), dtype=torch.int32, device=mask.device)
    _compact[(b1 * h1 * nq1,)](label, idx, count, nk, NK_P2=triton.next_power_of_2(nk),
                               num_warps=4)
    return idx, count, nk


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale + mask) v; q (B, H, Sq, D), k/v (B, H, Sk, D)."""
    return _forward(q, k, v, mask, scale, USE_TMA and _supports_tma(q.device))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float | None, use_tma: bool) -> torch.Tensor:
    """Checks the inputs and launches the kernels; TMA as given (tests force it on the CPU)."""
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
    if any(n not in (1, full) for n, full in zip(mask.shape, (B, H, Sq, Sk))):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not broadcast to {(B, H, Sq, Sk)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    idx, count, nk = _work_lists(mask, Sq, Sk)
    # one list row per (b, h, query block) of the mask's frame: stride 0 where it broadcasts
    b1, h1, nq1, _ = idx.shape
    sw_b = h1 * nq1 if b1 > 1 else 0
    sw_h = nq1 if h1 > 1 else 0
    sw_q = 1 if nq1 > 1 else 0
    mask_full = mask.expand(B, H, Sq, Sk)                         # a view: strides 0 to broadcast
    out = torch.empty_like(q)                                     # (B, H, Sq, D)
    upcast = _interpreting() and q.dtype == torch.bfloat16        # interpreter bf16 dot bug
    # TMA descriptors need 16-byte aligned base addresses (a view may start anywhere)
    use_tma = use_tma and all(t.data_ptr() % 16 == 0 for t in (q, k, v, out))
    if use_tma:
        # (B*H, S, D) views: each head is its own box range, so loads past S zero-fill and
        # stores clip per head. The descriptors need 16-byte aligned row strides (D >= 64).
        def desc(t: torch.Tensor, rows: int) -> "TensorDescriptor":
            S = t.shape[2]
            return TensorDescriptor(t, [B * H, S, D], [S * D, D, 1], [1, rows, D])
        tensors = (desc(q, BLOCK_M), desc(k, BLOCK_N), desc(v, BLOCK_N))
        o_arg = desc(out, BLOCK_M)
    else:
        tensors, o_arg = (q, k, v), out
    grid = (triton.cdiv(Sq, BLOCK_M) * B * H,)
    _masked_fwd[grid](*tensors, mask_full, idx, count, o_arg, H, Sq, Sk, nk,
                      scale * LOG2E if USE_EXP2 else scale, LOG2E if USE_EXP2 else 1.0,
                      *mask_full.stride(), sw_b, sw_h, sw_q,
                      HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, EXP2=USE_EXP2,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                      UPCAST=upcast, TMA=use_tma, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
