// RMSNorm backward, first stage: dx for every row and one fp32 partial dw row per row slab.
//
// With s = inv_rms[r] (saved by the forward, or recomputed: RECOMPUTE below) and
// c = mean(dy * w * x) over the row:
//   dx = s * (dy * w - x * s^2 * c) [+ dh],   dw = sum over rows of dy * x * s.
//
// Rows are dealt to `slabs` slabs in turn (slab i: rows i, i + slabs, i + 2 * slabs, ...), so the
// rows in flight on the whole GPU at any time are neighbours in memory (contiguous slabs are
// slower at 32768 rows); a slab belongs to a cluster of CLUSTER blocks (a plain block when CLUSTER
// is 1), each block owning a fixed contiguous range of the row's packs.
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
// Two options, template parameters that compile out when off (every kernel below takes both):
// RECOMPUTE computes s = rsqrt(mean(x^2) + eps) per row from the x it reads, its sum of squares
// reduced beside mean(dy * w * x) (inv_rms is not read); DH adds a gradient dh (dy's dtype, its
// own row stride) to dx, read where dx is written: dx = s * (dy * w - x * s^2 * c) + dh.
//
// Requires: dy, x, dx, dh and w aligned to VEC * sizeof(T) bytes, row strides multiples of VEC,
// rows shorter than 2^31 elements.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/reduce.cuh"

