// wgmma_flash.cu: flash attention forward with Hopper warpgroup MMA (wgmma), seed for `sdpa`.
//
// float16 / bfloat16 on a compute-capability-9.x GPU, built for sm_90a: each block owns
// BLOCK_M = 64 * NUM_WARPGROUPS query rows of one (b, h); each warpgroup (4 consecutive warps,
// 128 threads) owns 64 of them. Two ways to load, chosen per head dim (WARP_SPECIALIZE_D*): on
// the cp.async path every thread stages the q tile once and the k and v tiles of BLOCK_N keys,
// double-buffered (triple-buffered with overlap), with cp.async (16-byte copies, rows past S
// zero-filled, so no garbage can inject NaN/Inf); on the warp-specialised path (further down) a
// producer warpgroup loads them with TMA. Per key tile and consumer warpgroup:
//   S = q k^T   wgmma.m64n{BLOCK_N}k16, A = q from shared memory, B = k from shared memory;
//   online softmax on the f32 accumulator fragments in registers (log2 units, ex2.approx.ftz:
//               without -use_fast_math, exp2f costs a range check and two multiplies more per
//               score to keep subnormal results, which softmax does not need);
//   O += P v    wgmma.m64n{D}k16, A = P from registers (rounded to the input dtype, as
//               FlashAttention does), B = v from shared memory (transposed read, see below).
// Causal (top-left: query i sees keys 0..i): key tiles after the block's last row are never
// loaded, a warpgroup skips tiles after its own last row, and the mask is applied only to
// tiles that cross the diagonal or the end of the sequence. Heavy causal row blocks first,
// within sections of heads whose k and v fit in a share of L2 (block_coords).
// float32 inputs, pointers that are not 16-byte aligned, and GPUs that are not 9.x take the
// CUDA-core fallback (FA1-style, cuda_core_flash.cuh, shared with mma_flash.cu and fused.cu).
// Two entries (end of file): evoattn_sdpa, dense (B, H, S, D) tensors (the problem's contract);
// evoattn_sdpa_strided, views and grouped k/v read where they lie, on the warp-specialised path.
//
// Knobs: NUM_WARPGROUPS (1 or 2 consumer warpgroups), BLOCK_N_D64 / BLOCK_N_D128 (keys per tile
// for each head dim, 64 or 128; the kernel's template parameter BN is the one in use),
// OVERLAP_D64 / _D128 (per head dim; the kernels' template parameter OV; 0: per tile,
// S = q k^T, wait, softmax, P v, wait; 1: FlashAttention-3's intra-warpgroup pipelining,
// q k^T of tile j and P v of tile j-1 in flight together and the softmax of tile j run while
// P v is on the tensor cores; the cp.async path then uses a three-stage k/v ring),
// WARP_SPECIALIZE_D64 / _D128 (per head dim: the cp.async path above, or the warp-specialised
// path below with its knobs WS_STAGES_D64 / _D128 (the k/v ring's depth), Q_DOUBLE_MAX_S_D64 /
// _D128 (calls with S up to it keep two q tiles, so the next work item's q loads while the
// consumers finish the current one; 0: never), SETMAXNREG, PINGPONG,
// WIDE_D64 (three consumer warpgroups, 192-row blocks, at D=64), PERSISTENT_D64 / _D128,
// PERSISTENT_DYNAMIC, SPLIT_TAIL_D64 (D=64; 0: off; N: a non-causal call's last wave of work items
// on the persistent grid, where it fills at most half of it, in up to N parts of the key tiles
// each, merged by the part that ends last: TailSplit), and TMA_STORE_MAX_S: calls with S up to it
// write O with stmatrix into a shared tile per consumer warpgroup and one TMA store that runs on
// under the next work item, instead of st.global from registers; 0: never, and no shared tile; a
// ring too deep for 227 KB of shared memory at a head dim whose path is on fails the build),
// HEAD_MAJOR_D64 / _D128 and SECTION_MB_D64 / _D128 (the block order per head dim of non-causal
// and of causal calls, block_coords), EXP2_POLY_EVERY (0: every exponential on the
// MUFU; N: one score in N by a polynomial on the FMA pipe instead, FlashAttention-4's offload,
// exp2_poly below). The knobs' when(...) conditions name the routing knobs of
// seeds/sdpa/flash_hybrid.py, which loads this file as a companion: there a knob of a head dim the
// routing keeps on Triton runs no call and is left alone by the mutator.
// On its own this file has no routing knobs, and a condition on a knob it lacks always holds.
// The softmax has a masked and an unmasked variant chosen per tile (a branch around the whole
// tile): with the masks inside one loop, ptxas if-converted them into every tile and placed the
// wait for P v before the softmax, so OVERLAP overlapped nothing. Defaults, as measured
// (BENCHMARKS.md; CUDA-graph time, H100, python benchmarks/wgmma_variants.py): both head dims
// warp-specialised and persistent, causal items from the counter, 128-key tiles; D=64 with three
// consumer warpgroups (WIDE_D64: 1.03x two over the ten D=64 configs) and the row blocks of all
// heads heaviest first (causal: of 32 MB of heads, every head of the default configs; causal
// 1.19-1.26x head by head at S >= 2048), 1.10x two warpgroups head by head and ahead of Triton
// wherever a call gives every SM a work item (the hybrid seed sends those here, smaller ones to
// Triton), non-causal calls' last wave in thirds (SPLIT_TAIL_D64: 1.09x at (1,32,4096,64), whose
// 704 items on 132 SMs end in a wave of 44); D=128 with the intra-warpgroup overlap (10% over none,
// with the skipped rescales), the TMA-store epilogue up to S=4096 (1.4-2% over up to 1024, 9% over
// none), non-causal calls head by head, and causal calls in sections of 16 MB of heads (1.03-1.07x
// head by head; all heads at once lost 26% at (16,16,1024,128) causal; sections for non-causal
// calls lost 2-10% with L2 flushed before each call); both head dims with two q tiles up to S=1024
// (1.03-1.05x one at S <= 1024 at D=64; two at every length lost 7-9% at (2,32,2048,64)). A warp
// skips O's rescale when no row's max grew (exact).
// FlashAttention-4's slack (a row keeps a stale max while a tile's is at most 2^8 above it, so far
// more tiles skip) gained 3% more at D=128 but is not offered: the largest p of a row is then no
// longer exactly 1, its rounding to 16 bits doubled the error on some configs to the edge of the
// tolerance, and in a default search such children failed their checks now and then. One
// exponential in 8 off the MUFU lost 3% at D=128; at D=64 taking them all off (a timing experiment,
// wrong results) gained only 8%. Also measured slower and not offered (H100, graph time): each
// row's max and sum kept in four interleaved partials (2-3% at both head dims); at D=128 with two
// q tiles, the next item's first q k^T and softmax under the current item's last P v (0.84x
// against 0.93x at (16,16,1024,128)), and that P v issued first (ptxas serialised every wgmma,
// C7518); at D=64 the producer loading each tile's v before the next k (0.985x against 0.990x);
// for the last wave, two consumer warpgroups at D=64 (10-14% slower per row) or its key tiles in
// equal ranges over every SM, stream-K (0.975x of the equal parts where they split, 0.75x at
// (8,32,512,64) where a fuller wave was split); setmaxnreg 40 / 232 at D=128 (1.003x, no gain);
// at both head dims, the next item's first q k^T issued before the current item's TMA-store
// epilogue, which then ran under it (the store branchless: a branch in flight serialised every
// wgmma, C7515/C7518): 0.969x and 0.970x over the 14 configs in two processes, slower on every
// config, the long ones too (0.94-0.99x).
// Any S >= 1, D in {64, 128}, fp32 accumulation. Needs the sm_90a target for wgmma (the
// evaluator builds with -gencode=arch=compute_90a,code=sm_90a on H100/H200). Built for
// another target (plain sm_90, or PTX JIT-compiled from an older one), the code the GPU runs
// has no wgmma: a one-time probe kernel finds that out, and on a 9.x GPU every 16-bit call
// then returns cudaErrorInvalidDeviceFunction (a loud error, not the slow fallback).
//
// ---- Shared-memory layouts (all 16-bit elements; every tile base is 1024-byte aligned) ----
// Every operand tile (q: BLOCK_M x D, k and v: BLOCK_N x D) is kept as it is in global memory,
// row-major with D contiguous, split into D/64 "panels" of 64 columns (128 bytes). Panel p of
// a tile of R rows is a separate region of R * 128 bytes at offset p * R * 128; inside it row r
// occupies bytes [r * 128, r * 128 + 128), and its 16-byte chunk c (elements 8c .. 8c+7 of the
// panel) is stored at chunk position c ^ (r % 8). That is the hardware's 128-byte swizzle
// (CuTe Swizzle<3,4,3>: address bits [4,7) ^= bits [7,10)) applied to a dense
// [R][128 B] array whose 8-row x 128-byte atoms (1024 bytes) are 1024-byte aligned, so
// descriptors can use base_offset = 0.
//
// Descriptor (64 bits): start address >> 4 in bits [0,14), leading byte offset (LBO) >> 4 in
// [16,30), stride byte offset (SBO) >> 4 in [32,46), base_offset [49,52) = 0, layout type in
// [62,64) = 1 (128-byte swizzle).
//
// S = q k^T, M = 64 query rows, N = BLOCK_N keys, K = D (the contraction dim).
//   A = q, K-major (D contiguous), imm-trans-a = 0. Canonical SW128 K-major layout (units of
//     16 bytes): ((8, m), (8, 2)) : ((8, SBO), (1, 1)), i.e. rows of 128 bytes, 8-row groups
//     SBO = 1024 bytes apart; LBO is unused for swizzled K-major layouts (set to 16 bytes = 1,
//     as CuTe does). One k16 step reads 32 bytes of each row: step ks uses panel ks / 4 and
//     advances the start address by 32 * (ks % 4) bytes inside the 128-byte row; the hardware
//     applies the XOR to the final address, so this lands on the swizzled chunks. The
//     warpgroup's 64 rows start at q_base + p * BLOCK_M * 128 + wg * 64 * 128.
//   B = k tile [key][d], also K-major (for B the "K" dim is the contraction dim d, N = keys),
//     imm-trans-b = 0, same descriptor shape: SBO = 1024, start + p * BLOCK_N * 128 + 32 * (ks%4).
// O += P v, M = 64, N = D, K = BLOCK_N keys (16 per instruction).
//   A = P from registers: the wgmma A fragment of m64nNk16 is the mma.m16n8k16 A fragment per
//     warp (warp w of the warpgroup owns rows 16w .. 16w+15; lane l, g = l/4, t = l%4:
//     a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..2t+1), a2 = (row g, k 2t+8..+9),
//     a3 = (row g+8, k 2t+8..+9); lower k in the low half). The f32 accumulator fragment
//     of S is per warp the mma.m16n8 C fragment repeated over n8 tiles: d[4i + 0..1] =
//     (row g, cols 8i + 2t + 0..1), d[4i + 2..3] = (row g + 8, same cols). So for key step j
//     (keys 16j .. 16j+15) the A fragment is pack(d[8j+0,1]), pack(d[8j+2,3]),
//     pack(d[8j+4,5]), pack(d[8j+6,7]) (n8 tiles 2j and 2j+1).
//   B = v tile [key][d]: d (= N) is contiguous, so B is MN-major: imm-trans-b = 1, canonical
//     SW128 MN-major layout (units of 16 bytes, CuTe make_gmma_desc<Major::MN>):
//     ((8, n), (8, k)) : ((1, LBO), (8, SBO)): 64 N-elements (128 bytes) contiguous per K row,
//     8 K rows 128 bytes apart, then the next 8 K rows SBO = 1024 bytes on, and the next 64 N
//     elements (the next panel) LBO = BLOCK_N * 128 bytes on. That is exactly the stored v
//     tile (rows = keys, panels = 64-column slabs of d). Key step j advances the start address
//     by 16 rows * 128 = 2048 bytes (two whole atoms, so the swizzle phase is unchanged).
// The output O (64 x D per warpgroup) has the accumulator layout above and is stored from
// registers, normalised by the row sums, two elements (4 bytes) per store.
//
// Ordering (the cp.async path; on the TMA path the copies complete on mbarriers, which order
// them before the wgmma that waits there): cp.async writes are generic-proxy writes and wgmma
// reads shared memory through the async proxy, so each thread issues
// fence.proxy.async.shared::cta after its cp.async.wait_group and before the block barrier.
// wgmma.fence precedes every batch of wgmma (their accumulator / A registers were written by
// ordinary code), then wgmma.commit_group and wgmma.wait_group 0 (with overlap, wait_group 1
// first: see the kernels' second loops); empty volatile asm "+f"/"+r" fences on the registers
// keep the compiler from moving ordinary accesses across those points, and keep the P registers
// (read asynchronously by the P v wgmma) reserved until the wait.
#include <cuda.h>            // CUtensorMap and its enums (types only: no -lcuda)
#include <cudaTypedefs.h>    // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <mutex>
#include <type_traits>
// evoattn: companion cuda_core_flash.cuh
#include "cuda_core_flash.cuh"  // the CUDA-core fallback (float32, misaligned pointers)

