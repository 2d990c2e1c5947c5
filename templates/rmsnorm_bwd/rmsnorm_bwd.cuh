// RMSNorm backward, first stage: dx for every row and one fp32 partial dw row per row slab.
//
// With s = inv_rms[r] (saved by the forward) and c = mean(dy * w * x) over the row:
//   dx = s * (dy * w - x * s^2 * c),   dw = sum over rows of dy * x * s.
//
// Rows are cut into `slabs` contiguous, balanced slabs (slab i: rows [i * rows / slabs,
// (i + 1) * rows / slabs)); a slab belongs to a cluster of CLUSTER blocks (a
// plain block when CLUSTER is 1), each block owning a fixed contiguous range of the row's packs.
// Inside a block, ROWS groups of GROUP threads each work on their own row, in lockstep. A thread
// owns the same columns for every row it sees, so it keeps its dw in registers across the whole
// slab and never needs an atomic: at the end the groups of a block add their dw through shared
// memory and the block writes one partial row, partial[slab, its columns], which
// rmsnorm_bwd_reduce sums over slabs.
//
// Each thread holds PACKS packs of dy and x in registers between the row sum and the dx pass (and
// loads the next row's before this row's reduction, to keep loads in flight across the barriers),
// so a row is read once when the block's range fits in GROUP * PACKS packs. Beyond that (very wide rows
// without clusters; only with ROWS == 1, checked on the host), the rest is re-read for the dx pass
// and its dw is accumulated in place in the block's own partial row. Columns past the last whole
// pack (fewer than VEC) belong to the cluster's last block, one per thread.
//
// CLUSTER > 1 (sm_90 and later) splits a row across the blocks of a thread-block cluster: each
// block sums its range, the partial sums are exchanged through distributed shared memory with one
// cluster barrier per row. The per-row slots are double-buffered by row parity, so the next row's
// writes never race the previous row's remote reads.
//
// Requires: dy, x, dx and w aligned to VEC * sizeof(T) bytes, row strides multiples of VEC, rows
// shorter than 2^31 elements.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln {
namespace bwd {

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Reads a float at the same shared-memory address in block `rank` of the cluster.
__device__ __forceinline__ float cluster_load(const float* local, unsigned rank) {
  float v = 0.f;
#if __CUDA_ARCH__ >= 900
  unsigned addr, remote;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(local));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// Sum over the GROUP threads of the calling thread's group, returned to all of them. `scratch`:
// 32 floats of shared memory for this call's parity; every thread of the block must call.
template <int GROUP, int ROWS>
__device__ __forceinline__ float group_sum(float v, float* scratch) {
  constexpr int k_warps = GROUP / 32;
  v = warp_sum(v);
  if constexpr (k_warps == 1) {
    return v;
  } else {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int first = (warp / k_warps) * k_warps;
    return warp_sum(lane < k_warps ? scratch[first + lane] : 0.f);
  }
}

}  // namespace bwd

