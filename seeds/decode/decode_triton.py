"""Seed for `decode`: split-KV (FlashDecoding) attention over a KV cache, in Triton.

q is (B, Hq, Sq, D), the cache k, v is (B, Hkv, Smax, D), and sequence b's valid cache is its
first cache_seqlens[b] positions; query i of Sq sees keys 0 .. L - Sq + i (L its length).

Two kernels:
  _split_kv  one program per (batch * key/value head, split of the cache, block of query
             rows). The G = Hq // Hkv query heads of a key/value head, times their Sq new
             tokens, are the G*Sq rows of one tile (they are contiguous in q: head h =
             kv*G + g, row g*Sq + i), so each cache block is loaded once for all of them. A
             program folds its split of the cache into a running max, sum and float32
             accumulator (online softmax, exp2), and writes its partial output and log2-sum-exp.
             Splits let a batch of 1 fill the GPU: the cache of each sequence is cut into
             `num_splits` pieces of `split` keys (a multiple of BLOCK_N), chosen on the host
             from Smax, never from the lengths (reading them would synchronise with the host
             and break CUDA-graph capture); splits past a sequence's length return at once.
  _merge     one program per (batch * key/value head, block of rows): combines the splits
             that hold keys, weighting each partial output by 2^(lse - max lse).
With a single split the first kernel writes the output itself and no merge runs. With
FUSED_MERGE (the default) no merge kernel runs either: the last split of each group to finish
combines the group's partial results inside _split_kv (the same _combine), so a call is one
launch (1.09x as fast as two launches in call time on an H200, BENCHMARKS.md); where
MERGE_TREE_AT or more splits hold keys, in two levels (groups of MERGE_GROUP splits, then the
groups: 1.3x call time on an H100 where one program merged 64 splits, BENCHMARKS.md).

Knobs (the lines marked `# evoattn: choice(...)`); every combination is correct (on a GPU, the
largest tiles with the deepest pipelines may not fit in shared memory: the launch then fails):
  BLOCK_N_D64, BLOCK_N_D128   keys per loop iteration, per head dim
  NUM_WARPS, NUM_STAGES       the split kernel's launch settings (stages pipeline the cache loads)
  MAX_BLOCK_M                 most query rows per tile: more rows than this (G*Sq > MAX_BLOCK_M)
                              take several row blocks, each reading the cache again
  PROGRAMS_PER_SM             the split count aims at this many programs per SM over the grid
  MIN_SPLIT_KEYS              ... but gives no split fewer keys than this
  MERGE_WARPS                 the merge kernel's warps (FUSED_MERGE off)
  FUSED_MERGE                 no merge kernel: the last split of each (batch * key/value head,
                              row block) to finish merges them (a ticket counted atomically),
                              which saves a launch and its wait; the merge kernel otherwise
  MERGE_TREE_AT, MERGE_GROUP  with FUSED_MERGE, a merge of MERGE_TREE_AT or more splits runs
                              in two levels: the last split of each group of MERGE_GROUP merges
                              its group, the last of those merges the groups' results (one
                              program reading every split's partial result one after another is
                              what a batch of 1 with many splits waits for at its end; with few
                              splits the second level costs more than it saves)
  MERGE_UNROLL                a merge issues the loads of this many splits' partial results
                              at once (one round trip to L2 for each, not one per split)
  FAST_LAUNCH                 calls of a shape seen before launch the compiled kernels directly
                              through Triton's C launcher, with plain addresses (its argument
                              binding, cache lookup and Python wrapper skipped: tens of
                              microseconds of host time per call, what a decode step pays);
                              on Triton 3.6 only (RAW_LAUNCH_TRITON), Triton's launch elsewhere

Rows with no visible key (L = 0, or L < Sq) output zeros. Loads never go past a sequence's
length: the last block's rows past it are masked (read as zeros, scored -inf).
"""
from __future__ import annotations

import functools
import math
import os
import threading

import torch
import triton
import triton.language as tl

