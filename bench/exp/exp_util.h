// What the experiments in bench/exp share: error checks, the timing loop (CUDA events around each
// call, a 256 MiB memset before it so that inputs come from DRAM, as the kiln bench and
// triton.testing.do_bench time), random bf16 inputs and output comparisons.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/dtype.cuh"

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace exp_util {

using kiln::bf16_t;
constexpr size_t k_flush = 256ull << 20;

inline void* flush_buffer() {
  static void* p = [] {
    void* q;
    CK(cudaMalloc(&q, k_flush));
    return q;
  }();
  return p;
}

// Median of `reps` timed calls after five untimed ones, in µs.
inline double time_us(const std::function<void()>& f, int reps = 40) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaMemsetAsync(flush_buffer(), i & 0xff, k_flush));
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2] * 1e3;
}

// n normal(0, 1) values, rounded to bf16, on the device.
inline bf16_t* rand_bf16(size_t n, unsigned seed) {
  std::vector<bf16_t> h(n);
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  for (auto& v : h) {
    float f = d(g);
    unsigned u;
    std::memcpy(&u, &f, 4);
    v.bits = (unsigned short)(u >> 16);
  }
  bf16_t* p;
  CK(cudaMalloc(&p, n * 2));
  CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  return p;
}

inline std::vector<bf16_t> to_host(const bf16_t* p, size_t n) {
  std::vector<bf16_t> h(n);
  CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

inline bool same(const bf16_t* a, const bf16_t* b, size_t n) {
  const auto ha = to_host(a, n), hb = to_host(b, n);
  for (size_t i = 0; i < n; ++i)
    if (ha[i].bits != hb[i].bits) return false;
  return true;
}

// Largest |a - b| / max(|b|, 0.01) over the elements; infinite where only one is NaN.
inline double max_rel(const bf16_t* a, const bf16_t* b, size_t n) {
  const auto ha = to_host(a, n), hb = to_host(b, n);
  auto f = [](bf16_t v) {
    const unsigned u = unsigned(v.bits) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = f(ha[i]), y = f(hb[i]);
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    worst = std::max(worst, std::fabs(x - y) / std::max(1e-2, std::fabs(y)));
  }
  return worst;
}

// Microseconds of a device-to-device copy of `bytes` (read `bytes`, write `bytes`), timed as above.
inline double copy_us(size_t bytes) {
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  const double t = time_us([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  CK(cudaFree(a));
  CK(cudaFree(b));
  return t;
}

// GB/s (bytes read + written) of a 1 GiB device-to-device copy.
inline double copy_gbs_1gib() { return 2.0 * double(size_t(1) << 30) / copy_us(size_t(1) << 30) * 1e-3; }

// Blocks of kernel k that one SM holds with this block size and dynamic shared memory.
template <typename K>
inline int occupancy(K k, int threads, size_t smem) {
  int n = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, smem));
  return n;
}

// A 1-D launch in clusters of `cluster` blocks (1: plain blocks). Not copyable: cfg points at attr.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  ClusterLaunch(unsigned grid, unsigned block, size_t smem, int cluster) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Launches k on a 1-D grid in clusters of `cluster` blocks (1: plain blocks).
template <typename K, typename... A>
inline void launch(K k, unsigned grid, unsigned block, size_t smem, int cluster, A... args) {
  ClusterLaunch l(grid, block, smem, cluster);
  CK(cudaLaunchKernelEx(&l.cfg, k, args...));
}

// How many clusters of `cluster` blocks with this shared memory the GPU holds at once.
template <typename K>
inline int max_clusters(K k, int threads, size_t smem, int cluster) {
  ClusterLaunch l(unsigned(cluster * 64), unsigned(threads), smem, cluster);
  int n = 0;
  CK(cudaOccupancyMaxActiveClusters(&n, k, &l.cfg));
  return n;
}

}  // namespace exp_util
