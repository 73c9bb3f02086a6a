// fused.cu: one fused flash-attention kernel on CUDA cores (FA1-style), seed for `sdpa`.
//
// Each block owns BLOCK_M query rows of one (b, h). q (pre-scaled by scale*log2(e)) stays in
// shared memory; the block walks the keys in tiles of BLOCK_N, staging k and v in shared
// memory as float, and keeps an online softmax (running max m, running sum l per row) so the
// S x S score matrix is never materialised. The output accumulator lives in registers: thread
// t owns the flat (row, d) indices t, t + NUM_THREADS, ... of the BLOCK_M x D tile.
// Causal: key tiles that start after the block's last row are skipped; the mask is applied
// element-wise (top-left aligned: query i sees keys 0..i).
//
// Knobs: BLOCK_M (query rows per block), BLOCK_N (keys per tile), NUM_THREADS.
// Limits: no tensor cores, fp32 shared tiles (up to ~150 KB of shared memory; the opt-in
// limit is raised with cudaFuncSetAttribute, and a tile set that does not fit returns the
// CUDA error). Any S >= 1, D in {64, 128}, float16 / bfloat16 / float32, fp32 accumulation.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>

#define BLOCK_M 32  // evoattn: choice(16, 32, 64)
#define BLOCK_N 64  // evoattn: choice(32, 64, 128)
#define NUM_THREADS 128  // evoattn: choice(64, 128, 256)

constexpr float LOG2E = 1.4426950408889634f;  // 1/ln 2: exp(x) == exp2(x * LOG2E)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Shared-memory layout (floats), padded so that a warp reading a column is conflict-free.
template <int D> struct Smem {
  static constexpr int KLD = D + 1;           // k tile row stride
  static constexpr int SLD = BLOCK_N + 1;     // score tile row stride
  static constexpr int q = 0;                          // [BLOCK_M][D]
  static constexpr int k = q + BLOCK_M * D;            // [BLOCK_N][KLD]
  static constexpr int v = k + BLOCK_N * KLD;          // [BLOCK_N][D]
  static constexpr int s = v + BLOCK_N * D;            // [BLOCK_M][SLD] scores, then p
  static constexpr int alpha = s + BLOCK_M * SLD;      // [BLOCK_M] rescale of the tile
  static constexpr int total = alpha + BLOCK_M;
  static constexpr size_t bytes = total * sizeof(float);
};

