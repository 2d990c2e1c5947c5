// Experiment (nvcc on the GPU machine): RMSNorm forward at hidden 5120 bf16, where kiln's kernel
// has trailed torch.compile by 1-2% in every run (32768 x 5120: 226.7 against 224.4 µs; 4096 x
// 5120: 33.3 against 32.6; seventh session). A 5120-element row is 640 16-byte packs or 1280
// 8-byte packs, which no power-of-two block covers evenly with 16-byte packs. Candidates, all the
// template of templates/rmsnorm/rmsnorm_fwd.cuh at other block sizes and grids:
//  - blocks of 160, 320 and 640 threads (which the catalog does not hold), each thread an equal
//    share of the row;
//  - the pipelined path (a capped grid, the next row's loads in flight during this row's
//    stores) at grids that deal the rows evenly to the blocks;
//  - (second run) the template capped at 32 registers, 2048 resident threads per SM instead of
//    1024 (kiln_occ::, made by make_copies.sh), at hidden 5120, 8192 and 16384;
//  - (third run, RMS_TWOPASS=1) two passes over the row as torch.compile's kernel makes them.
// Each candidate's output is compared with the heuristic's (block 256, 8-byte packs).
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/rms_exp3.cu
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "rms_occ.cuh"  // bench/exp/make_copies.sh
#include "exp_util.h"

using kiln::bf16_t;
using namespace exp_util;

static int g_sms = 0;
static double g_copy_gbs = 0;

// Dynamic shared memory as the host gives it (families/rmsnorm, rmsnorm_smem_packs) for rows that
// fit the register cache: the weight staged there for packs of 8 bytes and more.
static size_t smem_for(int block, int vec, long long cols) {
  const long long pack_bytes = vec * 2, packs = cols / vec;
  const long long cached = (block >= 1024 ? 8 : 16) / std::max<long long>(1, pack_bytes / 4);
  if (packs <= block * cached) return block < 1024 && pack_bytes >= 8 ? size_t(packs * pack_bytes) : 0;
  return 0;  // not used here: every candidate fits its register cache
}

