// Experiment (nvcc on the GPU machine): how much of RMSNorm backward's time at 4096 rows is the
// second launch (rmsnorm_bwd_reduce), and does a single cooperative launch with a grid barrier
// (rmsnorm_bwd_bulk_fused) or a programmatic dependent launch of the reduce win it back?
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/fuse_exp.cu
// Per shape (bf16, the heuristic's bulk choice and slab count, as kiln's typed op launches them):
//   two    rmsnorm_bwd_bulk then rmsnorm_bwd_reduce (kiln today)
//   first  rmsnorm_bwd_bulk alone (no dw: the floor for any second stage)
//   pdl    the same two, the reduce launched as a programmatic dependent (griddepcontrol.wait)
//   fused  rmsnorm_bwd_bulk_fused, launched cooperatively
//   fusedp the same without the cooperative attribute (every block is resident anyway)
//   pdlt   pdl with the first stage triggering its dependents at its start
//          (griddepcontrol.launch_dependents), so the reduce's blocks are resident and waiting
//          when it ends, for three reduce shapes (threads x columns per block)
#include "exp_util.h"
#include "rmsnorm_bwd/rmsnorm_bwd.cuh"
#include "rmsnorm_bwd/rmsnorm_bwd_reduce.cuh"

using namespace exp_util;
using kiln::bf16_t;

namespace exp_fuse {

// A barrier across the whole grid, for kernels whose blocks are all resident at once (launched
// cooperatively). `bar` is two words of global memory: an arrival count that must be 0 before the
// first launch, and a generation. The last block to arrive resets the count and bumps the
// generation, which releases the others, so the words are ready for the next launch with no
// clearing in between. Every thread of every block must call it.
__device__ __forceinline__ void grid_sync(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned gen, old;
    // The generation is read before this block arrives: it cannot change until every block has.
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(gen) : "l"(bar + 1) : "memory");
    __threadfence();  // the block's writes (ordered before thread 0 by the barrier) go first
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
    if (old == gridDim.x * gridDim.y * gridDim.z - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1) : "memory");
    } else {
      unsigned now;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 1) : "memory");
      } while (now == gen);
    }
    __threadfence();
  }
  __syncthreads();
}

// The second stage inside the first stage's grid, after grid_sync: dw[c] = sum over slabs of
// partial[slab, c], each block summing one chunk of adjacent columns (a power of two of at least 8
// floats, one 32-byte sector, and small enough that the chunks go round the blocks once). A thread
// adds the slabs s, s + lanes, ... of one float4 column; threads sharing a column add by shuffles,
// the warps through shared memory, in a fixed order (deterministic). Needs cols % 4 == 0 and
// THREADS a multiple of 32. The partial rows were written by other blocks in this launch, so they
// are read from L2 (ld.global.cg), never from a stale L1 line.
template <typename T, int THREADS>
__device__ __forceinline__ void reduce_in_grid(const float* __restrict__ partial, T* __restrict__ dw,
                                               long long slabs, long long cols) {
  static_assert(THREADS % 32 == 0, "whole warps");
  long long chunk = 8;
  while ((cols + chunk - 1) / chunk > (long long)gridDim.x) chunk *= 2;
  const long long begin = (long long)blockIdx.x * chunk;
  if (begin >= cols) return;
  const long long end = min(begin + chunk, cols);
  const int lanes = int(min(chunk / 4, 32LL));  // float4 columns per pass
  const int slab_lanes = THREADS / lanes;
  const int cl = int(threadIdx.x) % lanes, s0 = int(threadIdx.x) / lanes;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  __shared__ float4 sums[THREADS / 32][32];
  for (long long base = begin; base < end; base += 4LL * lanes) {
    const long long c = base + 4LL * cl;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < end) {
      const float* p = partial + c;
      long long s = s0;
      constexpr int k_unroll = 4;
      for (; s + (k_unroll - 1) * slab_lanes < slabs; s += k_unroll * slab_lanes) {
        float4 v[k_unroll];
#pragma unroll
        for (int u = 0; u < k_unroll; ++u) v[u] = __ldcg(reinterpret_cast<const float4*>(p + (s + u * slab_lanes) * cols));
#pragma unroll
        for (int u = 0; u < k_unroll; ++u) {
          acc.x += v[u].x;
          acc.y += v[u].y;
          acc.z += v[u].z;
          acc.w += v[u].w;
        }
      }
      for (; s < slabs; s += slab_lanes) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p + s * cols));
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
    }
    // Lanes `lanes` apart in a warp hold the same column.
    for (int off = lanes; off < 32; off *= 2) {
      acc.x += __shfl_xor_sync(0xffffffffu, acc.x, off);
      acc.y += __shfl_xor_sync(0xffffffffu, acc.y, off);
      acc.z += __shfl_xor_sync(0xffffffffu, acc.z, off);
      acc.w += __shfl_xor_sync(0xffffffffu, acc.w, off);
    }
    if (lane < lanes) sums[warp][lane] = acc;
    __syncthreads();
    if (int(threadIdx.x) < lanes && c < end) {
      float4 total = sums[0][threadIdx.x];
#pragma unroll
      for (int q = 1; q < THREADS / 32; ++q) {
        total.x += sums[q][threadIdx.x].x;
        total.y += sums[q][threadIdx.x].y;
        total.z += sums[q][threadIdx.x].z;
        total.w += sums[q][threadIdx.x].w;
      }
      dw[c] = kiln::from_float<T>(total.x);
      dw[c + 1] = kiln::from_float<T>(total.y);
      dw[c + 2] = kiln::from_float<T>(total.z);
      dw[c + 3] = kiln::from_float<T>(total.w);
    }
    __syncthreads();
  }
}

}  // namespace exp_fuse