# ---- knobs (one per line; the mutator rewrites only the value) ------------------------
BLOCK_N_D64 = 128  # evoattn: choice(16, 32, 64, 128)
BLOCK_N_D128 = 64  # evoattn: choice(16, 32, 64, 128)
NUM_WARPS = 4  # evoattn: choice(1, 2, 4, 8)
NUM_STAGES = 3  # evoattn: choice(1, 2, 3, 4)
MAX_BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
PROGRAMS_PER_SM = 2  # evoattn: choice(1, 2, 4, 8)
MIN_SPLIT_KEYS = 512  # evoattn: choice(64, 128, 256, 512, 1024, 2048)
MERGE_WARPS = 4  # evoattn: choice(1, 2, 4, 8) when(FUSED_MERGE=False)
FUSED_MERGE = True  # evoattn: choice(True, False)
MERGE_GROUP = 4  # evoattn: choice(4, 8, 16) when(FUSED_MERGE=True)
MERGE_TREE_AT = 32  # evoattn: choice(8, 16, 32, 64, 512) when(FUSED_MERGE=True)
MERGE_UNROLL = 2  # evoattn: choice(1, 2, 4, 8)
FAST_LAUNCH = True  # evoattn: choice(True, False) when(@target!=cpu)

MAX_SPLITS = 256               # the grid's second axis (at most 65535)
INTERPRETER_SMS = 4            # the SM count assumed by Triton's CPU interpreter
LOG2E = 1.44269504             # log2(e) = 1/ln 2: exp(x) == exp2(x * LOG2E)
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
def _fold(acc, l_i, m_i, q, K, V, kv_base, lo, hi, lim, L, qk_scale,
          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Folds cache blocks [lo, hi) of one key/value head into (acc, l_i, m_i). Unmasked
    blocks lie below L and every row sees all their keys; masked ones hide keys past each
    row's last visible key `lim` (and never load at or past L)."""
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
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # (BLOCK_M, BLOCK_N)
        if MASKED:
            s = tl.where(cols[None, :] <= lim[:, None], s, float("-inf"))
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
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["SMAX", "SPLIT", "NUM_SPLITS"])   # they change every step
def _split_kv(Q, K, V, Lens, O, OPart, LsePart, Count, SMAX, HKV, ROWS, SQ, SPLIT, NUM_SPLITS,
              qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              DIRECT: tl.constexpr, FUSED: tl.constexpr, GROUP: tl.constexpr,
              TREE_AT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
              UNROLL: tl.constexpr):
    """Q, O: contiguous (B*Hkv, ROWS, D) views of (B, Hq, Sq, D); K, V: (B*Hkv, SMAX, D);
    OPart (B*Hkv, SLOTS, ROWS, D) and LsePart (B*Hkv, SLOTS, ROWS) float32, SLOTS =
    NUM_SPLITS + cdiv(NUM_SPLITS, GROUP): a slot per split, then one per group of GROUP splits.
    Grid: (B*Hkv, NUM_SPLITS, row blocks). DIRECT: one split, the output written here.
    FUSED: the last split of a (batch * key/value head, row block) to finish merges them; with
    TREE_AT or more splits holding keys, the last of each group of GROUP merges the group into
    its group slot and the last group merger merges those (Count: 1 + cdiv(NUM_SPLITS, GROUP) int32
    tickets per (batch * key/value head, row block), zero before the call and left zero)."""
    bh = tl.program_id(0)                       # b * Hkv + key/value head
    split = tl.program_id(1)
    rb = tl.program_id(2)
    L = tl.load(Lens + bh // HKV)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, L)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)                          # tile rows
    offs_d = tl.arange(0, HEAD_DIM)
    lim = L - SQ + rows % SQ                    # row g*Sq + i sees keys 0 .. L - Sq + i
    row_ptrs = bh.to(tl.int64) * ROWS * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    if not DIRECT:
        if lo >= L:                             # past the sequence: the merge skips it
            if FUSED:
                if split == 0:                  # an empty sequence: no merge, zeros
                    zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=O.dtype.element_ty)
                    tl.store(O + row_ptrs, zeros, mask=rows[:, None] < ROWS)
            return
    # -- q: (BLOCK_M, D), in registers throughout; rows past ROWS read as zeros
    q = tl.load(Q + row_ptrs, mask=rows[:, None] < ROWS, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)            # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                          # running row sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                # unnormalised output
    # Keys below L - Sq + 1 are visible to every row: whole blocks of them need no mask.
    full_end = tl.minimum(hi, L - SQ + 1)
    mid = lo + (tl.maximum(full_end - lo, 0) // BLOCK_N) * BLOCK_N
    kv_base = bh.to(tl.int64) * SMAX * HEAD_DIM
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, kv_base, lo, mid, lim, L, qk_scale,
                          HEAD_DIM, BLOCK_N, False, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fold(acc, l_i, m_i, q, K, V, kv_base, mid, hi, lim, L, qk_scale,
                          HEAD_DIM, BLOCK_N, True, UPCAST, DOT_PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                              # no key: acc is 0
    o = acc / l_safe[:, None]
    keep_rows = rows[:, None] < ROWS
    if DIRECT:
        tl.store(O + row_ptrs, o.to(O.dtype.element_ty), mask=keep_rows)
    else:
        groups = tl.cdiv(NUM_SPLITS, GROUP)
        slots = NUM_SPLITS + groups
        part = (bh.to(tl.int64) * slots + split) * ROWS + rows
        tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=keep_rows)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(LsePart + part, lse, mask=rows < ROWS)
        if FUSED:
            used = tl.minimum(tl.cdiv(L, SPLIT), NUM_SPLITS)    # splits that store a result
            used_groups = tl.cdiv(used, GROUP)
            tickets = Count + (bh * tl.num_programs(2) + rb) * (1 + groups)  # final, groups
            tl.debug_barrier()                  # every thread's stores before the ticket
            if used < TREE_AT:
                ticket = tl.atomic_add(tickets, 1, sem="acq_rel")   # releases them
                if ticket == used - 1:          # the last: the others' results are visible
                    out, _ = _combine(OPart, LsePart, bh, rows, 0, used, ROWS, slots,
                                      HEAD_DIM, BLOCK_M, UNROLL)
                    tl.store(O + row_ptrs, out.to(O.dtype.element_ty), mask=keep_rows)
                    tl.atomic_xchg(tickets, 0)  # ready for the next call
            else:
                g = split // GROUP
                members = tl.minimum(GROUP, used - g * GROUP)
                ticket = tl.atomic_add(tickets + 1 + g, 1, sem="acq_rel")
                if ticket == members - 1:       # the group's last: merge it into its slot
                    out, out_lse = _combine(OPart, LsePart, bh, rows, g * GROUP, members, ROWS,
                                            slots, HEAD_DIM, BLOCK_M, UNROLL)
                    part = (bh.to(tl.int64) * slots + NUM_SPLITS + g) * ROWS + rows
                    tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], out,
                             mask=keep_rows)
                    tl.store(LsePart + part, out_lse, mask=rows < ROWS)
                    tl.atomic_xchg(tickets + 1 + g, 0)
                    tl.debug_barrier()
                    ticket = tl.atomic_add(tickets, 1, sem="acq_rel")
                    if ticket == used_groups - 1:   # the last group: merge the groups
                        out, _ = _combine(OPart, LsePart, bh, rows, NUM_SPLITS, used_groups,
                                          ROWS, slots, HEAD_DIM, BLOCK_M, UNROLL)
                        tl.store(O + row_ptrs, out.to(O.dtype.element_ty), mask=keep_rows)
                        tl.atomic_xchg(tickets, 0)


