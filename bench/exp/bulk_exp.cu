// Experiment (nvcc on the GPU machine): RMSNorm backward and forward with rows staged in shared
// memory by bulk copies (cp.async.bulk, sm_90) in a ring of STAGES row buffers, one issuing thread
// per block and an mbarrier per buffer, against kiln's current kernels. Persistent blocks: one
// slab of rows per block (or per cluster of CLUSTER blocks that split each row), so the loads for
// the next rows are in flight while a row is reduced, without registers to hold them.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/bulk_exp.cu
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "rmsnorm_bwd/rmsnorm_bwd.cuh"
#include "rmsnorm_bwd/rmsnorm_bwd_reduce.cuh"
#include "exp_util.h"

using kiln::bf16_t;
using namespace exp_util;

namespace bulk {

__device__ __forceinline__ unsigned saddr(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void bar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count) : "memory");
}

__device__ __forceinline__ void expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void load(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   saddr(dst)),
               "l"(src), "r"(bytes), "r"(saddr(b))
               : "memory");
}

__device__ __forceinline__ void wait(unsigned long long* b, unsigned parity) {
  unsigned ok = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok)
                 : "r"(saddr(b)), "r"(parity)
                 : "memory");
  } while (!ok);
}

}  // namespace bulk

constexpr int VEC = 8;  // bf16 elements per 16-byte pack
using P = kiln::Pack<bf16_t, VEC>;

// dx for every row, dw partials per slab (as kiln's rmsnorm_bwd writes them), rows of exactly
// CLUSTER * NT * PPT * VEC columns, contiguous.
template <int NT, int PPT, int STAGES, int CLUSTER, int PIECES = 1, bool DW_SMEM = false>
__global__ void __launch_bounds__(NT) bwd_bulk(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                               const bf16_t* __restrict__ w, const float* __restrict__ inv_rms,
                                               bf16_t* __restrict__ dx, float* __restrict__ partial, long long rows,
                                               long long cols, long long slabs, int interleave) {
  constexpr int CHUNK = NT * PPT * VEC;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sdy = reinterpret_cast<bf16_t*>(smem);
  bf16_t* sx = sdy + STAGES * CHUNK;
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float row_sums[2];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = CLUSTER > 1 ? kiln::bwd::cluster_rank() : 0u;
  const long long slab = blockIdx.x / CLUSTER;
  const long long col0 = (long long)rank * CHUNK;
  // Contiguous slabs, or rows slab, slab + slabs, ... (interleave: the rows in flight on the GPU
  // at one time are then neighbours in memory).
  const long long r0 = interleave ? slab : slab * rows / slabs;
  const long long n = interleave ? (rows - slab + slabs - 1) / slabs : (slab + 1) * rows / slabs - r0;
  const long long rstep = interleave ? slabs : 1;
  if (t == 0) {
    for (int s = 0; s < STAGES; ++s) bulk::bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s, long long row) {
    constexpr int PIECE = CHUNK / PIECES;
    bulk::expect_tx(&full[s], 2u * CHUNK * 2u);
#pragma unroll
    for (int q = 0; q < PIECES; ++q) {
      bulk::load(sdy + s * CHUNK + q * PIECE, dy + row * cols + col0 + q * PIECE, PIECE * 2, &full[s]);
      bulk::load(sx + s * CHUNK + q * PIECE, x + row * cols + col0 + q * PIECE, PIECE * 2, &full[s]);
    }
  };
  if (t == 0)
    for (int s = 0; s < STAGES && s < n; ++s) issue(s, r0 + s * rstep);
  P wv[PPT];
#pragma unroll
  for (int j = 0; j < PPT; ++j) wv[j] = kiln::load_pack<bf16_t, VEC>(w + col0 + (j * NT + t) * VEC);
  // dw in registers, or (DW_SMEM) in shared memory after the row buffers, slot (j * VEC + k) * NT + t
  // (consecutive threads, consecutive words).
  float dw_regs[DW_SMEM ? 1 : PPT * VEC];
  float* dws = reinterpret_cast<float*>(sx + STAGES * CHUNK) + t;
  auto dw = [&](int e) -> float& { return DW_SMEM ? dws[e * NT] : dw_regs[DW_SMEM ? 0 : e]; };
#pragma unroll
  for (int j = 0; j < PPT * VEC; ++j) dw(j) = 0.f;
  const float inv_cols = 1.f / float(cols);

  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    const unsigned ph = unsigned(i / STAGES) & 1u;
    const long long row = r0 + i * rstep;
    const float rs = inv_rms[row];
    bulk::wait(&full[s], ph);
    P a[PPT], b[PPT];
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      a[j] = *reinterpret_cast<const P*>(sdy + s * CHUNK + (j * NT + t) * VEC);
      b[j] = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
    }
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PPT; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        acc = fmaf(kiln::to_float(a[j].v[k]) * kiln::to_float(wv[j].v[k]), kiln::to_float(b[j].v[k]), acc);
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();
    if (t == 0 && i + STAGES < n) issue(s, row + STAGES * rstep);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
    if constexpr (CLUSTER > 1) {
      if (t == 0) row_sums[i & 1] = sum;
      kiln::bwd::cluster_sync();
      sum = 0.f;
#pragma unroll
      for (unsigned q = 0; q < CLUSTER; ++q) sum += kiln::bwd::cluster_load(&row_sums[i & 1], q);
    }
    const float k2 = rs * rs * sum * inv_cols;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float fdy = kiln::to_float(a[j].v[k]), fx = kiln::to_float(b[j].v[k]);
        out.v[k] = kiln::from_float<bf16_t>(rs * fmaf(-fx, k2, fdy * kiln::to_float(wv[j].v[k])));
        dw(j * VEC + k) = fmaf(fdy * fx, rs, dw(j * VEC + k));
      }
      kiln::store_pack<bf16_t, VEC>(dx + row * cols + col0 + (j * NT + t) * VEC, out);
    }
  }