// SM_THREADS resident threads per SM (a register cap of 65536 / SM_THREADS per thread: 128 or
// 64). dw lives in shared memory (each thread only ever touches its own slots, so no barrier
// guards them), which frees the registers it took beside the row cache and the next row's
// prefetch; at 64 registers there is no room for the prefetch (it spilled 200 bytes), and twice
// the threads keep loads in flight through the row reductions' barriers instead.
template <typename T, int GROUP, int ROWS, int VEC, int PACKS, int CLUSTER, int SM_THREADS>
__global__ void __launch_bounds__(GROUP * ROWS, SM_THREADS / (GROUP * ROWS))
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER, 1, 1)
#endif
rmsnorm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
            const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial, long long rows,
            long long cols, long long dy_stride, long long x_stride, long long dx_stride, long long slabs) {
  static_assert(GROUP % 32 == 0 && GROUP * ROWS <= 512, "bad block shape");
  using P = Pack<T, VEC>;
#if __CUDA_ARCH__ < 900
  if constexpr (CLUSTER > 1) {
    __trap();  // never launched: the host allows clusters on sm_90 and later only
    return;
  }
#endif
  __shared__ float scratch[2][32];
  __shared__ float row_sums[2][ROWS];
  __shared__ float combine[ROWS > 1 ? GROUP * ROWS : 1];
  // dw of the cached columns, one slot per (group, pack, element, thread): consecutive threads
  // use consecutive words, so the accesses are free of bank conflicts.
  __shared__ float dws[ROWS * PACKS * VEC * GROUP];

  const int g = int(threadIdx.x) / GROUP;  // row group within the block
  const int t = int(threadIdx.x) % GROUP;  // thread within the group
  const unsigned rank = CLUSTER > 1 ? bwd::cluster_rank() : 0u;
  const long long slab = blockIdx.x / CLUSTER;

  // This block's packs of the row: [pack_begin, pack_begin + block_packs).
  const int packs = int(cols / VEC);
  const int per_block = (packs + CLUSTER - 1) / CLUSTER;
  const int pack_begin = min(packs, int(rank) * per_block);
  const int block_packs = min(packs, pack_begin + per_block) - pack_begin;
  const int tail = (rank == CLUSTER - 1) ? int(cols) - packs * VEC : 0;
  // From this thread's first element to its tail element (packs * VEC + t of the row).
  const int tail_off = (packs - pack_begin - t) * VEC + t;
  const float inv_cols = 1.f / float(cols);

  // Balanced slabs: slab i holds rows [i * rows / slabs, (i + 1) * rows / slabs).
  const long long row_end = (slab + 1) * rows / slabs;
  long long row = slab * rows / slabs + g;
  const int iters = int((row_end - (row - g) + ROWS - 1) / ROWS);

  const int first = (pack_begin + t) * VEC;
  const T* dyp = dy + row * dy_stride + first;
  const T* xp = x + row * x_stride + first;
  T* dxp = dx + row * dx_stride + first;
  const T* wp = w + first;
  float* part = partial + slab * cols + first;

  float* dw = dws + g * (PACKS * VEC * GROUP) + t;  // dw[(i * VEC + k) * GROUP]
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw[(i * VEC + k) * GROUP] = 0.f;
  float dw_tail = 0.f;
  // Packs past the register cache keep their dw in this block's partial row (ROWS == 1 only).
  for (int o = PACKS * GROUP * VEC; o < (block_packs - t) * VEC; o += GROUP * VEC)
#pragma unroll
    for (int k = 0; k < VEC; ++k) part[o + k] = 0.f;

  // The cached packs of the current row. At 512 threads per SM the next row's are loaded before
  // this row's reduction, so the memory system stays busy through the barriers; at 1024 the
  // registers for that are not there, and the other resident blocks keep loads in flight instead.
  constexpr bool k_prefetch = SM_THREADS < 1024;
  P cdy[PACKS], cx[PACKS];
  auto load_row = [&](P* a, P* b, long long ahead) {
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (row + ahead < row_end && t + i * GROUP < block_packs) {
        a[i] = load_pack<T, VEC>(dyp + ahead * dy_stride + i * GROUP * VEC);
        b[i] = load_pack<T, VEC>(xp + ahead * x_stride + i * GROUP * VEC);
      }
  };
  if constexpr (k_prefetch) load_row(cdy, cx, 0);

  for (int it = 0; it < iters; ++it) {
    const bool valid = row < row_end;
    P ndy[k_prefetch ? PACKS : 1], nx[k_prefetch ? PACKS : 1];
    if constexpr (k_prefetch) load_row(ndy, nx, ROWS);
    else load_row(cdy, cx, 0);
    const float s = valid ? inv_rms[row] : 0.f;

    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < block_packs) {
        const P wv = load_pack<T, VEC>(wp + i * GROUP * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc = fmaf(to_float(cdy[i].v[k]) * to_float(wv.v[k]), to_float(cx[i].v[k]), acc);
      }
    if (valid)
      for (int o = PACKS * GROUP * VEC; o < (block_packs - t) * VEC; o += GROUP * VEC) {
        const P a = load_pack<T, VEC>(dyp + o), b = load_pack<T, VEC>(xp + o), wv = load_pack<T, VEC>(wp + o);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc = fmaf(to_float(a.v[k]) * to_float(wv.v[k]), to_float(b.v[k]), acc);
      }
    float tdy = 0.f, tx = 0.f, tw = 0.f;
    if (valid && t < tail) {
      tdy = to_float(dyp[tail_off]);
      tx = to_float(xp[tail_off]);
      tw = to_float(wp[tail_off]);
      acc = fmaf(tdy * tw, tx, acc);
    }

    float sum = bwd::group_sum<GROUP, ROWS>(acc, scratch[it & 1]);
    if constexpr (CLUSTER > 1) {
      if (t == 0) row_sums[it & 1][g] = sum;
      bwd::cluster_sync();
      sum = 0.f;
#pragma unroll
      for (unsigned q = 0; q < CLUSTER; ++q) sum += bwd::cluster_load(&row_sums[it & 1][g], q);
    }
    const float k2 = s * s * sum * inv_cols;

#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < block_packs) {
        const P wv = load_pack<T, VEC>(wp + i * GROUP * VEC);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float fdy = to_float(cdy[i].v[k]), fx = to_float(cx[i].v[k]);
          out.v[k] = from_float<T>(s * fmaf(-fx, k2, fdy * to_float(wv.v[k])));
          dw[(i * VEC + k) * GROUP] = fmaf(fdy * fx, s, dw[(i * VEC + k) * GROUP]);
        }
        store_pack<T, VEC>(dxp + i * GROUP * VEC, out);
      }
    if (valid)
      for (int o = PACKS * GROUP * VEC; o < (block_packs - t) * VEC; o += GROUP * VEC) {
        const P a = load_pack<T, VEC>(dyp + o), b = load_pack<T, VEC>(xp + o), wv = load_pack<T, VEC>(wp + o);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float fdy = to_float(a.v[k]), fx = to_float(b.v[k]);
          out.v[k] = from_float<T>(s * fmaf(-fx, k2, fdy * to_float(wv.v[k])));
          part[o + k] = fmaf(fdy * fx, s, part[o + k]);
        }
        store_pack<T, VEC>(dxp + o, out);
      }
    if (valid && t < tail) {
      dxp[tail_off] = from_float<T>(s * fmaf(-tx, k2, tdy * tw));
      dw_tail = fmaf(tdy * tx, s, dw_tail);
    }

    if constexpr (k_prefetch)
#pragma unroll
      for (int i = 0; i < PACKS; ++i) {
        cdy[i] = ndy[i];
        cx[i] = nx[i];
      }
    row += ROWS;
    dyp += ROWS * dy_stride;
    xp += ROWS * x_stride;
    dxp += ROWS * dx_stride;
  }

  if constexpr (ROWS > 1) {
    // Group 0 adds the other groups' dw to its own.
    combine[threadIdx.x] = dw_tail;
    __syncthreads();
    if (g == 0) {
#pragma unroll
      for (int q = 1; q < ROWS; ++q) {
        dw_tail += combine[q * GROUP + t];
#pragma unroll
        for (int j = 0; j < PACKS * VEC; ++j) dw[j * GROUP] += dw[q * (PACKS * VEC * GROUP) + j * GROUP];
      }
    }
  }
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (t + i * GROUP < block_packs)
#pragma unroll
        for (int k = 0; k < VEC; ++k) part[i * GROUP * VEC + k] = dw[(i * VEC + k) * GROUP];
    if (t < tail) part[tail_off] = dw_tail;
  }
  // Blocks of a cluster may still read this block's row sums until every block gets here.
  if constexpr (CLUSTER > 1) bwd::cluster_sync();
}

}  // namespace kiln