#define NUM_WARPGROUPS 2  // evoattn: choice(1, 2) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define BLOCK_N_D64 128  // evoattn: choice(64, 128) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define BLOCK_N_D128 128  // evoattn: choice(64, 128) when(@target=sm90) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define OVERLAP_D64 0  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define OVERLAP_D128 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define WARP_SPECIALIZE_D64 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define WIDE_D64 1  // evoattn: choice(0, 1) when(@target=sm90) when(WARP_SPECIALIZE_D64=1) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define WARP_SPECIALIZE_D128 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define WS_STAGES_D64 2  // evoattn: choice(2, 3, 4) when(@target=sm90) when(WARP_SPECIALIZE_D64=1) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define WS_STAGES_D128 2  // evoattn: choice(2, 3, 4) when(@target=sm90) when(WARP_SPECIALIZE_D128=1) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define Q_DOUBLE_MAX_S_D64 1024  // evoattn: choice(0, 512, 1024, 2048, 65536) when(@target=sm90) when(WARP_SPECIALIZE_D64=1) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define Q_DOUBLE_MAX_S_D128 1024  // evoattn: choice(0, 512, 1024, 2048, 65536) when(@target=sm90) when(WARP_SPECIALIZE_D128=1) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define SETMAXNREG 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define PINGPONG 0  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define HEAD_MAJOR_D64 0  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define HEAD_MAJOR_D128 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D128=True)
#define SECTION_MB_D64 32  // evoattn: choice(0, 8, 16, 32, 64, 128) when(@target=sm90) when(CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define SECTION_MB_D128 16  // evoattn: choice(0, 8, 16, 32, 64, 128) when(@target=sm90) when(CUDA_D128_CAUSAL=True)
#define PERSISTENT_D64 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define PERSISTENT_D128 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D128=True, CUDA_D128_CAUSAL=True)
#define SPLIT_TAIL_D64 3  // evoattn: choice(0, 2, 3, 4) when(@target=sm90) when(WARP_SPECIALIZE_D64=1) when(CUDA_D64=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0) when(PERSISTENT_D64=1)
#define PERSISTENT_DYNAMIC 1  // evoattn: choice(0, 1) when(@target=sm90) when(CUDA_D64_CAUSAL=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define TMA_STORE_MAX_S 4096  // evoattn: choice(0, 1024, 2048, 4096, 65536) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
#define EXP2_POLY_EVERY 0  // evoattn: choice(0, 8, 4, 2) when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)

#define FB_BLOCK_M 32    // fallback tiles; fixed, not knobs
#define FB_BLOCK_N 32
#define FB_THREADS 128

constexpr float LOG2E = 1.4426950408889634f;  // 1/ln 2: exp(x) == exp2(x * LOG2E)
constexpr int WG_THREADS = 128;               // one warpgroup
constexpr int BLOCK_M = 64 * NUM_WARPGROUPS;
constexpr int THREADS = WG_THREADS * NUM_WARPGROUPS;

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGF_SM90A 1                           // this device pass may use wgmma
#else
#define WGF_SM90A 0
#endif

// Returns (lo, hi) rounded to T and packed into one register, lo in the low half.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ---- shared memory, cp.async ----------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared; valid == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Byte offset of 16-byte chunk c (0 .. D/8-1) of row r in a swizzled tile of `rows` rows:
// panel c / 8 (64 columns), row r at 128 * r inside it, chunk (c % 8) ^ (r % 8).
__host__ __device__ constexpr uint32_t sw128_offset(int rows, int r, int c) {
  return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Copies rows r0 .. r0+ROWS-1 of the row-major [S][D] matrix `src` into the swizzled tile at
// shared address `dst` (1024-byte aligned); rows >= S are zero-filled. All NTHREADS threads
// of the block (or warpgroup) call it with tid in [0, NTHREADS).
template <int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_tile_sw128(uint32_t dst, const uint16_t* src, int r0, int S,
                                                int tid) {
  constexpr int CHUNKS = D / 8;               // 16-byte chunks per row
  static_assert((ROWS * CHUNKS) % NTHREADS == 0, "tile chunks must split evenly");
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS / NTHREADS; ++i) {
    const int idx = tid + i * NTHREADS;
    const int r = idx / CHUNKS, c = idx % CHUNKS, row = r0 + r;
    const bool valid = row < S;
    const uint16_t* g = src + (valid ? (long long)row * D + c * 8 : 0);   // clamp when invalid
    cp_async16(dst + sw128_offset(ROWS, r, c), g, valid);
  }
}

// ---- wgmma wrappers (sm_90a only) -----------------------------------------------------

// 128-byte-swizzle matrix descriptors, base_offset 0 (atoms are 1024-byte aligned), kept as two
// 32-bit words: every descriptor here has the same high word (SBO = 1024 bytes, the next 8-row
// group; layout type 1), and the low word holds the start address >> 4 in bits [0,14) and
// LBO >> 4 in [16,30). A k step's offset is added to the low word alone (as CUTLASS's descriptor
// iterator does): shared addresses are below 2^18, so the start field cannot carry into LBO,
// and a step costs one 32-bit add where a 64-bit descriptor costs an add with carry and moves.
constexpr uint32_t DESC_HI = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo_bytes) {
  return ((addr & 0x3FFFFu) >> 4) | (((lbo_bytes >> 4) & 0x3FFFu) << 16);
}

// x as lane 0 of the warp has it: the compiler then knows the value warp-uniform. Branches on
// such values around in-flight wgmma stay unserialised (else ptxas warns C7520 and serialises
// them), and shared-memory addresses built from them (q tile, ring stage) go into the wgmma
// descriptors from uniform registers, where a per-thread value is moved there (R2UR) before
// each instruction (a q-tile index computed per thread measured 3.6% slower at D=128).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

__device__ __forceinline__ void wgmma_fence() {
#if WGF_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if WGF_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_wait0() {
#if WGF_SM90A
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Waits until at most one committed wgmma group is still in flight (the most recent one).
__device__ __forceinline__ void wgmma_wait1() {
#if WGF_SM90A
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#endif
}
// Makes generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#if WGF_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Compiler-only fences: pin the ordinary reads/writes of these registers on the right side
// of the (volatile) wgmma fence / wait instructions.
template <int N> __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int J> __device__ __forceinline__ void reg_fence(uint32_t (&r)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[j][i])::"memory");
}

#define WGF_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                       "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WGF_ACC32(d) WGF_ACC8(d, 0), WGF_ACC8(d, 8), WGF_ACC8(d, 16), WGF_ACC8(d, 24)
#define WGF_ACC64(d) WGF_ACC32(d), WGF_ACC8(d, 32), WGF_ACC8(d, 40), WGF_ACC8(d, 48), \
                     WGF_ACC8(d, 56)
#define WGF_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGF_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D(64 x N, f32) = A(64 x 16, smem desc, K-major) * B(16 x N, smem desc, K-major) [+ D].
// accum == 0: D is overwritten (scale-d false). da, db: the descriptors' low words.
#define WGF_SS(TY, NN, R, A0, A1, HI, AC, ACC)                                              \
  asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nmov.b64 da, {" A0 ", " HI "};\n"     \
               "mov.b64 db, {" A1 ", " HI "};\nsetp.ne.b32 p, " AC ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" NN "k16.f32." TY "." TY " " R            \
               ", da, db, p, 1, 1, 0, 0;\n}\n"                                              \
               : ACC(d) : "r"(da), "r"(db), "r"(DESC_HI), "r"(accum))
#define WGF_SS32(TY) WGF_SS(TY, "64", WGF_R32, "%32", "%33", "%34", "%35", WGF_ACC32)
#define WGF_SS64(TY) WGF_SS(TY, "128", WGF_R64, "%64", "%65", "%66", "%67", WGF_ACC64)
// D(64 x N, f32) += A(64 x 16, registers) * B(16 x N, smem desc, MN-major: imm-trans-b = 1).
#define WGF_RS(TY, NN, R, A, B0, HI, ONE, ACC)                                              \
  asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nmov.b64 db, {" B0 ", " HI "};\n"          \
               "setp.ne.b32 p, " ONE ", 0;\n"                                                \
               "wgmma.mma_async.sync.aligned.m64n" NN "k16.f32." TY "." TY " " R            \
               ", " A ", db, p, 1, 1, 1;\n}\n"                                              \
               : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(db), "r"(DESC_HI),  \
                 "r"(1))
#define WGF_RS32(TY) WGF_RS(TY, "64", WGF_R32, "{%32, %33, %34, %35}", "%36", "%37", "%38", \
                            WGF_ACC32)
#define WGF_RS64(TY) WGF_RS(TY, "128", WGF_R64, "{%64, %65, %66, %67}", "%68", "%69", "%70", \
                            WGF_ACC64)

template <int N, bool BF16>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint32_t da, uint32_t db, int accum) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N must be 64 or 128");
#if WGF_SM90A
  if constexpr (N == 64) {
    if constexpr (BF16) WGF_SS32("bf16"); else WGF_SS32("f16");
  } else {
    if constexpr (BF16) WGF_SS64("bf16"); else WGF_SS64("f16");
  }
#endif
}

template <int N, bool BF16>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t db) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N must be 64 or 128");
#if WGF_SM90A
  if constexpr (N == 64) {
    if constexpr (BF16) WGF_RS32("bf16"); else WGF_RS32("f16");
  } else {
    if constexpr (BF16) WGF_RS64("bf16"); else WGF_RS64("f16");
  }
#endif
}