namespace kiln {
namespace bwd {

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

// group_sum of two values at once, with one barrier: the row's mean(dy * w * x) and, with
// RECOMPUTE, its sum of squares. `scratch`: 32 float2 of shared memory for this call's parity.
template <int GROUP, int ROWS>
__device__ __forceinline__ float2 group_sum2(float a, float b, float2* scratch) {
  constexpr int k_warps = GROUP / 32;
  a = warp_sum(a);
  b = warp_sum(b);
  if constexpr (k_warps == 1) {
    return make_float2(a, b);
  } else {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    if (lane == 0) scratch[warp] = make_float2(a, b);
    __syncthreads();
    const int first = (warp / k_warps) * k_warps;
    const float2 v = lane < k_warps ? scratch[first + lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(v.x), warp_sum(v.y));
  }
}

// One element of dx: s * (dy * w - x * k2), plus dh with DH (k2 = s^2 * mean(dy * w * x)).
template <bool DH>
__device__ __forceinline__ float dx_of(float s, float dy, float x, float w, float k2, float dh) {
  if constexpr (DH) return fmaf(s, fmaf(-x, k2, dy * w), dh);
  else return s * fmaf(-x, k2, dy * w);
}

}  // namespace bwd

// SM_THREADS resident threads per SM (a register cap of 65536 / SM_THREADS per thread: 128 or
// 64). dw lives in shared memory (each thread only ever touches its own slots, so no barrier
// guards them), which frees the registers it took beside the row cache and the next row's
// prefetch; at 64 registers there is no room for the prefetch (it spilled 200 bytes), and twice
// the threads keep loads in flight through the row reductions' barriers instead.
template <typename T, int GROUP, int ROWS, int VEC, int PACKS, int CLUSTER, int SM_THREADS, bool RECOMPUTE = false,
          bool DH = false>
__global__ void __launch_bounds__(GROUP * ROWS, SM_THREADS / (GROUP * ROWS))
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER, 1, 1)
#endif
rmsnorm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
            const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial, long long rows,
            long long cols, long long dy_stride, long long x_stride, long long dx_stride, long long slabs,
            const T* __restrict__ dh, long long dh_stride, float eps) {
  static_assert(GROUP % 32 == 0 && GROUP * ROWS <= 512, "bad block shape");
  using P = Pack<T, VEC>;
#if __CUDA_ARCH__ < 900
  if constexpr (CLUSTER > 1) {
    __trap();  // never launched: the host allows clusters on sm_90 and later only
    return;
  }
#endif
  __shared__ float scratch[2][32];
  __shared__ float2 scratch2[RECOMPUTE ? 2 : 1][32];
  __shared__ float row_sums[2][ROWS];
  __shared__ float row_squares[RECOMPUTE ? 2 : 1][ROWS];
  __shared__ float combine[ROWS > 1 ? GROUP * ROWS : 1];
  // dw of the cached columns, one slot per (group, pack, element, thread): consecutive threads
  // use consecutive words, so the accesses are free of bank conflicts.
  __shared__ float dws[ROWS * PACKS * VEC * GROUP];

  const int g = int(threadIdx.x) / GROUP;  // row group within the block
  const int t = int(threadIdx.x) % GROUP;  // thread within the group
  const unsigned rank = CLUSTER > 1 ? ptx::cluster_ctarank() : 0u;
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

  // Slab i holds rows i, i + slabs, ...: its k-th row is i + k * slabs; group g takes k = g, g + ROWS, ...
  const long long slab_rows = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  long long k_row = g;  // this group's current index within the slab
  long long row = slab + k_row * slabs;
  const int iters = int((slab_rows + ROWS - 1) / ROWS);
  const long long step = ROWS * slabs;  // rows between a group's consecutive rows

  const int first = (pack_begin + t) * VEC;
  const T* dyp = dy + row * dy_stride + first;
  const T* xp = x + row * x_stride + first;
  T* dxp = dx + row * dx_stride + first;
  const T* dhp = DH ? dh + row * dh_stride + first : nullptr;
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
  // `ahead` counts this group's rows: 0 is the current one, 1 the next (`step` rows further on).
  auto load_row = [&](P* a, P* b, long long ahead) {
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (k_row + ahead * ROWS < slab_rows && t + i * GROUP < block_packs) {
        a[i] = load_pack<T, VEC>(dyp + ahead * step * dy_stride + i * GROUP * VEC);
        b[i] = load_pack<T, VEC>(xp + ahead * step * x_stride + i * GROUP * VEC);
      }
  };
  if constexpr (k_prefetch) load_row(cdy, cx, 0);

  for (int it = 0; it < iters; ++it) {
    const bool valid = k_row < slab_rows;
    P ndy[k_prefetch ? PACKS : 1], nx[k_prefetch ? PACKS : 1];
    if constexpr (k_prefetch) load_row(ndy, nx, 1);
    else load_row(cdy, cx, 0);
    float s = !RECOMPUTE && valid ? inv_rms[row] : 0.f;

    float acc = 0.f, sq = 0.f;  // sq: the row's sum of squares (RECOMPUTE)
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < block_packs) {
        const P wv = load_pack<T, VEC>(wp + i * GROUP * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          acc = fmaf(to_float(cdy[i].v[k]) * to_float(wv.v[k]), to_float(cx[i].v[k]), acc);
          if constexpr (RECOMPUTE) sq = fmaf(to_float(cx[i].v[k]), to_float(cx[i].v[k]), sq);
        }
      }
    if (valid)
      for (int o = PACKS * GROUP * VEC; o < (block_packs - t) * VEC; o += GROUP * VEC) {
        const P a = load_pack<T, VEC>(dyp + o), b = load_pack<T, VEC>(xp + o), wv = load_pack<T, VEC>(wp + o);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          acc = fmaf(to_float(a.v[k]) * to_float(wv.v[k]), to_float(b.v[k]), acc);
          if constexpr (RECOMPUTE) sq = fmaf(to_float(b.v[k]), to_float(b.v[k]), sq);
        }
      }
    float tdy = 0.f, tx = 0.f, tw = 0.f;
    if (valid && t < tail) {
      tdy = to_float(dyp[tail_off]);
      tx = to_float(xp[tail_off]);
      tw = to_float(wp[tail_off]);
      acc = fmaf(tdy * tw, tx, acc);
      if constexpr (RECOMPUTE) sq = fmaf(tx, tx, sq);
    }

    float sum;
    if constexpr (RECOMPUTE) {
      const float2 both = bwd::group_sum2<GROUP, ROWS>(acc, sq, scratch2[it & 1]);
      sum = both.x;
      sq = both.y;
    } else {
      sum = bwd::group_sum<GROUP, ROWS>(acc, scratch[it & 1]);
    }
    if constexpr (CLUSTER > 1) {
      if (t == 0) {
        row_sums[it & 1][g] = sum;
        if constexpr (RECOMPUTE) row_squares[it & 1][g] = sq;
      }
      ptx::cluster_sync_aligned();
      sum = 0.f;
#pragma unroll
      for (unsigned q = 0; q < CLUSTER; ++q) sum += ptx::ld_remote_f32(ptx::smem_addr_opaque(&row_sums[it & 1][g]), q);
      if constexpr (RECOMPUTE) {
        sq = 0.f;
#pragma unroll
        for (unsigned q = 0; q < CLUSTER; ++q)
          sq += ptx::ld_remote_f32(ptx::smem_addr_opaque(&row_squares[it & 1][g]), q);
      }
    }
    if constexpr (RECOMPUTE) s = valid ? rsqrtf(sq * inv_cols + eps) : 0.f;
    const float k2 = s * s * sum * inv_cols;

