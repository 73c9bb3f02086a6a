"""Seed for `model_decode`: split-K (flash-decoding) attention over a KV cache with the
features of Gemma 2 and GPT-OSS: GQA, a left sliding window, logit softcap and sinks.

q is (B, H, T, D), the cache k, v is (B, Hkv, Smax, D); sequence b's valid cache is its first
L = cache_seqlens[b] positions, and new token t sits at position p = L - T + t.

Two kernels:
  _split   one program per (batch * key/value head, chunk of the cache, block of query rows).
           The G = H // Hkv query heads of a key/value head times their T new tokens are the
           G*T rows of one tile (contiguous in q: head kv*G + g, token t is row g*T + t), so
           each cache block is loaded once for all of them. A program folds its chunk into a
           running max, sum and float32 accumulator (online softmax in base 2) and writes
           its partial output and log2-sum-exp. Chunks start at the first key some row sees
           (0, or L - T - W + 1 with a window, rounded down to BLOCK_N): a 128-wide window
           over a 16k cache is one chunk, whatever the cache's length. The chunk count comes
           from Smax and the window on the host, never from the lengths (reading them would
           synchronise with the host and break CUDA-graph capture); chunks past a sequence's
           length return at once.
  _merge   one program per (batch * key/value head, block of rows): combines the chunks that
           hold keys, weighting each by 2^(lse - max lse), and adds the head's sink to the
           denominator. With one chunk the split kernel does this itself and no merge runs.

Within a chunk, up to three stages: masked blocks below the keys every row sees (the window's
lower edge), unmasked blocks every row sees, masked blocks at the causal edge.

Features are constexpr switches, so a call compiles only the code it uses:
  WINDOW   key j visible to the query at position p iff p - W < j <= p
  SOFTCAP  s = cap * tanh(s / cap) on the scaled score, before the mask; tanh(x) =
           1 - 2 / (2^(2x·log2 e) + 1) in float32, which saturates to ±1 without NaN
  SINKS    the sink logit joins the final denominator in the running-max frame

Knobs (the lines marked `# evoattn: choice(...)`), per head dim: keys per block, warps,
stages; the chunking (PROGRAMS_PER_SM, MIN_CHUNK_KEYS), MAX_BLOCK_M, SPLIT_MASK, MERGE_WARPS.
Rows with no visible key (p < 0) output zeros. Loads never go past a sequence's length.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# ---- knobs (one per line; the mutator rewrites only the value) ------------------------
BLOCK_N_D64 = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS_D64 = 4  # evoattn: choice(1, 2, 4, 8)
NUM_STAGES_D64 = 3  # evoattn: choice(1, 2, 3, 4)
BLOCK_N_D128 = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS_D128 = 4  # evoattn: choice(1, 2, 4, 8)
NUM_STAGES_D128 = 3  # evoattn: choice(1, 2, 3, 4)
# D = 256: a 64-key block of K or V is 32 KB per stage in 16 bits
BLOCK_N_D256 = 32  # evoattn: choice(16, 32, 64)
NUM_WARPS_D256 = 4  # evoattn: choice(2, 4, 8)
NUM_STAGES_D256 = 2  # evoattn: choice(1, 2, 3)
MAX_BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
PROGRAMS_PER_SM = 2  # evoattn: choice(1, 2, 4, 8)
MIN_CHUNK_KEYS = 512  # evoattn: choice(128, 256, 512, 1024, 2048)
SPLIT_MASK = True  # evoattn: choice(True, False)
MERGE_WARPS = 4  # evoattn: choice(1, 2, 4, 8)

MAX_CHUNKS = 256               # the grid's second axis (at most 65535)
INTERPRETER_SMS = 4            # the SM count assumed by Triton's CPU interpreter
LOG2E = 1.44269504             # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (64, 128, 256)
MAX_T = 16
_DTYPES = (torch.float16, torch.bfloat16)


# ---- capability helpers ---------------------------------------------------------------
def _interpreting() -> bool:
    """Returns True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---- kernels --------------------------------------------------------------------------
