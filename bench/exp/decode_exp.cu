// Experiment (nvcc on the GPU machine): RMSNorm's GPU time at decode shapes (1 and 16 rows) for
// every block size and access width of the template, beside an empty kernel, timed as the kiln
// bench times its decode figure (a 256 MiB memset before each call, so x and w come from DRAM).
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/decode_exp.cu
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "exp_util.h"

using kiln::bf16_t;
using namespace exp_util;

__global__ void empty_kernel() {}

// Dynamic shared memory as families/rmsnorm gives it (rmsnorm_smem_packs).
static size_t smem_for(int block, int vec, long long cols) {
  const long long pack_bytes = vec * 2, packs = cols / vec;
  const long long cached = (block >= 1024 ? 8 : 16) / std::max<long long>(1, pack_bytes / 4);
  if (packs <= block * cached) return block < 1024 && pack_bytes >= 8 ? size_t(packs * pack_bytes) : 0;
  return size_t(std::clamp<long long>(packs - block * cached, 0, 96 * 1024 / pack_bytes) * pack_bytes);
}

template <int B, int V>
static void one(long long rows, long long cols, bf16_t* x, bf16_t* w, bf16_t* y, double empty_us) {
  auto k = kiln::rmsnorm_fwd<bf16_t, B, V>;
  const size_t smem = smem_for(B, V, cols);
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  auto go = [&] { k<<<unsigned(rows), B, smem>>>(x, w, y, nullptr, rows, cols, cols, cols, 1e-6f); };
  const double a = time_us(go, 60), b = time_us(go, 60);
  std::printf("%4lld x %-6lld B%-5d v%d  %6.2f %6.2f us  (%.2fx empty)\n", rows, cols, B, V, a, b,
              std::min(a, b) / empty_us);
}

template <int B>
static void blocks(long long rows, long long cols, bf16_t* x, bf16_t* w, bf16_t* y, double e) {
  if (cols / 1 <= (long long)B * (B >= 1024 ? 8 : 16) * 1) one<B, 1>(rows, cols, x, w, y, e);
  one<B, 2>(rows, cols, x, w, y, e);
  one<B, 4>(rows, cols, x, w, y, e);
  one<B, 8>(rows, cols, x, w, y, e);
}

int main() {
  const double e1 = time_us([] { empty_kernel<<<1, 32>>>(); }, 60);
  const double e2 = time_us([] { empty_kernel<<<1, 32>>>(); }, 60);
  const double e = std::min(e1, e2);
  std::printf("empty kernel %.2f %.2f us\n", e1, e2);
  for (long long rows : {1ll, 16ll}) {
    const long long cols = 4096;
    bf16_t *x = rand_bf16(size_t(rows) * cols, 1), *w = rand_bf16(cols, 2), *y;
    CK(cudaMalloc(&y, size_t(rows) * cols * 2));
    blocks<128>(rows, cols, x, w, y, e);
    blocks<256>(rows, cols, x, w, y, e);
    blocks<512>(rows, cols, x, w, y, e);
    blocks<1024>(rows, cols, x, w, y, e);
    CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(y));
  }
  return 0;
}
