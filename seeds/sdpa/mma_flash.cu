// mma_flash.cu: tensor-core flash attention (FA2-style) with mma.sync m16n8k16, seed for `sdpa`.
//
// float16 / bfloat16: each block owns BLOCK_M = 16 * NUM_WARPS query rows of one (b, h); each
// warp owns 16 of them. The warp's q fragments stay in registers for the whole kernel; k and v
// tiles of BLOCK_N keys are staged in shared memory (double-buffered with cp.async when
// USE_CP_ASYNC is 1). Scores S = q k^T and the output O += P v are mma.sync.m16n8k16 with fp32
// accumulators; the online softmax runs in registers in log2 units (scale * log2(e) folded
// into one multiply, exp2f). Causal (top-left: query i sees keys 0..i): key tiles after the
// block's last row are never loaded, a warp skips tiles after its own last row, and the mask
// is applied only to tiles that cross the diagonal or the end of the sequence.
// float32 inputs, and pointers that are not 16-byte aligned, take the CUDA-core fallback
// (FA1-style, the `fused` seed's kernel with fixed tiles) of cuda_core_flash.cuh.
//
// Knobs: NUM_WARPS (BLOCK_M = 16 * NUM_WARPS), BLOCK_N (keys per tile), USE_CP_ASYNC.
// Limits: needs sm_80+ (mma.sync bf16, cp.async); P is rounded to the input dtype before the
// P v product (as FlashAttention does). Any S >= 1, D in {64, 128}, fp32 accumulation.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <type_traits>
// evoattn: companion cuda_core_flash.cuh
#include "cuda_core_flash.cuh"  // the CUDA-core fallback (float32, misaligned pointers)

#define NUM_WARPS 4  // evoattn: choice(2, 4, 8)
#define BLOCK_N 64  // evoattn: choice(32, 64, 128)
#define USE_CP_ASYNC 1  // evoattn: choice(1, 0)

#define FB_BLOCK_M 32    // fallback (fp32) tiles; fixed, not knobs
#define FB_BLOCK_N 32
#define FB_THREADS 128

constexpr float LOG2E = 1.4426950408889634f;  // 1/ln 2: exp(x) == exp2(x * LOG2E)
constexpr int BLOCK_M = 16 * NUM_WARPS;
constexpr int THREADS = 32 * NUM_WARPS;

// ---- tensor-core path (float16 / bfloat16) ------------------------------------------
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D(16x8) = A(16x16) * B(16x8) + C.
// Per lane: g = lane / 4 (group), t = lane % 4 (thread in group). Each .b32 register holds two
// 16-bit elements, the lower-indexed one in the low half.
//   A (4 regs, row-major m x k): a[0] = (m=g,   k=2t..2t+1)   a[1] = (m=g+8, k=2t..2t+1)
//                                a[2] = (m=g,   k=2t+8..+9)   a[3] = (m=g+8, k=2t+8..+9)
//   B (2 regs, k x n):           b[0] = (k=2t..2t+1, n=g)     b[1] = (k=2t+8..+9, n=g)
//   C/D (4 fp32):                c[0..1] = (m=g, n=2t..2t+1)  c[2..3] = (m=g+8, n=2t..2t+1)
// So for S = q k^T, B[k][n] = k_tile[key n][dim k]: two consecutive dims of one key, a single
// 32-bit load from the row-major k tile. For O = P v, B[k][n] = v_tile[key k][dim n]: two keys
// of one dim, packed from two 16-bit loads. The C fragments of two adjacent n8 score tiles
// are exactly the A fragment of P for one k16 step (FlashAttention-2's register reuse).

template <bool BF16>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

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

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
  const int src_bytes = valid ? 16 : 0;       // 0: nothing read, 16 zero bytes written
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <int D> struct MmaSmem {
  static constexpr int LD = D + 8;            // row stride in halves: 16-byte rows, no conflicts
  static constexpr int TILE = BLOCK_N * LD;   // one k or v tile, in 16-bit elements
  static constexpr int STAGES = USE_CP_ASYNC ? 2 : 1;
  static constexpr size_t bytes = (size_t)STAGES * 2 * TILE * sizeof(uint16_t);
};

