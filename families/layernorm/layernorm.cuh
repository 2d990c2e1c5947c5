// LayerNorm forward and backward (families/layernorm/README.md).
//
// Both kernels split a block into ROWS groups of GROUP threads; each group works on its own row,
// the groups of a block in lockstep. A thread owns packs t, t + GROUP, ..., t + (PACKS - 1) *
// GROUP of VEC elements of every row it sees. Row sums go through group_sum: a warp shuffle, and
// for groups wider than a warp one barrier, alternating between two scratch slots. Rows may be
// strided (the last dimension contiguous).
//
// Forward (layernorm_fwd), fp32 statistics:
//   mean = sum(x) / cols, rstd = rsqrt(sum((x - mean)^2) / cols + eps)   (two passes: exact where a
//   one-pass sum of squares cancels for rows with a large mean),
//   y = (x - mean) * rstd * weight + bias.
// The row is held in registers between the passes (as packed elements), so x is read from memory
// once. The weight and bias are staged once per block in dynamic shared memory with cp.async while
// the first row's loads are in flight, when the launch gives room for them; otherwise they are
// read from global memory for every row (into registers beside x, before the first reduction,
// for blocks of one row and at most two packs of up to 16 bytes per thread). mean and rstd (f32,
// one per row) are written when non-null, bias is read when non-null.
//
// Backward (layernorm_bwd), with xhat = (x - mean) * rstd, g = dy * weight:
//   dx = rstd * (g - (sum(g) + xhat * sum(g * xhat)) / cols)
//   partial[slab, c] = sum over the slab's rows of dy * xhat,  partial[slabs + slab, c] = of dy
// Rows are dealt to the slabs (one per block) in turn: slab i takes rows i, i + slabs, ..., so the
// rows in flight on the whole GPU are neighbours in memory. Each thread keeps its columns' two
// sums in dynamic shared memory (a float2 per element, consecutive threads on consecutive slots)
// over the slab, which leaves the registers to the row; the groups of a block add theirs at the
// end and the block writes one row of each partial sum. A second kernel (rmsnorm_bwd_reduce) sums
// the slabs into dweight and dbias in a fixed order, so the result is deterministic.
//
// Requires: cols a multiple of VEC and at most GROUP * PACKS * VEC, every buffer and row stride
// aligned to VEC elements, rows shorter than 2^31 elements.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"

namespace kiln::layernorm {

// Registers a thread's PACKS packs of VEC elements of T take (a pack narrower than a register
// still takes one).
template <typename T, int VEC, int PACKS>
constexpr int cache_regs() {
  return PACKS * (sizeof(T) * VEC >= 4 ? int(sizeof(T) * VEC / 4) : 1);
}

// Blocks per SM a kernel is built for: 1024 resident threads (a 64-register cap) while its row
// cache takes at most 16 registers, else 512 (128 registers). While one block's groups wait at a
// barrier the other resident blocks keep loads in flight. The host mirrors this rule.
template <int BLOCK, int CACHE_REGS>
constexpr int min_blocks() {
  return (CACHE_REGS <= 16 ? 1024 : 512) / BLOCK > 0 ? (CACHE_REGS <= 16 ? 1024 : 512) / BLOCK : 1;
}

// Sum over the GROUP threads of the calling thread's group, returned to all of them. scratch: two
// slots of 32 floats of shared memory; the caller alternates `parity` between calls, so a slot is
// rewritten only after the next call's barrier, which every thread passes after its reads here.
// Every thread of the block must call. The warps' sums are added in the same order in every
// thread, so the whole group gets the same value.
template <int GROUP>
__device__ __forceinline__ float group_sum(float v, float (*scratch)[32], int parity) {
  constexpr int k_warps = GROUP / 32;
  v = kiln::warp_sum(v);
  if constexpr (k_warps == 1) {
    return v;
  } else {
    float* s = scratch[parity];
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
    __syncthreads();
    const float* mine = s + (threadIdx.x / GROUP) * k_warps;
    float t = mine[0];
#pragma unroll
    for (int i = 1; i < k_warps; ++i) t += mine[i];
    return t;
  }
}

// Two such sums with one barrier. scratch: two slots of 32 float2.
template <int GROUP>
__device__ __forceinline__ float2 group_sum2(float a, float b, float2 (*scratch)[32], int parity) {
  constexpr int k_warps = GROUP / 32;
  a = kiln::warp_sum(a);
  b = kiln::warp_sum(b);
  if constexpr (k_warps == 1) {
    return make_float2(a, b);
  } else {
    float2* s = scratch[parity];
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = make_float2(a, b);
    __syncthreads();
    const float2* mine = s + (threadIdx.x / GROUP) * k_warps;
    float2 t = mine[0];
#pragma unroll
    for (int i = 1; i < k_warps; ++i) {
      t.x += mine[i].x;
      t.y += mine[i].y;
    }
    return t;
  }
}

// A row's mean and rstd from the thread's PACKS packs of it (pack t + i * GROUP, where below
// `packs`; none where !valid), in two passes over the registers: two group sums, each flipping
// `parity`.
template <int GROUP, int PACKS, typename T, int VEC>
__device__ __forceinline__ void row_stats(const kiln::Pack<T, VEC> (&v)[PACKS], int t, int packs, bool valid,
                                          float inv_cols, float eps, float (*scratch)[32], int& parity, float& mean,
                                          float& rstd) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (valid && t + i * GROUP < packs) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += kiln::to_float(v[i].v[k]);
    }
  mean = group_sum<GROUP>(sum, scratch, parity) * inv_cols;
  parity ^= 1;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (valid && t + i * GROUP < packs) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = kiln::to_float(v[i].v[k]) - mean;
        sq += d * d;
      }
    }
  rstd = rsqrtf(group_sum<GROUP>(sq, scratch, parity) * inv_cols + eps);
  parity ^= 1;
}