#pragma unroll
  for (int j = 0; j < PPT; ++j) {
    float* p = partial + slab * cols + col0 + (j * NT + t) * VEC;
    reinterpret_cast<float4*>(p)[0] = make_float4(dw(j * VEC), dw(j * VEC + 1), dw(j * VEC + 2), dw(j * VEC + 3));
    reinterpret_cast<float4*>(p)[1] =
        make_float4(dw(j * VEC + 4), dw(j * VEC + 5), dw(j * VEC + 6), dw(j * VEC + 7));
  }
  if constexpr (CLUSTER > 1) kiln::bwd::cluster_sync();
}

// RMSNorm forward with the same ring: y = x * rsqrt(mean(x^2) + eps) * w.
template <int NT, int PPT, int STAGES, int CLUSTER>
__global__ void __launch_bounds__(NT) fwd_bulk(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                               bf16_t* __restrict__ y, long long rows, long long cols,
                                               long long slabs, float eps, int interleave) {
  constexpr int CHUNK = NT * PPT * VEC;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sx = reinterpret_cast<bf16_t*>(smem);
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float row_sums[2];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = CLUSTER > 1 ? kiln::bwd::cluster_rank() : 0u;
  const long long slab = blockIdx.x / CLUSTER;
  const long long col0 = (long long)rank * CHUNK;
  const long long r0 = interleave ? slab : slab * rows / slabs;
  const long long n = interleave ? (rows - slab + slabs - 1) / slabs : (slab + 1) * rows / slabs - r0;
  const long long rstep = interleave ? slabs : 1;
  if (t == 0) {
    for (int s = 0; s < STAGES; ++s) bulk::bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s, long long row) {
    bulk::expect_tx(&full[s], CHUNK * 2u);
    bulk::load(sx + s * CHUNK, x + row * cols + col0, CHUNK * 2, &full[s]);
  };
  if (t == 0)
    for (int s = 0; s < STAGES && s < n; ++s) issue(s, r0 + s * rstep);
  P wv[PPT];
#pragma unroll
  for (int j = 0; j < PPT; ++j) wv[j] = kiln::load_pack<bf16_t, VEC>(w + col0 + (j * NT + t) * VEC);
  const float inv_cols = 1.f / float(cols);
  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    const unsigned ph = unsigned(i / STAGES) & 1u;
    const long long row = r0 + i * rstep;
    bulk::wait(&full[s], ph);
    P b[PPT];
#pragma unroll
    for (int j = 0; j < PPT; ++j) b[j] = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PPT; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = kiln::to_float(b[j].v[k]);
        acc = fmaf(v, v, acc);
      }
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();
    if (t == 0 && i + STAGES < n) issue(s, row + STAGES * rstep);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
    if constexpr (CLUSTER > 1) {
      if (t == 0) row_sums[i & 1] = sum;
      kiln::bwd::cluster_sync();
      sum = 0.f;
#pragma unroll
      for (unsigned q = 0; q < CLUSTER; ++q) sum += kiln::bwd::cluster_load(&row_sums[i & 1], q);
    }
    const float r = rsqrtf(sum * inv_cols + eps);
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = kiln::from_float<bf16_t>(kiln::to_float(b[j].v[k]) * r * kiln::to_float(wv[j].v[k]));
      kiln::store_pack<bf16_t, VEC>(y + row * cols + col0 + (j * NT + t) * VEC, out);
    }
  }
  if constexpr (CLUSTER > 1) kiln::bwd::cluster_sync();
}

