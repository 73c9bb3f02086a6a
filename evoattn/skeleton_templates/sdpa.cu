// ${name}: an `sdpa` kernel for evoattn, in the CUDA fast form (written by `evoattn new-kernel`).
//
// What it must compute (`evoattn problems`):
${contract}
//
// Paste your kernel's body between the two "----" lines of attention_kernel; the launcher, the
// dtype dispatch and the extern "C" entry below are what evoattn calls, and can stay as they
// are. The body here is simple and correct (one thread per query row, online softmax, fp32
// accumulation) and slow: replace it. Check it with `evoattn eval ${name}` (without a GPU the
// file is only compiled, exit 6). THREADS is a knob: its `evoattn: choice(...)` comment lists
// the values a search may try.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>

#define THREADS 128  // evoattn: choice(64, 128, 256)
#define MAX_D 128    // the largest head dim the body below holds in registers

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// q, k, v, out: contiguous (B, H, S, D) in T (__half, __nv_bfloat16 or float); rows = B*H*S.
template <typename T>
__global__ void __launch_bounds__(THREADS)
attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 T* __restrict__ out, long long rows, int S, int D, int causal, float scale) {
  // ---- your kernel's body: from here ----
  const long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x;   // bh * S + i
  if (row >= rows) return;
  const int i = (int)(row % S);
  const int n = causal ? i + 1 : S;          // keys 0 .. n-1 (top-left aligned causal)
  const T* qr = q + row * D;
  const T* kb = k + (row - i) * D;           // k[bh, 0, :]
  const T* vb = v + (row - i) * D;           // v[bh, 0, :]
  float acc[MAX_D];
  for (int d = 0; d < D; ++d) acc[d] = 0.f;
  float m = -INFINITY, l = 0.f;              // running max and sum of exp
  for (int j = 0; j < n; ++j) {
    float s = 0.f;
    for (int d = 0; d < D; ++d) s += to_f32(qr[d]) * to_f32(kb[(long long)j * D + d]);
    s *= scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);      // 0 at the first key (m = -inf)
    const float p = expf(s - m_new);
    l = l * corr + p;
    for (int d = 0; d < D; ++d) acc[d] = acc[d] * corr + p * to_f32(vb[(long long)j * D + d]);
    m = m_new;
  }
  for (int d = 0; d < D; ++d) out[row * D + d] = from_f32<T>(acc[d] / l);
  // ---- to here ----
}

// Launches the kernel for one dtype on the caller's stream; returns a cudaError_t code.
template <typename T>
static int launch(const void* q, const void* k, const void* v, void* out, int B, int H, int S,
                  int D, int causal, float scale, cudaStream_t stream) {
  const long long rows = (long long)B * H * S;
  const unsigned blocks = (unsigned)((rows + THREADS - 1) / THREADS);
  attention_kernel<T><<<blocks, THREADS, 0, stream>>>((const T*)q, (const T*)k, (const T*)v,
                                                      (T*)out, rows, S, D, causal, scale);
  return (int)cudaGetLastError();
}

// The entry evoattn calls (through ctypes); dtype: 0 float16, 1 bfloat16, 2 float32.
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  if (B < 1 || H < 1 || S < 1 || D < 1 || D > MAX_D) return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return launch<__half>(q, k, v, out, B, H, S, D, causal, scale, st);
    case 1: return launch<__nv_bfloat16>(q, k, v, out, B, H, S, D, causal, scale, st);
    case 2: return launch<float>(q, k, v, out, B, H, S, D, causal, scale, st);
    default: return (int)cudaErrorInvalidValue;
  }
}
