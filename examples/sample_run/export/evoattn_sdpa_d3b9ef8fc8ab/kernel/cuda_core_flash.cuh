// cuda_core_flash.cuh: flash attention on CUDA cores (FA1-style), shared by the CUDA seeds.
//
// The `fused` seed's kernel, and the float32 / misaligned-pointer fallback of the tensor-core
// seeds (mma_flash.cu, wgmma_flash.cu), which name it as a companion file.
// Each block owns BM query rows of one (b, h). q (pre-scaled by scale*log2(e)) stays in shared
// memory; the block walks the keys in tiles of BN, staging k and v in shared memory as float,
// and keeps an online softmax (running max m, running sum l per row) so the S x S score matrix
// is never materialised. The output accumulator lives in registers: thread t owns the flat
// (row, d) indices t, t + NT, ... of the BM x D tile. Causal: key tiles that start after the
// block's last row are skipped; the mask is applied element-wise (top-left aligned: query i
// sees keys 0..i). No tensor cores, fp32 shared tiles (the opt-in shared-memory limit is
// raised with cudaFuncSetAttribute; tiles that do not fit return the CUDA error). Any S >= 1,
// D in {64, 128}, float16 / bfloat16 / float32, fp32 accumulation.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>

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
template <int D, int BM, int BN> struct CudaCoreSmem {
  static constexpr int KLD = D + 1;           // k tile row stride
  static constexpr int SLD = BN + 1;     // score tile row stride
  static constexpr int q = 0;                          // [BM][D]
  static constexpr int k = q + BM * D;            // [BN][KLD]
  static constexpr int v = k + BN * KLD;          // [BN][D]
  static constexpr int s = v + BN * D;            // [BM][SLD] scores, then p
  static constexpr int alpha = s + BM * SLD;      // [BM] rescale of the tile
  static constexpr int total = alpha + BM;
  static constexpr size_t bytes = total * sizeof(float);
};

template <typename T, int D, int BM, int BN, int NT>
__global__ void __launch_bounds__(NT)
cuda_core_flash_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* __restrict__ out, int BH, int S, int causal, float scale_log2) {
  using L = CudaCoreSmem<D, BM, BN>;
  constexpr int NWARPS = NT / 32;
  constexpr int OPT = (BM * D + NT - 1) / NT;  // outputs per thread
  extern __shared__ float smem[];
  float* qs = smem + L::q;
  float* ks = smem + L::k;
  float* vs = smem + L::v;
  float* ss = smem + L::s;
  float* alpha_s = smem + L::alpha;

  // Heavy (late) causal row blocks first: block x -> (row block, bh), bh fastest.
  const int n_mblocks = (S + BM - 1) / BM;
  const int mb = n_mblocks - 1 - (int)(blockIdx.x / BH);
  const long long bh = blockIdx.x % BH;
  const int m0 = mb * BM;
  const T* qb = q + bh * S * D;
  const T* kb = k + bh * S * D;
  const T* vb = v + bh * S * D;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  for (int idx = tid; idx < BM * D; idx += NT) {
    const int r = idx / D, row = m0 + r;
    qs[idx] = row < S ? to_f32(qb[(long long)row * D + idx % D]) * scale_log2 : 0.f;
  }
  float acc[OPT];
#pragma unroll
  for (int o = 0; o < OPT; ++o) acc[o] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;       // meaningful in lane 0 of the row's warp

  const int n_end = causal ? min(S, m0 + BM) : S;   // keys beyond are masked for all rows
  for (int n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();                          // previous tile fully consumed
    for (int idx = tid; idx < BN * D; idx += NT) {
      const int c = idx / D, d = idx % D, key = n0 + c;
      const bool in = key < S;                // out-of-range keys: zeros, never NaN garbage
      ks[c * L::KLD + d] = in ? to_f32(kb[(long long)key * D + d]) : 0.f;
      vs[c * D + d] = in ? to_f32(vb[(long long)key * D + d]) : 0.f;
    }
    __syncthreads();
    // Scores in log2 units; masked entries are -inf.
    for (int idx = tid; idx < BM * BN; idx += NT) {
      const int r = idx / BN, c = idx % BN;
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
    for (int r = warp; r < BM; r += NWARPS) {
      float* sr = ss + r * L::SLD;
      float mx = -INFINITY;
      for (int c = lane; c < BN; c += 32) mx = fmaxf(mx, sr[c]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      // Rows r, r+NWARPS, ... of this warp: keep their (m, l) in lanes r / NWARPS (<= 32 rows).
      const int slot = r / NWARPS;
      const float m_old = __shfl_sync(0xffffffffu, m_run, slot);
      const float l_old = __shfl_sync(0xffffffffu, l_run, slot);
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;   // fully masked so far: p = 0
      float sum = 0.f;
      for (int c = lane; c < BN; c += 32) {
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
      const int idx = tid + o * NT;
      if (idx < BM * D) {
        const int r = idx / D, d = idx % D;
        const float* pr = ss + r * L::SLD;
        float a = acc[o] * alpha_s[r];
#pragma unroll 8
        for (int c = 0; c < BN; ++c) a += pr[c] * vs[c * D + d];
        acc[o] = a;
      }
    }
  }
  // Publish the final row sums, then normalise and store.
  __syncthreads();
  for (int r = warp; r < BM; r += NWARPS) {
    const float l = __shfl_sync(0xffffffffu, l_run, r / NWARPS);
    if (lane == 0) alpha_s[r] = l > 0.f ? 1.f / l : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int o = 0; o < OPT; ++o) {
    const int idx = tid + o * NT;
    const int r = idx / D, row = m0 + r;
    if (idx < BM * D && row < S)
      out[bh * S * D + (long long)row * D + idx % D] = from_f32<T>(acc[o] * alpha_s[r]);
  }
}

// Launches the kernel on `stream`; returns 0 or a cudaError_t code. scale: softmax's, unfolded.
template <typename T, int D, int BM, int BN, int NT>
static int launch_cuda_core(const void* q, const void* k, const void* v, void* out, int BH,
                            int S, int causal, float scale, cudaStream_t stream) {
  static_assert(NT % 32 == 0, "NT must be whole warps");
  static_assert(BM <= 32 * (NT / 32), "one warp keeps at most 32 rows' stats");
  const size_t smem = CudaCoreSmem<D, BM, BN>::bytes;
  cudaError_t err = cudaFuncSetAttribute(cuda_core_flash_kernel<T, D, BM, BN, NT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) {                   // tiles too large for this GPU: fail cleanly,
    (void)cudaGetLastError();                 // and leave no error for the next launch check
    return (int)err;
  }
  const long long blocks = (long long)((S + BM - 1) / BM) * BH;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  cuda_core_flash_kernel<T, D, BM, BN, NT><<<(unsigned)blocks, NT, smem, stream>>>(
      (const T*)q, (const T*)k, (const T*)v, (T*)out, BH, S, causal, scale * 1.4426950408889634f);
  return (int)cudaGetLastError();
}
