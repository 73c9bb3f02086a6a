"""Seed for `model`: one flash-attention Triton kernel for the prefill of Gemma 2, GPT-OSS,
Mistral and Llama: causal GQA with an optional sliding window, logit softcap and sinks.

q is (B, H, S, D), k and v are (B, Hkv, S, D); query head h reads key/value head h // G
(G = H // Hkv) in place, nothing repeated. One program computes one (BLOCK_M, D) output tile
of one (batch, query head) with the online softmax (running max, running sum, float32
accumulator), in base 2: log2(e) is folded into the scale, so exp2 does the exponentials.
Query blocks of a head run together and the G heads of a group are consecutive, so a
key/value head stays hot in L2 while its group runs.

The loop visits only the key tiles some row of the tile sees: from the tile holding key
start_m - W + 1 (0 without a window) to the diagonal. A 128-wide window at S = 8192 so
touches 2-3 key tiles per query tile instead of up to 128. In up to three stages: a masked
lower edge (keys that leave some rows' windows), an unmasked middle (keys every row sees)
and a masked diagonal.

Features are constexpr switches, so a call compiles only the code it uses:
  WINDOW   key j visible to query i iff i - W < j <= i (transformers' convention)
  SOFTCAP  s = cap * tanh(s / cap) on the scaled score, before the mask; tanh(x) =
           1 - 2 / (2^(2x·log2 e) + 1) in float32, which saturates to ±1 without NaN
  SINKS    the head's sink logit joins the final denominator, in the running-max frame:
           m' = max(m, sink), l' = l·2^(m - m') + 2^(sink - m'), acc scaled by 2^(m - m')

Knobs (the lines marked `# evoattn: choice(...)`), per head dim: tile sizes, warps, stages;
SPLIT_MASK (the three-stage loop; False masks every visited tile); HEAVY_FIRST (each head's
query tiles in reverse, so the causal tiles with the most keys do not trail the grid).
Correct for any S >= 1, H % Hkv == 0, D in {64, 128, 256}, window >= 0, softcap >= 0; on a
GPU, the largest tiles with deep pipelines may not fit in shared memory at D = 256 (the
launch then fails).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# ---- knobs (one per line; the mutator rewrites only the value) ------------------------
BLOCK_M_D64 = 128  # evoattn: choice(32, 64, 128)
BLOCK_N_D64 = 64  # evoattn: choice(32, 64, 128)
NUM_WARPS_D64 = 4  # evoattn: choice(4, 8)
NUM_STAGES_D64 = 3  # evoattn: choice(1, 2, 3, 4)
BLOCK_M_D128 = 128  # evoattn: choice(32, 64, 128)
BLOCK_N_D128 = 64  # evoattn: choice(32, 64, 128)
NUM_WARPS_D128 = 8  # evoattn: choice(4, 8)
NUM_STAGES_D128 = 2  # evoattn: choice(1, 2, 3, 4)
# D = 256: a 64x256 q tile and a 64x256 float32 accumulator, K and V tiles of 32 or 64 keys
# (16 or 32 KB each per stage in 16 bits) keep within an H100's 228 KB of shared memory.
BLOCK_M_D256 = 64  # evoattn: choice(32, 64, 128)
BLOCK_N_D256 = 32  # evoattn: choice(16, 32, 64)
NUM_WARPS_D256 = 8  # evoattn: choice(4, 8)
NUM_STAGES_D256 = 2  # evoattn: choice(1, 2, 3)
SPLIT_MASK = True  # evoattn: choice(True, False)
HEAVY_FIRST = True  # evoattn: choice(True, False)

LOG2E = 1.44269504  # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- kernel -------------------------------------------------------------------------
@triton.jit
def _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, lo, hi, S, window, qk_scale, cap2,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """Folds key tiles [lo, hi) of one key/value head into (acc, l_i, m_i), scores in log2."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n                                           # key indices
        kv_off = kv_head + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=cols[:, None] < S, other=0.0)    # (BLOCK_N, D)
        else:
            k = tl.load(K + kv_off)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale                             # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            # qk_scale = 2·log2(e)·scale/cap here: s is 2x·log2(e) for x = score/cap, and
            # cap2 = cap·log2(e) turns tanh(x) into the capped score in log2 units.
            s = cap2 * (1.0 - 2.0 / (tl.math.exp2(s) + 1.0))
        if MASKED:
            keep = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] < S)
            if WINDOW:
                keep = keep & (cols[None, :] > offs_m[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)               # no -inf - -inf = NaN
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)                                 # rescales the old state
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(V + kv_off, mask=cols[:, None] < S, other=0.0)
        else:
            v = tl.load(V + kv_off)
        if UPCAST:                      # the interpreter's bfloat16: p stays float32
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)           # for the tensor cores
        acc = tl.dot(p, v, acc)
        m_i = m_ij
    return acc, l_i, m_i