// Copies keys n0 .. n0+BLOCK_N-1 of k and v (rows of D 16-bit values) into a stage; rows past
// S are zero-filled so they can never inject NaN/Inf into the products.
template <int D>
__device__ __forceinline__ void load_kv(uint16_t* ks, uint16_t* vs, const uint16_t* kb,
                                        const uint16_t* vb, int n0, int S) {
  constexpr int CHUNKS = D / 8;               // 16-byte chunks per row
  constexpr int LD = MmaSmem<D>::LD;
  for (int idx = threadIdx.x; idx < BLOCK_N * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c8 = (idx % CHUNKS) * 8, key = n0 + r;
    const bool valid = key < S;
    const long long off = valid ? (long long)key * D + c8 : 0;   // clamp to a valid address
    if constexpr (USE_CP_ASYNC) {
      cp_async16(ks + r * LD + c8, kb + off, valid);
      cp_async16(vs + r * LD + c8, vb + off, valid);
    } else {
      const uint4 z = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(ks + r * LD + c8) =
          valid ? *reinterpret_cast<const uint4*>(kb + off) : z;
      *reinterpret_cast<uint4*>(vs + r * LD + c8) =
          valid ? *reinterpret_cast<const uint4*>(vb + off) : z;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
mma_flash_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 T* __restrict__ out, int BH, int S, int causal, float scale_log2) {
  constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
  constexpr int LD = MmaSmem<D>::LD, TILE = MmaSmem<D>::TILE;
  constexpr int KSTEPS = D / 16;              // k16 steps of q k^T
  constexpr int NT = BLOCK_N / 8;             // n8 score tiles per key tile
  constexpr int DT = D / 8;                   // n8 output tiles
  extern __shared__ __align__(16) uint16_t smem_u16[];

  const int n_mblocks = (S + BLOCK_M - 1) / BLOCK_M;
  const int mb = n_mblocks - 1 - (int)(blockIdx.x / BH);   // heavy causal blocks first
  const long long bh = blockIdx.x % BH;
  const int m0 = mb * BLOCK_M;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wrow0 = m0 + warp * 16;           // the warp's first query row
  const int row_a = wrow0 + g, row_b = row_a + 8;   // this lane's two rows
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k) + bh * S * D;
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v) + bh * S * D;

  // q fragments (16 rows x D) in registers; rows past S are zeros.
  uint32_t qf[KSTEPS][4];
  {
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + bh * S * D;
    const uint32_t* qa = reinterpret_cast<const uint32_t*>(qb + (long long)row_a * D);
    const uint32_t* qc = reinterpret_cast<const uint32_t*>(qb + (long long)row_b * D);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int w = (ks * 16 + 2 * t) / 2;    // 32-bit word index within the row
      qf[ks][0] = row_a < S ? qa[w] : 0u;
      qf[ks][1] = row_b < S ? qc[w] : 0u;
      qf[ks][2] = row_a < S ? qa[w + 4] : 0u;
      qf[ks][3] = row_b < S ? qc[w + 4] : 0u;
    }
  }
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};    // rows row_a, row_b (log2 units)
  float l_run[2] = {0.f, 0.f};                // this lane's partial row sums

  const int n_end = causal ? min(S, m0 + BLOCK_M) : S;
  const int ntiles = (n_end + BLOCK_N - 1) / BLOCK_N;
  if constexpr (USE_CP_ASYNC) {
    load_kv<D>(smem_u16, smem_u16 + TILE, kb, vb, 0, S);
    cp_async_commit();
  }
  for (int it = 0; it < ntiles; ++it) {
    const int n0 = it * BLOCK_N;
    const int stage = USE_CP_ASYNC ? (it & 1) : 0;
    if constexpr (USE_CP_ASYNC) {
      if (it + 1 < ntiles) {                  // prefetch the next tile into the other stage
        uint16_t* nxt = smem_u16 + ((it + 1) & 1) * 2 * TILE;
        load_kv<D>(nxt, nxt + TILE, kb, vb, n0 + BLOCK_N, S);
        cp_async_commit();
        cp_async_wait<1>();                   // all but the newest group: tile `it` landed
      } else {
        cp_async_wait<0>();
      }
    } else {
      load_kv<D>(smem_u16, smem_u16 + TILE, kb, vb, n0, S);
    }
    __syncthreads();
    const uint16_t* ks = smem_u16 + stage * 2 * TILE;
    const uint16_t* vs = ks + TILE;
    const bool active = wrow0 < S && !(causal && n0 > wrow0 + 15);
    if (active) {
      // S = q k^T for 16 rows x BLOCK_N keys.
      float s[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(ks + (nt * 8 + g) * LD);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
          mma16816<BF16>(s[nt], qf[kk], krow[kk * 8 + t], krow[kk * 8 + 4 + t]);
      }
      const bool need_mask = n0 + BLOCK_N > S || (causal && n0 + BLOCK_N - 1 > wrow0);
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[nt][e] * scale_log2;
          if (need_mask) {
            const int key = n0 + nt * 8 + 2 * t + (e & 1);
            const int row = e < 2 ? row_a : row_b;
            if (key >= S || (causal && key > row)) x = -INFINITY;
          }
          s[nt][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {           // the 4 lanes of a group share the row
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;   // nothing seen yet: p = 0, alpha = 0
        alpha[h] = exp2f(m_run[h] - m_use[h]);
        m_run[h] = m_new;
        l_run[h] *= alpha[h];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(s[nt][e] - m_use[e >> 1]);
          s[nt][e] = p;
          l_run[e >> 1] += p;
        }
      }
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= alpha[0]; o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1]; o[dt][3] *= alpha[1];
      }
      // O += P v, one k16 step (16 keys) at a time.