template <typename T, int D>
__global__ void __launch_bounds__(NUM_THREADS)
fused_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* __restrict__ out, int BH, int S, int causal, float scale_log2) {
  using L = Smem<D>;
  constexpr int NWARPS = NUM_THREADS / 32;
  constexpr int OPT = (BLOCK_M * D + NUM_THREADS - 1) / NUM_THREADS;  // outputs per thread
  extern __shared__ float smem[];
  float* qs = smem + L::q;
  float* ks = smem + L::k;
  float* vs = smem + L::v;
  float* ss = smem + L::s;
  float* alpha_s = smem + L::alpha;

  // Heavy (late) causal row blocks first: block x -> (row block, bh), bh fastest.
  const int n_mblocks = (S + BLOCK_M - 1) / BLOCK_M;
  const int mb = n_mblocks - 1 - (int)(blockIdx.x / BH);
  const long long bh = blockIdx.x % BH;
  const int m0 = mb * BLOCK_M;
  const T* qb = q + bh * S * D;
  const T* kb = k + bh * S * D;
  const T* vb = v + bh * S * D;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  for (int idx = tid; idx < BLOCK_M * D; idx += NUM_THREADS) {
    const int r = idx / D, row = m0 + r;
    qs[idx] = row < S ? to_f32(qb[(long long)row * D + idx % D]) * scale_log2 : 0.f;
  }
  float acc[OPT];
#pragma unroll
  for (int o = 0; o < OPT; ++o) acc[o] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;       // meaningful in lane 0 of the row's warp

  const int n_end = causal ? min(S, m0 + BLOCK_M) : S;   // keys beyond are masked for all rows
  for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
    __syncthreads();                          // previous tile fully consumed
    for (int idx = tid; idx < BLOCK_N * D; idx += NUM_THREADS) {
      const int c = idx / D, d = idx % D, key = n0 + c;
      const bool in = key < S;                // out-of-range keys: zeros, never NaN garbage
      ks[c * L::KLD + d] = in ? to_f32(kb[(long long)key * D + d]) : 0.f;
      vs[c * D + d] = in ? to_f32(vb[(long long)key * D + d]) : 0.f;
    }
    __syncthreads();
    // Scores in log2 units; masked entries are -inf.
    for (int idx = tid; idx < BLOCK_M * BLOCK_N; idx += NUM_THREADS) {
      const int r = idx / BLOCK_N, c = idx % BLOCK_N;
      const int row = m0 + r, key = n0 + c;
      float s = -INFINITY;
      if (key < S && !(causal && key > row)) {
        s = 0.f;
        const float* qr = qs + r * D;
        const float* kr = ks + c * L::KLD;
#pragma unroll 16
        for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
      }
      ss[r * L::SLD + c] = s;
    }
    __syncthreads();
    // Online softmax: one warp per row; each row's running (m, l) stays with one warp.
    for (int r = warp; r < BLOCK_M; r += NWARPS) {
      float* sr = ss + r * L::SLD;
      float mx = -INFINITY;
      for (int c = lane; c < BLOCK_N; c += 32) mx = fmaxf(mx, sr[c]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      // Rows r, r+NWARPS, ... of this warp: keep their (m, l) in lanes r / NWARPS (<= 32 rows).
      const int slot = r / NWARPS;
      const float m_old = __shfl_sync(0xffffffffu, m_run, slot);
      const float l_old = __shfl_sync(0xffffffffu, l_run, slot);
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;   // fully masked so far: p = 0
      float sum = 0.f;
      for (int c = lane; c < BLOCK_N; c += 32) {
        const float p = exp2f(sr[c] - m_use);
        sr[c] = p;
        sum += p;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float a = exp2f(m_old - m_use);  // m_old = -inf -> 0
      if (lane == slot) { m_run = m_new; l_run = l_old * a + sum; }
      if (lane == 0) alpha_s[r] = a;
    }
    __syncthreads();
    // acc = acc * alpha + P V for the thread's (row, d) indices.
#pragma unroll
    for (int o = 0; o < OPT; ++o) {
      const int idx = tid + o * NUM_THREADS;
      if (idx < BLOCK_M * D) {
        const int r = idx / D, d = idx % D;
        const float* pr = ss + r * L::SLD;
        float a = acc[o] * alpha_s[r];
#pragma unroll 8
        for (int c = 0; c < BLOCK_N; ++c) a += pr[c] * vs[c * D + d];
        acc[o] = a;
      }
    }
  }
  // Publish the final row sums, then normalise and store.
  __syncthreads();
  for (int r = warp; r < BLOCK_M; r += NWARPS) {
    const float l = __shfl_sync(0xffffffffu, l_run, r / NWARPS);
    if (lane == 0) alpha_s[r] = l > 0.f ? 1.f / l : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int o = 0; o < OPT; ++o) {
    const int idx = tid + o * NUM_THREADS;
    const int r = idx / D, row = m0 + r;
    if (idx < BLOCK_M * D && row < S)
      out[bh * S * D + (long long)row * D + idx % D] = from_f32<T>(acc[o] * alpha_s[r]);
  }
}

template <typename T, int D>
static int launch(const void* q, const void* k, const void* v, void* out, int BH, int S,
                  int causal, float scale, cudaStream_t stream) {
  static_assert(NUM_THREADS % 32 == 0, "NUM_THREADS must be whole warps");
  static_assert(BLOCK_M <= 32 * (NUM_THREADS / 32), "one warp keeps at most 32 rows' stats");
  const size_t smem = Smem<D>::bytes;
  cudaError_t err = cudaFuncSetAttribute(fused_kernel<T, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return (int)err;    // tiles too large for this GPU: fail cleanly
  const long long blocks = (long long)((S + BLOCK_M - 1) / BLOCK_M) * BH;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  fused_kernel<T, D><<<(unsigned)blocks, NUM_THREADS, smem, stream>>>(
      (const T*)q, (const T*)k, (const T*)v, (T*)out, BH, S, causal, scale * LOG2E);
  return (int)cudaGetLastError();
}

template <typename T>
static int run(const void* q, const void* k, const void* v, void* out, int BH, int S, int D,
               int causal, float scale, cudaStream_t stream) {
  if (D == 64) return launch<T, 64>(q, k, v, out, BH, S, causal, scale, stream);
  return launch<T, 128>(q, k, v, out, BH, S, causal, scale, stream);
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