# Sequence lengths, group sizes and windows are not specialised: one compiled kernel serves
# every S, G and W of a feature set.
@triton.jit(do_not_specialize=["S", "G", "H", "window"])
def _model_fwd(Q, K, V, O, SINK, S, G, H, window, qk_scale, cap2,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
               SPLIT: tl.constexpr, HEAVY_FIRST: tl.constexpr, UPCAST: tl.constexpr):
    """Q, O: contiguous (B, H, S, D); K, V: (B, Hkv, S, D); SINK: (H,) float32 logits, read
    only if SINKS. A 1-D grid of (query blocks) * B*H programs, query blocks fastest."""
    num_m = tl.cdiv(S, BLOCK_M)
    pid = tl.program_id(0)
    m_idx = pid % num_m
    if HEAVY_FIRST:                 # the last query tiles see the most keys: start them first
        m_idx = num_m - 1 - m_idx
    start_m = m_idx * BLOCK_M
    off_hz = pid // num_m                            # flat query head b*H + h
    off_kv = off_hz // G                             # its key/value head b*Hkv + h // G
    offs_m = start_m + tl.arange(0, BLOCK_M)                              # query indices
    offs_d = tl.arange(0, HEAD_DIM)
    q_head = off_hz.to(tl.int64) * S * HEAD_DIM
    kv_head = off_kv.to(tl.int64) * S * HEAD_DIM
    # q: (BLOCK_M, D), stays in registers throughout; rows past S read as zeros
    q = tl.load(Q + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < S, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)            # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                          # running row sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                # unnormalised output
    last = tl.minimum(start_m + BLOCK_M, S) - 1        # the tile's last real query
    hi = last + 1                                      # keys past it are causally hidden
    diag = ((start_m + 1) // BLOCK_N) * BLOCK_N        # tiles below it: every row sees them
    if WINDOW:
        lo = (tl.maximum(start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
        # keys in [last - W + 1, start_m] lie inside every row's window
        mid_lo = tl.minimum(tl.maximum(lo, tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N)
                                       * BLOCK_N), hi)
    else:
        lo = 0
        mid_lo = 0
    if SPLIT:
        mid_hi = tl.maximum(mid_lo, diag)
    else:
        mid_lo = hi
        mid_hi = hi
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, lo, mid_lo, S, window,
                           qk_scale, cap2, HEAD_DIM, BLOCK_N, True, WINDOW, SOFTCAP, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, mid_lo, mid_hi, S, window,
                           qk_scale, cap2, HEAD_DIM, BLOCK_N, False, WINDOW, SOFTCAP, UPCAST)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, K, V, kv_head, offs_m, mid_hi, hi, S, window,
                           qk_scale, cap2, HEAD_DIM, BLOCK_N, True, WINDOW, SOFTCAP, UPCAST)
    if SINKS:
        sink = tl.load(SINK + off_hz % H) * 1.44269504                    # log2 units
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_i = tl.where(l_i == 0.0, 1.0, l_i)                                  # rows past S: no 0/0
    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + q_head + offs_m[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], out,
             mask=offs_m[:, None] < S)


# ---- wrapper ------------------------------------------------------------------------
def _settings(head_dim: int) -> tuple[int, int, int, int]:
    """Returns (BLOCK_M, BLOCK_N, num_warps, num_stages) for a head dimension."""
    if head_dim == 64:
        return BLOCK_M_D64, BLOCK_N_D64, NUM_WARPS_D64, NUM_STAGES_D64
    if head_dim == 128:
        return BLOCK_M_D128, BLOCK_N_D128, NUM_WARPS_D128, NUM_STAGES_D128
    return BLOCK_M_D256, BLOCK_N_D256, NUM_WARPS_D256, NUM_STAGES_D256


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, softcap: float,
           sinks: torch.Tensor | None) -> None:
    """Raises ValueError for inputs outside the `model` contract."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q (B, H, S, D) and k, v (B, Hkv, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D) or Hkv == 0 or H % Hkv:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         "(same B, S, D and H % Hkv == 0)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, float16 or bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} not supported (64, 128 or 256)")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window}, {softcap}")
    if sinks is not None and (sinks.shape != (H,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be a float32 tensor of shape ({H},), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    if not (q.device == k.device == v.device) or (sinks is not None
                                                  and sinks.device != q.device):
        raise ValueError("q, k, v and sinks must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("model_triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU ones")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              window: int = 0, softcap: float = 0.0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Returns causal GQA attention with an optional window, softcap and sinks (the contract)."""
    window, softcap = int(window), float(softcap)
    _check(q, k, v, window, softcap, sinks)
    B, H, S, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()    # no-ops for contiguous inputs
    # Triton's interpreter multiplies bfloat16 tiles as their raw bits and truncates float32
    # to bfloat16: there, and only there, the dots take bfloat16 values widened to float32
    # and the kernel writes float32, which torch rounds to nearest.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=torch.float32 if upcast else q.dtype, device=q.device)
    block_m, block_n, num_warps, num_stages = _settings(D)
    use_window = 0 < window < S                                 # W >= S is plain causal
    if softcap:
        qk_scale, cap2 = 2.0 * LOG2E * scale / softcap, softcap * LOG2E
    else:
        qk_scale, cap2 = scale * LOG2E, 1.0
    grid = (triton.cdiv(S, block_m) * B * H,)
    _model_fwd[grid](q, k, v, out, sinks if sinks is not None else q, S, G, H,
                     window if use_window else 0, qk_scale, cap2,
                     HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=use_window,
                     SOFTCAP=softcap > 0, SINKS=sinks is not None, SPLIT=SPLIT_MASK,
                     HEAVY_FIRST=HEAVY_FIRST, UPCAST=upcast, num_warps=num_warps,
                     num_stages=num_stages)
    return out.to(q.dtype) if upcast else out
