// RMSNorm backward for calls of a few rows (rmsnorm_bwd_rows): dx and dw in one launch, where the
// two-stage backward (rmsnorm_bwd, then rmsnorm_bwd_reduce) spends most of a call on its second
// launch and the first stage's slab bookkeeping. Same formulas and options as rmsnorm_bwd:
//   dx = s * dy * w - x * s^3 * mean(dy * w * x) [+ dh],   dw = sum over rows of dy * x * s,
// s = inv_rms[r], or rsqrt(mean(x^2) + eps) with RECOMPUTE.
//
// The grid is one thread-block cluster of CLUSTER blocks, block r taking rows r and r + CLUSTER
// (blocks past the last row contribute nothing). Each thread holds PACKS packs of VEC elements of
// dy, x, the weight (and dh) in registers, all loaded before the row's one reduction. With CLUSTER
// 1 (one row) the thread writes dw from registers. Otherwise every block keeps its rows' dw terms
// (f32, summed over its rows) in dynamic shared memory; after a cluster barrier block r sums its share of the columns over the cluster's
// blocks through distributed shared memory, in rank order (so the result is deterministic), and
// writes dw; a second barrier keeps every block's terms alive until the others have read them.
//
// Requires: VEC * sizeof(T) == 16 (so cols is a multiple of 4), cols a multiple of VEC and at most
// BLOCK * PACKS * VEC, rows <= 2 CLUSTER (1 when CLUSTER is 1), every buffer and row stride aligned
// to 16 bytes; dynamic shared memory of cols floats when CLUSTER > 1; sm_90 or later when
// CLUSTER > 1.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/reduce.cuh"

namespace kiln {

template <typename T, int BLOCK, int VEC, int PACKS, int CLUSTER, bool RECOMPUTE, bool DH>
__global__ void __launch_bounds__(BLOCK)
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER, 1, 1)
#endif
rmsnorm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                 const float* __restrict__ inv_rms, T* __restrict__ dx, T* __restrict__ dw, long long rows,
                 long long cols, long long dy_stride, long long x_stride, long long dx_stride,
                 const T* __restrict__ dh, long long dh_stride, float eps) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  static_assert(VEC * sizeof(T) == 16, "16-byte packs");
  using P = Pack<T, VEC>;
#if __CUDA_ARCH__ < 900
  if constexpr (CLUSTER > 1) {
    __trap();  // never launched: the host allows clusters on sm_90 and later only
    return;
  }
#endif
  __shared__ __align__(16) float2 sums[BLOCK / 32];
  extern __shared__ __align__(16) float terms[];
  if (rows <= 0) return;  // every block of the cluster alike: no barrier is left waiting
  const int t = int(threadIdx.x);
  const int packs = int(cols) / VEC;
  const float inv_cols = 1.f / float(cols);
  const unsigned rank = CLUSTER > 1 ? ptx::cluster_ctarank() : 0u;
  // Block r takes rows r and r + CLUSTER (rows <= 2 CLUSTER); a block past the last row runs once
  // and contributes nothing.
  const long long iters = rows > rank ? (rows - 1 - rank) / CLUSTER + 1 : 1;
  for (long long it = 0; it < iters; ++it) {
    const long long row = rank + it * CLUSTER;
    const bool valid = row < rows;

    // Every load issued unconditionally, so that all go out before the first use of any: a
    // thread past the row's end reads the row's last pack, and a block past the last row the last
    // row; neither uses what it read.
    const long long src = valid ? row : rows - 1;
    const T* dyr = dy + src * dy_stride;
    const T* xr = x + src * x_stride;
    P dyv[PACKS], xv[PACKS], wv[PACKS], dhv[DH ? PACKS : 1];
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int p = min(t + i * BLOCK, packs - 1);
      dyv[i] = load_pack<T, VEC>(dyr + p * VEC);
      xv[i] = load_pack<T, VEC>(xr + p * VEC);
      wv[i] = load_pack<T, VEC>(w + p * VEC);
      if constexpr (DH) dhv[i] = load_pack<T, VEC>(dh + src * dh_stride + p * VEC);
    }
    float saved = 0.f;
    if constexpr (!RECOMPUTE) saved = inv_rms[src];

    // The row's sums: mean(dy * w * x), and mean(x^2) with RECOMPUTE, in one reduction.
    float dot = 0.f, squares = 0.f;
    if (valid) {
#pragma unroll
      for (int i = 0; i < PACKS; ++i)
        if (t + i * BLOCK < packs) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xf = to_float(xv[i].v[k]);
            dot = fmaf(to_float(dyv[i].v[k]) * to_float(wv[i].v[k]), xf, dot);
            if constexpr (RECOMPUTE) squares = fmaf(xf, xf, squares);
          }
        }
    }
    dot = warp_sum(dot);
    if constexpr (RECOMPUTE) squares = warp_sum(squares);
    if constexpr (BLOCK > 32) {
      if (it > 0) __syncthreads();  // every warp has read the previous row's sums
      if (t % 32 == 0) sums[t / 32] = make_float2(dot, squares);
      __syncthreads();
      float2 total = sums[0];
#pragma unroll
      for (int i = 1; i < BLOCK / 32; ++i) {
        total.x += sums[i].x;
        total.y += sums[i].y;
      }
      dot = total.x;
      squares = total.y;
    }
    const float s = RECOMPUTE ? rsqrtf(squares * inv_cols + eps) : saved;
    const float c = s * s * s * dot * inv_cols;

    T* dxr = dx + row * dx_stride + t * VEC;
    const float ts = valid ? s : 0.f;  // a block past the last row adds nothing to dw
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int p = t + i * BLOCK;
      if (p < packs) {
        P out, dwp;
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          float4 term;  // the four elements' dw terms, kept in shared memory as one vector
          float* tq = &term.x;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = 4 * q + e;
            const float g = to_float(dyv[i].v[k]), xf = to_float(xv[i].v[k]);
            float d = s * g * to_float(wv[i].v[k]) - xf * c;
            if constexpr (DH) d += to_float(dhv[i].v[k]);
            out.v[k] = from_float<T>(d);
            tq[e] = g * xf * ts;
            dwp.v[k] = from_float<T>(tq[e]);
          }
          if constexpr (CLUSTER > 1) {
            float4* slot = reinterpret_cast<float4*>(terms + p * VEC) + q;
            if (it > 0) {
              const float4 before = *slot;
              term.x += before.x;
              term.y += before.y;
              term.z += before.z;
              term.w += before.w;
            }
            *slot = term;
          }
        }
        if (valid) store_pack<T, VEC>(dxr + i * BLOCK * VEC, out);
        if constexpr (CLUSTER == 1) store_pack<T, VEC>(dw + p * VEC, dwp);
      }
    }
  }

  if constexpr (CLUSTER > 1) {
    ptx::cluster_sync_aligned();  // every block's terms are in its shared memory
    const int quads = int(cols) / 4;
    const int per = (quads + CLUSTER - 1) / CLUSTER;
    const int end = min(quads, int(rank) * per + per);
    const unsigned base = ptx::smem_addr(terms);
    for (int j = int(rank) * per + t; j < end; j += BLOCK) {
      const float4 acc = ptx::cluster_sum_f4<0, CLUSTER>(base + unsigned(j) * 16u);
      T* out = dw + 4 * j;
      out[0] = from_float<T>(acc.x);
      out[1] = from_float<T>(acc.y);
      out[2] = from_float<T>(acc.z);
      out[3] = from_float<T>(acc.w);
    }
    ptx::cluster_sync_aligned();  // no block leaves while another may still read its terms
  }
}

}  // namespace kiln