template <typename T, int GROUP, int ROWS, int VEC, int PACKS>
__global__ void __launch_bounds__(GROUP * ROWS, (min_blocks<GROUP * ROWS, cache_regs<T, VEC, PACKS>()>()))
layernorm_fwd(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
              float* __restrict__ mean_out, float* __restrict__ rstd_out, long long rows, long long cols,
              long long x_stride, long long y_stride, float eps) {
  constexpr int BLOCK = GROUP * ROWS;
  static_assert(GROUP % 32 == 0 && BLOCK <= 1024, "bad block shape");
  using P = kiln::Pack<T, VEC>;
  __shared__ __align__(16) float scratch[2][32];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  P* const sw = reinterpret_cast<P*>(dyn_smem);  // the weight's packs, then the bias's

  const int g = int(threadIdx.x) / GROUP, t = int(threadIdx.x) % GROUP;
  const int packs = int(cols / VEC);
  const float inv_cols = 1.f / float(cols);
  const bool staged = kiln::dynamic_smem_bytes() >= 2u * unsigned(packs) * unsigned(sizeof(P));
  P* const sb = sw + packs;
  if (staged) {
    // Every thread of the block copies a share; the copies complete before the first row needs them.
    for (int p = int(threadIdx.x); p < packs; p += BLOCK) {
      if constexpr (sizeof(P) >= 4) {
        kiln::cp_async_pack<T, VEC>(sw + p, weight + p * VEC);
        if (bias) kiln::cp_async_pack<T, VEC>(sb + p, bias + p * VEC);
      } else {
        sw[p] = kiln::load_pack<T, VEC>(weight + p * VEC);
        if (bias) sb[p] = kiln::load_pack<T, VEC>(bias + p * VEC);
      }
    }
  }

  int parity = 0;
  // One row per block and at most two packs (of up to 16 bytes) of each buffer per thread, without
  // staging:
  // the weight and bias are loaded into registers right behind x, before the first reduction, so
  // no row waits for them after its statistics, and no barrier waits for staged copies. The host
  // launches this way for calls of a few rows, where one block's latency is the kernel's time.
  constexpr bool k_lean = ROWS == 1 && PACKS <= 2 && PACKS * VEC * int(sizeof(T)) <= 32;
  if constexpr (k_lean) {
    if (!staged) {
      for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* const xr = x + row * x_stride;
        // Every load issued unconditionally (at the last pack for a thread past the row's end,
        // whose values are not used), so that all go out before the first use of any; a missing
        // bias reads the weight instead and adds nothing.
        const T* const bsrc = bias ? bias : weight;
        P v[PACKS], wv[PACKS], bv[PACKS];
#pragma unroll
        for (int i = 0; i < PACKS; ++i) {
          const int p = min(t + i * GROUP, packs - 1);
          v[i] = kiln::load_pack<T, VEC>(xr + p * VEC);
          wv[i] = kiln::load_pack<T, VEC>(weight + p * VEC);
          bv[i] = kiln::load_pack<T, VEC>(bsrc + p * VEC);
        }
        float mean, rstd;
        row_stats<GROUP, PACKS>(v, t, packs, true, inv_cols, eps, scratch, parity, mean, rstd);
        if (t == 0) {
          if (mean_out) mean_out[row] = mean;
          if (rstd_out) rstd_out[row] = rstd;
        }
        T* const yt = y + row * y_stride + t * VEC;
#pragma unroll
        for (int i = 0; i < PACKS; ++i)
          if (t + i * GROUP < packs) {
            P out;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float b = bias ? kiln::to_float(bv[i].v[k]) : 0.f;
              out.v[k] = kiln::from_float<T>((kiln::to_float(v[i].v[k]) - mean) * rstd * kiln::to_float(wv[i].v[k]) + b);
            }
            kiln::store_pack<T, VEC>(yt + i * GROUP * VEC, out);
          }
      }
      return;
    }
  }

  bool first = true;
  // Every group runs the same number of iterations (the barriers); a group past the last row idles.
  for (long long base = (long long)blockIdx.x * ROWS; base < rows; base += (long long)gridDim.x * ROWS) {
    const long long row = base + g;
    const bool valid = row < rows;
    // One base pointer per thread: the packs' offsets are immediates.
    const T* const xt = x + row * x_stride + t * VEC;
    P v[PACKS];
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < packs) v[i] = kiln::load_pack<T, VEC>(xt + i * GROUP * VEC);
    if (first) {
      if (staged) {
        kiln::cp_async_wait_all();
        __syncthreads();  // the packs another thread copied
      }
      first = false;
    }
    float mean, rstd;
    row_stats<GROUP, PACKS>(v, t, packs, valid, inv_cols, eps, scratch, parity, mean, rstd);
    if (!valid) continue;
    if (t == 0) {
      if (mean_out) mean_out[row] = mean;
      if (rstd_out) rstd_out[row] = rstd;
    }
    T* const yt = y + row * y_stride + t * VEC;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int p = t + i * GROUP;
      if (p < packs) {
        const P wp = staged ? sw[p] : kiln::load_pack<T, VEC>(weight + p * VEC);
        float add[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) add[k] = 0.f;
        if (bias) {
          const P bp = staged ? sb[p] : kiln::load_pack<T, VEC>(bias + p * VEC);
#pragma unroll
          for (int k = 0; k < VEC; ++k) add[k] = kiln::to_float(bp.v[k]);
        }
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          out.v[k] = kiln::from_float<T>((kiln::to_float(v[i].v[k]) - mean) * rstd * kiln::to_float(wp.v[k]) + add[k]);
        kiln::store_pack<T, VEC>(yt + i * GROUP * VEC, out);
      }
    }
  }
}

