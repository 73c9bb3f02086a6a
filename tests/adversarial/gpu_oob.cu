// Class 11 (GPU crash, GPU only): a fast-form kernel that writes far past the output buffer.
#include <cuda_runtime.h>

__global__ void scribble(float* out, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  out[i + (1LL << 34)] = 1.0f;                 // 64 GiB past the end: an illegal address
  (void)n;
}

extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out,
                            int B, int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  long long n = (long long)B * H * S * D;
  scribble<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>((float*)out, n);
  cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
  return (int)err;
}