@triton.jit
def _combine(OPart, LsePart, bh, rows, first, count, ROWS, SLOTS, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr, UNROLL: tl.constexpr):
    """Returns (output rows, their log2-sum-exp) of one (batch * key/value head, row block)
    from the partial results in slots first .. first + count - 1, each weighted by
    2^(lse - max lse). The loads bypass L1 (other programs of this call wrote them); UNROLL
    slots' loads are issued together, so one merge waits for count / UNROLL round trips to
    L2, not count (a slot past the last reads as lse -inf, weight 0)."""
    offs_d = tl.arange(0, HEAD_DIM)
    keep = rows < ROWS
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = first + count
    for s0 in range(first, end, UNROLL):
        for j in tl.static_range(UNROLL):
            here = keep & (tl.full([BLOCK_M], s0 + j, tl.int32) < end)
            part = (bh.to(tl.int64) * SLOTS + s0 + j) * ROWS + rows
            lse = tl.load(LsePart + part, mask=here, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], mask=here[:, None],
                        other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_sub)
            w = tl.math.exp2(lse - m_sub)
            acc = acc * alpha[:, None] + o * w[:, None]
            l = l * alpha + w
            m = m_new
    lse = tl.where(l == 0.0, float("-inf"), m + tl.math.log2(tl.where(l == 0.0, 1.0, l)))
    return acc / tl.where(l == 0.0, 1.0, l)[:, None], lse               # rows with no key: 0