// ---- harness ----

static int g_sms = 0;

struct BwdData {
  long long rows, cols;
  bf16_t *dy, *x, *w, *dx, *dw;
  float *inv_rms, *partial;
  size_t partial_cap;
};

static BwdData make_bwd(long long rows, long long cols) {
  BwdData d{rows, cols};
  const size_t n = size_t(rows) * cols;
  d.dy = rand_bf16(n, 11);
  d.x = rand_bf16(n, 12);
  d.w = rand_bf16(cols, 13);
  CK(cudaMalloc(&d.dx, n * 2));
  CK(cudaMalloc(&d.dw, cols * 2));
  std::vector<float> h(rows);
  std::mt19937 g(5);
  std::uniform_real_distribution<float> u(0.5f, 2.f);
  for (auto& v : h) v = u(g);
  CK(cudaMalloc(&d.inv_rms, rows * 4));
  CK(cudaMemcpy(d.inv_rms, h.data(), rows * 4, cudaMemcpyHostToDevice));
  d.partial_cap = size_t(2048) * cols;
  CK(cudaMalloc(&d.partial, d.partial_cap * 4));
  return d;
}

static void free_bwd(BwdData& d) {
  CK(cudaFree(d.dy)); CK(cudaFree(d.x)); CK(cudaFree(d.w)); CK(cudaFree(d.dx)); CK(cudaFree(d.dw));
  CK(cudaFree(d.inv_rms)); CK(cudaFree(d.partial));
}

// Candidate second stage: C adjacent columns per block (one 32-byte sector per slab row when C is
// 8), BLOCK / C slab lanes; lanes of a warp with the same column add by shuffles, then the warps
// through shared memory, in a fixed order.
template <int C, int BLOCK>
__global__ void __launch_bounds__(BLOCK) reduce2(const float* __restrict__ partial, bf16_t* __restrict__ dw,
                                                 long long slabs, long long cols) {
  constexpr int L = BLOCK / C, k_warps = BLOCK / 32;
  __shared__ float sums[k_warps][C];
  const int c = int(threadIdx.x) % C, l = int(threadIdx.x) / C;
  const long long col = (long long)blockIdx.x * C + c;
  float acc = 0.f;
  if (col < cols) {
    long long s = l;
    for (; s + 3 * L < slabs; s += 4 * L) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = partial[(s + u * L) * cols + col];
#pragma unroll
      for (int u = 0; u < 4; ++u) acc += v[u];
    }
    for (; s < slabs; s += L) acc += partial[s * cols + col];
  }
