// Fused residual add + RMSNorm: h = x + residual (fp32 sum, rounded to T), residual_out = h,
// y = h * rsqrt(mean(h^2) + eps) * w with h the rounded value (vLLM's convention), fp32 accumulation.
//
// One block per row (grid-stride over rows). Each thread keeps up to k_cached packs of h in
// registers between the reduction and the write; the next smem_packs packs in dynamic shared
// memory (the host sizes it); any packs past both are re-read from residual_out, which the same
// thread wrote in the first pass (so the re-read sees its own store, and usually hits L2).
// Columns past the last whole pack go one element at a time.
//
// Aliasing: every element is read and written by one thread, inputs before outputs, so
// residual_out may be residual and y may be x (same base and row stride); y and residual_out must
// not overlap. Hence no __restrict__ on those four pointers.
// Requires: every buffer aligned to VEC*sizeof(T) bytes, row strides multiples of VEC.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln {

// At least 1024 resident threads per SM (a 64-register cap): the block-wide reduction stalls a
// block's warps, and other resident blocks keep loads in flight meanwhile.
template <typename T, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
add_rmsnorm_fwd(const T* x, const T* residual, const T* __restrict__ w, T* y, T* residual_out, long long rows,
                long long cols, long long x_stride, long long r_stride, long long y_stride, long long ro_stride,
                float eps) {
  using P = Pack<T, VEC>;
  // Row cache of 8 registers of h (two 16-byte packs); the residual packs loaded beside it take
  // as many again, briefly. The heuristic gives each thread at most two packs up to 1024 * 2
  // packs per row, so rows up to 16384 bf16 / 8192 f32 elements are read once.
  constexpr int k_cache_regs = 8;
  constexpr int k_regs_per_pack = sizeof(P) >= 4 ? int(sizeof(P)) / 4 : 1;
  constexpr int k_cached = k_cache_regs / k_regs_per_pack;
  // Beyond the cache, batches of two packs of x and two of the residual (one each for 16-byte
  // packs): larger batches spilled under the 64-register cap.
  constexpr int k_batch = sizeof(P) >= 16 ? 1 : 2;
  __shared__ float scratch[33];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  P* spill = reinterpret_cast<P*>(dyn_smem);
  const int first_uncached = k_cached * BLOCK;

  // Row lengths are below 2^31 (checked on the host), so in-row indices are 32-bit.
  const int packs = int(cols / VEC);
  const int n = int(cols);
  const int smem_packs = int(dynamic_smem_bytes() / sizeof(P));
  const int smem_end = min(packs, first_uncached + smem_packs);
  const float inv_cols = 1.f / float(cols);

  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_stride;
    const T* rr = residual + row * r_stride;
    T* yr = y + row * y_stride;
    T* hr = residual_out + row * ro_stride;

    // The rounded sum of one pack, stored to residual_out; its squares go into acc.
    auto add_pack = [&](int p, const P& a, const P& b, float& acc) {
      P h;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        h.v[k] = from_float<T>(to_float(a.v[k]) + to_float(b.v[k]));
        const float f = to_float(h.v[k]);
        acc = fmaf(f, f, acc);
      }
      store_pack<T, VEC>(hr + p * VEC, h);
      return h;
    };
    auto write_pack = [&](int p, const P& h, float scale) {
      const P wv = load_pack<T, VEC>(w + p * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(h.v[k]) * scale * to_float(wv.v[k]));
      store_pack<T, VEC>(yr + p * VEC, out);
    };

    // Every load of the cached packs is issued before the first store: without __restrict__ the
    // compiler may not move a later pack's loads above an earlier pack's store to residual_out,
    // which would leave one pack in flight per thread.
    P cached[k_cached], res[k_cached];
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) {
        cached[i] = load_pack<T, VEC>(xr + p * VEC);
        res[i] = load_pack<T, VEC>(rr + p * VEC);
      }
    }
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) cached[i] = add_pack(p, cached[i], res[i], acc);
    }
    // Past the register cache: batches of packs, every load of a batch issued before the first
    // store; h goes to shared memory (the first smem_packs of them) as well as residual_out.
    // Offsets within a batch are compile-time constants from one base pointer per buffer.
    for (int base = first_uncached + int(threadIdx.x); base < packs; base += k_batch * BLOCK) {
      const int left = packs - base;
      const T* xs = xr + base * VEC;
      const T* rs = rr + base * VEC;
      P xb[k_batch], rb[k_batch];
#pragma unroll
      for (int u = 0; u < k_batch; ++u) {
        if (u * BLOCK < left) {
          xb[u] = load_pack<T, VEC>(xs + u * BLOCK * VEC);
          rb[u] = load_pack<T, VEC>(rs + u * BLOCK * VEC);
        }
      }
#pragma unroll
      for (int u = 0; u < k_batch; ++u) {
        if (u * BLOCK < left) {
          const P h = add_pack(base + u * BLOCK, xb[u], rb[u], acc);
          if (base + u * BLOCK < smem_end) spill[base - first_uncached + u * BLOCK] = h;
        }
      }
    }
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK) {
      const T h = from_float<T>(to_float(xr[j]) + to_float(rr[j]));
      hr[j] = h;
      const float f = to_float(h);
      acc = fmaf(f, f, acc);
    }

    const float scale = rsqrtf(block_sum<BLOCK>(acc, scratch) * inv_cols + eps);