@triton.jit(do_not_specialize=["SPLIT", "NUM_SPLITS"])
def _merge(OPart, LsePart, Lens, O, HKV, ROWS, SPLIT, NUM_SPLITS,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
           UNROLL: tl.constexpr):
    """Combines the splits holding keys of one (batch, key/value head) and row block."""
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    L = tl.load(Lens + bh // HKV)
    used = tl.minimum(tl.cdiv(L, SPLIT), NUM_SPLITS)       # splits that wrote a result
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    slots = NUM_SPLITS + tl.cdiv(NUM_SPLITS, GROUP)     # the split kernel's layout
    out, _ = _combine(OPart, LsePart, bh, rows, 0, used, ROWS, slots, HEAD_DIM, BLOCK_M,
                      UNROLL)
    row_ptrs = bh.to(tl.int64) * ROWS * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(O + row_ptrs, out.to(O.dtype.element_ty), mask=(rows < ROWS)[:, None])


# ---- wrapper ------------------------------------------------------------------------
def _splits(programs: int, smax: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """Returns (num_splits, keys per split): enough programs for PROGRAMS_PER_SM per SM, no
    split under MIN_SPLIT_KEYS keys, each a whole number of BLOCK_N blocks."""
    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), programs)
    most = triton.cdiv(smax, max(MIN_SPLIT_KEYS, block_n))
    n = max(1, min(want, most, MAX_SPLITS))
    split = triton.cdiv(triton.cdiv(smax, n), block_n) * block_n
    return triton.cdiv(smax, split), split


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q (B, Hq, Sq, D) and k, v (B, Hkv, Smax, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, HQ, _, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] == 0 or HQ % k.shape[1]:
        raise ValueError(f"cache shape {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         "(same B and D, Hq % Hkv == 0)")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v of one dtype, float16 or bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported (64 or 128)")
    if tuple(lens.shape) != (B,) or lens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens must be int32 of shape ({B},); got {lens.dtype} "
                         f"{tuple(lens.shape)}")
    if not (q.device == k.device == v.device == lens.device):
        raise ValueError("q, k, v and cache_seqlens must be on one device")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError("decode_triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU ones")


class _Launch:
    """One call shape's compiled kernels, prepared by its first calls: everything but the
    cache length (Smax grows by one every generation step; the split count follows it)."""

    __slots__ = ("programs", "block_n", "grid0", "row_blocks", "ints", "kernels")

    def __init__(self, programs: int, block_n: int, grid0: int, row_blocks: int,
                 ints: tuple) -> None:
        self.programs, self.block_n = programs, block_n      # as _splits takes them
        self.grid0, self.row_blocks, self.ints = grid0, row_blocks, ints   # ints: HKV, ROWS, SQ
        self.kernels: dict[bool, tuple] = {}    # one split? -> (split, constexprs, merge, ...)


# Launches prepared per (q shape, cache shape but its length, dtype, device). Triton's launch
# hooks, if anyone set them, are honoured by taking the ordinary path.
_LAUNCHES: dict[tuple, _Launch] = {}
_MAX_LAUNCHES = 256
# FUSED_MERGE's tickets per (device, stream): zeroed once, left zero by every call (the last
# split of each group sets its ticket back), so calls in one stream's order share them. Calls
# sharing them must not run at once: two CUDA graphs captured on one stream and replayed
# concurrently on two streams need FUSED_MERGE off.
_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device, stream: int, n: int) -> torch.Tensor | None:
    """Returns at least n zeroed int32 tickets for calls on this stream; None while a CUDA
    graph is being captured and there are none yet (a buffer made inside a capture is zeroed
    only when the graph replays, and belongs to its memory pool)."""
    t = _TICKETS.get((device, stream))
    if t is None or t.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(n, 2 * (0 if t is None else t.numel()))
        t = _kept_zeros(size, device) if device.type == "cuda" else \
            torch.zeros(size, dtype=torch.int32, device=device)
        _TICKETS[(device, stream)] = t
    return t


def _kept_zeros(n: int, device: torch.device) -> torch.Tensor:
    """n zeroed int32 from the caching allocator's general pool, made by another thread: while
    torch.compile's CUDA graphs warm up (mode="reduce-overhead"), every allocation of the
    warming thread goes to the graphs' private pool, where a buffer kept across calls is not
    the graphs' to reuse (torch refuses it) and would be overwritten if they did. The thread
    synchronises before handing the zeros over; the calling stream is recorded on them, so
    that they are not reused before its work is done when a larger set replaces them."""
    made: list = []

    def make() -> None:
        try:
            with torch.cuda.device(device):
                z = torch.zeros(n, dtype=torch.int32, device=device)
                torch.cuda.current_stream(device).synchronize()
            made.append(z)
        except BaseException as e:              # raised again in the calling thread
            made.append(e)
    worker = threading.Thread(target=make, name="decode-tickets")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    made[0].record_stream(torch.cuda.current_stream(device))
    return made[0]