#pragma unroll
  for (int off = C; off < 32; off *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane < C) sums[warp][lane] = acc;
  __syncthreads();
  if (threadIdx.x < C && col < cols) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < k_warps; ++q) t += sums[q][threadIdx.x];
    dw[col] = kiln::from_float<bf16_t>(t);
  }
}

static int g_reduce = 0;  // 0: kiln's; 8, 16, 32: reduce2 with that many columns per block

static void reduce(const BwdData& d, long long slabs) {
  const unsigned c = unsigned(d.cols);
  if (g_reduce == 8) reduce2<8, 512><<<(c + 7) / 8, 512>>>(d.partial, d.dw, slabs, d.cols);
  else if (g_reduce == 16) reduce2<16, 512><<<(c + 15) / 16, 512>>>(d.partial, d.dw, slabs, d.cols);
  else if (g_reduce == 32) reduce2<32, 512><<<(c + 31) / 32, 512>>>(d.partial, d.dw, slabs, d.cols);
  else kiln::rmsnorm_bwd_reduce<bf16_t, 512, 32><<<unsigned((d.cols + 31) / 32), 512>>>(d.partial, d.dw, slabs, d.cols);
}

static double bwd_bytes(const BwdData& d) { return 3.0 * d.rows * d.cols * 2 + d.cols * 4.0 + d.rows * 4.0; }

struct Ref {
  std::vector<bf16_t> dx, dw;
};
static Ref g_ref;

// kiln's rmsnorm_bwd with the heuristic's choice (families/rmsnorm_bwd, bf16, H100), + reduce.
template <int GROUP, int ROWS, int PACKS, int CLUSTER>
static void kiln_bwd(BwdData& d) {
  auto k = kiln::rmsnorm_bwd<bf16_t, GROUP, ROWS, VEC, PACKS, CLUSTER, 1024>;
  const int resident = 1024 / (GROUP * ROWS);
  const int spread = CLUSTER >= 4 ? CLUSTER / 2 : 1;
  const long long slabs = std::min<long long>(g_sms * resident / CLUSTER * spread, (d.rows + ROWS - 1) / ROWS);
  auto main_k = [&] {
    launch(k, unsigned(slabs * CLUSTER), GROUP * ROWS, 0, CLUSTER, (const bf16_t*)d.dy, (const bf16_t*)d.x,
           (const bf16_t*)d.w, (const float*)d.inv_rms, d.dx, d.partial, d.rows, d.cols, d.cols, d.cols, d.cols,
           slabs);
  };
  main_k();
  reduce(d, slabs);
  CK(cudaDeviceSynchronize());
  g_ref.dx = to_host(d.dx, size_t(d.rows) * d.cols);
  g_ref.dw = to_host(d.dw, d.cols);
  const double tm = time_us(main_k), tr = time_us([&] { reduce(d, slabs); });
  const double tt = time_us([&] { main_k(); reduce(d, slabs); });
  std::printf("%6lld x %-6lld kiln   G%d R%d P%d C%d slabs %4lld: main %8.2f reduce %6.2f total %8.2f us  %6.0f GB/s\n",
              d.rows, d.cols, GROUP, ROWS, PACKS, CLUSTER, slabs, tm, tr, tt, bwd_bytes(d) / tt * 1e-3);
}

static double worst_dx_dw(const BwdData& d) {
  const auto dx = to_host(d.dx, size_t(d.rows) * d.cols), dw = to_host(d.dw, d.cols);
  auto f = [](bf16_t v) {
    const unsigned u = unsigned(v.bits) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return double(x);
  };
  double worst = 0;
  for (size_t i = 0; i < dx.size(); ++i)
    worst = std::max(worst, std::fabs(f(dx[i]) - f(g_ref.dx[i])) / std::max(1e-2, std::fabs(f(g_ref.dx[i]))));
  for (size_t i = 0; i < dw.size(); ++i)
    worst = std::max(worst, std::fabs(f(dw[i]) - f(g_ref.dw[i])) / std::max(1.0, std::fabs(f(g_ref.dw[i]))));
  return worst;
}