#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < block_packs) {
        const P wv = load_pack<T, VEC>(wp + i * GROUP * VEC);
        P hv{};
        if constexpr (DH) hv = load_pack<T, VEC>(dhp + i * GROUP * VEC);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float fdy = to_float(cdy[i].v[k]), fx = to_float(cx[i].v[k]);
          out.v[k] = from_float<T>(bwd::dx_of<DH>(s, fdy, fx, to_float(wv.v[k]), k2, DH ? to_float(hv.v[k]) : 0.f));
          dw[(i * VEC + k) * GROUP] = fmaf(fdy * fx, s, dw[(i * VEC + k) * GROUP]);
        }
        store_pack<T, VEC>(dxp + i * GROUP * VEC, out);
      }
    if (valid)
      for (int o = PACKS * GROUP * VEC; o < (block_packs - t) * VEC; o += GROUP * VEC) {
        const P a = load_pack<T, VEC>(dyp + o), b = load_pack<T, VEC>(xp + o), wv = load_pack<T, VEC>(wp + o);
        P hv{};
        if constexpr (DH) hv = load_pack<T, VEC>(dhp + o);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float fdy = to_float(a.v[k]), fx = to_float(b.v[k]);
          out.v[k] = from_float<T>(bwd::dx_of<DH>(s, fdy, fx, to_float(wv.v[k]), k2, DH ? to_float(hv.v[k]) : 0.f));
          part[o + k] = fmaf(fdy * fx, s, part[o + k]);
        }
        store_pack<T, VEC>(dxp + o, out);
      }
    if (valid && t < tail) {
      dxp[tail_off] = from_float<T>(bwd::dx_of<DH>(s, tdy, tx, tw, k2, DH ? to_float(dhp[tail_off]) : 0.f));
      dw_tail = fmaf(tdy * tx, s, dw_tail);
    }

    if constexpr (k_prefetch)
#pragma unroll
      for (int i = 0; i < PACKS; ++i) {
        cdy[i] = ndy[i];
        cx[i] = nx[i];
      }
    k_row += ROWS;
    row += step;
    dyp += step * dy_stride;
    xp += step * x_stride;
    dxp += step * dx_stride;
    if constexpr (DH) dhp += step * dh_stride;
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
  // Group 0's dw (the cached packs) goes out with consecutive threads on consecutive words: each
  // thread storing its own VEC adjacent floats would touch a new 32-byte sector per store (a
  // large cost to the bulk kernel below at 32768 x 16384).
  __syncthreads();
  float* const block_part = partial + slab * cols + pack_begin * VEC;
  for (int c = int(threadIdx.x); c < PACKS * GROUP * VEC; c += GROUP * ROWS) {
    const int i = c / (GROUP * VEC), owner = c / VEC % GROUP, k = c % VEC;
    if (owner + i * GROUP < block_packs) block_part[c] = dws[(i * VEC + k) * GROUP + owner];
  }
  if (g == 0 && t < tail) part[tail_off] = dw_tail;
  // Blocks of a cluster may still read this block's row sums until every block gets here.
  if constexpr (CLUSTER > 1) ptx::cluster_sync_aligned();
}