def _no_hook(hook) -> bool:  # noqa: ANN001
    """Whether a Triton launch hook is unset (None, or an empty HookChain)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _fast_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> bool:
    """Whether a call may use a prepared launch: a real GPU, no launch hooks, contiguous and
    16-byte aligned inputs (the compiled kernel assumed both of the first call's inputs)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return (FAST_LAUNCH and runtime is not None and q.device.type == "cuda"
            and not _interpreting()
            and _no_hook(getattr(runtime, "launch_enter_hook", None))
            and _no_hook(getattr(runtime, "launch_exit_hook", None))
            and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and lens.is_contiguous()
            and (q.data_ptr() | k.data_ptr() | v.data_ptr() | lens.data_ptr()) % 16 == 0)


# Triton versions whose C launcher takes the argument layout _launch_prepared passes (a private
# API: Triton 3.9's launcher takes another); any other version takes the Python launch path.
RAW_LAUNCH_TRITON = ((3, 6),)


def _raw_launcher(kernel) -> tuple | None:  # noqa: ANN001
    """(Triton's C launcher, cooperative, pdl): the launch beneath its Python wrapper, which
    takes plain addresses without asking the driver about each; None on a Triton not in
    RAW_LAUNCH_TRITON or not laid out as expected, or where the kernel needs scratch memory."""
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in RAW_LAUNCH_TRITON:
        return None
    run = kernel.run
    launch = getattr(run, "launch", None)
    if launch is None or hasattr(launch, "__code__") or \
            getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return launch, run.launch_cooperative_grid, run.launch_pdl