template <int NT, int PPT, int STAGES, int CLUSTER, int PIECES = 1, bool DW_SMEM = false>
static void bulk_bwd(BwdData& d, int per_sm_cap = 64, int interleave = 0) {
  if (d.cols != (long long)CLUSTER * NT * PPT * VEC) return;
  auto k = bwd_bulk<NT, PPT, STAGES, CLUSTER, PIECES, DW_SMEM>;
  const size_t smem = size_t(STAGES) * NT * PPT * VEC * 2 * 2 + (DW_SMEM ? size_t(NT) * PPT * VEC * 4 : 0);
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  if (CLUSTER > 1) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int occ = std::min(per_sm_cap, occupancy(k, NT, smem));
  if (occ < 1) {
    std::printf("  bulk NT%d P%d S%d C%d: does not fit\n", NT, PPT, STAGES, CLUSTER);
    return;
  }
  const int spread = CLUSTER >= 4 ? CLUSTER / 2 : 1;
  const long long slabs = std::min<long long>(std::max(1, g_sms * occ / CLUSTER * spread), d.rows);
  CK(cudaMemset(d.dx, 0xff, size_t(d.rows) * d.cols * 2));
  auto main_k = [&] {
    launch(k, unsigned(slabs * CLUSTER), NT, smem, CLUSTER, (const bf16_t*)d.dy, (const bf16_t*)d.x,
           (const bf16_t*)d.w, (const float*)d.inv_rms, d.dx, d.partial, d.rows, d.cols, slabs, interleave);
  };
  main_k();
  reduce(d, slabs);
  CK(cudaDeviceSynchronize());
  const double err = worst_dx_dw(d);
  const double tm = time_us(main_k), tr = time_us([&] { reduce(d, slabs); });
  const double tt = time_us([&] { main_k(); reduce(d, slabs); });
  std::printf("%6lld x %-6lld bulk   NT%d P%d S%d C%d pc%d dws%d il%d occ %d slabs %4lld red%d: main %8.2f reduce %6.2f total %8.2f us  %6.0f GB/s  err %.2g\n",
              d.rows, d.cols, NT, PPT, STAGES, CLUSTER, PIECES, int(DW_SMEM), interleave, occ, slabs, g_reduce, tm, tr, tt,
              bwd_bytes(d) / tt * 1e-3, err);
}