// The same first stage on sm_90 and later, with each row of dy and x brought into shared memory by
// two bulk copies (cp.async.bulk) into a ring of STAGES row buffers. One thread posts the copies;
// a buffer is refilled with the row STAGES ahead right after the barrier of the row reduction that
// last read it, so the loads of the next rows stay in flight through every barrier without
// registers to hold them (the register kernel above cannot prefetch at 1024 threads per SM, and
// its 512-thread blocks hold one row ahead). One block covers a whole row: THREADS threads, PACKS
// 16-byte packs each; dw stays in registers up to 16 elements per thread, beyond in shared memory
// as float4s (4 packs of bf16 in registers spilled 224 bytes). Blocks of THREADS threads come
// 512 / THREADS to an SM (at least 1), 128 registers each.
//
// Requires: sm_90; dy, x, dx (and dh) aligned to 16 bytes, row strides and cols multiples of 16 bytes;
// cols <= THREADS * PACKS * VEC; the dynamic shared memory that rmsnorm_bwd_bulk_smem gives for
// this choice (families/rmsnorm_bwd). The body is a device function so that other kernels can
// wrap it (the fusion experiments kept under the tag bench-exp-archive do).
namespace bwd {

// The bulk kernels' ring set-up: thread 0 initializes the STAGES `full` barriers, and the packs of
// every buffer from `filled` on (SLOTS packs each) are zeroed once. The copies never write there,
// and with a zero weight those packs add nothing, so every thread reads and multiplies all its
// packs without a bounds check: only its stores check. The caller synchronizes before use.
template <typename P, int STAGES, int THREADS, int SLOTS>
__device__ __forceinline__ void ring_init(unsigned long long* full, P* sdy, P* sx, int filled) {
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(ptx::smem_addr(&full[s]), 1);
      ptx::mbar_init_fence();
    }
  for (int q = filled + int(threadIdx.x); q < SLOTS; q += THREADS)
    for (int s = 0; s < STAGES; ++s) {
      sdy[s * SLOTS + q] = P{};
      sx[s * SLOTS + q] = P{};
    }
}

template <typename T, int THREADS, int PACKS, int STAGES, bool RECOMPUTE = false, bool DH = false>
__device__ __forceinline__ void bulk_body(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                          const float* __restrict__ inv_rms, T* __restrict__ dx,
                                          float* __restrict__ partial, long long rows, long long cols,
                                          long long dy_stride, long long x_stride, long long dx_stride,
                                          long long slabs, const T* __restrict__ dh = nullptr,
                                          long long dh_stride = 0, float eps = 0.f) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int k_buffer = THREADS * PACKS * VEC;  // elements of one row buffer
  constexpr bool k_dw_smem = PACKS * VEC > 16;
  using P = Pack<T, VEC>;
  static_assert(THREADS % 32 == 0 && THREADS <= 1024 && STAGES >= 2, "bad block shape");
#if __CUDA_ARCH__ < 900
  __trap();  // never launched: the host picks this kernel on sm_90 and later only
#else
  extern __shared__ __align__(128) unsigned char smem[];
  T* sdy = reinterpret_cast<T*>(smem);  // [STAGES][k_buffer]
  T* sx = sdy + STAGES * k_buffer;       // [STAGES][k_buffer]
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float scratch_sq[RECOMPUTE ? 2 : 1][32];  // the warps' sums of squares (RECOMPUTE)

  const int t = int(threadIdx.x);
  const long long slab = blockIdx.x;
  const int packs = int(cols / VEC);
  const unsigned row_bytes = unsigned(packs) * 16u;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;  // rows slab, slab + slabs, ...

  ring_init<P, STAGES, THREADS, THREADS * PACKS>(full, reinterpret_cast<P*>(sdy), reinterpret_cast<P*>(sx), packs);
  __syncthreads();
  auto post = [&](int s, long long row) {
    const unsigned bar = ptx::smem_addr(&full[s]);
    auto copy = [&](T* buffer, const T* src) { ptx::bulk_copy(ptx::smem_addr(buffer), src, row_bytes, bar); };
    ptx::mbar_arrive_expect_tx(bar, 2u * row_bytes);
    copy(sdy + s * k_buffer, dy + row * dy_stride);
    copy(sx + s * k_buffer, x + row * x_stride);
  };
  if (t == 0)
    for (int s = 0; s < STAGES && s < n; ++s) post(s, slab + s * slabs);

  P wv[PACKS];