// One warpgroup: issues s(64 x N) = q(64 x D) k(N x D)^T, without fence, commit or wait.
// q_addr: the warpgroup's first q row in a swizzled tile of Q_ROWS rows (panel stride
// Q_ROWS * 128); k_addr: a swizzled tile of N rows.
template <int D, int N, int Q_ROWS, bool BF16>
__device__ __forceinline__ void wg_qk_issue(float (&s)[N / 2], uint32_t q_addr, uint32_t k_addr) {
  const uint32_t qd = desc_lo(q_addr, 16), kd = desc_lo(k_addr, 16);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t qo = (uint32_t)((ks / 4) * Q_ROWS * 128 + (ks % 4) * 32);
    const uint32_t ko = (uint32_t)((ks / 4) * N * 128 + (ks % 4) * 32);
    wgmma_ss<N, BF16>(s, qd + (qo >> 4), kd + (ko >> 4), ks > 0 ? 1 : 0);
  }
}

// One warpgroup: issues o(64 x D) += P(64 x N, A fragments in p) v(N x D), without fence,
// commit or wait; v_addr: a swizzled tile of N rows.
template <int D, int N, bool BF16>
__device__ __forceinline__ void wg_pv_issue(float (&o)[D / 2], uint32_t (&p)[N / 16][4],
                                            uint32_t v_addr) {
  const uint32_t vd = desc_lo(v_addr, N * 128);   // LBO: the next 64 d; SBO: the next 8 keys
#pragma unroll
  for (int j = 0; j < N / 16; ++j)
    wgmma_rs<D, BF16>(o, p[j], vd + (uint32_t)((j * 16 * 128) >> 4));
}

// s = q k^T for one warpgroup: issues, commits and waits; s is ready on return.
template <int D, int N, int Q_ROWS, bool BF16>
__device__ __forceinline__ void wg_qk(float (&s)[N / 2], uint32_t q_addr, uint32_t k_addr) {
  reg_fence(s);
  wgmma_fence();
  wg_qk_issue<D, N, Q_ROWS, BF16>(s, q_addr, k_addr);
  wgmma_commit();
  wgmma_wait0();
  reg_fence(s);
}

// o += P v for one warpgroup: issues, commits and waits; o is ready on return.
template <int D, int N, bool BF16>
__device__ __forceinline__ void wg_pv(float (&o)[D / 2], uint32_t (&p)[N / 16][4],
                                      uint32_t v_addr) {
  reg_fence(o);
  reg_fence(p);
  wgmma_fence();
  wg_pv_issue<D, N, BF16>(o, p, v_addr);
  wgmma_commit();
  wgmma_wait0();
  reg_fence(o);
  reg_fence(p);    // p is read asynchronously until the wait: keep its registers reserved
}

// Accumulator fragments of a 64 x N score tile -> A fragments of P for N/16 key steps.
template <typename T, int N>
__device__ __forceinline__ void pack_p(uint32_t (&p)[N / 16][4], const float (&s)[N / 2]) {
#pragma unroll
  for (int j = 0; j < N / 16; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[j][r] = pack2<T>(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
}

// ---- tensor-core path (float16 / bfloat16, sm_90a) -------------------------------------

template <int D, int BN, bool OV> struct WgSmem {
  static constexpr int KV_STAGES = OV ? 3 : 2;  // k/v ring depth (see the kernel's two loops)
  static constexpr uint32_t Q_BYTES = BLOCK_M * D * 2;
  static constexpr uint32_t KV_BYTES = BN * D * 2;          // one k or v tile
  static constexpr uint32_t STAGE_BYTES = 2 * KV_BYTES;          // k then v
  static constexpr size_t bytes = Q_BYTES + KV_STAGES * STAGE_BYTES + 1024;   // + alignment slack
};

// 2^x in one MUFU.EX2; results below 2^-126 flush to 0 (a probability < 1e-38 of the row max).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA and integer pipes instead of the MUFU (FlashAttention-4's offload of part of
// the softmax's exponentials): x = j + f with j = round(x) (the 1.5 * 2^23 shift) and f in
// [-1/2, 1/2], 2^f by a degree-3 polynomial (fitted for relative error on Chebyshev nodes:
// at most 7.6e-5, below a float16 half-ulp), and j added to the exponent bits. x is clamped
// at -126 (-inf for a masked score): the exponent then stays >= 0, so the result is a float
// in [0, 2^-126] there (below, it would wrap into NaN).
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -126.f);
  const float t = x + 12582912.f;             // round(x) in the low mantissa bits
  const float f = x - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.055191804f, f, 0.24261291f), f, 0.69325727f), f, 0.99992788f);
  // (bits(t) - bits(1.5 * 2^23)) << 23 == bits(t) << 23 modulo 2^32
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Score i of a lane's fragments takes exp2_poly when EXP2_POLY_EVERY divides i + 1 (one in
// EXP2_POLY_EVERY; 0: none), else the MUFU. i is a constant in the unrolled loops that call it.
__device__ __forceinline__ float exp2_score(int i, float x) {
  return EXP2_POLY_EVERY > 0 && (i + 1) % (EXP2_POLY_EVERY > 0 ? EXP2_POLY_EVERY : 1) == 0
             ? exp2_poly(x) : exp2_ftz(x);
}

// Online softmax of one 64 x BN score tile (this lane's fragments s, keys n0 .. n0+BN-1): the
// scores in log2 units (s * scale_log2), keys past S and (causal) past the row masked to -inf;
// updates the running row max m_run and this lane's partial row sums l_run, and leaves
// p = exp2(s * scale_log2 - m) in s. Returns in alpha the factor that rescales the accumulator
// of each of the lane's two rows. MASKED = false: no key of the tile is masked and
// scale_log2 >= 0, so the row max is taken on the raw scores and each p is one FMA and one
// exp2 (FlashAttention-3's folded scale); the caller picks the variant per tile, so the masking
// (three instructions per score) runs only on the tiles that need it.
template <int BN, bool MASKED>
__device__ __forceinline__ void softmax_impl(float (&s)[BN / 2], int n0, int S, int causal,
                                             int row_a, int row_b, int t, float scale_log2,
                                             float (&m_run)[2], float (&l_run)[2],
                                             float (&alpha)[2]) {
  constexpr int NT = BN / 8;                  // n8 score column groups per key tile
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * nt + e];
      if constexpr (MASKED) {
        x *= scale_log2;
        const int key = n0 + nt * 8 + 2 * t + (e & 1);
        const int row = e < 2 ? row_a : row_b;
        if (key >= S || (causal && key > row)) x = -INFINITY;
        s[4 * nt + e] = x;
      }
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
  float m_use[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {               // the 4 lanes of a quad share the row
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    if constexpr (!MASKED) mx[h] *= scale_log2;   // max(s) * scale = max(s * scale), scale >= 0
    const float m_new = fmaxf(m_run[h], mx[h]);
    m_use[h] = m_new == -INFINITY ? 0.f : m_new;   // nothing seen yet: p = 0, alpha = 0
    // a row whose max did not grow keeps its scale exactly (rescale() skips such warps)
    alpha[h] = m_new == m_run[h] ? 1.f : exp2_ftz(m_run[h] - m_use[h]);
    m_run[h] = m_new;
    l_run[h] *= alpha[h];
  }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const float m = m_use[(i >> 1) & 1];
    const float p = exp2_score(i, MASKED ? s[i] - m : fmaf(s[i], scale_log2, -m));
    s[i] = p;
    l_run[(i >> 1) & 1] += p;
  }
}

template <int BN>
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 2], int n0, int S, int causal,
                                             int wrow0, int row_a, int row_b, int t,
                                             float scale_log2, float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2]) {
  // warp-uniform: the tile crosses S or (causal) the warp's diagonal, or the scale is negative
  const bool need_mask = scale_log2 < 0.f || n0 + BN > S || (causal && n0 + BN - 1 > wrow0);
  if (need_mask)
    softmax_impl<BN, true>(s, n0, S, causal, row_a, row_b, t, scale_log2, m_run, l_run, alpha);
  else
    softmax_impl<BN, false>(s, n0, S, causal, row_a, row_b, t, scale_log2, m_run, l_run, alpha);
}

// A warp none of whose rows' maximum grew (alpha exactly 1 for each) skips the multiplies (a
// warp-uniform branch; every lane of the warp calls this).
template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 2], const float (&alpha)[2]) {
  if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// Work item `b`'s query row block `mb` (of n_mblocks) and flat head `bh` (of BH); without
// persistence, item b is block b. The heads are taken in sections of `section` heads (the last
// may have fewer); within a section the row blocks run last first (causal: the longest first),
// each row block of every head of the section before the next. One head per section: a head's
// row blocks are consecutive, so the blocks resident together share a few heads' k and v in
// L2, but the longest first holds within each head only (the last heads' long blocks end the
// grid, a tail of up to one row block's keys). All heads in one section: the longest first
// over the whole grid, but every head's k and v is read in every round of row blocks, from HBM
// once they outgrow L2. Sections of as many heads as whose k and v fit in SECTION_MB_D*
// megabytes (heads_per_section) keep both: FlashAttention-3's scheduler groups heads by L2 so.
__device__ __forceinline__ void block_coords(int b, int n_mblocks, int BH, int section, int& mb,
                                             int& bh) {
  if (section >= BH) {                        // one section: the arithmetic of one division
    mb = n_mblocks - 1 - b / BH;
    bh = b % BH;
    return;
  }
  const int first = b / (section * n_mblocks) * section;   // the section's first head
  const int heads = min(section, BH - first);
  const int i = b - first * n_mblocks;                       // the item within its section
  mb = n_mblocks - 1 - i / heads;
  bh = first + i % heads;
}

// Heads per section of the block order (block_coords) for a call of BH heads of S rows. A
// non-causal call's items are equal, so its order matters for L2 alone: one head at a time with
// HEAD_MAJOR_D*, else all at once. A causal call: as many heads as whose k and v (16-bit) fit
// in SECTION_MB_D* megabytes, at least one (0: one).
template <int D> static int heads_per_section(int BH, int S, int causal) {
  if (!causal) return (D == 64 ? HEAD_MAJOR_D64 : HEAD_MAJOR_D128) ? 1 : BH;
  const long long budget = (long long)(D == 64 ? SECTION_MB_D64 : SECTION_MB_D128) << 20;
  const long long heads = budget / (2LL * S * D * 2);
  return heads < 1 ? 1 : heads > BH ? BH : (int)heads;
}

// 1 / (the full row sum) of this lane's two rows (0 for an empty row): the quad's 4 lanes
// hold partial sums of the same rows.
__device__ __forceinline__ void row_inverse_sums(const float (&l_run)[2], float (&inv)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }
}

// Full row sums across the quad, then normalises the warpgroup's output fragments o and
// stores this lane's two rows (row_a, row_b; rows >= S are not stored) of the (S, D) slice
// `ob` whose rows lie `rs` elements apart, two dims (4 bytes) per store.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* ob_t, const float (&o)[D / 2],
                                           const float (&l_run)[2], int row_a, int row_b, int t,
                                           int S, long long rs) {
  float inv[2];
  row_inverse_sums(l_run, inv);
  uint32_t* ob = reinterpret_cast<uint32_t*>(ob_t);
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int w = (dt * 8 + 2 * t) / 2;       // 32-bit word within the row
    if (row_a < S)
      ob[(row_a * rs) / 2 + w] = pack2<T>(o[4 * dt] * inv[0], o[4 * dt + 1] * inv[0]);
    if (row_b < S)
      ob[(row_b * rs) / 2 + w] = pack2<T>(o[4 * dt + 2] * inv[1], o[4 * dt + 3] * inv[1]);
  }
}

