// Experiment (nvcc on the GPU machine): RMSNorm forward before and after the weight staging, and a
// candidate that keeps the weight in registers in 1024-thread blocks, at the shapes where the
// staging lost time on 2026-11-22 (H100).
//   bench/exp/make_copies.sh   # rms_old.cuh and rms_c.cuh, earlier versions of the template
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/rms_exp2.cu
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "rms_old.cuh"
#include "rms_c.cuh"
#include "exp_util.h"


using kiln::bf16_t;
using namespace exp_util;



// kiln's heuristic (families/rmsnorm) for bf16.
static void heuristic(long long rows, long long cols, int& block, int& vec) {
  int pack = rows >= 2048 ? 8 : 4;
  if (rows <= 64) {
    pack = 2;
    while (pack < 8 && (long long)pack * 2 * 1024 * 8 <= cols * 2) pack *= 2;
  }
  vec = pack / 2;
  const long long packs = cols / vec;
  block = 64;
  if (rows <= 64) block = 1024;
  else {
    const int per = rows >= 2048 ? 8 : 16;
    while (block < 512 && block * per < packs) block *= 2;
  }
}

template <int B, int V>
static void run_shape(long long rows, long long cols) {
  const size_t n = size_t(rows) * cols;
  bf16_t* x = rand_bf16(n, 1);
  bf16_t* w = rand_bf16(cols, 2);
  bf16_t *y0, *y1;
  CK(cudaMalloc(&y0, n * 2));
  CK(cudaMalloc(&y1, n * 2));
  const long long pack_bytes = V * 2, packs = cols / V;
  const long long cached = (B >= 1024 ? 8 : 16) / std::max<long long>(1, pack_bytes / 4);
  const long long smem_old = std::clamp<long long>(packs - B * cached, 0, 96 * 1024 / pack_bytes) * pack_bytes;
  const long long smem_new = packs <= B * cached ? (pack_bytes < 4 ? 0 : packs * pack_bytes) : smem_old;
  auto k_old = kiln_old::rmsnorm_fwd<bf16_t, B, V>;
  auto k_new = kiln::rmsnorm_fwd<bf16_t, B, V>;
  auto k_c = kiln_c::rmsnorm_fwd<bf16_t, B, V>;
  CK(cudaFuncSetAttribute(k_old, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  CK(cudaFuncSetAttribute(k_new, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  CK(cudaFuncSetAttribute(k_c, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  auto go = [&](auto k, long long smem, bf16_t* y) {
    k<<<unsigned(rows), B, size_t(smem)>>>(x, w, y, nullptr, rows, cols, cols, cols, 1e-6f);
  };
  go(k_old, smem_old, y0);
  go(k_new, smem_new, y1);
  CK(cudaDeviceSynchronize());
  const bool s1 = same(y0, y1, n);
  go(k_c, smem_new, y1);
  CK(cudaDeviceSynchronize());
  const bool s2 = same(y0, y1, n);
  const double bytes = 2.0 * n * 2 + cols * 2;
  // Interleave the three twice: a difference smaller than the spread between repeats is noise.
  double t[2][3];
  for (int r = 0; r < 2; ++r) {
    t[r][0] = time_us([&] { go(k_old, smem_old, y0); });
    t[r][1] = time_us([&] { go(k_new, smem_new, y1); });
    t[r][2] = time_us([&] { go(k_c, smem_new, y1); });
  }
  std::printf("%6lld x %-6lld B%-4d v%d  old %8.2f %8.2f  staged %8.2f %8.2f  regs1024 %8.2f %8.2f us  (%.0f GB/s old)  same %d %d\n",
              rows, cols, B, V, t[0][0], t[1][0], t[0][1], t[1][1], t[0][2], t[1][2], bytes / t[0][0] * 1e-3, s1, s2);
  CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(y0)); CK(cudaFree(y1));
}

#define SHAPE(R, C)                                            \
  do {                                                         \
    int b, v;                                                  \
    heuristic(R, C, b, v);                                     \
    if (b == 64 && v == 4) run_shape<64, 4>(R, C);             \
    else if (b == 128 && v == 4) run_shape<128, 4>(R, C);      \
    else if (b == 256 && v == 4) run_shape<256, 4>(R, C);      \
    else if (b == 512 && v == 4) run_shape<512, 4>(R, C);      \
    else if (b == 1024 && v == 4) run_shape<1024, 4>(R, C);    \
    else if (b == 64 && v == 2) run_shape<64, 2>(R, C);        \
    else if (b == 128 && v == 2) run_shape<128, 2>(R, C);      \
    else if (b == 256 && v == 2) run_shape<256, 2>(R, C);      \
    else if (b == 512 && v == 2) run_shape<512, 2>(R, C);      \
    else if (b == 1024 && v == 2) run_shape<1024, 2>(R, C);    \
    else if (b == 1024 && v == 1) run_shape<1024, 1>(R, C);    \
    else std::printf("no instance for B%d v%d\n", b, v);       \
  } while (0)

int main() {
  SHAPE(1, 4096); SHAPE(1, 16384); SHAPE(16, 16384); SHAPE(1, 65536);
  SHAPE(512, 2048); SHAPE(512, 5120); SHAPE(512, 8192); SHAPE(512, 16384);
  SHAPE(4096, 2048); SHAPE(4096, 5120); SHAPE(4096, 16384); SHAPE(4096, 65536);
  SHAPE(32768, 2048); SHAPE(32768, 5120); SHAPE(32768, 16384);
  return 0;
}