// Dynamic shared memory: ROWS * PACKS * VEC * GROUP float2, the (dweight, dbias) sums of each
// thread's elements, slot ((g * PACKS + i) * VEC + k) * GROUP + t.
template <typename T, int GROUP, int ROWS, int VEC, int PACKS>
__global__ void __launch_bounds__(GROUP * ROWS, (min_blocks<GROUP * ROWS, 2 * cache_regs<T, VEC, PACKS>()>()))
layernorm_bwd(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
              const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
              float* __restrict__ partial, long long rows, long long cols, long long dy_stride, long long x_stride,
              long long dx_stride, long long slabs) {
  constexpr int BLOCK = GROUP * ROWS;
  constexpr int k_elems = PACKS * VEC;  // elements per thread of a row
  static_assert(GROUP % 32 == 0 && BLOCK <= 1024, "bad block shape");
  using P = kiln::Pack<T, VEC>;
  __shared__ __align__(16) float2 scratch[2][32];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  float2* const sums = reinterpret_cast<float2*>(dyn_smem);

  const int g = int(threadIdx.x) / GROUP, t = int(threadIdx.x) % GROUP;
  const long long slab = blockIdx.x;
  const int packs = int(cols / VEC);
  const float inv_cols = 1.f / float(cols);
  float2* const acc = sums + g * (k_elems * GROUP) + t;  // acc[(i * VEC + k) * GROUP]
  const T* const wt = weight + t * VEC;
#pragma unroll
  for (int e = 0; e < k_elems; ++e) acc[e * GROUP] = make_float2(0.f, 0.f);

  // The slab's k-th row is slab + k * slabs; group g takes k = g, g + ROWS, ...
  const long long slab_rows = rows > slab ? (rows - slab + slabs - 1) / slabs : 0;
  const long long iters = (slab_rows + ROWS - 1) / ROWS;
  int parity = 0;
  for (long long it = 0; it < iters; ++it, parity ^= 1) {
    const long long k_row = it * ROWS + g;
    const bool valid = k_row < slab_rows;
    const long long row = slab + k_row * slabs;
    // One base pointer per row and thread: the packs' offsets are immediates.
    const T* const dyt = dy + row * dy_stride + t * VEC;
    const T* const xt = x + row * x_stride + t * VEC;
    P cdy[PACKS], cx[PACKS];
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (valid && t + i * GROUP < packs) {
        cdy[i] = kiln::load_pack<T, VEC>(dyt + i * GROUP * VEC);
        cx[i] = kiln::load_pack<T, VEC>(xt + i * GROUP * VEC);
      }
    const float m = valid ? mean[row] : 0.f, s = valid ? rstd[row] : 0.f;
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      if (valid && t + i * GROUP < packs) {
        const P wp = kiln::load_pack<T, VEC>(wt + i * GROUP * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float xh = (kiln::to_float(cx[i].v[k]) - m) * s;
          // Rounded on its own (no fused multiply-add with what follows), so the dx pass below
          // subtracts the very values these sums added: g - mean(g) is exactly 0 for one column.
          const float gg = __fmul_rn(kiln::to_float(cdy[i].v[k]), kiln::to_float(wp.v[k]));
          sum_g += gg;
          sum_gx += gg * xh;
        }
      }
    }
    const float2 both = group_sum2<GROUP>(sum_g, sum_gx, scratch, parity);
    if (!valid) continue;
    const float mg = both.x * inv_cols, mgx = both.y * inv_cols;
    T* const dxt = dx + row * dx_stride + t * VEC;
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      if (t + i * GROUP < packs) {
        const P wp = kiln::load_pack<T, VEC>(wt + i * GROUP * VEC);
        P out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float d = kiln::to_float(cdy[i].v[k]);
          const float xh = (kiln::to_float(cx[i].v[k]) - m) * s;
          const float gg = __fmul_rn(d, kiln::to_float(wp.v[k]));
          out.v[k] = kiln::from_float<T>(s * (gg - mg - xh * mgx));
          float2& a = acc[(i * VEC + k) * GROUP];
          a.x += d * xh;
          a.y += d;
        }
        kiln::store_pack<T, VEC>(dxt + i * GROUP * VEC, out);
      }
    }
  }

  if constexpr (ROWS > 1) {
    // Group 0 adds the other groups' sums to its own (each thread its own slots).
    __syncthreads();
    if (g == 0)
      for (int q = 1; q < ROWS; ++q)
#pragma unroll
        for (int e = 0; e < k_elems; ++e) {
          const float2 o = sums[(q * k_elems + e) * GROUP + t];
          float2& a = acc[e * GROUP];
          a.x += o.x;
          a.y += o.y;
        }
  }
  // The slab's partial rows go out with consecutive threads on consecutive columns.
  __syncthreads();
  float* const pw = partial + slab * cols;
  float* const pb = partial + (slabs + slab) * cols;
  for (int c = int(threadIdx.x); c < k_elems * GROUP; c += BLOCK) {
    const int i = c / (GROUP * VEC), owner = c / VEC % GROUP, k = c % VEC;
    if (owner + i * GROUP < packs) {
      const float2 a = sums[(i * VEC + k) * GROUP + owner];
      pw[c] = a.x;
      pb[c] = a.y;
    }
  }
}

}  // namespace kiln::layernorm