template <typename T, int D, int BN, bool OV>
__global__ void __launch_bounds__(THREADS, 1)
wgmma_flash_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   T* __restrict__ out, int BH, int S, int causal, float scale_log2,
                   int section) {
#if WGF_SM90A
  constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
  using L = WgSmem<D, BN, OV>;
  constexpr int KV_STAGES = L::KV_STAGES;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t sbase = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sq = sbase;                  // q tile, then KV_STAGES stages of (k tile, v tile)
  const uint32_t skv = sbase + L::Q_BYTES;

  const int n_mblocks = (S + BLOCK_M - 1) / BLOCK_M;
  int mb, bh;
  block_coords((int)blockIdx.x, n_mblocks, BH, section, mb, bh);
  const int m0 = mb * BLOCK_M;
  const int tid = threadIdx.x;
  const int wg = warp_uniform(tid / WG_THREADS);
  const int warp = (tid % WG_THREADS) / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wg_row0 = m0 + 64 * wg;           // the warpgroup's first query row
  const int wrow0 = wg_row0 + 16 * warp;      // the warp's first query row
  const int row_a = wrow0 + g, row_b = row_a + 8;   // this lane's two rows
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + (long long)bh * S * D;
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k) + (long long)bh * S * D;
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v) + (long long)bh * S * D;

  const int n_end = causal ? min(S, m0 + BLOCK_M) : S;
  const int ntiles = (n_end + BN - 1) / BN;
  // Key tiles this warpgroup computes (warpgroup-uniform: wgmma is .sync.aligned over the
  // warpgroup): none past S's last row block, and (causal) none after its own last row.
  const bool wg_live = wg_row0 < S;
  const int wg_ntiles = !wg_live ? 0 : causal ? min(ntiles, (wg_row0 + 63) / BN + 1) : ntiles;
  auto stage = [&](int tile) { return skv + (uint32_t)(tile % KV_STAGES) * L::STAGE_BYTES; };
  auto load_kv = [&](int tile) {
    load_tile_sw128<BN, D, THREADS>(stage(tile), kb, tile * BN, S, tid);
    load_tile_sw128<BN, D, THREADS>(stage(tile) + L::KV_BYTES, vb, tile * BN, S, tid);
    cp_async_commit();
  };
  load_tile_sw128<BLOCK_M, D, THREADS>(sq, qb, m0, S, tid);
  load_kv(0);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};    // rows row_a, row_b (log2 units)
  float l_run[2] = {0.f, 0.f};                // this lane's partial row sums
  float alpha[2];
  uint32_t p[BN / 16][4];

  if constexpr (!OV) {
    // Per tile: S = q k^T (wait), softmax, O = O * alpha + P v (wait); tile it+1 loads into
    // the other of two stages meanwhile.
    for (int it = 0; it < ntiles; ++it) {
      cp_async_wait_all();                    // tile `it` (the only group in flight) landed
      fence_proxy_async();                    // ... and is visible to wgmma's async proxy
      __syncthreads();                        // for every thread; and tile it-1 is consumed
      if (it + 1 < ntiles) load_kv(it + 1);   // into the other stage
      if (it < wg_ntiles) {
        wg_qk<D, BN, BLOCK_M, BF16>(s, sq + wg * 64 * 128, stage(it));
        softmax_tile<BN>(s, it * BN, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run,
                         l_run, alpha);
        rescale<D>(o, alpha);
        pack_p<T, BN>(p, s);
        wg_pv<D, BN, BF16>(o, p, stage(it) + L::KV_BYTES);
      }
    }
  } else {
    // FlashAttention-3's intra-warpgroup pipelining: in step `it` the warpgroup issues
    // S = q k_it^T and then O += P_{it-1} v_{it-1}, waits for S only (wgmma.wait_group 1),
    // runs the softmax of tile `it` while P v is still on the tensor cores, then waits for
    // P v, rescales O and packs P_it. Tile it+1 loads into the stage tile it-2 used (three
    // stages: it-1 is read by this step's P v, `it` by its q k^T).
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (1 < ntiles) load_kv(1);
    if (0 < wg_ntiles) {
      wg_qk<D, BN, BLOCK_M, BF16>(s, sq + wg * 64 * 128, stage(0));
      softmax_tile<BN>(s, 0, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run, l_run,
                       alpha);                // o is still 0: no rescale
      pack_p<T, BN>(p, s);
    }
    for (int it = 1; it < ntiles; ++it) {
      cp_async_wait_all();                    // tile `it` landed ...
      fence_proxy_async();
      __syncthreads();                        // ... for all; every warpgroup is past step it-1
      if (it + 1 < ntiles) load_kv(it + 1);
      // Each branch waits for all it issued, so no register is in flight across a branch
      // (ptxas serialises every wgmma of the kernel otherwise, warning C7514).
      if (it < wg_ntiles) {
        reg_fence(o);
        reg_fence(p);
        reg_fence(s);
        wgmma_fence();
        wg_qk_issue<D, BN, BLOCK_M, BF16>(s, sq + wg * 64 * 128, stage(it));
        wgmma_commit();
        wgmma_fence();                        // its own fence: a separate stage for ptxas
        wg_pv_issue<D, BN, BF16>(o, p, stage(it - 1) + L::KV_BYTES);
        wgmma_commit();
        wgmma_wait1();                        // S done; P v may still run
        reg_fence(s);
        softmax_tile<BN>(s, it * BN, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run,
                         l_run, alpha);
        reg_fence(s);                         // the softmax stays before the wait (the compiler
        reg_fence(alpha);                     // may otherwise sink it past the volatile asm)
        reg_fence(l_run);
        wgmma_wait0();                        // P v done: o and p are ours again
        reg_fence(o);
        reg_fence(p);
        rescale<D>(o, alpha);
        pack_p<T, BN>(p, s);
      } else if (it == wg_ntiles) {           // this warpgroup's last tile: its P v only
        wg_pv<D, BN, BF16>(o, p, stage(it - 1) + L::KV_BYTES);
      }
    }
    if (wg_live && wg_ntiles == ntiles)       // the last tile's P v
      wg_pv<D, BN, BF16>(o, p, stage(ntiles - 1) + L::KV_BYTES);
  }

  if (wg_live) store_rows<T, D>(out + (long long)bh * S * D, o, l_run, row_a, row_b, t, S, D);
#else
  __trap();   // built without sm_90a: never launched (run() asks wgmma_built() first)
#endif
}

template <typename T, int D, bool OV>
static int launch_wgmma(const void* q, const void* k, const void* v, void* out, int BH, int S,
                        int causal, float scale, cudaStream_t stream) {
  constexpr int BN = D == 64 ? BLOCK_N_D64 : BLOCK_N_D128;
  static_assert(BN == 64 || BN == 128, "BLOCK_N_D64 and BLOCK_N_D128 must be 64 or 128");
  static_assert(NUM_WARPGROUPS == 1 || NUM_WARPGROUPS == 2, "NUM_WARPGROUPS must be 1 or 2");
  const size_t smem = WgSmem<D, BN, OV>::bytes;
  cudaError_t err = cudaFuncSetAttribute(wgmma_flash_kernel<T, D, BN, OV>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) {                   // tiles too large for this GPU: fail cleanly, and
    (void)cudaGetLastError();                 // clear the error, or the next call's launch check
    return (int)err;                          // would report it again
  }
  const long long blocks = (long long)((S + BLOCK_M - 1) / BLOCK_M) * BH;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  wgmma_flash_kernel<T, D, BN, OV><<<(unsigned)blocks, THREADS, smem, stream>>>(
      (const T*)q, (const T*)k, (const T*)v, (T*)out, BH, S, causal, scale * LOG2E,
      heads_per_section<D>(BH, S, causal));
  return (int)cudaGetLastError();
}

// ---- warp-specialised path (WARP_SPECIALIZE_D*=1): a TMA producer and an mbarrier ring ----
//
// FlashAttention-3's structure. The block has ws_consumers<D>() + 1 warpgroups: warpgroup 0 is the
// producer, and one thread of it issues every load as a TMA bulk tensor copy (q once per work item,
// then the k and v tiles of each key block into a ring of WS_STAGES_D* stages); the consumer
// warpgroups 1..ws_consumers<D>() compute as above, 64 query rows each. Nothing block-wide
// synchronises the loop: per stage, the k and v tiles each have a "full" mbarrier (the producer
// arms it with the tile's byte count, and the TMA completes it) and an "empty" mbarrier that every
// consumer thread arrives on once its wgmma reading the tile has completed (k after q k^T, v after
// P v, so a k stage is refilled while P v still reads its v); the producer waits on it before
// reusing the stage. A consumer warpgroup with fewer key tiles than the block (causal, or rows past
// S) still waits for and releases each remaining tile, in order, so the producer never waits for it
// forever and no phase of an empty barrier gets two arrivals from one thread. With SETMAXNREG (and
// two consumer warpgroups) the producer warpgroup gives its registers to the consumers (setmaxnreg
// 24 / 240). With PINGPONG the two consumer warpgroups take turns issuing their wgmma (two named
// barriers): with overlap a turn covers q k^T and the previous tile's P v, without it q k^T only
// (the P v of the last tile is outside any turn), so one warpgroup's softmax runs while the other's
// matrix products occupy the tensor cores.
// A block computes one work item (row block, head), or with PERSISTENT_D* (one block per SM)
// several in turn: every gridDim-th item, or for causal calls with PERSISTENT_DYNAMIC the next
// one not yet taken, from a counter in global memory (causal items differ in length: with a
// fixed stride some blocks drew twice the work of others). The k/v ring runs on across items,
// and the q tile has an "empty" mbarrier too, which the consumers arrive on after their last
// q k^T of an item, so the producer loads the next item's q and first k/v tiles while the
// consumers finish P v and store the outputs of the current one. With two q tiles
// (Q_DOUBLE_MAX_S_D*) the next item's q does not wait for that release: at S=512 the consumers
// had spent 6% of the warps' stall samples waiting for q (ncu, (8,32,512,64), H100).
//
// TMA writes shared memory in the 128-byte swizzle described above: each load is a box of 64
// columns (128 bytes) by R rows of one (b, h) slice of the (B*H, S, D) tensor, i.e. one panel,
// at a 1024-byte aligned address. Rows past S read as zeros (the tensor map's bounds), so a
// partial key block needs only the score mask.

// Consumer warpgroups of the warp-specialised kernel at head dim D: NUM_WARPGROUPS, or with
// WIDE_D64 three at D=64 (FlashAttention-3's 192-row tile for head dim 64: a third warpgroup's
// softmax to overlap with the others' matrix products, where a 64 x 64 output leaves registers
// to spare). (Functions, not constants: a build where neither head dim takes this path never
// calls them, where an unused constant would draw nvcc's warning #177.)
template <int D> __host__ __device__ constexpr int ws_consumers() {
  return D == 64 && WIDE_D64 ? 3 : NUM_WARPGROUPS;
}
template <int D> __host__ __device__ constexpr int ws_block_m() { return 64 * ws_consumers<D>(); }
template <int D> __host__ __device__ constexpr int ws_threads() {
  return WG_THREADS * (ws_consumers<D>() + 1);
}
template <int D> __host__ __device__ constexpr int ws_stages() {
  return D == 64 ? WS_STAGES_D64 : WS_STAGES_D128;
}

