// fused.cu: one fused flash-attention kernel on CUDA cores (FA1-style), seed for `sdpa`.
//
// The kernel is cuda_core_flash.cuh's (shared with the tensor-core seeds' float32 fallback):
// each block owns BLOCK_M query rows of one (b, h), walks the keys in tiles of BLOCK_N staged in
// shared memory as float, and keeps an online softmax, so the S x S score matrix is never
// materialised.
//
// Knobs: BLOCK_M (query rows per block), BLOCK_N (keys per tile), NUM_THREADS.
// Limits: no tensor cores, fp32 shared tiles (up to ~150 KB of shared memory; a tile set that
// does not fit returns the CUDA error). Any S >= 1, D in {64, 128}, float16 / bfloat16 /
// float32, fp32 accumulation.
// evoattn: companion cuda_core_flash.cuh
#include "cuda_core_flash.cuh"

#define BLOCK_M 32  // evoattn: choice(16, 32, 64)
#define BLOCK_N 64  // evoattn: choice(32, 64, 128)
#define NUM_THREADS 128  // evoattn: choice(64, 128, 256)

template <typename T>
static int run(const void* q, const void* k, const void* v, void* out, int BH, int S, int D,
               int causal, float scale, cudaStream_t stream) {
  if (D == 64)
    return launch_cuda_core<T, 64, BLOCK_M, BLOCK_N, NUM_THREADS>(q, k, v, out, BH, S, causal,
                                                                  scale, stream);
  return launch_cuda_core<T, 128, BLOCK_M, BLOCK_N, NUM_THREADS>(q, k, v, out, BH, S, causal,
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
