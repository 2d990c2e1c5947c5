// Experiment (nvcc on the GPU machine): RMSNorm forward and backward at hidden 65536 (bf16 rows of
// 128 KiB), where neither kernel of kiln reaches 85% of the copy bandwidth (forward 80.3%,
// backward 67.5% on an H100, fifth session). Candidates:
//  - fwd_wide: one 1024-thread block per SM, persistent over its rows. A row arrives in one
//    shared-memory buffer by bulk copy; the threads move it into registers (64 elements each),
//    and right after the row's reduction barrier the next row's copy is posted into the freed
//    buffer, so the next read overlaps this row's stores (kiln's kernel keeps the whole row too,
//    but issues the next row's reads only when the next block starts).
//  - fwd_pipe / bwd_pipe: a row split over a cluster of CLUSTER blocks, a ring of STAGES
//    buffers per block, and the partial row sums exchanged through distributed shared memory with
//    the cluster barrier split into arrive and wait one row apart: a block posts row i's partial
//    sum, arrives, finishes row i - 1 (whose sums the previous wait made visible), then waits. The
//    clustered bulk kernels of bench/exp/bulk_exp.cu waited on the whole cluster every row and lost
//    10-40% to kiln's register kernels at this width.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/wide_exp.cu
#include "common/bulk.cuh"
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "rmsnorm_bwd/rmsnorm_bwd.cuh"
#include "rmsnorm_bwd/rmsnorm_bwd_reduce.cuh"
#include "exp_util.h"

using kiln::bf16_t;
using namespace exp_util;
namespace bulk = kiln::bulk;

constexpr int VEC = 8;  // bf16 elements per 16-byte pack
using P = kiln::Pack<bf16_t, VEC>;

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The sum over the cluster of `slot` (one float per block): lanes 0..CLUSTER-1 of each warp read
// one block's copy, the warp adds them.
template <int CLUSTER>
__device__ __forceinline__ float cluster_total(const float* slot) {
  const int lane = int(threadIdx.x) % 32;
  float v = lane < CLUSTER ? kiln::bwd::cluster_load(slot, unsigned(lane)) : 0.f;
  return kiln::warp_sum(v);
}

// ---- forward, no cluster: one row buffer, the row held in registers ----
template <int NT, int PPT>
__global__ void __launch_bounds__(NT, 1) fwd_wide(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                                  bf16_t* __restrict__ y, long long rows, long long cols,
                                                  long long slabs, float eps) {
  constexpr int CHUNK = NT * PPT * VEC;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sx = reinterpret_cast<bf16_t*>(smem);
  __shared__ unsigned long long full;
  __shared__ float scratch[2][32];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const long long slab = blockIdx.x;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  if (t == 0) bulk::barrier_init(&full, 1);
  __syncthreads();
  auto post = [&](long long row) {
    bulk::arrive_expect(&full, CHUNK * 2u);
    bulk::copy(sx, x + row * cols, CHUNK * 2u, &full);
  };
  if (t == 0 && n > 0) post(slab);
  const float inv_cols = 1.f / float(cols);
  for (long long i = 0; i < n; ++i) {
    const long long row = slab + i * slabs;
    bulk::wait(&full, unsigned(i) & 1u);
    P b[PPT];
#pragma unroll
    for (int j = 0; j < PPT; ++j) b[j] = *reinterpret_cast<const P*>(sx + (j * NT + t) * VEC);
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
    if (t == 0 && i + 1 < n) post(row + slabs);
    // Opaque to the compiler: the row stays packed (32 registers) rather than as 64 floats kept
    // from the sum of squares, which spilled.
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      unsigned* u = reinterpret_cast<unsigned*>(&b[j]);
      asm volatile("" : "+r"(u[0]), "+r"(u[1]), "+r"(u[2]), "+r"(u[3]));
    }
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
    const float r = rsqrtf(sum * inv_cols + eps);
    // The weight's base made opaque every row: loop-invariant, its 8 packs were hoisted out of the
    // row loop into 32 registers and spilled the row cache.
    const bf16_t* wb = w + t * VEC;
    asm volatile("" : "+l"(wb));
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const P wv = kiln::load_pack<bf16_t, VEC>(wb + j * NT * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = kiln::from_float<bf16_t>(kiln::to_float(b[j].v[k]) * r * kiln::to_float(wv.v[k]));
      kiln::store_pack<bf16_t, VEC>(y + row * cols + (j * NT + t) * VEC, out);
    }
  }
}