// ---- two passes over the row, as torch.compile's kernel does (third run, RMS_TWOPASS=1) ----
// The sum of squares reads the row in 16-byte packs (with an L1 evict_last hint when HINTS), the
// scaled write reads it again (evict_first) with the weight (evict_last); nothing is held in
// registers between the passes, so blocks run at 2048 threads per SM.
using P8 = kiln::Pack<bf16_t, 8>;
template <bool HINTS>
__device__ __forceinline__ P8 ld(const bf16_t* p, bool last) {
  if constexpr (!HINTS) return kiln::load_pack<bf16_t, 8>(p);
  P8 v;
  unsigned* u = reinterpret_cast<unsigned*>(&v);
  if (last)
    asm volatile("ld.global.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "l"(p));
  else
    asm volatile("ld.global.L1::evict_first.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "l"(p));
  return v;
}

template <int NT, bool HINTS>
__global__ void __launch_bounds__(NT, 2048 / NT) rms_twopass(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                                             bf16_t* __restrict__ y, float* inv_rms, long long rows,
                                                             long long cols, long long xs, long long ys, float eps) {
  __shared__ float scratch[33];
  const int packs = int(cols / 8), t = int(threadIdx.x);
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const bf16_t* xr = x + row * xs;
    float acc = 0.f;
    for (int p = t; p < packs; p += NT) {
      const P8 v = ld<HINTS>(xr + p * 8, true);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = fmaf(kiln::to_float(v.v[k]), kiln::to_float(v.v[k]), acc);
    }
    const float r = rsqrtf(kiln::block_sum<NT>(acc, scratch) / float(cols) + eps);
    for (int p = t; p < packs; p += NT) {
      const P8 v = ld<HINTS>(xr + p * 8, false), wv = ld<HINTS>(w + p * 8, true);
      P8 o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = kiln::from_float<bf16_t>(kiln::to_float(v.v[k]) * r * kiln::to_float(wv.v[k]));
      kiln::store_pack<bf16_t, 8>(y + row * ys + p * 8, o);
    }
  }
}

struct Shape {
  long long rows, cols;
  bf16_t *x, *w, *y_ref, *y;
};

template <int B, int V, bool OCC = false, int TWOPASS = 0>
static void candidate(Shape& s, long long grid, const char* what) {
  auto k = TWOPASS == 1   ? rms_twopass<B, false>
           : TWOPASS == 2 ? rms_twopass<B, true>
           : OCC          ? kiln_occ::rmsnorm_fwd<bf16_t, B, V>
                          : kiln::rmsnorm_fwd<bf16_t, B, V>;
  const size_t smem = smem_for(B, V, s.cols);
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  const size_t n = size_t(s.rows) * s.cols;
  if (grid <= 0) grid = s.rows;
  auto go = [&] { k<<<unsigned(grid), B, smem>>>(s.x, s.w, s.y, nullptr, s.rows, s.cols, s.cols, s.cols, 1e-6f); };
  CK(cudaMemset(s.y, 0xff, n * 2));
  go();
  CK(cudaDeviceSynchronize());
  const double err = max_rel(s.y, s.y_ref, n);
  const double t = time_us(go, 60);
  const double gbs = 4.0 * s.rows * s.cols / t * 1e-3;
  std::printf("%6lld x %-6lld B%-4d V%d grid %-6lld %-26s occ %d  %8.2f us %6.0f GB/s %5.1f%% of copy  err %.2g\n",
              s.rows, s.cols, B, V, grid, what, occupancy(k, B, smem), t, gbs, 100.0 * gbs / g_copy_gbs, err);
}

static void shape(long long rows, long long cols) {
  Shape s{rows, cols};
  const size_t n = size_t(rows) * cols;
  s.x = rand_bf16(n, 31);
  s.w = rand_bf16(cols, 32);
  CK(cudaMalloc(&s.y_ref, n * 2));
  CK(cudaMalloc(&s.y, n * 2));
  {
    auto k = kiln::rmsnorm_fwd<bf16_t, 256, 4>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    k<<<unsigned(rows), 256, smem_for(256, 4, cols)>>>(s.x, s.w, s.y_ref, nullptr, rows, cols, cols, cols, 1e-6f);
    CK(cudaDeviceSynchronize());
  }
  if (std::getenv("RMS_TWOPASS")) {
    candidate<256, 4>(s, 0, "kiln 256 x 8-byte");
    candidate<256, 8>(s, 0, "kiln 256 x 16-byte");
    candidate<512, 4>(s, 0, "kiln 512 x 8-byte");
    candidate<128, 8, false, 1>(s, 0, "two passes, no hints");
    candidate<256, 8, false, 1>(s, 0, "two passes, no hints");
    candidate<512, 8, false, 1>(s, 0, "two passes, no hints");
    candidate<128, 8, false, 2>(s, 0, "two passes, L1 evict hints");
    candidate<256, 8, false, 2>(s, 0, "two passes, L1 evict hints");
    candidate<512, 8, false, 2>(s, 0, "two passes, L1 evict hints");
    candidate<256, 8, false, 2>(s, g_sms * 8, "two passes, hints, sms x 8");
  } else if (std::getenv("RMS_OCC")) {
    // The heuristic's block for the row (256 at 5120 and 8192, 512 at 16384) and its neighbours.
    candidate<256, 4>(s, 0, "heuristic block, 1024 thr/SM");
    candidate<256, 4, true>(s, 0, "32 regs, 2048 thr/SM");
    candidate<256, 8>(s, 0, "1024 thr/SM");
    candidate<256, 8, true>(s, 0, "32 regs, 2048 thr/SM");
    candidate<512, 4>(s, 0, "1024 thr/SM");
    candidate<512, 4, true>(s, 0, "32 regs, 2048 thr/SM");
    candidate<512, 8>(s, 0, "1024 thr/SM");
    candidate<512, 8, true>(s, 0, "32 regs, 2048 thr/SM");
    candidate<128, 8, true>(s, 0, "32 regs, 2048 thr/SM");
    candidate<128, 4, true>(s, 0, "32 regs, 2048 thr/SM");
  } else {
    candidate<256, 4>(s, 0, "heuristic");
    candidate<256, 8>(s, 0, "");
    candidate<160, 8>(s, 0, "4 x 16 B per thread");
    candidate<320, 4>(s, 0, "4 x 8 B per thread");
    candidate<640, 4>(s, 0, "2 x 8 B per thread");
    candidate<640, 8>(s, 0, "1 x 16 B per thread");
    candidate<320, 8>(s, 0, "2 x 16 B per thread");
    // Pipelined (packs <= half the register cache): 320 x 2 x 16 B and 640 x 1 x 16 B.
    for (long long per_sm : {3, 4, 6})
      candidate<320, 8>(s, g_sms * per_sm, "pipelined, sms x k");
    for (long long rows_per_block : {4, 8, 16})
      candidate<320, 8>(s, rows / rows_per_block, "pipelined, even rows");
    for (long long per_sm : {2, 3})
      candidate<640, 8>(s, g_sms * per_sm, "pipelined, sms x k");
    candidate<640, 8>(s, rows / 8, "pipelined, even rows");
    candidate<256, 4>(s, 0, "heuristic (again)");
  }
  CK(cudaFree(s.x)); CK(cudaFree(s.w)); CK(cudaFree(s.y)); CK(cudaFree(s.y_ref));
}

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  g_copy_gbs = copy_gbs_1gib();
  std::printf("copy 1 GiB: %.0f GB/s, %d SMs\n", g_copy_gbs, g_sms);
  shape(32768, 5120);
  shape(4096, 5120);
  if (std::getenv("RMS_TWOPASS")) {
    shape(32768, 8192);
    shape(32768, 16384);
    shape(4096, 2048);
    shape(32768, 2048);
  }
  if (std::getenv("RMS_OCC")) {
    shape(32768, 8192);
    shape(32768, 16384);
    shape(4096, 8192);
  }
  return 0;
}
