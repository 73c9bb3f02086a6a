// Does not compile on purpose: an undeclared identifier inside the entry point.
#include <cuda_runtime.h>
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B, int H,
                            int S, int D, int dtype, int causal, float scale, void* stream) {
  return not_declared_anywhere + 1;
}