// setmaxnreg moves registers from the producer warpgroup to the consumers: 24 / 240 for two
// consumer warpgroups (384 threads start at 168 registers, 65536 / 384, which ptxas uses
// whenever the kernel has setmaxnreg; a pool of 64512 = 128 * 24 + 256 * 240), 32 / 160 for
// three (512 threads start at 128; 65536 = 128 * 32 + 384 * 160). With one consumer warpgroup
// (256 threads, up to 255 registers each) there is nothing to move, and an .inc below the
// starting count is not allowed: off.
template <int NW> __host__ __device__ constexpr bool use_setmaxnreg() {
  return SETMAXNREG && (NW == 2 || NW == 3);
}

// QB: q tiles in shared memory, 1 or 2 (calls with S up to Q_DOUBLE_MAX_S_D*): with two, the
// producer loads the next work item's q while the consumers still read the current one's.
template <int D, int BN, int QB> struct WsSmem {
  static constexpr int NW = ws_consumers<D>();
  static constexpr uint32_t Q_BYTES = ws_block_m<D>() * D * 2;   // one q tile; QB of them first
  static constexpr uint32_t KV_BYTES = BN * D * 2;
  static constexpr uint32_t STAGE_BYTES = 2 * KV_BYTES;
  // TMA_STORE_MAX_S > 0: the output tile, 64 rows x D per consumer warpgroup, after the stages
  static constexpr int STAGES = ws_stages<D>();
  static constexpr uint32_t KV_OFFSET = QB * Q_BYTES;
  static constexpr uint32_t O_OFFSET = KV_OFFSET + STAGES * STAGE_BYTES;
  static constexpr uint32_t O_WG_BYTES = 64 * D * 2;
  static constexpr uint32_t BAR_OFFSET =
      O_OFFSET + (TMA_STORE_MAX_S > 0 ? NW * O_WG_BYTES : 0);
  // barriers (8 bytes each): per q tile q_full, q_empty, then per stage k_full, v_full,
  // k_empty, v_empty; then the item slot of each q tile (4 bytes; offsets from the first)
  static constexpr uint32_t STAGE_BARS = 16 * QB;
  static constexpr uint32_t ITEM_SLOT = STAGE_BARS + 32 * STAGES;
  static constexpr size_t bytes = BAR_OFFSET + ITEM_SLOT + 8 * QB + 1024;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if WGF_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Arrives on `bar` and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#if WGF_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if WGF_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// True once the phase of `bar` with this parity has completed (try_wait may suspend a while).
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
#if WGF_SM90A
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
               "selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#endif
  return done != 0;
}
// Waits until the phase of `bar` with this parity has completed. Built with -DWGF_WATCHDOG
// (benchmarks/wgmma_probe.py does), 2^30 failed tries (each try_wait suspends the thread up
// to a time limit: seconds in all, far longer than any tile takes) mean the pipeline is
// deadlocked, and the kernel traps: the error shows at the next synchronisation (asynchronously,
// like any fault) instead of the GPU hanging. It guards the mbarrier waits only, not the
// PINGPONG named barriers or setmaxnreg. Not in the normal build: the extra branch costs the
// D=128 consumers register spills.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#ifdef WGF_WATCHDOG
  for (uint32_t tries = 0; !mbar_try(bar, parity);)
    if (++tries == (1u << 30)) __trap();
#else
  while (!mbar_try(bar, parity)) {
  }
#endif
}