#pragma unroll
  for (int j = 0; j < PACKS; ++j) wv[j] = t + j * THREADS < packs ? load_pack<T, VEC>(w + (t + j * THREADS) * VEC) : P{};
  // dw of pack j: registers, or VEC / 4 float4 slots after the row buffers, slot (j * VEC / 4 + q)
  // * THREADS + t (consecutive threads on consecutive 16 bytes: one access per 4 floats, no bank
  // conflicts).
  float dw_regs[k_dw_smem ? 1 : PACKS * VEC];
  float4* dw_smem = reinterpret_cast<float4*>(sx + STAGES * k_buffer) + t;
  auto load_dw = [&](int j, float (&v)[VEC]) {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      const float4 f = k_dw_smem ? dw_smem[(j * VEC / 4 + q) * THREADS] : float4{};
      v[4 * q] = k_dw_smem ? f.x : dw_regs[k_dw_smem ? 0 : j * VEC + 4 * q];
      v[4 * q + 1] = k_dw_smem ? f.y : dw_regs[k_dw_smem ? 0 : j * VEC + 4 * q + 1];
      v[4 * q + 2] = k_dw_smem ? f.z : dw_regs[k_dw_smem ? 0 : j * VEC + 4 * q + 2];
      v[4 * q + 3] = k_dw_smem ? f.w : dw_regs[k_dw_smem ? 0 : j * VEC + 4 * q + 3];
    }
  };
  auto store_dw = [&](int j, const float (&v)[VEC]) {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      if constexpr (k_dw_smem) {
        dw_smem[(j * VEC / 4 + q) * THREADS] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) dw_regs[j * VEC + 4 * q + k] = v[4 * q + k];
      }
    }
  };
  {
    const float zero[VEC] = {};
#pragma unroll
    for (int j = 0; j < PACKS; ++j) store_dw(j, zero);
  }
  const float inv_cols = 1.f / float(cols);

  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    float rs = RECOMPUTE ? 0.f : inv_rms[row];
    ptx::mbar_wait(ptx::smem_addr(&full[s]), unsigned(i / STAGES) & 1u);
    P a[PACKS], b[PACKS];
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      a[j] = *reinterpret_cast<const P*>(sdy + s * k_buffer + (t + j * THREADS) * VEC);
      b[j] = *reinterpret_cast<const P*>(sx + s * k_buffer + (t + j * THREADS) * VEC);
    }
    // The zeroed packs past the row add nothing to either sum.
    float acc = 0.f, sq = 0.f;
#pragma unroll
    for (int j = 0; j < PACKS; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc = fmaf(to_float(a[j].v[k]) * to_float(wv[j].v[k]), to_float(b[j].v[k]), acc);
        if constexpr (RECOMPUTE) sq = fmaf(to_float(b[j].v[k]), to_float(b[j].v[k]), sq);
      }
    acc = warp_sum(acc);
    if constexpr (RECOMPUTE) sq = warp_sum(sq);
    if (t % 32 == 0) {
      scratch[i & 1][t / 32] = acc;
      if constexpr (RECOMPUTE) scratch_sq[i & 1][t / 32] = sq;
    }
    __syncthreads();
    // Every thread has read buffer s: refill it with the row STAGES ahead.
    if (t == 0 && i + STAGES < n) post(s, row + STAGES * slabs);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < THREADS / 32; ++q) sum += scratch[i & 1][q];
    if constexpr (RECOMPUTE) {
      sq = 0.f;
#pragma unroll
      for (int q = 0; q < THREADS / 32; ++q) sq += scratch_sq[i & 1][q];
      rs = rsqrtf(sq * inv_cols + eps);
    }
    const float k2 = rs * rs * sum * inv_cols;
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const bool in_row = t + j * THREADS < packs;
      P hv{};
      if constexpr (DH)
        if (in_row) hv = load_pack<T, VEC>(dh + row * dh_stride + (t + j * THREADS) * VEC);
      P out;
      float d[VEC];
      load_dw(j, d);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float fdy = to_float(a[j].v[k]), fx = to_float(b[j].v[k]);
        out.v[k] = from_float<T>(bwd::dx_of<DH>(rs, fdy, fx, to_float(wv[j].v[k]), k2, to_float(hv.v[k])));
        d[k] = fmaf(fdy * fx, rs, d[k]);
      }
      store_dw(j, d);
      if (in_row) store_pack<T, VEC>(dx + row * dx_stride + (t + j * THREADS) * VEC, out);
    }
  }
  // The partial row goes out through shared memory (the row buffers are free now), consecutive
  // threads on consecutive words: each thread storing its own VEC adjacent floats would touch a
  // new 32-byte sector per store, a large cost at 32768 x 16384.
  __syncthreads();
  float* row_out = reinterpret_cast<float*>(smem);  // k_buffer floats fit in the 2 * STAGES row buffers