@triton.jit
def _fold(acc, l_i, m_i, q, K, V, kv_base, lo, hi, pos, L, window, qk_scale, cap2,
          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """Folds cache blocks [lo, hi) of one key/value head into (acc, l_i, m_i), scores in
    log2. Masked blocks hide keys outside each row's [pos - W + 1, pos] and never load at or
    past L; unmasked ones lie where every row sees every key."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n                                            # key positions
        ptrs = kv_base + cols[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + ptrs, mask=cols[:, None] < L, other=0.0)      # (BLOCK_N, D)
        else:
            k = tl.load(K + ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale                            # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            # qk_scale = 2·log2(e)·scale/cap here: s is 2x·log2(e) for x = score/cap, and
            # cap2 = cap·log2(e) turns tanh(x) into the capped score in log2 units.
            s = cap2 * (1.0 - 2.0 / (tl.math.exp2(s) + 1.0))
        if MASKED:
            keep = cols[None, :] <= pos[:, None]
            if WINDOW:
                keep = keep & (cols[None, :] > pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)             # no -inf - -inf
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)                                # rescales the old state
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + ptrs, mask=cols[:, None] < L, other=0.0)
        else:
            v = tl.load(V + ptrs)
        if UPCAST:                      # the interpreter's bfloat16: p stays float32
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)                                            # as a flash kernel does
        acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _finish(acc, l_i, m_i, SINK, heads, rows, ROWS, SINKS: tl.constexpr):
    """Returns the normalised output rows: the sink (log2 units) joins the denominator."""
    if SINKS:
        sink = tl.load(SINK + heads, mask=rows < ROWS, other=0.0) * 1.44269504
        m_new = tl.maximum(m_i, sink)
        m_sub = tl.where(m_i == float("-inf"), m_new, m_i)
        alpha = tl.math.exp2(m_sub - m_new)
        # a row with no key stays at l = 0 (its output is zero, not the sink's share)
        l_i = tl.where(l_i == 0.0, 0.0, l_i * alpha + tl.math.exp2(sink - m_new))
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                              # no key: acc is 0
    return acc / l_safe[:, None]


@triton.jit(do_not_specialize=["SMAX", "CHUNK", "NUM_CHUNKS", "window"])
def _split(Q, K, V, Lens, SINK, O, OPart, LsePart, SMAX, HKV, G, ROWS, T, CHUNK, NUM_CHUNKS,
           window, qk_scale, cap2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, WINDOW: tl.constexpr,
           SOFTCAP: tl.constexpr, SINKS: tl.constexpr, SPLIT: tl.constexpr,
           UPCAST: tl.constexpr):
    """Q, O: contiguous (B*Hkv, ROWS, D) views of (B, H, T, D); K, V: (B*Hkv, SMAX, D);
    OPart (B*Hkv, NUM_CHUNKS, ROWS, D) and LsePart (B*Hkv, NUM_CHUNKS, ROWS) float32.
    Grid: (B*Hkv, NUM_CHUNKS, row blocks). DIRECT: one chunk, the output written here."""
    bh = tl.program_id(0)                       # b * Hkv + key/value head
    chunk = tl.program_id(1)
    rb = tl.program_id(2)
    L = tl.load(Lens + bh // HKV)
    if WINDOW:      # the first key the first new token sees, on a block boundary
        first = (tl.maximum(L - T - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        first = L * 0
    lo = first + chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    if not DIRECT:
        if lo >= L:                             # past the sequence: the merge skips it
            return
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)                          # tile rows
    offs_d = tl.arange(0, HEAD_DIM)
    pos = L - T + rows % T                      # row g*T + t is token t, at L - T + t
    row_ptrs = bh.to(tl.int64) * ROWS * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    keep_rows = rows[:, None] < ROWS
    # q: (BLOCK_M, D), in registers throughout; rows past ROWS read as zeros
    q = tl.load(Q + row_ptrs, mask=keep_rows, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)            # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                          # running row sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                # unnormalised output
    # Every row sees keys [L - W, L - T] (from 0 without a window): whole blocks there need
    # no mask. lo is on a block boundary, so are mid_lo and mid_hi.
    if WINDOW:
        full_lo = tl.maximum(L - window, 0)
    else:
        full_lo = L * 0
    mid_lo = tl.minimum(tl.maximum(lo, tl.cdiv(full_lo, BLOCK_N) * BLOCK_N), hi)
    mid_hi = tl.maximum(mid_lo, (tl.minimum(hi, L - T + 1) // BLOCK_N) * BLOCK_N)
    if not SPLIT:
        mid_lo = hi
        mid_hi = hi
    kv_base = bh.to(tl.int64) * SMAX * HEAD_DIM
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, kv_base, lo, mid_lo, pos, L, window,
                          qk_scale, cap2, HEAD_DIM, BLOCK_N, True, WINDOW, SOFTCAP, UPCAST)
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, kv_base, mid_lo, mid_hi, pos, L, window,
                          qk_scale, cap2, HEAD_DIM, BLOCK_N, False, WINDOW, SOFTCAP, UPCAST)
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, kv_base, mid_hi, hi, pos, L, window,
                          qk_scale, cap2, HEAD_DIM, BLOCK_N, True, WINDOW, SOFTCAP, UPCAST)
    if DIRECT:
        heads = (bh % HKV) * G + rows // T
        out = _finish(acc, l_i, m_i, SINK, heads, rows, ROWS, SINKS)
        tl.store(O + row_ptrs, out.to(O.dtype.element_ty), mask=keep_rows)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        part = (bh.to(tl.int64) * NUM_CHUNKS + chunk) * ROWS + rows
        tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=keep_rows)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(LsePart + part, lse, mask=rows < ROWS)


@triton.jit(do_not_specialize=["CHUNK", "NUM_CHUNKS", "window"])
def _merge(OPart, LsePart, Lens, SINK, O, HKV, G, ROWS, T, CHUNK, NUM_CHUNKS, window,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           WINDOW: tl.constexpr, SINKS: tl.constexpr):
    """Combines the chunks that hold keys of one (batch * key/value head, row block), then
    the sink. Grid: (B*Hkv, row blocks)."""
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    L = tl.load(Lens + bh // HKV)
    if WINDOW:                                  # as _split places its chunks
        first = (tl.maximum(L - T - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        first = L * 0
    used = tl.minimum(tl.cdiv(tl.maximum(L - first, 0), CHUNK), NUM_CHUNKS)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    keep = rows < ROWS
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for c in range(0, used):
        part = (bh.to(tl.int64) * NUM_CHUNKS + c) * ROWS + rows
        lse = tl.load(LsePart + part, mask=keep, other=float("-inf"))
        o = tl.load(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], mask=keep[:, None],
                    other=0.0)
        m_new = tl.maximum(m, lse)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_sub)
        w = tl.math.exp2(lse - m_sub)                                    # 0 for an empty chunk
        l = l * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    heads = (bh % HKV) * G + rows // T
    out = _finish(acc, l, m, SINK, heads, rows, ROWS, SINKS)
    row_ptrs = bh.to(tl.int64) * ROWS * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(O + row_ptrs, out.to(O.dtype.element_ty), mask=keep[:, None])


# ---- wrapper ------------------------------------------------------------------------
def _settings(head_dim: int) -> tuple[int, int, int]:
    """Returns (BLOCK_N, num_warps, num_stages) for a head dimension."""
    if head_dim == 64:
        return BLOCK_N_D64, NUM_WARPS_D64, NUM_STAGES_D64
    if head_dim == 128:
        return BLOCK_N_D128, NUM_WARPS_D128, NUM_STAGES_D128
    return BLOCK_N_D256, NUM_WARPS_D256, NUM_STAGES_D256


def _chunks(programs: int, span: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """Returns (num_chunks, keys per chunk) covering `span` keys: enough programs for
    PROGRAMS_PER_SM per SM, no chunk under MIN_CHUNK_KEYS keys, each whole BLOCK_N blocks."""
    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), programs)
    most = triton.cdiv(span, max(MIN_CHUNK_KEYS, block_n))
    n = max(1, min(want, most, MAX_CHUNKS))
    chunk = triton.cdiv(triton.cdiv(span, n), block_n) * block_n
    return triton.cdiv(span, chunk), chunk


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, window: int,
           softcap: float, sinks: torch.Tensor | None) -> None:
    """Raises ValueError for inputs outside the `model_decode` contract."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q (B, H, T, D) and k, v (B, Hkv, Smax, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != B or k.shape[3] != D or Hkv == 0 or H % Hkv or k.shape[2] == 0:
        raise ValueError(f"cache shape {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         "(same B and D, Smax >= 1, H % Hkv == 0)")
    if not 1 <= T <= MAX_T:
        raise ValueError(f"{T} new tokens: 1 to {MAX_T} supported")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, float16 or bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} not supported (64, 128 or 256)")
    if tuple(lens.shape) != (B,) or lens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens must be int32 of shape ({B},); got {lens.dtype} "
                         f"{tuple(lens.shape)}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window}, {softcap}")
    if sinks is not None and (sinks.shape != (H,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be a float32 tensor of shape ({H},), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    devices = {t.device for t in (q, k, v, lens) + ((sinks,) if sinks is not None else ())}
    if len(devices) != 1:
        raise ValueError("q, k, v, cache_seqlens and sinks must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("model_decode_triton needs CUDA tensors, or TRITON_INTERPRET=1 for "
                         "CPU ones")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
              scale: float | None = None, window: int = 0, softcap: float = 0.0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Returns attention of q (B, H, T, D), the newest T tokens, over the cache k, v
    (B, Hkv, Smax, D) of per-sequence lengths cache_seqlens (int32, (B,)), with an optional
    window, softcap and sinks (the contract)."""
    window, softcap = int(window), float(softcap)
    _check(q, k, v, cache_seqlens, window, softcap, sinks)
    B, H, T, D = q.shape
    HKV, SMAX = k.shape[1], k.shape[2]
    G = H // HKV
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = G * T                                # query rows sharing one key/value head
    block_m = min(max(16, triton.next_power_of_2(rows)), max(16, MAX_BLOCK_M))
    row_blocks = triton.cdiv(rows, block_m)
    block_n, num_warps, num_stages = _settings(D)
    use_window = 0 < window < SMAX               # W >= Smax: every row sees all it may
    # keys some row may see: the window and the new tokens, plus the block rounding of `first`
    span = min(SMAX, window + T - 1 + block_n - 1) if use_window else SMAX
    num_chunks, chunk = _chunks(B * HKV * row_blocks, span, block_n, q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # no-ops for contiguous inputs
    lens = cache_seqlens.contiguous()
    # Triton's interpreter multiplies bfloat16 tiles as their raw bits and truncates float32
    # to bfloat16: there, and only there, the dots take bfloat16 values widened to float32
    # and the kernel writes float32, which torch rounds to nearest.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=torch.float32 if upcast else q.dtype, device=q.device)
    if softcap:
        qk_scale, cap2 = 2.0 * LOG2E * scale / softcap, softcap * LOG2E
    else:
        qk_scale, cap2 = scale * LOG2E, 1.0
    direct = num_chunks == 1
    if direct:
        o_part = lse_part = out                                # unused
    else:
        o_part = torch.empty(B * HKV, num_chunks, rows, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B * HKV, num_chunks, rows, dtype=torch.float32, device=q.device)
    sink = sinks if sinks is not None else lens                # unread without sinks
    w = window if use_window else 0
    _split[(B * HKV, num_chunks, row_blocks)](
        q, k, v, lens, sink, out, o_part, lse_part, SMAX, HKV, G, rows, T, chunk, num_chunks,
        w, qk_scale, cap2, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct,
        WINDOW=use_window, SOFTCAP=softcap > 0, SINKS=sinks is not None, SPLIT=SPLIT_MASK,
        UPCAST=upcast, num_warps=num_warps, num_stages=num_stages)
    if not direct:
        _merge[(B * HKV, row_blocks)](
            o_part, lse_part, lens, sink, out, HKV, G, rows, T, chunk, num_chunks, w,
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=use_window,
            SINKS=sinks is not None, num_warps=MERGE_WARPS)
    return out.to(q.dtype) if upcast else out