// One panel (64 columns x rows) of head h of batch b, rows from y, into `dst`; completes on
// `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int x, int y, int h,
                                         int b, uint32_t bar) {
#if WGF_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      ::"r"(dst), "l"((uint64_t)map), "r"(x), "r"(y), "r"(h), "r"(b), "r"(bar) : "memory");
#endif
}
// Named barriers 1 and 2 (0 is __syncthreads): the PINGPONG turn of consumer warpgroup w.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The TMA-store epilogue: four 8x8 16-bit matrices from registers into shared memory (lanes
// 8i .. 8i+7 give the row addresses of matrix i; register i holds matrix i in the mma
// accumulator layout, the same as the A fragment of P), then a bulk tensor store of a 64-column
// panel to global memory.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
#if WGF_SM90A
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
#endif
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int x, int y,
                                          int h, int b) {
#if WGF_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"((uint64_t)map), "r"(src), "r"(x), "r"(y), "r"(h), "r"(b) : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if WGF_SM90A
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's bulk stores have read their shared memory (the buffer is free).
__device__ __forceinline__ void bulk_wait_read() {
#if WGF_SM90A
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
// Waits until this thread's bulk stores have completed (written global memory).
__device__ __forceinline__ void bulk_wait_all() {
#if WGF_SM90A
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
template <int R> __device__ __forceinline__ void set_max_regs_inc() {
#if WGF_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R> __device__ __forceinline__ void set_max_regs_dec() {
#if WGF_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

// The TMA-store epilogue (TMA_STORE_MAX_S) for one consumer warpgroup (all its 128 threads call
// it): normalises o by the full row sums, writes the warpgroup's 64 x D output tile into its
// shared buffer `so` (swizzled as the loads are, so a TMA store of each panel reads it back in
// order) with stmatrix, and lets one thread (`leader`) store it to rows row0 .. row0+63 of
// head h of batch b with TMA (rows past S are clipped by the tensor map). The store runs on while the
// warpgroup goes on to its next item; the leader waits for it to have read the buffer before the
// buffer is written again (here, at the next item), and for completion before the block exits
// (the caller).
// Named barrier 3 + wg (1 and 2 are the PINGPONG turns) orders the warpgroup's threads.
template <typename T, int D>
__device__ __forceinline__ void store_rows_tma(const CUtensorMap* map, uint32_t so,
                                               const float (&o)[D / 2], const float (&l_run)[2],
                                               int warp, int lane, int wg, int row0, int h,
                                               int b, bool leader) {
  float inv[2];
  row_inverse_sums(l_run, inv);
  if (leader) bulk_wait_read();               // the previous item's store has read the buffer
  named_sync(3 + wg, WG_THREADS);
  // Lane l addresses row l % 8 of matrix l / 8: matrices 0 and 1 are rows 0-7 and 8-15 of the
  // warp's 16 rows at the key step's first 8 columns, matrices 2 and 3 the next 8 columns.
  const int mi = lane / 8;
  const int r = 16 * warp + lane % 8 + 8 * (mi & 1);
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int c = 2 * j + (mi >> 1);          // 16-byte chunk of the row (8 columns)
    const uint32_t addr =
        so + (uint32_t)((c >> 3) * 64 * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
    stmatrix_x4(addr, pack2<T>(o[8 * j] * inv[0], o[8 * j + 1] * inv[0]),
                pack2<T>(o[8 * j + 2] * inv[1], o[8 * j + 3] * inv[1]),
                pack2<T>(o[8 * j + 4] * inv[0], o[8 * j + 5] * inv[0]),
                pack2<T>(o[8 * j + 6] * inv[1], o[8 * j + 7] * inv[1]));
  }
  fence_proxy_async();                        // the writes, visible to the TMA (async proxy)
  named_sync(3 + wg, WG_THREADS);
  if (leader) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p) tma_store(map, so + p * 64 * 128, 64 * p, row0, h, b);
    bulk_commit();
  }
}

// SPLIT_TAIL_D64 (launch_ws): a non-causal call on a persistent grid whose last wave of work items
// would leave SMs idle takes that wave's items in `split` parts of their key tiles (1: none),
// each part on its own block, merged by the last to finish: the items from `start` on in the
// block order. `tickets`: one int per split item and consumer warp (zero between launches);
// `ws`: each part's unnormalised output, row maxima and partial row sums, D / 2 + 4 floats per
// consumer thread.
struct TailSplit {
  float* ws;
  int* tickets;
  int split, start;
};

// The parts SPLIT_TAIL_D64 splits each item of a non-causal call's last wave into (1: none),
// for `items` work items of `ntiles` key tiles on a persistent grid of `blocks`: as many as the
// grid holds, none where the wave (items % blocks) fills more than half of it, at most the knob
// and the key tiles. At (1,32,4096,64) 704 items on 132 SMs end in a wave of 44: 3 parts each.
[[maybe_unused]] static int tail_parts(long long items, long long blocks, long long ntiles) {
  if (SPLIT_TAIL_D64 < 2 || items <= blocks) return 1;
  const long long rest = items % blocks;
  long long parts = rest > 0 ? blocks / rest : 1;
  parts = parts < SPLIT_TAIL_D64 ? parts : SPLIT_TAIL_D64;
  return (int)(parts < ntiles ? parts : ntiles);
}

// SPLIT_TAIL_D64 serves head dim 64 only: at 128 its code alone cost 0.4-1.6% on the default
// configs, where no call's last wave is short enough to split.
__host__ __device__ constexpr bool splits_tail(int D) { return D == 64; }

// The first key tile of part `part` of an item's `all` tiles split `parts` ways (part = parts:
// the end); every part gets at least one tile where parts <= all.
__host__ __device__ __forceinline__ int part_first_tile(int part, int all, int parts) {
  return part * all / parts;
}

// Where a call's heads lie, for the warp-specialised kernel: q, k and v are read through tensor
// maps that carry their strides; the output is written through its map or, past
// TMA_STORE_MAX_S, at these element strides (batch, head, row). `group` query heads share a
// k/v head (grouped-query attention; 1: none).
struct HeadLayout {
  int H, group;
  long long out_b, out_h, out_s;
};

// One part of a SPLIT_TAIL_D64 item: this thread's o, m_run and l_run go to the workspace (part
// `part` of split item `slot`, consumer thread `cidx` of `nct`), then its consumer warp (`cwarp`)
// takes a ticket; the part that takes the last one merges the others' into its registers, puts
// the ticket back to 0 for the stream's next launch and returns true (it stores the rows); the
// others return false. Every part of an item has the same rows, so the same warps take tickets.
template <int D>
__device__ __forceinline__ bool merge_parts(const TailSplit& ts, int slot, int part, int nct,
                                            int cidx, int cwarp, int lane, float (&o)[D / 2],
                                            float (&m_run)[2], float (&l_run)[2]) {
  constexpr int F = D / 2 + 4;                // floats per thread: o, m_run, l_run
  auto at = [&](int p) { return ts.ws + (size_t)(slot * ts.split + p) * F * nct + cidx; };
  float* mine = at(part);                     // element f at mine[f * nct]: coalesced per warp
#pragma unroll
  for (int i = 0; i < D / 2; ++i) mine[i * nct] = o[i];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mine[(D / 2 + h) * nct] = m_run[h];
    mine[(D / 2 + 2 + h) * nct] = l_run[h];
  }
  __threadfence();                            // this thread's writes, before the warp's ticket
  __syncwarp();
  int* ticket = ts.tickets + slot * (nct / 32) + cwarp;
  int taken = 0;
  if (lane == 0) taken = atomicAdd(ticket, 1);
  taken = __shfl_sync(0xffffffffu, taken, 0);
  if (taken != ts.split - 1) return false;
  __threadfence();                            // the other parts' writes, before reading them
  if (lane == 0) *ticket = 0;
  for (int p = 0; p < ts.split; ++p) {
    if (p == part) continue;
    const float* other = at(p);
    float a[2], c[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mo = __ldcg(other + (D / 2 + h) * nct);
      const float lo = __ldcg(other + (D / 2 + 2 + h) * nct);
      const float m_new = fmaxf(m_run[h], mo);
      a[h] = m_run[h] == -INFINITY ? 0.f : exp2_ftz(m_run[h] - m_new);
      c[h] = mo == -INFINITY ? 0.f : exp2_ftz(mo - m_new);
      m_run[h] = m_new;
      l_run[h] = l_run[h] * a[h] + lo * c[h];
    }
#pragma unroll
    for (int i = 0; i < D / 2; ++i)
      o[i] = o[i] * a[(i >> 1) & 1] + __ldcg(other + i * nct) * c[(i >> 1) & 1];
  }
  return true;
}

template <typename T, int D, int BN, bool OV, int QB>
__global__ void __launch_bounds__(ws_threads<D>(), 1)
wgmma_ws_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                T* __restrict__ out, int BH, int S,
                int causal, float scale_log2, int* __restrict__ item_counter, int tma_store,
                int section, const HeadLayout lay, const TailSplit tail) {
#if WGF_SM90A
  constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
  using L = WsSmem<D, BN, QB>;
  constexpr int PANELS = D / 64;
  constexpr int NW = ws_consumers<D>();
  constexpr int BLOCK_M = ws_block_m<D>();   // this path's row block (shadows the cp.async one)
  constexpr uint32_t CONSUMERS = WG_THREADS * NW;
  constexpr int STAGES = ws_stages<D>();     // the k/v ring's depth
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t sbase = (smem_addr(smem_raw) + 1023u) & ~1023u;
  static_assert(QB == 1 || QB == 2, "one or two q tiles");   // item n's is n % QB
  auto sq = [&](int j) { return sbase + (uint32_t)j * L::Q_BYTES; };
  auto sk = [&](int st) { return sbase + L::KV_OFFSET + (uint32_t)st * L::STAGE_BYTES; };
  auto sv = [&](int st) { return sk(st) + L::KV_BYTES; };
  const uint32_t bars = sbase + L::BAR_OFFSET;
  auto bar_q = [&](int j) { return bars + 16u * j; };                // q tile j landed
  auto bar_qe = [&](int j) { return bar_q(j) + 8u; };                // q tile j consumed
  // The work item whose q is (being) loaded into tile j: written by the producer before it
  // arms bar_q(j).
  int* item_slot = reinterpret_cast<int*>(smem_raw + (bars + L::ITEM_SLOT - smem_addr(smem_raw)));
  auto bar_k = [&](int st) { return bars + L::STAGE_BARS + 32u * st; };   // k tile landed
  auto bar_v = [&](int st) { return bar_k(st) + 8u; };               // v tile landed
  auto bar_ke = [&](int st) { return bar_k(st) + 16u; };             // k tile consumed
  auto bar_ve = [&](int st) { return bar_k(st) + 24u; };             // v tile consumed

  const int n_mblocks = (S + BLOCK_M - 1) / BLOCK_M;
  // Work items: (row block, head) in block_coords' order, SPLIT_TAIL_D64's parts counted; the host
  // checks that their number, plus the grid, fits in int.
  constexpr bool SPLITS = splits_tail(D);
  const int n_items =
      SPLITS ? tail.start + (n_mblocks * BH - tail.start) * tail.split : n_mblocks * BH;
  const int tid = threadIdx.x;
  const int wg_all = warp_uniform(tid / WG_THREADS);
  // Work item `item` of this block: its row block's first row m0, flat head bh, its key tiles
  // t0 .. t0 + ntiles - 1 and, for a part of a split item, that item's index among the split ones
  // (`slot`; else -1) and the part.
  auto item_coords = [&](int item, int& m0, int& bh, int& t0, int& ntiles, int& slot,
                         int& part) {
    int real = item;
    slot = -1;
    part = 0;
    if (SPLITS && item >= tail.start) {
      slot = (item - tail.start) / tail.split;
      part = item - tail.start - slot * tail.split;
      real = tail.start + slot;
    }
    int mb;
    block_coords(real, n_mblocks, BH, section, mb, bh);
    m0 = mb * BLOCK_M;
    const int all = ((causal ? min(S, m0 + BLOCK_M) : S) + BN - 1) / BN;
    t0 = slot < 0 ? 0 : part_first_tile(part, all, tail.split);
    ntiles = (slot < 0 ? all : part_first_tile(part + 1, all, tail.split)) - t0;
  };

  if (tid == 0) {
    for (int j = 0; j < QB; ++j) {
      mbar_init(bar_q(j), 1);
      mbar_init(bar_qe(j), CONSUMERS);
    }
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(bar_k(st), 1);
      mbar_init(bar_v(st), 1);
      mbar_init(bar_ke(st), CONSUMERS);
      mbar_init(bar_ve(st), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();                            // the last block-wide barrier

  if (wg_all == 0) {                          // ---- producer warpgroup
    if (use_setmaxnreg<NW>()) set_max_regs_dec<NW == 2 ? 24 : 32>();
    if (tid == 0) {
      // The k and v tiles of all this block's work items go through one ring: the block's
      // r-th tile (counting over its items in order) goes into stage r % STAGES once the
      // tile STAGES before it there has been consumed. k runs one tile ahead of v, as the
      // consumers need them. With one q tile (QB = 1) an item's q is loaded after its first k
      // tile, once the consumers have released the previous item's q (after their last q k^T);
      // with two, before it, into the tile the item before the previous one released; the
      // item's index goes into that tile's item_slot. Items: blockIdx.x first, then every
      // gridDim.x-th (static), or with an item_counter the next one not yet taken (dynamic: a
      // block that drew short causal items takes more). Past the last item the next slot gets
      // n_items and its bar_q a plain arrival, which tells the consumers to stop.
      // ring: the tiles of earlier items, modulo 2 * STAGES (stage and phase repeat with that
      // period; a running count could outgrow int), plus 2 * STAGES once the ring has been round
      // (from then on every load waits for its stage's release; the phases are the same).
      int ring = 0, n = 0;                    // n: items done
      int item = blockIdx.x;
      for (; item < n_items; ++n) {
        const int next = item_counter ? gridDim.x + atomicAdd(item_counter, 1) : item + gridDim.x;
        int m0, bh, t0, ntiles, slot, part;
        item_coords(item, m0, bh, t0, ntiles, slot, part);
        const int b = bh / lay.H, h = bh - b * lay.H, hk = h / lay.group;
        // Key tile `kt` (t0 .. t_end - 1) of this item, the ring's tile rb + kt, of k or v into
        // its stage.
        const int t_end = t0 + ntiles, rb = ring - t0;
        auto load = [&](int kt, const CUtensorMap* map, uint32_t dst, uint32_t full,
                        uint32_t empty) {
          const int r = rb + kt;
          if (r >= STAGES) mbar_wait(empty, ((r / STAGES) + 1) & 1);
          mbar_expect_tx(full, L::KV_BYTES);
#pragma unroll
          for (int p = 0; p < PANELS; ++p)
            tma_load(dst + p * BN * 128, map, 64 * p, kt * BN, hk, b, full);
        };
        // This item's q into tile n % QB, once the item QB before it has released that tile.
        auto load_q = [&]() {
          const int j = n % QB;
          if (n >= QB) mbar_wait(bar_qe(j), (n / QB - 1) & 1);
          // Seen by every consumer that completes this phase of bar_q(j): mbarrier.arrive (here
          // with expect_tx) has .release.cta semantics and try_wait .acquire.cta by default.
          item_slot[j] = item;
          mbar_expect_tx(bar_q(j), L::Q_BYTES);
#pragma unroll
          for (int p = 0; p < PANELS; ++p)
            tma_load(sq(j) + p * BLOCK_M * 128, &tm_q, 64 * p, m0, h, b, bar_q(j));
        };
        for (int kt = t0; kt <= t_end; ++kt) {
          if (QB > 1 && kt == t0) load_q();   // its tile is free long before: first
          if (kt < t_end) {
            const int st = (rb + kt) % STAGES;
            load(kt, &tm_k, sk(st), bar_k(st), bar_ke(st));
          }
          if (QB == 1 && kt == t0) load_q();  // waits for the previous item's last q k^T
          if (kt > t0) {
            const int st = (rb + kt - 1) % STAGES;
            load(kt - 1, &tm_v, sv(st), bar_v(st), bar_ve(st));
          }
        }
        const int r_end = rb + t_end;
        ring = r_end >= STAGES ? r_end % (2 * STAGES) + 2 * STAGES : r_end;
        item = next;
      }
      if (n >= QB) mbar_wait(bar_qe(n % QB), (n / QB - 1) & 1);
      item_slot[n % QB] = n_items;            // no more items
      mbar_arrive(bar_q(n % QB));
      if (item_counter) {
        // This block draws no more items: count it; the launch's last block puts the counter
        // (item_counter[0], and this count, [1]) back to 0 for the stream's next launch. Every
        // block's last atomicAdd on [0] precedes its count, so none comes after the reset.
        __threadfence();
        if (atomicAdd(item_counter + 1, 1) == (int)gridDim.x - 1) {
          item_counter[0] = 0;
          item_counter[1] = 0;
        }
      }
    }
    return;
  }

  // ---- consumer warpgroups
  if (use_setmaxnreg<NW>()) set_max_regs_inc<NW == 2 ? 240 : 160>();
  const int wg = wg_all - 1;
  const int ctid = tid - WG_THREADS;
  const int warp = (ctid % WG_THREADS) / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;
  const bool pingpong = PINGPONG && NW == 2;
  const uint32_t so_wg = sbase + L::O_OFFSET + wg * L::O_WG_BYTES;   // the TMA store's tile
  const bool leader = ctid % WG_THREADS == 0;                        // ... and its storer

  for (int ring = 0, n = 0;; ++n) {            // as the producer counts them (ring modulo
                                              // 2 * STAGES)
    // Every consumer thread waits for each item's q (the barrier's phases go in order) and
    // releases it once: after its last q k^T, or at once if it has no tile to compute.
    const int qj = warp_uniform(n % QB);
    mbar_wait(bar_q(qj), (n / QB) & 1);
    const int item = item_slot[qj];
    const uint32_t q_addr = sq(qj) + wg * 64 * 128;
    if (item >= n_items) break;
    int m0, bh, t0, ntiles, slot, part;
    item_coords(item, m0, bh, t0, ntiles, slot, part);
    const int wg_row0 = m0 + 64 * wg;
    const int wrow0 = wg_row0 + 16 * warp;
    const int row_a = wrow0 + g, row_b = row_a + 8;
    const bool wg_live = wg_row0 < S;
    const int wg_ntiles = !wg_live ? 0 : causal ? min(ntiles, (wg_row0 + 63) / BN + 1) : ntiles;
    // The ring stage (warp-uniform: the k and v descriptors) and phase of this item's tile `it`.
    auto stage = [&](int it) { return warp_uniform((ring + it) % STAGES); };
    auto phase = [&](int it) { return (uint32_t)(((ring + it) / STAGES) & 1); };
    // PINGPONG turns: warpgroup w issues its matrix products after a bar.sync on barrier 1 + w
    // and then lets the other one go (bar.arrive on its barrier). Every consumer warpgroup
    // takes ntiles turns per item (idle ones too), and warpgroup 1 gives warpgroup 0 the first
    // turn of each item and does not hand on its last one, so each item starts afresh.
    auto turn_begin = [&]() { if (pingpong) named_sync(1 + wg, 2 * WG_THREADS); };
    auto turn_end = [&](int it) {
      if (pingpong && !(wg == 1 && it == ntiles - 1)) named_arrive(2 - wg, 2 * WG_THREADS);
    };
    if (pingpong && wg == 1) named_arrive(1, 2 * WG_THREADS);

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float s[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    float alpha[2];
    uint32_t p[BN / 16][4];

    if (wg_ntiles == 0) mbar_arrive(bar_qe(qj));
    auto release_k = [&](int it) {
      mbar_arrive(bar_ke(stage(it)));
      if (it == wg_ntiles - 1) mbar_arrive(bar_qe(qj));
    };
    if constexpr (!OV) {
      for (int it = 0; it < wg_ntiles; ++it) {
        const int st = stage(it);
        mbar_wait(bar_k(st), phase(it));
        turn_begin();
        reg_fence(s);
        wgmma_fence();
        wg_qk_issue<D, BN, BLOCK_M, BF16>(s, q_addr, sk(st));
        wgmma_commit();
        turn_end(it);
        wgmma_wait0();
        reg_fence(s);
        release_k(it);
        softmax_tile<BN>(s, (t0 + it) * BN, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run,
                         l_run, alpha);
        rescale<D>(o, alpha);
        pack_p<T, BN>(p, s);
        mbar_wait(bar_v(st), phase(it));
        wg_pv<D, BN, BF16>(o, p, sv(st));
        mbar_arrive(bar_ve(st));
      }
    } else {
      // As the OVERLAP loop above: q k_it^T and P_{it-1} v_{it-1} in flight together, the
      // softmax of tile `it` while P v runs; stage it-1 is released once P v has completed.
      if (wg_ntiles > 0) {
        const int st = stage(0);
        mbar_wait(bar_k(st), phase(0));
        turn_begin();
        reg_fence(s);
        wgmma_fence();
        wg_qk_issue<D, BN, BLOCK_M, BF16>(s, q_addr, sk(st));
        wgmma_commit();
        turn_end(0);
        wgmma_wait0();
        reg_fence(s);
        release_k(0);
        softmax_tile<BN>(s, t0 * BN, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run, l_run,
                         alpha);
        alpha[0] = alpha[1] = 1.f;            // o is still zero: its first rescale is skipped
        pack_p<T, BN>(p, s);
      }
      for (int it = 1; it < wg_ntiles; ++it) {
        const int st = stage(it), prev = stage(it - 1);
        mbar_wait(bar_k(st), phase(it));
        mbar_wait(bar_v(prev), phase(it - 1));
        turn_begin();
        reg_fence(o);
        reg_fence(p);
        reg_fence(s);
        wgmma_fence();
        wg_qk_issue<D, BN, BLOCK_M, BF16>(s, q_addr, sk(st));
        wgmma_commit();
        // O's rescale for tile it-1 while q k_it^T runs (FlashAttention-3's order), not
        // after P v's wait, where it held up the next issue
        rescale<D>(o, alpha);
        reg_fence(o);
        wgmma_fence();
        wg_pv_issue<D, BN, BF16>(o, p, sv(prev));
        wgmma_commit();
        turn_end(it);
        wgmma_wait1();
        reg_fence(s);
        release_k(it);                        // q k_it^T done: its k stage may be refilled
        softmax_tile<BN>(s, (t0 + it) * BN, S, causal, wrow0, row_a, row_b, t, scale_log2, m_run,
                         l_run, alpha);
        reg_fence(s);
        reg_fence(alpha);
        reg_fence(l_run);
        wgmma_wait0();
        reg_fence(o);
        reg_fence(p);
        mbar_arrive(bar_ve(prev));
        pack_p<T, BN>(p, s);
      }
      if (wg_ntiles > 0) {                    // the last tile's P v
        const int st = stage(wg_ntiles - 1);
        mbar_wait(bar_v(st), phase(wg_ntiles - 1));
        rescale<D>(o, alpha);
        wg_pv<D, BN, BF16>(o, p, sv(st));
        mbar_arrive(bar_ve(st));
      }
    }
    // Tiles this warpgroup does not compute: wait for each to land and release it, in order.
    for (int it = wg_ntiles; it < ntiles; ++it) {
      const int st = stage(it);
      turn_begin();                           // every warpgroup takes ntiles turns
      turn_end(it);
      mbar_wait(bar_k(st), phase(it));
      mbar_arrive(bar_ke(st));
      mbar_wait(bar_v(st), phase(it));
      mbar_arrive(bar_ve(st));
    }
    if (wg_live) {
      const int b = bh / lay.H, h = bh - b * lay.H;
      // A split item's rows are stored by the part that merges them, from registers (the TMA
      // store's barrier is the warpgroup's, a ticket is the warp's).
      const bool split = SPLITS && slot >= 0;
      if (!split || merge_parts<D>(tail, slot, part, CONSUMERS, ctid, 4 * wg + warp, lane, o,
                                   m_run, l_run)) {
        if (TMA_STORE_MAX_S > 0 && tma_store && !split)
          store_rows_tma<T, D>(&tm_o, so_wg, o, l_run, warp, lane, wg, wg_row0, h, b, leader);
        else
          store_rows<T, D>(out + b * lay.out_b + h * lay.out_h, o, l_run, row_a, row_b, t, S,
                           lay.out_s);
      }
    }
    ring = (ring + ntiles) % (2 * STAGES);
  }
  if (TMA_STORE_MAX_S > 0 && tma_store && leader)
    bulk_wait_all();                          // the block's shared memory outlives its stores
#else
  __trap();
#endif
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no -lcuda needed);
// nullptr if the driver has none. A function-local static: initialised once, thread-safe.
// Unused (and not warned about) in a build where neither head dim is warp-specialised.
[[maybe_unused]] static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = []() {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess) (void)cudaGetLastError();   // not left for a later launch check
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  return fn;
}

// Element strides of a (B, H, S, D) tensor whose last dim is dense: batch, head, row.
struct Strides { long long b, h, s; };

// A tensor map over the (B, H, S, D) tensor at `base` with strides `st`: boxes of 64 columns x
// `rows` rows of one head, 128-byte swizzle, zeros past the bounds. Returns false if the driver
// refuses it (a stride or the base not a multiple of 16 bytes).
template <typename T>
static bool make_tensor_map(CUtensorMap* map, const void* base, int B, int H, int S, int D,
                            Strides st, int rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const CUtensorMapDataType type = std::is_same<T, __nv_bfloat16>::value
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)S, (cuuint64_t)H, (cuuint64_t)B};
  const cuuint64_t strides[3] = {(cuuint64_t)st.s * 2, (cuuint64_t)st.h * 2,   // bytes, dims 1-3
                                 (cuuint64_t)st.b * 2};
  const cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A zeroed device buffer of at least `bytes` for a launch on `stream`, or nullptr with the error
// cleared. `kind` names its use: 0 the dynamic schedule's counter (a pair of ints: the next
// item, the blocks done; the kernel's last block zeroes them again), 1 SPLIT_TAIL_D64's tickets
// (each zeroed again by the kernel) and partial outputs. Launches on one stream run in order, so
// each stream keeps one buffer of each kind, allocated and zeroed once (stream-ordered: never a
// device-wide synchronisation; one too small is freed after the launches before it and
// replaced) and found again by (device, stream, kind): no allocation or memset per call, which
// had cost a causal call about 8 us of host time. Launches on different streams may overlap, so
// they never share a buffer; while `stream` captures a graph (which may later be launched on any
// stream) and when the table is full, the launch gets a buffer of its own, freed after it
// (`owned`). A stream destroyed with work pending whose handle a new stream gets at once could
// share its buffer: torch takes its streams from pools it keeps for the life of the process.
[[maybe_unused]] static void* stream_buffer(cudaStream_t stream, int kind, size_t bytes,
                                            bool& owned) {
  constexpr int SLOTS = 64;
  struct Slot { int dev; cudaStream_t stream; int kind; size_t bytes; void* ptr; };
  static Slot slots[SLOTS];
  static int used = 0;
  static std::mutex lock;
  owned = false;
  int dev = 0;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaStreamIsCapturing(stream, &capturing) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> guard(lock);
  int found = -1;                             // this stream's buffer of this kind, too small
  if (capturing == cudaStreamCaptureStatusNone)
    for (int i = 0; i < used && found < 0; ++i)
      if (slots[i].dev == dev && slots[i].stream == stream && slots[i].kind == kind) {
        if (slots[i].bytes >= bytes) return slots[i].ptr;
        found = i;
      }
  void* ptr = nullptr;
  if (cudaMallocAsync(&ptr, bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();                 // no stream-ordered allocator (some virtualised GPUs)
    return nullptr;
  }
  if (cudaMemsetAsync(ptr, 0, bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaFreeAsync(ptr, stream);
    (void)cudaGetLastError();
    return nullptr;
  }
  if (found >= 0) {
    if (cudaFreeAsync(slots[found].ptr, stream) != cudaSuccess) (void)cudaGetLastError();
    slots[found] = {dev, stream, kind, bytes, ptr};
  } else if (capturing == cudaStreamCaptureStatusNone && used < SLOTS) {
    slots[used++] = {dev, stream, kind, bytes, ptr};
  } else {
    owned = true;
  }
  return ptr;
}

// The dynamic schedule's counter for a launch on `stream` (stream_buffer's kind 0).
[[maybe_unused]] static int* stream_counter(cudaStream_t stream, bool& owned) {
  return static_cast<int*>(stream_buffer(stream, 0, 2 * sizeof(int), owned));
}

// A call's shape and where its tensors lie: q and the output (B, H, S, D), k and v (B, Hkv, S,
// D), H a multiple of Hkv, each with its element strides (the last dim dense).
struct Call {
  int B, H, Hkv, S;
  Strides q, k, v, o;
};

// The call of dense (B, H, S, D) tensors, k and v with q's heads.
static Call dense_call(int B, int H, int S, int D) {
  const Strides st{(long long)H * S * D, (long long)S * D, D};
  return {B, H, H, S, st, st, st, st};
}

template <typename T, int D, int BN, bool OV, int QB>
static int launch_ws(const void* q, const void* k, const void* v, void* out, const Call& c,
                     int causal, float scale, cudaStream_t stream) {
  const int S = c.S, BH = c.B * c.H;
  static_assert(ws_stages<D>() >= 2 && ws_stages<D>() <= 4, "WS_STAGES_D* must be 2, 3 or 4");
#ifndef WGF_ALLOW_OVERSIZED_SMEM   // the probe builds settings that do not fit, to report them
  // A ring too deep for a Hopper block (227 KB of dynamic shared memory) fails the build, not
  // every call on the GPU: instantiated only for a head dim whose WARP_SPECIALIZE_D* is on.
  static_assert(WsSmem<D, BN, QB>::bytes <= 232448,
                "WS_STAGES_D* too deep for this head dim's tiles (BLOCK_N_D*, TMA_STORE_MAX_S, "
                "Q_DOUBLE_MAX_S_D*): "
                "the warp-specialised kernel's shared memory exceeds 227 KB");
#endif
  const size_t smem = WsSmem<D, BN, QB>::bytes;
  // Set on every call, as launch_wgmma does: a per-device cache would go stale after a
  // cudaDeviceReset, and the call costs well under a microsecond of host time.
  cudaError_t err = cudaFuncSetAttribute(wgmma_ws_kernel<T, D, BN, OV, QB>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) {                   // too many stages for this GPU: fail cleanly (and
    (void)cudaGetLastError();                 // clear the error for the next call)
    return (int)err;
  }
  if (tensor_map_encoder() == nullptr) return (int)cudaErrorNotSupported;   // driver too old
  // The TMA-store epilogue for sequences up to TMA_STORE_MAX_S (with OVERLAP_D128 on and the
  // skipped rescales, up to S=4096 gained 1.4-2% at D=128 over the four default configs
  // against up to S=1024, H100; without them it had lost 5-6% at S=4096).
  const int tma_store = TMA_STORE_MAX_S > 0 && S <= TMA_STORE_MAX_S;
  CUtensorMap tq, tk, tv, to{};               // to: the output's, used only with tma_store
  constexpr int BLOCK_M = ws_block_m<D>();
  if (!make_tensor_map<T>(&tq, q, c.B, c.H, S, D, c.q, BLOCK_M) ||
      !make_tensor_map<T>(&tk, k, c.B, c.Hkv, S, D, c.k, BN) ||
      !make_tensor_map<T>(&tv, v, c.B, c.Hkv, S, D, c.v, BN) ||
      (tma_store && !make_tensor_map<T>(&to, out, c.B, c.H, S, D, c.o, 64)))
    return (int)cudaErrorInvalidValue;        // the driver refused a map (shape or alignment)
  const HeadLayout lay{c.H, c.H / c.Hkv, c.o.b, c.o.h, c.o.s};
  const long long items = (long long)((S + BLOCK_M - 1) / BLOCK_M) * BH;
  long long blocks = items;
  const bool persistent = D == 64 ? PERSISTENT_D64 : PERSISTENT_D128;
  if (persistent) {
    // One block per SM, each looping over work items (the kernel's item loop).
    int dev = 0, sms = 0;
    if ((err = cudaGetDevice(&dev)) != cudaSuccess ||
        (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) {
      (void)cudaGetLastError();               // not left for the next call's launch check
      return (int)err;
    }
    blocks = items < sms ? items : sms;
  }
  if (items + blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  // The work-item counter of a dynamic schedule (see stream_counter); where none can be had, the
  // call takes the fixed stride instead.
  bool owned = false;
  int* counter =
      persistent && causal && PERSISTENT_DYNAMIC ? stream_counter(stream, owned) : nullptr;
  // SPLIT_TAIL_D64: the fixed stride's last wave, items % blocks of them, split by key tiles
  // (tail_parts). At (1,32,4096,64) 44 blocks ran a sixth item while 88 idled; in thirds, 132
  // parts end the call together. Where no workspace can be had, the call is not split.
  TailSplit split{nullptr, nullptr, 1, (int)items};
  bool split_owned = false;
  const int parts =
      splits_tail(D) && persistent && !causal ? tail_parts(items, blocks, (S + BN - 1) / BN) : 1;
  if (parts > 1) {
    // The tickets first, 16 per block whatever the head dim (at most 12 consumer warps), so
    // that no call's partial outputs overlap another's tickets in the stream's buffer.
    constexpr int NCT = WG_THREADS * ws_consumers<D>();   // consumer threads
    static_assert(NCT / 32 <= 16, "a ticket per consumer warp");
    const long long rest = items % blocks;
    const size_t tickets = (size_t)blocks * 16 * sizeof(int);
    const size_t bytes = tickets + (size_t)rest * parts * (D / 2 + 4) * NCT * sizeof(float);
    char* buf = static_cast<char*>(stream_buffer(stream, 1, bytes, split_owned));
    if (buf != nullptr)
      split = {reinterpret_cast<float*>(buf + tickets), reinterpret_cast<int*>(buf), parts,
               (int)(items - rest)};
  }
  wgmma_ws_kernel<T, D, BN, OV, QB><<<(unsigned)blocks, ws_threads<D>(), smem, stream>>>(
      tq, tk, tv, to, (T*)out, BH, S, causal, scale * LOG2E, counter, tma_store,
      heads_per_section<D>(BH, S, causal), lay, split);
  err = cudaGetLastError();
  if (owned && cudaFreeAsync(counter, stream) != cudaSuccess) {
    (void)cudaGetLastError();                 // a leaked 8 bytes, not a failed call
  }
  if (split_owned && cudaFreeAsync(split.tickets, stream) != cudaSuccess) (void)cudaGetLastError();
  return (int)err;

}

// Compute-capability major of the current device (cached per device), or -1 on error.
static int device_major() {
  static int cached[64];                      // 0: not yet asked
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  if (dev >= 0 && dev < 64 && cached[dev] != 0) return cached[dev];
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return -1;
  if (dev >= 0 && dev < 64) cached[dev] = major;
  return major;
}

// Writes whether the code this GPU runs was compiled with wgmma (the sm_90a pass).
__global__ void wgmma_probe_kernel(int* built) { *built = WGF_SM90A; }

// 1 if this device's code has the wgmma kernel, 0 if not, a negative cudaError_t on error;
// asked once per device (one tiny launch and copy, on the first call).
static int wgmma_built() {
  static int cached[64];                      // 0: not yet asked, 1: yes, 2: no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -(int)cudaErrorInvalidDevice;
  if (dev >= 0 && dev < 64 && cached[dev] != 0) return cached[dev] == 1;
  int* flag = nullptr;
  int built = 0;
  cudaError_t err = cudaMalloc(&flag, sizeof(int));
  if (err == cudaSuccess) {
    wgmma_probe_kernel<<<1, 1>>>(flag);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&built, flag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(flag);
  }
  if (err != cudaSuccess) return -(int)err;
  if (dev >= 0 && dev < 64) cached[dev] = built ? 1 : 2;
  return built != 0;
}

// What evoattn_sdpa_strided returns for a call this build does not take, so that its caller
// runs another kernel: views and grouped k/v need the warp-specialised path of their head dim
// (WARP_SPECIALIZE_D*), a Hopper GPU built for sm_90a, 16-bit data, and 16-byte aligned
// pointers and strides; every other path reads dense tensors only.
constexpr int NOT_TAKEN = 1000;

// A 16-bit call on head dim D's path: warp-specialised (WS; two q tiles for S up to Q2_MAX_S)
// or, for dense tensors only, cp.async. if constexpr: only the path a head dim takes is
// instantiated (and size-checked).
template <typename T, int D, int BN, bool OV, bool WS, int Q2_MAX_S>
static int launch_head_dim(const void* q, const void* k, const void* v, void* out, const Call& c,
                           int causal, float scale, cudaStream_t stream, bool dense) {
  if constexpr (WS) {
    if constexpr (Q2_MAX_S > 0)
      if (c.S <= Q2_MAX_S)
        return launch_ws<T, D, BN, OV, 2>(q, k, v, out, c, causal, scale, stream);
    return launch_ws<T, D, BN, OV, 1>(q, k, v, out, c, causal, scale, stream);
  } else {
    return dense ? launch_wgmma<T, D, OV>(q, k, v, out, c.B * c.H, c.S, causal, scale, stream)
                 : NOT_TAKEN;
  }
}

template <typename T>
static int run(const void* q, const void* k, const void* v, void* out, const Call& c, int D,
               int causal, float scale, cudaStream_t stream, bool dense) {
  const int BH = c.B * c.H, S = c.S;
  const bool aligned = ((uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)out) % 16 == 0;
  if constexpr (!std::is_same<T, float>::value) {
    // Hopper, 16-bit, aligned: always the wgmma kernel (never silently the fallback).
    if (aligned && device_major() == 9) {
      const int built = wgmma_built();
      if (built < 0) return -built;
      if (built == 0) return dense ? (int)cudaErrorInvalidDeviceFunction : NOT_TAKEN;
      if (D == 64)
        return launch_head_dim<T, 64, BLOCK_N_D64, OVERLAP_D64, WARP_SPECIALIZE_D64 != 0,
                               Q_DOUBLE_MAX_S_D64>(q, k, v, out, c, causal, scale, stream, dense);
      return launch_head_dim<T, 128, BLOCK_N_D128, OVERLAP_D128, WARP_SPECIALIZE_D128 != 0,
                             Q_DOUBLE_MAX_S_D128>(q, k, v, out, c, causal, scale, stream, dense);
    }
  }
  if (!dense) return NOT_TAKEN;
  if (D == 64)
    return launch_cuda_core<T, 64, FB_BLOCK_M, FB_BLOCK_N, FB_THREADS>(q, k, v, out, BH, S, causal,
                                                                       scale, stream);
  return launch_cuda_core<T, 128, FB_BLOCK_M, FB_BLOCK_N, FB_THREADS>(q, k, v, out, BH, S, causal,
                                                                      scale, stream);
}

// The shape checks both entries share: whether (B, H, S, D) is a call either could take.
static bool shape_ok(int B, int H, int S, int D) {
  return B >= 1 && H >= 1 && S >= 1 && (D == 64 || D == 128) &&
         S <= 0x7fffffff - 256 &&                 // S + BLOCK_M - 1 must fit in int
         (long long)B * H <= 0x7fffffffLL;
}

extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  if (!shape_ok(B, H, S, D)) return (int)cudaErrorInvalidValue;
  const Call c = dense_call(B, H, S, D);
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return run<__half>(q, k, v, out, c, D, causal, scale, st, true);
    case 1: return run<__nv_bfloat16>(q, k, v, out, c, D, causal, scale, st, true);
    case 2: return run<float>(q, k, v, out, c, D, causal, scale, st, true);
    default: return (int)cudaErrorInvalidValue;
  }
}

// evoattn_sdpa for views and grouped k/v (transformers passes (B, S, H, D) storage viewed as
// (B, H, S, D), and k, v with Hkv heads, each serving H / Hkv consecutive query heads): the same
// attention, each tensor read or written where it lies. `strides` holds 12 element strides,
// (batch, head, row) of q, k, v and out in that order; every last dim is dense. Returns
// NOT_TAKEN (nothing launched) where this build cannot take the call, see above.
extern "C" int evoattn_sdpa_strided(const void* q, const void* k, const void* v, void* out,
                                    int B, int H, int Hkv, int S, int D, int dtype, int causal,
                                    float scale, const long long* strides, void* stream) {
  if (!shape_ok(B, H, S, D) || Hkv < 1 || H % Hkv != 0) return (int)cudaErrorInvalidValue;
  for (int i = 0; i < 12; ++i)   // 16 bytes, TMA's unit (and no broadcast, stride 0)
    if (strides[i] < 8 || strides[i] % 8 != 0) return NOT_TAKEN;
  const Call c{B, H, Hkv, S, {strides[0], strides[1], strides[2]},
               {strides[3], strides[4], strides[5]}, {strides[6], strides[7], strides[8]},
               {strides[9], strides[10], strides[11]}};
  cudaStream_t st = (cudaStream_t)stream;
  int rc = NOT_TAKEN;
  if (dtype == 0) rc = run<__half>(q, k, v, out, c, D, causal, scale, st, false);
  if (dtype == 1) rc = run<__nv_bfloat16>(q, k, v, out, c, D, causal, scale, st, false);
  // A tensor map the driver refused (strides it does not take) is nothing launched either.
  return rc == (int)cudaErrorInvalidValue ? NOT_TAKEN : rc;
}

// 1 if evoattn_sdpa_strided takes aligned 16-bit calls of head dim D on the current device (its
// head dim's path is warp-specialised, the GPU a Hopper with this build's sm_90a code), else 0.
extern "C" int evoattn_sdpa_strided_ready(int D) {
  const bool ws = D == 64 ? WARP_SPECIALIZE_D64 != 0 : D == 128 && WARP_SPECIALIZE_D128 != 0;
  return ws && device_major() == 9 && wgmma_built() == 1;
}