// kiln's rmsnorm_bwd_bulk (the template as adopted) with its reduce, as the family launches them.
template <int NT, int PPT, int STAGES>
static void kiln_bulk(BwdData& d, bool cluster_launch = false) {
  auto k = kiln::rmsnorm_bwd_bulk<bf16_t, NT, PPT, STAGES>;
  const size_t smem = size_t(STAGES) * 2 * NT * PPT * VEC * 2 + (PPT * VEC > 16 ? size_t(NT) * PPT * VEC * 4 : 0);
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const long long slabs = std::min<long long>(g_sms * std::max(1, 512 / NT), d.rows);
  CK(cudaMemset(d.dx, 0xff, size_t(d.rows) * d.cols * 2));
  auto main_k = [&] {
    if (cluster_launch)
      launch(k, unsigned(slabs), NT, smem, 1, (const bf16_t*)d.dy, (const bf16_t*)d.x, (const bf16_t*)d.w,
             (const float*)d.inv_rms, d.dx, d.partial, d.rows, d.cols, d.cols, d.cols, d.cols, slabs);
    else
      k<<<unsigned(slabs), NT, smem>>>(d.dy, d.x, d.w, d.inv_rms, d.dx, d.partial, d.rows, d.cols, d.cols, d.cols,
                                       d.cols, slabs);
  };
  const int columns = d.cols / 32 >= 256 ? 32 : d.cols / 16 >= 256 ? 16 : 8;
  auto red = [&] {
    if (columns == 8) kiln::rmsnorm_bwd_reduce<bf16_t, 512, 8><<<unsigned(d.cols / 8), 512>>>(d.partial, d.dw, slabs, d.cols);
    else if (columns == 16) kiln::rmsnorm_bwd_reduce<bf16_t, 512, 16><<<unsigned(d.cols / 16), 512>>>(d.partial, d.dw, slabs, d.cols);
    else kiln::rmsnorm_bwd_reduce<bf16_t, 512, 32><<<unsigned(d.cols / 32), 512>>>(d.partial, d.dw, slabs, d.cols);
  };
  main_k();
  red();
  CK(cudaDeviceSynchronize());
  const double err = worst_dx_dw(d);
  const double tm = time_us(main_k), tr = time_us(red);
  const double tt = time_us([&] { main_k(); red(); });
  std::printf("%6lld x %-6lld kilnbulk cl%d NT%d P%d S%d slabs %4lld col%d: main %8.2f reduce %6.2f total %8.2f us  %6.0f GB/s  err %.2g\n",
              d.rows, d.cols, int(cluster_launch), NT, PPT, STAGES, slabs, columns, tm, tr, tt, bwd_bytes(d) / tt * 1e-3, err);
}

static void bwd_shape(long long rows, long long cols) {
  BwdData d = make_bwd(rows, cols);
  g_reduce = 0;
  switch (cols) {
    case 2048:
      kiln_bwd<128, 2, 2, 1>(d);
      g_reduce = 8;
      kiln_bulk<128, 2, 4>(d);
      bulk_bwd<128, 2, 4, 1>(d, 4, 1);
      kiln_bulk<128, 2, 4>(d);
      break;
    case 8192:
      kiln_bwd<512, 1, 2, 1>(d);
      g_reduce = 16;
      kiln_bulk<512, 2, 4>(d);
      bulk_bwd<512, 2, 4, 1>(d, 64, 1);
      kiln_bulk<512, 2, 4>(d);
      break;
    case 16384:
      kiln_bwd<512, 1, 2, 2>(d);
      g_reduce = 32;
      kiln_bulk<512, 4, 2>(d);
      bulk_bwd<512, 4, 2, 1, 1, true>(d, 64, 1);
      kiln_bulk<512, 4, 2>(d);
      break;
  }
  free_bwd(d);
}

// kiln's rmsnorm_fwd with the heuristic's choice for >= 2048 rows (8-byte packs), dynamic shared
// memory as families/rmsnorm gives it.
template <int B>
static void kiln_fwd(long long rows, long long cols, bf16_t* x, bf16_t* w, bf16_t* y) {
  constexpr int V = 4;
  const long long pack_bytes = V * 2, packs = cols / V;
  const long long cached = (B >= 1024 ? 8 : 16) / std::max<long long>(1, pack_bytes / 4);
  size_t smem;
  if (packs <= B * cached) smem = B < 1024 && pack_bytes >= 8 ? size_t(packs * pack_bytes) : 0;
  else smem = size_t(std::clamp<long long>(packs - B * cached, 0, 96 * 1024 / pack_bytes) * pack_bytes);
  auto k = kiln::rmsnorm_fwd<bf16_t, B, V>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  auto go = [&] { k<<<unsigned(rows), B, smem>>>(x, w, y, nullptr, rows, cols, cols, cols, 1e-6f); };
  go();
  CK(cudaDeviceSynchronize());
  const double a = time_us(go), b = time_us(go);
  std::printf("%6lld x %-6lld fwd kiln B%d: %8.2f %8.2f us  %6.0f GB/s\n", rows, cols, B, a, b,
              4.0 * rows * cols / std::min(a, b) * 1e-3);
}