#pragma unroll
  for (int j = 0; j < PACKS; ++j) {
    float d[VEC];
    load_dw(j, d);
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      reinterpret_cast<float4*>(row_out + (t + j * THREADS) * VEC)[q] =
          make_float4(d[4 * q], d[4 * q + 1], d[4 * q + 2], d[4 * q + 3]);
  }
  __syncthreads();
  for (int c = t; c < cols; c += THREADS) partial[slab * cols + c] = row_out[c];
#endif
}

// Rows too wide for one block's ring (sm_90 and later): a row is split over a cluster of CLUSTER
// blocks, block `rank` owning packs [rank * THREADS * PACKS, ...) of it (the last blocks may own
// fewer, or none), each with its own ring of STAGES buffers filled by bulk copies. The blocks'
// partial row sums meet through distributed shared memory, the cluster barrier split into arrive
// and wait one row apart: a block sums row i, posts its sum, arrives, finishes row i - 1 (whose
// sums the previous wait made visible: dx, and dw in registers), then waits. A buffer is refilled
// as soon as its row's dx pass is done (a block barrier right after it), so two rows are in
// flight while a block sums one and finishes another; refilling only after the next row's sum
// barrier would leave one row in flight, and is clearly slower at 4096 x 65536 bf16 (clusters of
// 4, 512 threads x 4 packs, 3 buffers; docs/benchmarks.md). Clusters of 4 fit 30 at a time on an
// H100 (GPC packing), so the caller launches as many slabs as clusters can be resident.
//
// Requires: sm_90; STAGES >= 3; dy, x, dx (and dh) 16-byte aligned, row strides and cols multiples of 16
// bytes; cols <= CLUSTER * THREADS * PACKS * VEC; dynamic shared memory 2 * STAGES * THREADS *
// PACKS * 16 bytes; slabs * CLUSTER blocks, slabs <= rows.
template <typename T, int THREADS, int PACKS, int STAGES, int CLUSTER, bool RECOMPUTE = false, bool DH = false>
__device__ __forceinline__ void bulk_cluster_body(const T* __restrict__ dy, const T* __restrict__ x,
                                                  const T* __restrict__ w, const float* __restrict__ inv_rms,
                                                  T* __restrict__ dx, float* __restrict__ partial, long long rows,
                                                  long long cols, long long dy_stride, long long x_stride,
                                                  long long dx_stride, long long slabs,
                                                  const T* __restrict__ dh = nullptr, long long dh_stride = 0,
                                                  float eps = 0.f) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int k_buffer = THREADS * PACKS * VEC;  // elements of one block's row buffer
  using P = Pack<T, VEC>;
  static_assert(THREADS % 32 == 0 && THREADS <= 1024 && STAGES >= 3 && CLUSTER >= 2 && CLUSTER <= 8,
                "bad block shape: rows i - 1 and i are in use while i + 1 arrives");
#if __CUDA_ARCH__ < 900
  __trap();  // never launched: the host picks this kernel on sm_90 and later only