def _launch_prepared(launch: _Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lens: torch.Tensor, qk_scale: float) -> torch.Tensor | None:
    """Launches a prepared shape's kernels on fresh inputs (see _LAUNCHES), or returns None
    when this cache length needs kernels not prepared yet (one split where there were
    several, or the reverse)."""
    smax = k.shape[2]
    num_splits, split = _splits(launch.programs, smax, launch.block_n, q.device)
    prepared = launch.kernels.get(num_splits == 1)
    if prepared is None:
        return None
    s, constexprs, m, merge_constexprs = prepared
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    hkv, rows, sq = launch.ints
    count = None
    groups = triton.cdiv(num_splits, MERGE_GROUP)
    if num_splits > 1 and m is None:          # the merge fused: this stream's tickets
        count = _tickets(q.device, stream, launch.grid0 * launch.row_blocks * (1 + groups))
        if count is None:
            return None
    out = torch.empty_like(q)
    o = out.data_ptr()
    if num_splits == 1:
        o_part = lse_part = o
    else:   # one float32 buffer: the partial outputs, then their log-sum-exps
        parts = launch.grid0 * (num_splits + groups) * rows
        work = q.new_empty(parts * (q.shape[3] + 1), dtype=torch.float32)
        o_part = work.data_ptr()
        lse_part = o_part + parts * q.shape[3] * 4
    lens_ptr = lens.data_ptr()
    raw, cooperative, pdl = s[1]
    raw(launch.grid0, num_splits, launch.row_blocks, stream, s[0], cooperative, pdl, None, None,
        s[2], None, None, None, q.data_ptr(), k.data_ptr(), v.data_ptr(), lens_ptr, o, o_part,
        lse_part, o if count is None else count.data_ptr(), smax, hkv, rows, sq, split,
        num_splits, qk_scale, *constexprs)
    if m is not None and num_splits > 1:
        raw, cooperative, pdl = m[1]
        raw(launch.grid0, launch.row_blocks, 1, stream, m[0], cooperative, pdl, None, None,
            m[2], None, None, None, o_part, lse_part, lens_ptr, o, hkv, rows, split, num_splits,
            *merge_constexprs)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Returns attention of q (B, Hq, Sq, D), the newest Sq tokens, over the cache k, v
    (B, Hkv, Smax, D) of per-sequence lengths cache_seqlens (int32, (B,))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    fast = _fast_ok(q, k, v, cache_seqlens)
    key = (q.shape, k.shape[0], k.shape[1], k.shape[3], q.dtype, q.device)
    launch = _LAUNCHES.get(key) if fast else None
    if launch is not None and v.shape == k.shape and k.dtype == q.dtype == v.dtype and \
            cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == q.shape[:1] and \
            k.device == v.device == cache_seqlens.device == q.device and k.shape[2] > 0:
        out = _launch_prepared(launch, q, k, v, cache_seqlens, scale * LOG2E)
        if out is not None:
            return out
    _check(q, k, v, cache_seqlens)
    return _forward(q, k, v, cache_seqlens, scale, key if fast else None)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
             scale: float, key: tuple | None) -> torch.Tensor:
    """Launches the kernels through Triton; with a key, prepares the shape's fast launch."""
    B, HQ, SQ, D = q.shape
    HKV, SMAX = k.shape[1], k.shape[2]
    rows = (HQ // HKV) * SQ                     # query rows sharing one key/value head
    block_m = min(max(16, triton.next_power_of_2(rows)), MAX_BLOCK_M)
    row_blocks = triton.cdiv(rows, block_m)
    block_n = BLOCK_N_D64 if D == 64 else BLOCK_N_D128
    num_splits, split = _splits(B * HKV * row_blocks, SMAX, block_n, q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # no-ops for contiguous inputs
    lens = cache_seqlens.contiguous()
    # Triton's interpreter multiplies bfloat16 tiles as their raw bits and rounds float32 to
    # bfloat16 by truncation, so there, and only there, the dots take bfloat16 values widened
    # to float32 (exact products), p is not rounded, and the output is written in float32 and
    # rounded to nearest by torch.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=torch.float32 if upcast else q.dtype, device=q.device)
    direct = num_splits == 1
    count = None
    groups = triton.cdiv(num_splits, MERGE_GROUP)   # merge groups: a slot and a ticket each
    if FUSED_MERGE and not direct:
        stream = torch._C._cuda_getCurrentRawStream(q.device.index) if q.is_cuda else 0
        count = _tickets(q.device, stream, B * HKV * row_blocks * (1 + groups))
        if count is None:         # first call on this stream inside a CUDA-graph capture
            key = None
    fused = count is not None
    if direct:
        o_part = lse_part = out                                # unused
    else:
        slots = num_splits + groups
        o_part = torch.empty(B * HKV, slots, rows, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B * HKV, slots, rows, dtype=torch.float32, device=q.device)
    grid = (B * HKV, num_splits, row_blocks)
    ints = (SMAX, HKV, rows, SQ, split, num_splits)
    constexprs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct,
                      FUSED=fused, GROUP=MERGE_GROUP, TREE_AT=MERGE_TREE_AT, UPCAST=upcast,
                      DOT_PRECISION="ieee" if upcast else "tf32", UNROLL=MERGE_UNROLL)
    split_kernel = _split_kv[grid](q, k, v, lens, out, o_part, lse_part,
                                   out if count is None else count, *ints, scale * LOG2E,
                                   **constexprs, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    merge_kernel, merge_grid = None, (B * HKV, row_blocks, 1)
    merge_ints = (HKV, rows, split, num_splits)
    merge_constexprs = dict(HEAD_DIM=D, BLOCK_M=block_m, GROUP=MERGE_GROUP, UNROLL=MERGE_UNROLL)
    if not direct and not fused:
        merge_kernel = _merge[merge_grid](o_part, lse_part, lens, out, *merge_ints,
                                          **merge_constexprs, num_warps=MERGE_WARPS)
    prepared = [(kernel.function, _raw_launcher(kernel), kernel.packed_metadata)
                for kernel in (split_kernel, merge_kernel)
                if kernel is not None and hasattr(kernel, "packed_metadata")]
    if key is not None and len(prepared) == (1 if direct or fused else 2) and \
            all(raw is not None for _, raw, _ in prepared):
        launch = _LAUNCHES.get(key)
        if launch is None:
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            launch = _LAUNCHES[key] = _Launch(B * HKV * row_blocks, block_n, B * HKV,
                                              row_blocks, (HKV, rows, SQ))
        launch.kernels[direct] = (prepared[0], tuple(constexprs.values()),
                                  None if direct or fused else prepared[1],
                                  tuple(merge_constexprs.values()))
    return out.to(q.dtype) if upcast else out