// ---- forward, no cluster: one row buffer in two halves, the first half held in registers ----
// The second half is read from shared memory and written first; a barrier then frees it for the
// next row's second half, and the first half goes out of registers while that copy runs. The first
// half's buffer is refilled right after the row's reduction barrier.
template <int NT, int PPT>
__global__ void __launch_bounds__(NT, 1) fwd_half(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                                  bf16_t* __restrict__ y, long long rows, long long cols,
                                                  long long slabs, float eps) {
  constexpr int CHUNK = NT * PPT * VEC, H = PPT / 2, HALF = CHUNK / 2;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sx = reinterpret_cast<bf16_t*>(smem);
  __shared__ unsigned long long full[2];
  __shared__ float scratch[2][32];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const long long slab = blockIdx.x;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  if (t == 0) {
    bulk::barrier_init(&full[0], 1);
    bulk::barrier_init(&full[1], 1);
  }
  __syncthreads();
  auto post = [&](int h, long long row) {
    bulk::arrive_expect(&full[h], HALF * 2u);
    bulk::copy(sx + h * HALF, x + row * cols + h * HALF, HALF * 2u, &full[h]);
  };
  if (t == 0 && n > 0) {
    post(0, slab);
    post(1, slab);
  }
  const float inv_cols = 1.f / float(cols);
  for (long long i = 0; i < n; ++i) {
    const long long row = slab + i * slabs;
    bulk::wait(&full[0], unsigned(i) & 1u);
    P a[H];
#pragma unroll
    for (int j = 0; j < H; ++j) a[j] = *reinterpret_cast<const P*>(sx + (j * NT + t) * VEC);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < H; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = kiln::to_float(a[j].v[k]);
        acc = fmaf(v, v, acc);
      }
    bulk::wait(&full[1], unsigned(i) & 1u);
#pragma unroll
    for (int j = H; j < PPT; ++j) {
      const P b = *reinterpret_cast<const P*>(sx + (j * NT + t) * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = kiln::to_float(b.v[k]);
        acc = fmaf(v, v, acc);
      }
    }
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();
    if (t == 0 && i + 1 < n) post(0, row + slabs);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
    const float r = rsqrtf(sum * inv_cols + eps);
    bf16_t* yr = y + row * cols + t * VEC;
#pragma unroll
    for (int j = H; j < PPT; ++j) {
      const P b = *reinterpret_cast<const P*>(sx + (j * NT + t) * VEC);
      const P wv = kiln::load_pack<bf16_t, VEC>(w + (j * NT + t) * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = kiln::from_float<bf16_t>(kiln::to_float(b.v[k]) * r * kiln::to_float(wv.v[k]));
      kiln::store_pack<bf16_t, VEC>(yr + j * NT * VEC, out);
    }
    __syncthreads();
    if (t == 0 && i + 1 < n) post(1, row + slabs);
#pragma unroll
    for (int j = 0; j < H; ++j) {
      const P wv = kiln::load_pack<bf16_t, VEC>(w + (j * NT + t) * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = kiln::from_float<bf16_t>(kiln::to_float(a[j].v[k]) * r * kiln::to_float(wv.v[k]));
      kiln::store_pack<bf16_t, VEC>(yr + j * NT * VEC, out);
    }
  }
}

// ---- forward, cluster, ring, split cluster barrier one row apart ----
template <int NT, int PPT, int STAGES, int CLUSTER>
__global__ void __launch_bounds__(NT, 1) fwd_pipe(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                                  bf16_t* __restrict__ y, long long rows, long long cols,
                                                  long long slabs, float eps) {
  constexpr int CHUNK = NT * PPT * VEC;
  static_assert(STAGES >= 3, "rows i - 1 and i are in use while i + 1 arrives");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sx = reinterpret_cast<bf16_t*>(smem);
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float sums[4];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = kiln::bwd::cluster_rank();
  const long long slab = blockIdx.x / CLUSTER;
  const long long col0 = (long long)rank * CHUNK;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  if (t == 0)
    for (int s = 0; s < STAGES; ++s) bulk::barrier_init(&full[s], 1);
  kiln::bwd::cluster_sync();  // every block of the cluster runs before any remote read
  auto post = [&](long long i) {
    const int s = int(i % STAGES);
    bulk::arrive_expect(&full[s], CHUNK * 2u);
    bulk::copy(sx + s * CHUNK, x + (slab + i * slabs) * cols + col0, CHUNK * 2u, &full[s]);
  };
  if (t == 0)
    for (long long i = 0; i < STAGES && i < n; ++i) post(i);
  const float inv_cols = 1.f / float(cols);
  auto finish = [&](long long i) {  // row i: its sums are visible
    const int s = int(i % STAGES);
    const float r = rsqrtf(cluster_total<CLUSTER>(&sums[i & 3]) * inv_cols + eps);
    const long long row = slab + i * slabs;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const P b = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
      const P wv = kiln::load_pack<bf16_t, VEC>(w + col0 + (j * NT + t) * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out.v[k] = kiln::from_float<bf16_t>(kiln::to_float(b.v[k]) * r * kiln::to_float(wv.v[k]));
      kiln::store_pack<bf16_t, VEC>(y + row * cols + col0 + (j * NT + t) * VEC, out);
    }
  };
  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    bulk::wait(&full[s], unsigned(i / STAGES) & 1u);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const P b = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = kiln::to_float(b.v[k]);
        acc = fmaf(v, v, acc);
      }
    }
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();  // also: every thread finished row i - 2, so its buffer is free
    if (t == 0 && i >= 2 && i - 2 + STAGES < n) post(i - 2 + STAGES);
    if (t == 0) {
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
      sums[i & 3] = sum;
    }
    cluster_arrive();
    if (i >= 1) finish(i - 1);
    cluster_wait();
  }
  if (n > 0) finish(n - 1);
  kiln::bwd::cluster_sync();  // peers may still read this block's sums
}