#else
  extern __shared__ __align__(128) unsigned char smem[];
  T* sdy = reinterpret_cast<T*>(smem);  // [STAGES][k_buffer]
  T* sx = sdy + STAGES * k_buffer;       // [STAGES][k_buffer]
  __shared__ unsigned long long full[STAGES];
  __shared__ float scratch[2][32];
  __shared__ float sums[4];  // this block's sum of row i in slot i % 4, read by the whole cluster
  // With RECOMPUTE, the same for the row's sum of squares.
  __shared__ float scratch_sq[RECOMPUTE ? 2 : 1][32];
  __shared__ float squares[RECOMPUTE ? 4 : 1];

  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const unsigned rank = ptx::cluster_ctarank();
  const long long slab = blockIdx.x / CLUSTER;
  const int packs = int(cols / VEC);
  const int first = int(rank) * THREADS * PACKS;  // the first pack this block owns
  const int own = packs - first < 0 ? 0 : (packs - first < THREADS * PACKS ? packs - first : THREADS * PACKS);
  const unsigned own_bytes = unsigned(own) * 16u;
  const long long col0 = (long long)first * VEC;
  const long long n = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;  // rows slab, slab + slabs, ...

  ring_init<P, STAGES, THREADS, THREADS * PACKS>(full, reinterpret_cast<P*>(sdy), reinterpret_cast<P*>(sx), own);
  ptx::cluster_sync_aligned();
  auto post = [&](long long i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    const unsigned bar = ptx::smem_addr(&full[s]);
    auto copy = [&](T* buffer, const T* src) { ptx::bulk_copy(ptx::smem_addr(buffer), src, own_bytes, bar); };
    ptx::mbar_arrive_expect_tx(bar, 2u * own_bytes);
    if (own_bytes > 0) {
      copy(sdy + s * k_buffer, dy + row * dy_stride + col0);
      copy(sx + s * k_buffer, x + row * x_stride + col0);
    }
  };
  if (t == 0)
    for (long long i = 0; i < STAGES && i < n; ++i) post(i);

  P wv[PACKS];
#pragma unroll
  for (int j = 0; j < PACKS; ++j) wv[j] = j * THREADS + t < own ? load_pack<T, VEC>(w + col0 + (j * THREADS + t) * VEC) : P{};
  float dw[PACKS * VEC];
#pragma unroll
  for (int e = 0; e < PACKS * VEC; ++e) dw[e] = 0.f;
  const float inv_cols = 1.f / float(cols);

  // dx of row i and its dw terms, once the cluster's sums of row i are visible.
  auto finish = [&](long long i) {
    const int s = int(i % STAGES);
    const long long row = slab + i * slabs;
    float rs;
    if constexpr (RECOMPUTE) {
      float total_sq =
          lane < CLUSTER ? ptx::ld_remote_f32(ptx::smem_addr_opaque(&squares[i & 3]), unsigned(lane)) : 0.f;
      rs = rsqrtf(warp_sum(total_sq) * inv_cols + eps);
    } else {
      rs = inv_rms[row];
    }
    float total = lane < CLUSTER ? ptx::ld_remote_f32(ptx::smem_addr_opaque(&sums[i & 3]), unsigned(lane)) : 0.f;
    total = warp_sum(total);
    const float k2 = rs * rs * total * inv_cols;
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const P a = *reinterpret_cast<const P*>(sdy + s * k_buffer + (j * THREADS + t) * VEC);
      const P b = *reinterpret_cast<const P*>(sx + s * k_buffer + (j * THREADS + t) * VEC);
      const bool in_row = j * THREADS + t < own;
      P hv{};
      if constexpr (DH)
        if (in_row) hv = load_pack<T, VEC>(dh + row * dh_stride + col0 + (j * THREADS + t) * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float fdy = to_float(a.v[k]), fx = to_float(b.v[k]);
        out.v[k] = from_float<T>(bwd::dx_of<DH>(rs, fdy, fx, to_float(wv[j].v[k]), k2, to_float(hv.v[k])));
        dw[j * VEC + k] = fmaf(fdy * fx, rs, dw[j * VEC + k]);
      }
      if (in_row) store_pack<T, VEC>(dx + row * dx_stride + col0 + (j * THREADS + t) * VEC, out);
    }
  };
  for (long long i = 0; i < n; ++i) {
    const int s = int(i % STAGES);
    const unsigned parity = unsigned(i / STAGES) & 1u;
    ptx::mbar_wait(ptx::smem_addr(&full[s]), parity);
    float acc = 0.f, sq = 0.f;  // sq: the sum of squares (RECOMPUTE)
#pragma unroll
    for (int j = 0; j < PACKS; ++j) {
      const P a = *reinterpret_cast<const P*>(sdy + s * k_buffer + (j * THREADS + t) * VEC);
      const P b = *reinterpret_cast<const P*>(sx + s * k_buffer + (j * THREADS + t) * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc = fmaf(to_float(a.v[k]) * to_float(wv[j].v[k]), to_float(b.v[k]), acc);
        if constexpr (RECOMPUTE) sq = fmaf(to_float(b.v[k]), to_float(b.v[k]), sq);
      }
    }
    acc = warp_sum(acc);
    if constexpr (RECOMPUTE) sq = warp_sum(sq);
    if (lane == 0) {
      scratch[i & 1][warp] = acc;
      if constexpr (RECOMPUTE) scratch_sq[i & 1][warp] = sq;
    }
    __syncthreads();
    if (t == 0) {
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < THREADS / 32; ++q) sum += scratch[i & 1][q];
      sums[i & 3] = sum;
      if constexpr (RECOMPUTE) {
        float squares_sum = 0.f;
#pragma unroll
        for (int q = 0; q < THREADS / 32; ++q) squares_sum += scratch_sq[i & 1][q];
        squares[i & 3] = squares_sum;
      }
    }
    ptx::cluster_arrive_aligned();
    if (i >= 1) finish(i - 1);
    // Every thread is done with row i - 1's buffer: refill it with the row STAGES after it.
    __syncthreads();
    if (t == 0 && i >= 1 && i - 1 + STAGES < n) post(i - 1 + STAGES);
    ptx::cluster_wait_aligned();
  }
  if (n > 0) finish(n - 1);
  // The partial row of the block's columns goes out through shared memory (the buffers are free
  // once every thread is past its last finish), consecutive threads on consecutive words.
  __syncthreads();
  float* row_out = reinterpret_cast<float*>(smem);  // k_buffer floats fit in the 2 * STAGES buffers
