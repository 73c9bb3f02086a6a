// ext_naive.cu: PyTorch-extension seed for `sdpa`: one query row per thread block.
//
// Defines `torch::Tensor attention(q, k, v, causal, scale)`; evoattn wraps it in a
// PYBIND11_MODULE and builds it with torch.utils.cpp_extension. Each block handles one
// (b, h, i) row: q[i] is staged in shared memory as float, keys are visited in chunks of
// THREADS (one key per thread), and an online softmax (running max m and sum l, kept
// redundantly by every thread) folds each chunk into the output; thread d accumulates
// out[i, d]. Causal is top-left aligned: row i stops after key i.
//
// Knobs: THREADS (keys per chunk; must be >= D, so 128 or 256).
// Limits: no data reuse across rows (k and v are re-read from L2 for every query row), so it
// is slow; a correct, readable starting point. q, k, v: contiguous CUDA tensors of shape
// (B, H, S, D), same dtype (float16, bfloat16 or float32), any S >= 1, D in {64, 128}.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#define THREADS 128  // evoattn: choice(128, 256)

namespace {

constexpr int MAX_D = 128;

// Returns the block-wide max or sum of x; every thread gets the result.
template <bool IS_MAX>
__device__ float block_reduce(float x, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = IS_MAX ? fmaxf(x, y) : x + y;
  }
  __syncthreads();                            // red may still be read by a previous call
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < THREADS / 32; ++w) r = IS_MAX ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

template <typename scalar_t>
__global__ void __launch_bounds__(THREADS)
row_attention_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                     const scalar_t* __restrict__ v, scalar_t* __restrict__ out, int S, int D,
                     bool causal, float scale) {
  __shared__ float qs[MAX_D];
  __shared__ float ps[THREADS];
  __shared__ float red[THREADS / 32];
  const long long row = blockIdx.x;           // (b*H + h) * S + i
  const int i = (int)(row % S);
  const long long base = (row - i) * D;       // start of this (b, h) in k and v
  const int tid = threadIdx.x;
  if (tid < D) qs[tid] = static_cast<float>(q[row * D + tid]) * scale;
  __syncthreads();

  const int n = causal ? i + 1 : S;           // keys 0 .. n-1 are visible
  float m = -INFINITY, l = 0.f, acc = 0.f;
  for (int c0 = 0; c0 < n; c0 += THREADS) {
    const int j = c0 + tid;
    float s = -INFINITY;
    if (j < n) {
      const scalar_t* kr = k + base + (long long)j * D;
      s = 0.f;
      for (int d = 0; d < D; ++d) s += qs[d] * static_cast<float>(kr[d]);
    }
    const float m_new = fmaxf(m, block_reduce<true>(s, red));   // finite: key c0 is visible
    const float p = j < n ? expf(s - m_new) : 0.f;
    const float alpha = expf(m - m_new);      // m = -inf on the first chunk -> 0
    l = l * alpha + block_reduce<false>(p, red);
    m = m_new;
    ps[tid] = p;
    __syncthreads();
    if (tid < D) {
      const int len = min(THREADS, n - c0);
      float a = acc * alpha;
      for (int jj = 0; jj < len; ++jj) a += ps[jj] * static_cast<float>(v[base + (long long)(c0 + jj) * D + tid]);
      acc = a;
    }
    __syncthreads();                          // ps is rewritten by the next chunk
  }
  if (tid < D) out[row * D + tid] = static_cast<scalar_t>(acc / l);
}

}  // namespace

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                        double scale) {
  static_assert(THREADS >= MAX_D && THREADS % 32 == 0, "THREADS must cover D and be whole warps");
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4, "q must be (B, H, S, D), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v shapes differ");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k, v dtypes differ");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "q, k, v must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, "head dim D must be 64 or 128, got ", D);
  TORCH_CHECK(S <= INT32_MAX && B * H * S <= INT32_MAX, "too many rows for this kernel");
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = torch::empty_like(q);
  if (B * H * S == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention", [&] {
    row_attention_kernel<scalar_t><<<(unsigned)(B * H * S), THREADS, 0, stream>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>(), (int)S, (int)D, causal, (float)scale);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