// ---- backward, cluster, ring, split cluster barrier one row apart ----
// EARLY (ninth session): a buffer is refilled as soon as its row's dx pass is done (a block
// barrier right after finish(i - 1), then row i - 1 + STAGES is posted), a row sooner than after
// the next row's sum barrier.
template <int NT, int PPT, int STAGES, int CLUSTER, int EARLY = 0>
__global__ void __launch_bounds__(NT, 1) bwd_pipe(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                                  const bf16_t* __restrict__ w, const float* __restrict__ inv_rms,
                                                  bf16_t* __restrict__ dx, float* __restrict__ partial,
                                                  long long rows, long long cols, long long slabs) {
  constexpr int CHUNK = NT * PPT * VEC;
  static_assert(STAGES >= 3, "rows i - 1 and i are in use while i + 1 arrives");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sdy = reinterpret_cast<bf16_t*>(smem);
  bf16_t* sx = sdy + STAGES * CHUNK;
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float sums[4];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = kiln::bwd::cluster_rank();
  const long long slab = blockIdx.x / CLUSTER;
  const long long col0 = (long long)rank * CHUNK;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  if (t == 0)
    for (int s = 0; s < STAGES; ++s) bulk::barrier_init(&full[s], 1);
  kiln::bwd::cluster_sync();
  auto post = [&](long long i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    bulk::arrive_expect(&full[s], 2u * CHUNK * 2u);
    bulk::copy(sdy + s * CHUNK, dy + row * cols + col0, CHUNK * 2u, &full[s]);
    bulk::copy(sx + s * CHUNK, x + row * cols + col0, CHUNK * 2u, &full[s]);
  };
  if (t == 0)
    for (long long i = 0; i < STAGES && i < n; ++i) post(i);
  P wv[PPT];
#pragma unroll
  for (int j = 0; j < PPT; ++j) wv[j] = kiln::load_pack<bf16_t, VEC>(w + col0 + (j * NT + t) * VEC);
  float dw[PPT * VEC];
#pragma unroll
  for (int e = 0; e < PPT * VEC; ++e) dw[e] = 0.f;
  const float inv_cols = 1.f / float(cols);
  auto finish = [&](long long i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    const float rs = inv_rms[row];
    const float k2 = rs * rs * cluster_total<CLUSTER>(&sums[i & 3]) * inv_cols;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const P a = *reinterpret_cast<const P*>(sdy + s * CHUNK + (j * NT + t) * VEC);
      const P b = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float fdy = kiln::to_float(a.v[k]), fx = kiln::to_float(b.v[k]);
        out.v[k] = kiln::from_float<bf16_t>(rs * fmaf(-fx, k2, fdy * kiln::to_float(wv[j].v[k])));
        dw[j * VEC + k] = fmaf(fdy * fx, rs, dw[j * VEC + k]);
      }
      kiln::store_pack<bf16_t, VEC>(dx + row * cols + col0 + (j * NT + t) * VEC, out);
    }
  };
  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    bulk::wait(&full[s], unsigned(i / STAGES) & 1u);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      const P a = *reinterpret_cast<const P*>(sdy + s * CHUNK + (j * NT + t) * VEC);
      const P b = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        acc = fmaf(kiln::to_float(a.v[k]) * kiln::to_float(wv[j].v[k]), kiln::to_float(b.v[k]), acc);
    }
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();
    if (!EARLY && t == 0 && i >= 2 && i - 2 + STAGES < n) post(i - 2 + STAGES);
    if (t == 0) {
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
      sums[i & 3] = sum;
    }
    cluster_arrive();
    if (i >= 1) finish(i - 1);
    if (EARLY) {
      __syncthreads();
      if (t == 0 && i >= 1 && i - 1 + STAGES < n) post(i - 1 + STAGES);
    }
    cluster_wait();
  }
  if (n > 0) finish(n - 1);
  // Partial dw row, coalesced through shared memory (the row buffers are free once every thread
  // is past its last finish).
  __syncthreads();
  float* row_out = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < PPT; ++j)
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      reinterpret_cast<float4*>(row_out + (j * NT + t) * VEC)[q] =
          make_float4(dw[j * VEC + 4 * q], dw[j * VEC + 4 * q + 1], dw[j * VEC + 4 * q + 2], dw[j * VEC + 4 * q + 3]);
  __syncthreads();
  for (int c = t; c < CHUNK; c += NT) partial[slab * cols + col0 + c] = row_out[c];
  kiln::bwd::cluster_sync();
}

