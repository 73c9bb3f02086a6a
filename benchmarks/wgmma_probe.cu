// wgmma_probe.cu: single-tile checks of the wgmma_flash seed's shared-memory layouts, descriptors
// and register fragments, driven by benchmarks/wgmma_probe.py (Hopper, built for sm_90a).
//
// It #includes the seed itself (WGF_SEED, default ../seeds/sdpa/wgmma_flash.cu), so the unit
// kernels below run the very device helpers the seed runs: load_tile_sw128 (cp.async into
// the 128-byte-swizzled tiles), wg_qk (S = q k^T, both operands K-major shared-memory
// descriptors), pack_p + wg_pv (O += P v, P from registers, v MN-major with imm-trans-b = 1).
// The library also exports the seed's evoattn_sdpa for the full-kernel checks.
// Build with -DWGF_PROBE_UNITS=0 to leave the unit kernels out (knob variants of the seed).
#ifndef WGF_SEED
#define WGF_SEED "../seeds/sdpa/wgmma_flash.cu"
#endif
#define WGF_ALLOW_OVERSIZED_SMEM   // settings too deep for a block build, and report their size
#include WGF_SEED

#ifndef WGF_PROBE_UNITS
#define WGF_PROBE_UNITS 1
#endif

// The dynamic shared memory the warp-specialised kernel asks for at head dim D (64 or 128) and
// this build's knobs: the probe compares it with the GPU's limit instead of restating the
// seed's layout (with two q tiles where Q_DOUBLE_MAX_S_D* lets some calls have them, the most a
// call asks for). Host code only: callable without a GPU.
extern "C" long long probe_ws_smem_bytes(int D) {
  return D == 64 ? (long long)WsSmem<64, BLOCK_N_D64, (Q_DOUBLE_MAX_S_D64 > 0 ? 2 : 1)>::bytes
                 : (long long)WsSmem<128, BLOCK_N_D128, (Q_DOUBLE_MAX_S_D128 > 0 ? 2 : 1)>::bytes;
}

// SPLIT_TAIL_D64's plan (the parts each item of a call's last wave is split into) and the first
// key tile of each part, as the seed's launch and kernel compute them. Host code as well.
extern "C" int probe_tail_parts(long long items, long long blocks, long long ntiles) {
  return tail_parts(items, blocks, ntiles);
}
extern "C" int probe_part_first_tile(int part, int all, int parts) {
  return part_first_tile(part, all, parts);
}

#if WGF_PROBE_UNITS

// A warpgroup's 64 x N f32 accumulator fragments <-> a row-major [64][N] array. Thread
// (warp w, lane l; g = l/4, t = l%4) holds d[4i + e] = element (16w + g + 8 * (e >= 2),
// 8i + 2t + (e & 1)).
template <int N>
__device__ __forceinline__ void store_acc(float* out, const float (&d)[N / 2]) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < N / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[(16 * warp + g + (e >= 2 ? 8 : 0)) * N + 8 * i + 2 * t + (e & 1)] = d[4 * i + e];
}
template <int N>
__device__ __forceinline__ void load_acc(float (&d)[N / 2], const float* in) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < N / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      d[4 * i + e] = in[(16 * warp + g + (e >= 2 ? 8 : 0)) * N + 8 * i + 2 * t + (e & 1)];
}

// s[64][N] = q[64][D] k[N][D]^T; k rows >= k_rows are zero-filled by the loader. The
// accumulators start as NaN: the first k step must overwrite them (scale-d = 0).
template <int D, int N, bool BF16>
__global__ void __launch_bounds__(128) probe_qk_kernel(const uint16_t* q, const uint16_t* k,
                                                       float* s_out, int k_rows) {
#if WGF_SM90A
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sq = base, sk = base + 64 * D * 2;
  load_tile_sw128<64, D, 128>(sq, q, 0, 64, threadIdx.x);
  load_tile_sw128<N, D, 128>(sk, k, 0, k_rows, threadIdx.x);
  cp_async_commit();
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();
  float s[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s[i] = __int_as_float(0x7fc00000);   // NaN
  wg_qk<D, N, 64, BF16>(s, sq, sk);
  store_acc<N>(s_out, s);
#else
  __trap();
#endif
}

// o[64][D] = o_in[64][D] + round(p[64][N]) v[N][D]; v rows >= v_rows are zero-filled.
template <int D, int N, bool BF16>
__global__ void __launch_bounds__(128) probe_pv_kernel(const float* p_in, const uint16_t* v,
                                                       const float* o_in, float* o_out,
                                                       int v_rows) {
#if WGF_SM90A
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t sv = (smem_addr(smem_raw) + 1023u) & ~1023u;
  load_tile_sw128<N, D, 128>(sv, v, 0, v_rows, threadIdx.x);
  cp_async_commit();
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();
  float s[N / 2];
  load_acc<N>(s, p_in);
  uint32_t p[N / 16][4];
  pack_p<T, N>(p, s);
  float o[D / 2];
  load_acc<D>(o, o_in);
  wg_pv<D, N, BF16>(o, p, sv);
  store_acc<D>(o_out, o);
#else
  __trap();
#endif
}

template <int D, int N, bool BF16>
static int launch_qk(const void* q, const void* k, void* s, int k_rows, cudaStream_t st) {
  const int smem = (64 + N) * D * 2 + 1024;
  cudaError_t err = cudaFuncSetAttribute(probe_qk_kernel<D, N, BF16>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  probe_qk_kernel<D, N, BF16><<<1, 128, smem, st>>>((const uint16_t*)q, (const uint16_t*)k,
                                                    (float*)s, k_rows);
  return (int)cudaGetLastError();
}

template <int D, int N, bool BF16>
static int launch_pv(const void* p, const void* v, const void* o_in, void* o, int v_rows,
                     cudaStream_t st) {
  const int smem = N * D * 2 + 1024;
  cudaError_t err = cudaFuncSetAttribute(probe_pv_kernel<D, N, BF16>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  probe_pv_kernel<D, N, BF16><<<1, 128, smem, st>>>((const float*)p, (const uint16_t*)v,
                                                    (const float*)o_in, (float*)o, v_rows);
  return (int)cudaGetLastError();
}

#define WGF_DISPATCH(FN, ...)                                                        \
  if (D == 64 && N == 64)                                                                \
    return bf16 ? FN<64, 64, true>(__VA_ARGS__) : FN<64, 64, false>(__VA_ARGS__);        \
  if (D == 64 && N == 128)                                                               \
    return bf16 ? FN<64, 128, true>(__VA_ARGS__) : FN<64, 128, false>(__VA_ARGS__);      \
  if (D == 128 && N == 64)                                                               \
    return bf16 ? FN<128, 64, true>(__VA_ARGS__) : FN<128, 64, false>(__VA_ARGS__);      \
  if (D == 128 && N == 128)                                                              \
    return bf16 ? FN<128, 128, true>(__VA_ARGS__) : FN<128, 128, false>(__VA_ARGS__);    \
  return (int)cudaErrorInvalidValue;

extern "C" int probe_qk(const void* q, const void* k, void* s, int D, int N, int bf16,
                        int k_rows, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  WGF_DISPATCH(launch_qk, q, k, s, k_rows, st)
}

extern "C" int probe_pv(const void* p, const void* v, const void* o_in, void* o, int D, int N,
                        int bf16, int v_rows, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  WGF_DISPATCH(launch_pv, p, v, o_in, o, v_rows, st)
}

#endif  // WGF_PROBE_UNITS