#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) write_pack(p, cached[i], scale);
    }
    // A thread reads back only the packs of h it wrote itself: from shared memory, then (rows
    // longer than both caches) from residual_out.
    int p = first_uncached + int(threadIdx.x);
    for (; p < smem_end; p += BLOCK) write_pack(p, spill[p - first_uncached], scale);
    for (; p < packs; p += BLOCK) write_pack(p, load_pack<T, VEC>(hr + p * VEC), scale);
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK)
      yr[j] = from_float<T>(to_float(hr[j]) * scale * to_float(w[j]));
  }
}

// Short rows, for calls of a few rows where one block's latency is the kernel's whole time: one
// block per row, each thread PACKS packs of x, the residual and the weight in registers, all loaded
// before anything is stored, one barrier, no loop. Its grid is the row count, so it is for small
// row counts only (the host's heuristic). Aliasing as above: each thread loads its elements before
// it stores them. Requires: cols a multiple of VEC, at most BLOCK * PACKS packs, rows below 2^31;
// the alignment of add_rmsnorm_fwd.
template <typename T, int BLOCK, int VEC, int PACKS>
__global__ void __launch_bounds__(BLOCK)
add_rmsnorm_fwd_row(const T* x, const T* residual, const T* __restrict__ w, T* y, T* residual_out, long long rows,
                    long long cols, long long x_stride, long long r_stride, long long y_stride, long long ro_stride,
                    float eps) {
  using P = Pack<T, VEC>;
  __shared__ float sums[BLOCK / 32];
  if (blockIdx.x >= rows) return;  // no rows: the host's grid is never empty
  const int packs = int(cols) / VEC, t = int(threadIdx.x);
  const float inv_cols = 1.f / float(cols);
  const long long row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const T* rr = residual + row * r_stride;
  // Every load is issued unconditionally, at the last pack for a thread past the row's end (its
  // values are not used): all of them go out together, before the first use of any, where
  // per-pack branches let the compiler wait for x and the residual before it requested the weight.
  P h[PACKS], rv[PACKS], wv[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    const int p = min(t + i * BLOCK, packs - 1);
    h[i] = load_pack<T, VEC>(xr + p * VEC);
    rv[i] = load_pack<T, VEC>(rr + p * VEC);
    wv[i] = load_pack<T, VEC>(w + p * VEC);
  }
  float acc = 0.f;
  T* hr = residual_out + row * ro_stride + t * VEC;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (t + i * BLOCK < packs) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        h[i].v[k] = from_float<T>(to_float(h[i].v[k]) + to_float(rv[i].v[k]));
        const float f = to_float(h[i].v[k]);
        acc = fmaf(f, f, acc);
      }
      store_pack<T, VEC>(hr + i * BLOCK * VEC, h[i]);
    }
  acc = warp_sum(acc);
  if constexpr (BLOCK > 32) {
    if (t % 32 == 0) sums[t / 32] = acc;
    __syncthreads();
    acc = sums[0];
#pragma unroll
    for (int i = 1; i < BLOCK / 32; ++i) acc += sums[i];
  }
  const float scale = rsqrtf(acc * inv_cols + eps);
  T* yr = y + row * y_stride + t * VEC;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (t + i * BLOCK < packs) {
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(h[i].v[k]) * scale * to_float(wv[i].v[k]));
      store_pack<T, VEC>(yr + i * BLOCK * VEC, out);
    }
}

}  // namespace kiln