// Opaque to the compiler: the pack stays as 4 packed registers rather than 8 floats kept alive.
__device__ __forceinline__ void opaque(P& p) {
  unsigned* u = reinterpret_cast<unsigned*>(&p);
  asm volatile("" : "+r"(u[0]), "+r"(u[1]), "+r"(u[2]), "+r"(u[3]));
}

// ---- backward, cluster, ring kept in flight: each row moves into registers on arrival ----
// bwd_pipe holds a row's buffer until its dx pass, so with three buffers at most one or two rows
// are in flight while a block waits on the cluster. Here every thread copies its packs of dy and
// x into registers as soon as the row lands; the block barrier of the row sum then frees the
// buffer and the next-but-STAGES row is posted into it at once, so STAGES rows stay in flight
// through the cluster exchange and the dx stores. LAG 1 finishes row i - 1 between the cluster
// barrier's arrive and wait of row i (two rows in registers); LAG 0 waits at once.
// WSM 1 keeps the block's weight range in shared memory after the ring (read per row) instead
// of 4 * PPT registers.
template <int NT, int PPT, int STAGES, int CLUSTER, int LAG, int WSM = 0>
__global__ void __launch_bounds__(NT, 1) bwd_regs(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                                  const bf16_t* __restrict__ w, const float* __restrict__ inv_rms,
                                                  bf16_t* __restrict__ dx, float* __restrict__ partial,
                                                  long long rows, long long cols, long long slabs) {
  constexpr int CHUNK = NT * PPT * VEC;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16_t* sdy = reinterpret_cast<bf16_t*>(smem);
  bf16_t* sx = sdy + STAGES * CHUNK;
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float sums[4];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = kiln::bwd::cluster_rank();
  const long long slab = blockIdx.x / CLUSTER;
  const long long col0 = (long long)rank * CHUNK;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  if (t == 0)
    for (int s = 0; s < STAGES; ++s) bulk::barrier_init(&full[s], 1);
  kiln::bwd::cluster_sync();
  auto post = [&](long long i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    bulk::arrive_expect(&full[s], 2u * CHUNK * 2u);
    bulk::copy(sdy + s * CHUNK, dy + row * cols + col0, CHUNK * 2u, &full[s]);
    bulk::copy(sx + s * CHUNK, x + row * cols + col0, CHUNK * 2u, &full[s]);
  };
  if (t == 0)
    for (long long i = 0; i < STAGES && i < n; ++i) post(i);
  P wreg[WSM ? 1 : PPT];
  P* wsm = reinterpret_cast<P*>(sx + STAGES * CHUNK);
#pragma unroll
  for (int j = 0; j < PPT; ++j) {
    const P v = kiln::load_pack<bf16_t, VEC>(w + col0 + (j * NT + t) * VEC);
    if constexpr (WSM) wsm[j * NT + t] = v; else wreg[j] = v;
  }
  // Each thread reads back only its own slots: no barrier needed.
  auto wv_at = [&](int j) -> P {
    if constexpr (WSM) return wsm[j * NT + t]; else return wreg[j];
  };
  float dw[PPT * VEC];
#pragma unroll
  for (int e = 0; e < PPT * VEC; ++e) dw[e] = 0.f;
  const float inv_cols = 1.f / float(cols);
  // Row i into registers a/b, its block sum posted to sums[i & 3], buffer re-posted.
  auto take = [&](long long i, P (&a)[PPT], P (&b)[PPT]) {
    const int s = int(i % STAGES);
    bulk::wait(&full[s], unsigned(i / STAGES) & 1u);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      a[j] = *reinterpret_cast<const P*>(sdy + s * CHUNK + (j * NT + t) * VEC);
      b[j] = *reinterpret_cast<const P*>(sx + s * CHUNK + (j * NT + t) * VEC);
      opaque(a[j]);
      opaque(b[j]);
      P wv = wv_at(j);
      opaque(wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        acc = fmaf(kiln::to_float(a[j].v[k]) * kiln::to_float(wv.v[k]), kiln::to_float(b[j].v[k]), acc);
    }
    acc = kiln::warp_sum(acc);
    if (lane == 0) scratch[i & 1][warp] = acc;
    __syncthreads();  // every thread has its packs of buffer s: refill it
    if (t == 0) {
      if (i + STAGES < n) post(i + STAGES);
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < NT / 32; ++q) sum += scratch[i & 1][q];
      sums[i & 3] = sum;
    }
  };
  auto finish = [&](long long i, P (&a)[PPT], P (&b)[PPT]) {
    const long long row = slab + i * slabs;
    const float rs = inv_rms[row];
    const float k2 = rs * rs * cluster_total<CLUSTER>(&sums[i & 3]) * inv_cols;
#pragma unroll
    for (int j = 0; j < PPT; ++j) {
      P wv = wv_at(j);
      opaque(wv);
      opaque(a[j]);  // no float copies kept from the row sum
      opaque(b[j]);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float fdy = kiln::to_float(a[j].v[k]), fx = kiln::to_float(b[j].v[k]);
        out.v[k] = kiln::from_float<bf16_t>(rs * fmaf(-fx, k2, fdy * kiln::to_float(wv.v[k])));
        dw[j * VEC + k] = fmaf(fdy * fx, rs, dw[j * VEC + k]);
      }
      kiln::store_pack<bf16_t, VEC>(dx + row * cols + col0 + (j * NT + t) * VEC, out);
    }
  };
  P a0[PPT], b0[PPT];
  if constexpr (LAG == 0) {
#pragma unroll 1
    for (long long i = 0; i < n; ++i) {
      take(i, a0, b0);
      cluster_arrive();
      cluster_wait();
      finish(i, a0, b0);
    }
  } else {
    P a1[PPT], b1[PPT];
    long long i = 0;
#pragma unroll 1
    for (; i + 1 < n; i += 2) {
      take(i, a0, b0);
      cluster_arrive();
      if (i >= 1) finish(i - 1, a1, b1);
      cluster_wait();
      take(i + 1, a1, b1);
      cluster_arrive();
      finish(i, a0, b0);
      cluster_wait();
    }
    if (i < n) {
      take(i, a0, b0);
      cluster_arrive();
      if (i >= 1) finish(i - 1, a1, b1);
      cluster_wait();
      finish(i, a0, b0);
    } else if (n > 0) {
      finish(n - 1, a1, b1);
    }
  }
  __syncthreads();
  float* row_out = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < PPT; ++j)
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      reinterpret_cast<float4*>(row_out + (j * NT + t) * VEC)[q] =
          make_float4(dw[j * VEC + 4 * q], dw[j * VEC + 4 * q + 1], dw[j * VEC + 4 * q + 2], dw[j * VEC + 4 * q + 3]);
  __syncthreads();
  for (int c = t; c < CHUNK; c += NT) partial[slab * cols + col0 + c] = row_out[c];
  kiln::bwd::cluster_sync();
}