#pragma unroll
      for (int j = 0; j < BLOCK_N / 16; ++j) {
        const uint32_t pa[4] = {pack2<T>(s[2 * j][0], s[2 * j][1]),
                                pack2<T>(s[2 * j][2], s[2 * j][3]),
                                pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]),
                                pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3])};
        const uint16_t* v0 = vs + (j * 16 + 2 * t) * LD + g;   // key j*16+2t, dim g
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          const uint16_t* vp = v0 + dt * 8;
          const uint32_t b0 = (uint32_t)vp[0] | ((uint32_t)vp[LD] << 16);
          const uint32_t b1 = (uint32_t)vp[8 * LD] | ((uint32_t)vp[9 * LD] << 16);
          mma16816<BF16>(o[dt], pa, b0, b1);
        }
      }
    }
    __syncthreads();                          // this stage may be overwritten next
  }

  // Full row sums across the group's 4 lanes, then normalise and store two dims per lane.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }
  uint32_t* ob = reinterpret_cast<uint32_t*>(out + bh * S * D);
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int w = (dt * 8 + 2 * t) / 2;
    if (row_a < S) ob[((long long)row_a * D) / 2 + w] = pack2<T>(o[dt][0] * inv[0], o[dt][1] * inv[0]);
    if (row_b < S) ob[((long long)row_b * D) / 2 + w] = pack2<T>(o[dt][2] * inv[1], o[dt][3] * inv[1]);
  }
}

template <typename T, int D>
static int launch_mma(const void* q, const void* k, const void* v, void* out, int BH, int S,
                      int causal, float scale, cudaStream_t stream) {
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of the k16 step");
  const size_t smem = MmaSmem<D>::bytes;
  cudaError_t err = cudaFuncSetAttribute(mma_flash_kernel<T, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return (int)err;    // tiles too large for this GPU: fail cleanly
  const long long blocks = (long long)((S + BLOCK_M - 1) / BLOCK_M) * BH;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  mma_flash_kernel<T, D><<<(unsigned)blocks, THREADS, smem, stream>>>(
      (const T*)q, (const T*)k, (const T*)v, (T*)out, BH, S, causal, scale * LOG2E);
  return (int)cudaGetLastError();
}

template <typename T>
static int run(const void* q, const void* k, const void* v, void* out, int BH, int S, int D,
               int causal, float scale, cudaStream_t stream) {
  const bool aligned = ((uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)out) % 16 == 0;
  if constexpr (!std::is_same<T, float>::value) {
    if (aligned) {
      if (D == 64) return launch_mma<T, 64>(q, k, v, out, BH, S, causal, scale, stream);
      return launch_mma<T, 128>(q, k, v, out, BH, S, causal, scale, stream);
    }
  }
  if (D == 64)
    return launch_cuda_core<T, 64, FB_BLOCK_M, FB_BLOCK_N, FB_THREADS>(q, k, v, out, BH, S, causal,
                                                                       scale, stream);
  return launch_cuda_core<T, 128, FB_BLOCK_M, FB_BLOCK_N, FB_THREADS>(q, k, v, out, BH, S, causal,
                                                                      scale, stream);
}

extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  if (B < 1 || H < 1 || S < 1 || (D != 64 && D != 128)) return (int)cudaErrorInvalidValue;
  if ((long long)B * H > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  const int BH = B * H;
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return run<__half>(q, k, v, out, BH, S, D, causal, scale, st);
    case 1: return run<__nv_bfloat16>(q, k, v, out, BH, S, D, causal, scale, st);
    case 2: return run<float>(q, k, v, out, BH, S, D, causal, scale, st);
    default: return (int)cudaErrorInvalidValue;
  }
}