template <int NT, int PPT, int STAGES, int CLUSTER>
static void bulk_fwd(long long rows, long long cols, bf16_t* x, bf16_t* w, bf16_t* y, bf16_t* y_ref,
                     int per_sm_cap = 64, int interleave = 0) {
  if (cols != (long long)CLUSTER * NT * PPT * VEC) return;
  auto k = fwd_bulk<NT, PPT, STAGES, CLUSTER>;
  const size_t smem = size_t(STAGES) * NT * PPT * VEC * 2;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  if (CLUSTER > 1) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const int occ = std::min(per_sm_cap, occupancy(k, NT, smem));
  if (occ < 1) return;
  const int spread = CLUSTER >= 4 ? CLUSTER / 2 : 1;
  const long long slabs = std::min<long long>(std::max(1, g_sms * occ / CLUSTER * spread), rows);
  CK(cudaMemset(y, 0xff, size_t(rows) * cols * 2));
  auto go = [&] {
    launch(k, unsigned(slabs * CLUSTER), NT, smem, CLUSTER, (const bf16_t*)x, (const bf16_t*)w, y, rows, cols,
           slabs, 1e-6f, interleave);
  };
  go();
  CK(cudaDeviceSynchronize());
  const double err = max_rel(y, y_ref, size_t(rows) * cols);
  const double a = time_us(go), b = time_us(go);
  std::printf("%6lld x %-6lld fwd bulk NT%d P%d S%d C%d il%d occ %d: %8.2f %8.2f us  %6.0f GB/s  err %.2g\n", rows,
              cols, NT, PPT, STAGES, CLUSTER, interleave, occ, a, b, 4.0 * rows * cols / std::min(a, b) * 1e-3, err);
}

static void fwd_shape(long long rows, long long cols) {
  const size_t n = size_t(rows) * cols;
  bf16_t *x = rand_bf16(n, 21), *w = rand_bf16(cols, 22), *y, *y_ref;
  CK(cudaMalloc(&y, n * 2));
  CK(cudaMalloc(&y_ref, n * 2));
  switch (cols) {
    case 2048:
      kiln_fwd<64>(rows, cols, x, w, y_ref);
      bulk_fwd<256, 1, 4, 1>(rows, cols, x, w, y, y_ref);
      bulk_fwd<256, 1, 4, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      bulk_fwd<128, 2, 8, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      break;
    case 5120:
      kiln_fwd<256>(rows, cols, x, w, y_ref);
      bulk_fwd<160, 4, 4, 1>(rows, cols, x, w, y, y_ref);
      bulk_fwd<160, 4, 4, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      bulk_fwd<320, 2, 4, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      break;
    case 16384:
      kiln_fwd<512>(rows, cols, x, w, y_ref);
      bulk_fwd<512, 4, 4, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      bulk_fwd<256, 8, 4, 1>(rows, cols, x, w, y, y_ref, 64, 1);
      break;
    case 65536:
      kiln_fwd<512>(rows, cols, x, w, y_ref);
      bulk_fwd<512, 2, 4, 8>(rows, cols, x, w, y, y_ref);
      bulk_fwd<512, 2, 4, 8>(rows, cols, x, w, y, y_ref, 64, 1);
      bulk_fwd<512, 4, 3, 4>(rows, cols, x, w, y, y_ref, 64, 1);
      break;
  }
  CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(y)); CK(cudaFree(y_ref));
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  const bool only_fwd = argc > 1 && std::strcmp(argv[1], "fwd") == 0;
  const bool only_bwd = argc > 1 && std::strcmp(argv[1], "bwd") == 0;
  if (!only_fwd)
    for (long long rows : {4096ll, 32768ll})
      for (long long cols : {2048ll, 8192ll, 16384ll}) bwd_shape(rows, cols);
  if (!only_bwd) {
    for (long long rows : {4096ll, 32768ll})
      for (long long cols : {2048ll, 5120ll, 16384ll}) fwd_shape(rows, cols);
    fwd_shape(4096, 65536);
  }
  return 0;
}