// ---- harness ----

static int g_sms = 0;

static double g_copy_gbs = 0;  // 1 GiB copy, bytes read + written per second / 1e9

static void report(const char* what, long long rows, long long cols, double us, double bytes, double err) {
  const double gbs = bytes / us * 1e-3;
  std::printf("%6lld x %-6lld %-40s %9.2f us %6.0f GB/s %5.1f%% of copy  err %.2g\n", rows, cols, what, us, gbs,
              100.0 * gbs / g_copy_gbs, err);
}

static void fwd(long long rows, long long cols) {
  const size_t n = size_t(rows) * cols;
  bf16_t *x = rand_bf16(n, 21), *w = rand_bf16(cols, 22), *y, *y_ref;
  CK(cudaMalloc(&y, n * 2));
  CK(cudaMalloc(&y_ref, n * 2));
  const double bytes = 4.0 * rows * cols;
  {  // kiln's choice at 4096 x 65536: 1024 threads, 4-byte packs, 96 KiB of row in shared memory
    auto k = kiln::rmsnorm_fwd<bf16_t, 1024, 2>;
    const size_t smem = 96 * 1024;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    auto go = [&] { k<<<unsigned(rows), 1024, smem>>>(x, w, y_ref, nullptr, rows, cols, cols, cols, 1e-6f); };
    go();
    CK(cudaDeviceSynchronize());
    report("fwd kiln B1024 V2", rows, cols, time_us(go), bytes, 0);
    report("fwd kiln B1024 V2 (again)", rows, cols, time_us(go), bytes, 0);
  }
  {
    auto k = fwd_wide<1024, 8>;
    const size_t smem = size_t(cols) * 2;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const long long slabs = std::min<long long>(g_sms * occupancy(k, 1024, smem), rows);
    CK(cudaMemset(y, 0xff, n * 2));
    auto go = [&] { k<<<unsigned(slabs), 1024, smem>>>(x, w, y, rows, cols, slabs, 1e-6f); };
    go();
    CK(cudaDeviceSynchronize());
    const double err = max_rel(y, y_ref, n);
    report("fwd_wide NT1024 P8", rows, cols, time_us(go), bytes, err);
    report("fwd_wide NT1024 P8 (again)", rows, cols, time_us(go), bytes, err);
  }
  {
    auto k = fwd_half<1024, 8>;
    const size_t smem = size_t(cols) * 2;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const long long slabs = std::min<long long>(g_sms * occupancy(k, 1024, smem), rows);
    CK(cudaMemset(y, 0xff, n * 2));
    auto go = [&] { k<<<unsigned(slabs), 1024, smem>>>(x, w, y, rows, cols, slabs, 1e-6f); };
    go();
    CK(cudaDeviceSynchronize());
    const double err = max_rel(y, y_ref, n);
    report("fwd_half NT1024 P8", rows, cols, time_us(go), bytes, err);
    report("fwd_half NT1024 P8 (again)", rows, cols, time_us(go), bytes, err);
  }
  // The adopted template (templates/rmsnorm/rmsnorm_fwd.cuh) built by nvcc, and fwd_half with the
  // largest shared-memory carveout (less L1 for the weight's re-reads).
  for (int carveout : {-1, 100}) {
    auto k = kiln::rmsnorm_fwd_bulk<bf16_t, 1024, 8>;
    const size_t smem = size_t(cols) * 2;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    CK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
    const long long slabs = std::min<long long>(g_sms, rows);
    CK(cudaMemset(y, 0xff, n * 2));
    auto go = [&] { k<<<unsigned(slabs), 1024, smem>>>(x, w, y, nullptr, rows, cols, cols, cols, 1e-6f); };
    go();
    CK(cudaDeviceSynchronize());
    const double err = max_rel(y, y_ref, n);
    report(carveout < 0 ? "kiln::rmsnorm_fwd_bulk<1024,8> (nvcc)" : "kiln::rmsnorm_fwd_bulk carveout 100", rows, cols,
           time_us(go), bytes, err);
    auto h = fwd_half<1024, 8>;
    CK(cudaFuncSetAttribute(h, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
    auto goh = [&] { h<<<unsigned(slabs), 1024, smem>>>(x, w, y, rows, cols, slabs, 1e-6f); };
    report(carveout < 0 ? "fwd_half (default carveout)" : "fwd_half carveout 100", rows, cols, time_us(goh), bytes, err);
  }
  auto pipe = [&](auto k, int nt, int ppt, int stages, int cluster) {
    const size_t smem = size_t(stages) * nt * ppt * VEC * 2;
    if (cols != (long long)cluster * nt * ppt * VEC) return;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (cluster > 8) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    const int clusters = max_clusters(k, nt, smem, cluster);
    const long long slabs = std::min<long long>(clusters, rows);
    CK(cudaMemset(y, 0xff, n * 2));
    auto go = [&] {
      launch(k, unsigned(slabs * cluster), nt, smem, cluster, (const bf16_t*)x, (const bf16_t*)w, y, rows, cols,
             slabs, 1e-6f);
    };
    go();
    CK(cudaDeviceSynchronize());
    const double err = max_rel(y, y_ref, n);
    char name[96];
    std::snprintf(name, sizeof name, "fwd_pipe NT%d P%d S%d C%d slabs %lld", nt, ppt, stages, cluster, slabs);
    report(name, rows, cols, time_us(go), bytes, err);
  };
  pipe(fwd_pipe<512, 2, 4, 8>, 512, 2, 4, 8);
  pipe(fwd_pipe<512, 2, 8, 8>, 512, 2, 8, 8);
  pipe(fwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4);
  pipe(fwd_pipe<512, 4, 6, 4>, 512, 4, 6, 4);
  pipe(fwd_pipe<1024, 4, 3, 2>, 1024, 4, 3, 2);
  pipe(fwd_pipe<256, 4, 8, 8>, 256, 4, 8, 8);
  CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(y)); CK(cudaFree(y_ref));
}

static void bwd(long long rows, long long cols) {
  const size_t n = size_t(rows) * cols;
  bf16_t *dy = rand_bf16(n, 11), *x = rand_bf16(n, 12), *w = rand_bf16(cols, 13), *dx, *dw, *dx_ref, *dw_ref;
  float *inv_rms, *partial;
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dx_ref, n * 2));
  CK(cudaMalloc(&dw, cols * 2));
  CK(cudaMalloc(&dw_ref, cols * 2));
  {
    std::vector<float> h(rows);
    std::mt19937 g(5);
    std::uniform_real_distribution<float> u(0.5f, 2.f);
    for (auto& v : h) v = u(g);
    CK(cudaMalloc(&inv_rms, rows * 4));
    CK(cudaMemcpy(inv_rms, h.data(), rows * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&partial, size_t(1024) * cols * 4));
  const double bytes = 3.0 * rows * cols * 2 + cols * 4.0 + rows * 4.0;
  auto red = [&](long long slabs, bf16_t* out) {
    kiln::rmsnorm_bwd_reduce<bf16_t, 512, 32><<<unsigned(cols / 32), 512>>>(partial, out, slabs, cols);
  };
  {  // kiln's choice: group 512, 1 row, 2 packs, cluster 8, 1024 threads per SM, 132 slabs
    auto k = kiln::rmsnorm_bwd<bf16_t, 512, 1, VEC, 2, 8, 1024>;
    const long long slabs = std::min<long long>(g_sms * 2 / 8 * 4, rows);
    auto main_k = [&] {
      launch(k, unsigned(slabs * 8), 512, 0, 8, (const bf16_t*)dy, (const bf16_t*)x, (const bf16_t*)w,
             (const float*)inv_rms, dx_ref, partial, rows, cols, cols, cols, cols, slabs);
    };
    main_k();
    red(slabs, dw_ref);
    CK(cudaDeviceSynchronize());
    report("bwd kiln G512 P2 C8 (main + reduce)", rows, cols, time_us([&] { main_k(); red(slabs, dw_ref); }), bytes, 0);
    report("bwd kiln (again)", rows, cols, time_us([&] { main_k(); red(slabs, dw_ref); }), bytes, 0);
  }
  auto pipe = [&](auto k, int nt, int ppt, int stages, int cluster, const char* tag = "bwd_pipe", int wsm = 0,
                  int use_clusters = 0) {
    const size_t smem = size_t(stages * 2 + wsm) * nt * ppt * VEC * 2;
    if (cols != (long long)cluster * nt * ppt * VEC) return;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (cluster > 8) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    const int clusters = use_clusters > 0 ? use_clusters : max_clusters(k, nt, smem, cluster);
    const long long slabs = std::min<long long>(clusters, rows);
    CK(cudaMemset(dx, 0xff, n * 2));
    CK(cudaMemset(dw, 0xff, cols * 2));
    auto main_k = [&] {
      launch(k, unsigned(slabs * cluster), nt, smem, cluster, (const bf16_t*)dy, (const bf16_t*)x, (const bf16_t*)w,
             (const float*)inv_rms, dx, partial, rows, cols, slabs);
    };
    main_k();
    red(slabs, dw);
    CK(cudaDeviceSynchronize());
    const double err = std::max(max_rel(dx, dx_ref, n), max_rel(dw, dw_ref, size_t(cols)));
    char name[96];
    std::snprintf(name, sizeof name, "%s NT%d P%d S%d C%d slabs %lld", tag, nt, ppt, stages, cluster, slabs);
    report(name, rows, cols, time_us([&] { main_k(); red(slabs, dw); }), bytes, err);
  };
  pipe(bwd_pipe<512, 2, 4, 8>, 512, 2, 4, 8);
  pipe(bwd_pipe<512, 2, 6, 8>, 512, 2, 6, 8);
  pipe(bwd_pipe<256, 4, 4, 8>, 256, 4, 4, 8);
  pipe(bwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4);
  pipe(bwd_pipe<1024, 2, 3, 4>, 1024, 2, 3, 4);
  pipe(bwd_pipe<512, 1, 6, 16>, 512, 1, 6, 16);
  if (std::getenv("WIDE_EARLY")) {
    // Ninth session: buffers refilled a row sooner (EARLY), each against the same shape without,
    // and the first pair again at the end.
    pipe(bwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4);
    pipe(bwd_pipe<512, 4, 3, 4, 1>, 512, 4, 3, 4, "bwd_pipe EARLY");
    pipe(bwd_pipe<1024, 2, 3, 4, 1>, 1024, 2, 3, 4, "bwd_pipe EARLY");
    pipe(bwd_pipe<512, 2, 4, 8, 1>, 512, 2, 4, 8, "bwd_pipe EARLY");
    pipe(bwd_pipe<512, 2, 6, 8, 1>, 512, 2, 6, 8, "bwd_pipe EARLY");
    pipe(bwd_pipe<256, 4, 6, 8, 1>, 256, 4, 6, 8, "bwd_pipe EARLY");
    for (int c : {10, 20}) pipe(bwd_pipe<512, 4, 3, 4, 1>, 512, 4, 3, 4, "bwd_pipe EARLY", 0, c);
    pipe(bwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4);
    pipe(bwd_pipe<512, 4, 3, 4, 1>, 512, 4, 3, 4, "bwd_pipe EARLY");
    return;
  }
  const bool scaling = std::getenv("WIDE_SCALING") != nullptr;
  if (scaling) {
    // Does bwd_pipe's throughput follow the number of SMs it runs on (30 clusters of 4 hold 120 of
    // the 132)? Fewer clusters, same kernel.
    for (int c : {10, 15, 20, 25, 30}) pipe(bwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4, "bwd_pipe", 0, c);
    // kiln's register kernel in clusters of 4, one 512-thread block per SM, every cluster resident.
    auto k = kiln::rmsnorm_bwd<bf16_t, 512, 1, VEC, 4, 4, 512>;
    for (long long slabs : {30LL, 60LL, 120LL}) {
      auto main_k = [&] {
        launch(k, unsigned(slabs * 4), 512, 0, 4, (const bf16_t*)dy, (const bf16_t*)x, (const bf16_t*)w,
               (const float*)inv_rms, dx, partial, rows, cols, cols, cols, cols, slabs);
      };
      CK(cudaMemset(dx, 0xff, n * 2));
      main_k();
      red(slabs, dw);
      CK(cudaDeviceSynchronize());
      const double err = std::max(max_rel(dx, dx_ref, n), max_rel(dw, dw_ref, size_t(cols)));
      char name[96];
      std::snprintf(name, sizeof name, "bwd kiln G512 P4 C4 T512 slabs %lld", slabs);
      report(name, rows, cols, time_us([&] { main_k(); red(slabs, dw); }), bytes, err);
    }
    return;
  }
  // Rows moved into registers on arrival (eighth session). The first call's candidates
  // (bwd_regs L0/L1, weight in registers) are in the log of that call; this list is the second's.
  pipe(bwd_pipe<512, 4, 3, 4>, 512, 4, 3, 4);
  pipe(bwd_regs<512, 4, 3, 4, 1, 1>, 512, 4, 3, 4, "bwd_regs L1 wsm", 1);
  pipe(bwd_regs<512, 4, 3, 4, 0, 1>, 512, 4, 3, 4, "bwd_regs L0 wsm", 1);
  pipe(bwd_regs<256, 8, 3, 4, 1, 1>, 256, 8, 3, 4, "bwd_regs L1 wsm", 1);
  pipe(bwd_regs<1024, 2, 3, 4, 1, 1>, 1024, 2, 3, 4, "bwd_regs L1 wsm", 1);
  pipe(bwd_regs<256, 4, 6, 8, 1, 1>, 256, 4, 6, 8, "bwd_regs L1 wsm", 1);
  pipe(bwd_regs<512, 4, 3, 4, 0>, 512, 4, 3, 4, "bwd_regs L0");
  pipe(bwd_regs<512, 4, 3, 4, 1>, 512, 4, 3, 4, "bwd_regs L1");
  pipe(bwd_regs<256, 8, 3, 4, 0>, 256, 8, 3, 4, "bwd_regs L0");
  pipe(bwd_regs<1024, 2, 3, 4, 0>, 1024, 2, 3, 4, "bwd_regs L0");
  pipe(bwd_regs<512, 2, 6, 8, 0>, 512, 2, 6, 8, "bwd_regs L0");
  pipe(bwd_regs<512, 2, 6, 8, 1>, 512, 2, 6, 8, "bwd_regs L1");
  pipe(bwd_regs<256, 4, 6, 8, 1>, 256, 4, 6, 8, "bwd_regs L1");
  CK(cudaFree(dy)); CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(dx)); CK(cudaFree(dx_ref));
  CK(cudaFree(dw)); CK(cudaFree(dw_ref)); CK(cudaFree(inv_rms)); CK(cudaFree(partial));
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  g_copy_gbs = 2.0 * (1u << 30) / copy_us(size_t(1) << 30) * 1e-3;
  std::printf("copy 1 GiB: %.0f GB/s\n", g_copy_gbs);
  const bool only_fwd = argc > 1 && std::strcmp(argv[1], "fwd") == 0;
  const bool only_bwd = argc > 1 && std::strcmp(argv[1], "bwd") == 0;
  if (!only_bwd) fwd(4096, 65536);
  if (!only_fwd) bwd(4096, 65536);
  return 0;
}