#pragma unroll
  for (int j = 0; j < PACKS; ++j)
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q)
      reinterpret_cast<float4*>(row_out + (j * THREADS + t) * VEC)[q] =
          make_float4(dw[j * VEC + 4 * q], dw[j * VEC + 4 * q + 1], dw[j * VEC + 4 * q + 2], dw[j * VEC + 4 * q + 3]);
  __syncthreads();
  const long long own_cols = (long long)own * VEC;
  for (long long c = t; c < own_cols; c += THREADS) partial[slab * cols + col0 + c] = row_out[c];
  // No block may leave while the others can still read its sums.
  ptx::cluster_sync_aligned();
#endif
}

}  // namespace bwd

template <typename T, int THREADS, int PACKS, int STAGES, bool RECOMPUTE = false, bool DH = false>
__global__ void __launch_bounds__(THREADS, (512 / THREADS > 1 ? 512 / THREADS : 1))
rmsnorm_bwd_bulk(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                 const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial, long long rows,
                 long long cols, long long dy_stride, long long x_stride, long long dx_stride, long long slabs,
                 const T* __restrict__ dh, long long dh_stride, float eps) {
  bwd::bulk_body<T, THREADS, PACKS, STAGES, RECOMPUTE, DH>(dy, x, w, inv_rms, dx, partial, rows, cols, dy_stride,
                                                           x_stride, dx_stride, slabs, dh, dh_stride, eps);
}

template <typename T, int THREADS, int PACKS, int STAGES, int CLUSTER, bool RECOMPUTE = false, bool DH = false>
__global__ void __launch_bounds__(THREADS, 1)
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER, 1, 1)
#endif
rmsnorm_bwd_bulk_cluster(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                         const float* __restrict__ inv_rms, T* __restrict__ dx, float* __restrict__ partial,
                         long long rows, long long cols, long long dy_stride, long long x_stride, long long dx_stride,
                         long long slabs, const T* __restrict__ dh, long long dh_stride, float eps) {
  bwd::bulk_cluster_body<T, THREADS, PACKS, STAGES, CLUSTER, RECOMPUTE, DH>(
      dy, x, w, inv_rms, dx, partial, rows, cols, dy_stride, x_stride, dx_stride, slabs, dh, dh_stride, eps);
}

}  // namespace kiln