// Both stages in one launch: the bulk kernel above, then, once every block's partial row is out
// (a grid barrier: the launch must be cooperative, with one block per slab), the second stage
// summed across the same blocks. Saves the second launch and its gap. `bar`: two words, the
// first 0 before the first launch (exp_fuse::grid_sync).
template <typename T, int THREADS, int PACKS, int STAGES>
__global__ void __launch_bounds__(THREADS, (512 / THREADS > 1 ? 512 / THREADS : 1))
rmsnorm_bwd_bulk_fused(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                       const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial,
                       T* __restrict__ dw, unsigned* __restrict__ bar, long long rows, long long cols,
                       long long dy_stride, long long x_stride, long long dx_stride, long long slabs) {
  kiln::bwd::bulk_body<T, THREADS, PACKS, STAGES>(dy, x, w, inv_rms, dx, partial, rows, cols, dy_stride, x_stride,
                                            dx_stride, slabs);
#if __CUDA_ARCH__ >= 900
  exp_fuse::grid_sync(bar);
  exp_fuse::reduce_in_grid<T, THREADS>(partial, dw, slabs, cols);
#endif
}


// rmsnorm_bwd_reduce with a griddepcontrol.wait first (the launch may start before the first
// stage ends; the wait returns when its writes are visible).
template <typename T, int BLOCK, int COLUMNS>
__global__ void __launch_bounds__(BLOCK) reduce_pdl(const float* __restrict__ partial, T* __restrict__ dw,
                                                    long long slabs, long long cols) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  constexpr int k_lanes = BLOCK / COLUMNS, k_warps = BLOCK / 32;
  __shared__ float sums[k_warps][COLUMNS];
  const int c = int(threadIdx.x) % COLUMNS, lane = int(threadIdx.x) / COLUMNS;
  const long long col = (long long)blockIdx.x * COLUMNS + c;
  float acc = 0.f;
  if (col < cols)
    for (long long s = lane; s < slabs; s += k_lanes) acc += partial[s * cols + col];
