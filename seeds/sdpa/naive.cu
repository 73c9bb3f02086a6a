// naive.cu: three-kernel attention, the simplest correct CUDA seed for `sdpa`.
//
//   kernel 1  scores[bh, i, j] = (q[bh, i, :] . k[bh, j, :]) * scale      (float scratch)
//   kernel 2  row softmax of scores in place, causal entries j > i set to 0
//   kernel 3  out[bh, i, :] = sum_j scores[bh, i, j] * v[bh, j, :]
//
// Knobs: SCORE_THREADS, SOFTMAX_THREADS, PV_THREADS (threads per block of each kernel).
// Limits: needs a B*H*S*S float scratch buffer (cudaMallocAsync on the given stream; 4.3 GB
// at B=4, H=16, S=4096) and reads k/v from global memory with no reuse: slow by design.
// Any S >= 1, D in {64, 128}, dtypes float16 / bfloat16 / float32, fp32 accumulation.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stddef.h>

#define SCORE_THREADS 256  // evoattn: choice(128, 256, 512)
#define SOFTMAX_THREADS 256  // evoattn: choice(64, 128, 256, 512)
#define PV_THREADS 128  // evoattn: choice(64, 128, 256)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// One thread per score; grid-stride over all B*H*S*S entries (row-major, j fastest).
template <typename T>
__global__ void __launch_bounds__(SCORE_THREADS)
scores_kernel(const T* __restrict__ q, const T* __restrict__ k, float* __restrict__ scores,
              long long BH, int S, int D, int causal, float scale) {
  const long long total = BH * S * (long long)S;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const int j = (int)(idx % S);
    const long long row = idx / S;            // bh * S + i
    const int i = (int)(row % S);
    if (causal && j > i) continue;            // masked: kernel 2 never reads it
    const T* qr = q + row * D;
    const T* kr = k + (row - i + j) * D;      // same bh, key j
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += to_f32(qr[d]) * to_f32(kr[d]);
    scores[idx] = acc * scale;
  }
}

// Returns the block-wide reduction (max or sum) of x; every thread gets the result.
template <bool IS_MAX>
__device__ float block_reduce(float x, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = IS_MAX ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nwarps = blockDim.x / 32;
  __syncthreads();                            // red may still be read by a previous call
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < nwarps; ++w) r = IS_MAX ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// One block per (bh, i) row: softmax over the row's valid prefix, zeros after it.
__global__ void __launch_bounds__(SOFTMAX_THREADS)
softmax_kernel(float* __restrict__ scores, long long rows, int S, int causal) {
  __shared__ float red[SOFTMAX_THREADS / 32];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    float* p = scores + row * S;
    const int n = causal ? (int)(row % S) + 1 : S;   // valid keys: 0 .. n-1
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, p[j]);
    m = block_reduce<true>(m, red);
    float l = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const float e = expf(p[j] - m);
      p[j] = e;
      l += e;
    }
    l = block_reduce<false>(l, red);
    const float inv = 1.f / l;                 // l >= 1: the max element contributes exp(0)
    for (int j = threadIdx.x; j < S; j += blockDim.x) p[j] = j < n ? p[j] * inv : 0.f;
  }
}

// One block per (bh, i) row; threads stride over D.
template <typename T>
__global__ void __launch_bounds__(PV_THREADS)
pv_kernel(const float* __restrict__ probs, const T* __restrict__ v, T* __restrict__ out,
          long long rows, int S, int D, int causal) {
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* p = probs + row * S;
    const int i = (int)(row % S);
    const int n = causal ? i + 1 : S;
    const T* vb = v + (row - i) * D;          // v[bh, 0, :]
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.f;
      for (int j = 0; j < n; ++j) acc += p[j] * to_f32(vb[(long long)j * D + d]);
      out[row * D + d] = from_f32<T>(acc);
    }
  }
}

static unsigned grid_for(long long work, int per_block) {
  const long long blocks = (work + per_block - 1) / per_block;
  return (unsigned)(blocks < (1LL << 30) ? blocks : (1LL << 30));   // kernels grid-stride
}

template <typename T>
static int run(const void* q, const void* k, const void* v, void* out, int B, int H, int S,
               int D, int causal, float scale, cudaStream_t stream) {
  const long long BH = (long long)B * H, rows = BH * S;
  float* scores = nullptr;
  cudaError_t err = cudaMallocAsync((void**)&scores, (size_t)rows * S * sizeof(float), stream);
  if (err != cudaSuccess) return (int)err;
  scores_kernel<T><<<grid_for(rows * S, SCORE_THREADS), SCORE_THREADS, 0, stream>>>(
      (const T*)q, (const T*)k, scores, BH, S, D, causal, scale);
  softmax_kernel<<<grid_for(rows, 1), SOFTMAX_THREADS, 0, stream>>>(scores, rows, S, causal);
  pv_kernel<T><<<grid_for(rows, 1), PV_THREADS, 0, stream>>>(scores, (const T*)v, (T*)out,
                                                              rows, S, D, causal);
  err = cudaGetLastError();                   // a failed launch, reported before the free
  const cudaError_t ferr = cudaFreeAsync(scores, stream);
  if (err != cudaSuccess) return (int)err;
  return (int)(ferr != cudaSuccess ? ferr : cudaGetLastError());
}

extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  static_assert(SCORE_THREADS % 32 == 0 && SOFTMAX_THREADS % 32 == 0 && PV_THREADS % 32 == 0,
                "thread counts must be whole warps");
  if (B < 1 || H < 1 || S < 1 || (D != 64 && D != 128)) return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return run<__half>(q, k, v, out, B, H, S, D, causal, scale, st);
    case 1: return run<__nv_bfloat16>(q, k, v, out, B, H, S, D, causal, scale, st);
    case 2: return run<float>(q, k, v, out, B, H, S, D, causal, scale, st);
    default: return (int)cudaErrorInvalidValue;
  }
}