#pragma unroll
  for (int off = COLUMNS; off < 32; off *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const int warp = int(threadIdx.x) / 32;
  if (int(threadIdx.x) % 32 < COLUMNS) sums[warp][c] = acc;
  __syncthreads();
  if (int(threadIdx.x) < COLUMNS && col < cols) {
    float total = 0.f;
    for (int q = 0; q < k_warps; ++q) total += sums[q][c];
    dw[col] = kiln::from_float<T>(total);
  }
}

// The first stage, triggering its dependents as it starts.
template <typename T, int THREADS, int PACKS, int STAGES>
__global__ void __launch_bounds__(THREADS, (512 / THREADS > 1 ? 512 / THREADS : 1))
bulk_trigger(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
             const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial, long long rows,
             long long cols, long long dy_stride, long long x_stride, long long dx_stride, long long slabs) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  kiln::bwd::bulk_body<T, THREADS, PACKS, STAGES>(dy, x, w, inv_rms, dx, partial, rows, cols, dy_stride, x_stride,
                                                  dx_stride, slabs);
}

template <int THREADS, int PACKS, int STAGES, int RBLOCK, int RCOLS>
void run(long long rows, long long cols) {
  const size_t n = size_t(rows) * cols;
  bf16_t* dy = rand_bf16(n, 1);
  bf16_t* x = rand_bf16(n, 2);
  bf16_t* w = rand_bf16(cols, 3);
  std::vector<float> hinv(rows);
  std::mt19937 g(4);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (auto& v : hinv) v = u(g);
  float* inv;
  CK(cudaMalloc(&inv, rows * 4));
  CK(cudaMemcpy(inv, hinv.data(), rows * 4, cudaMemcpyHostToDevice));
  bf16_t *dx, *dx2, *dw, *dw2;
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dx2, n * 2));
  CK(cudaMalloc(&dw, cols * 2));
  CK(cudaMalloc(&dw2, cols * 2));
  unsigned* bar;
  CK(cudaMalloc(&bar, 8));
  CK(cudaMemset(bar, 0, 8));

  constexpr int VEC = 8;
  const size_t elems = size_t(THREADS) * PACKS * VEC;
  const size_t smem = size_t(STAGES) * 2 * elems * 2 + (PACKS * VEC > 16 ? elems * 4 : 0);
  auto k1 = kiln::rmsnorm_bwd_bulk<bf16_t, THREADS, PACKS, STAGES>;
  auto kf = rmsnorm_bwd_bulk_fused<bf16_t, THREADS, PACKS, STAGES>;
  auto kr = kiln::rmsnorm_bwd_reduce<bf16_t, RBLOCK, RCOLS>;
  auto kp = reduce_pdl<bf16_t, RBLOCK, RCOLS>;
  auto kt = bulk_trigger<bf16_t, THREADS, PACKS, STAGES>;
  CK(cudaFuncSetAttribute(kt, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(kf, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const long long slabs = std::min<long long>(rows, (long long)sms * std::max(1, 512 / THREADS));
  const int occ1 = occupancy(k1, THREADS, smem), occf = occupancy(kf, THREADS, smem);
  float* partial;
  CK(cudaMalloc(&partial, slabs * cols * 4));
  const unsigned rgrid = unsigned((cols + RCOLS - 1) / RCOLS);

  auto first = [&](bf16_t* out) {
    k1<<<unsigned(slabs), THREADS, smem>>>(dy, x, w, inv, out, partial, rows, cols, cols, cols, cols, slabs);
  };
  auto two = [&] {
    first(dx);
    kr<<<rgrid, RBLOCK>>>(partial, dw, slabs, cols);
  };
  auto dependent = [&](auto kernel, unsigned threads, unsigned grid) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cudaLaunchAttribute a[1] = {};
    a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = a;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, (const float*)partial, dw, slabs, cols));
  };
  auto pdl = [&] {
    first(dx);
    dependent(kp, RBLOCK, rgrid);
  };
  auto trig = [&] {
    kt<<<unsigned(slabs), THREADS, smem>>>(dy, x, w, inv, dx, partial, rows, cols, cols, cols, cols, slabs);
  };
  auto pdlt = [&](int variant) {
    trig();
    if (variant == 0) dependent(kp, RBLOCK, rgrid);
    if (variant == 1) dependent(reduce_pdl<bf16_t, 256, 16>, 256, unsigned((cols + 15) / 16));
    if (variant == 2) dependent(reduce_pdl<bf16_t, 256, 32>, 256, unsigned((cols + 31) / 32));
  };
  auto fused = [&](bool coop) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(slabs));
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute a[1] = {};
    a[0].id = cudaLaunchAttributeCooperative;
    a[0].val.cooperative = 1;
    cfg.attrs = a;
    cfg.numAttrs = coop ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kf, (const bf16_t*)dy, (const bf16_t*)x, (const bf16_t*)w, (const float*)inv, dx2,
                          partial, dw2, bar, rows, cols, cols, cols, cols, slabs));
  };

  // Correctness: the fused launch against kiln's two (dx bit for bit, dw to fp32 summation order).
  CK(cudaMemset(dx2, 0xff, n * 2));
  CK(cudaMemset(dw2, 0xff, cols * 2));
  two();
  fused(true);
  CK(cudaDeviceSynchronize());
  const bool dx_same = same(dx, dx2, n);
  const double dw_fused = max_rel(dw2, dw, cols);
  CK(cudaMemset(dw2, 0xff, cols * 2));
  fused(true);  // the barrier words are reused by a second launch
  CK(cudaDeviceSynchronize());
  const double dw_again = max_rel(dw2, dw, cols);
  CK(cudaMemset(dw, 0xff, cols * 2));
  pdl();
  CK(cudaDeviceSynchronize());
  const double dw_pdl = max_rel(dw2, dw, cols);
  double dw_pdlt = 0;
  for (int v = 0; v < 3; ++v) {
    CK(cudaMemset(dw, 0xff, cols * 2));
    pdlt(v);
    CK(cudaDeviceSynchronize());
    dw_pdlt = std::max(dw_pdlt, max_rel(dw2, dw, cols));
  }

  const double t_two = time_us(two), t_first = time_us([&] { first(dx); }), t_pdl = time_us(pdl),
               t_fused = time_us([&] { fused(true); }), t_fusedp = time_us([&] { fused(false); }),
               t_two2 = time_us(two), t_trig = time_us(trig), t_pdlt0 = time_us([&] { pdlt(0); }),
               t_pdlt1 = time_us([&] { pdlt(1); }), t_pdlt2 = time_us([&] { pdlt(2); });
  const double bytes = 3.0 * n * 2 + cols * 2 + rows * 4;
  std::printf("%6lld x %5lld  slabs %4lld occ %d/%d  two %7.2f %7.2f  first %7.2f (trig %7.2f)  pdl %7.2f  "
              "pdlt %7.2f %7.2f %7.2f  fused %7.2f  fusedp %7.2f us  two %5.0f GB/s  dx %s dw %.1e/%.1e pdl %.1e "
              "pdlt %.1e\n",
              rows, cols, slabs, occ1, occf, t_two, t_two2, t_first, t_trig, t_pdl, t_pdlt0, t_pdlt1, t_pdlt2, t_fused,
              t_fusedp, bytes / t_two * 1e-3, dx_same ? "same" : "DIFF", dw_fused, dw_again, dw_pdl, dw_pdlt);
  for (void* p : {(void*)dy, (void*)x, (void*)w, (void*)inv, (void*)dx, (void*)dx2, (void*)dw, (void*)dw2,
                  (void*)bar, (void*)partial})
    CK(cudaFree(p));
}

int main() {
  run<128, 2, 4, 512, 8>(4096, 2048);
  run<256, 2, 4, 512, 16>(4096, 4096);
  run<512, 2, 4, 512, 32>(4096, 8192);
  run<512, 4, 2, 512, 32>(4096, 16384);
  run<128, 2, 4, 512, 8>(32768, 2048);
  run<256, 2, 4, 512, 16>(32768, 4096);
  run<512, 2, 4, 512, 32>(32768, 8192);
  return 0;
}
