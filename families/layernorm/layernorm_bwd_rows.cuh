// LayerNorm backward for calls of a few rows (layernorm_bwd_rows): dx, dweight and dbias in one
// launch, where the two-stage backward (layernorm_bwd, then rmsnorm_bwd_reduce for each of dweight
// and dbias) takes three. With xhat = (x - mean) * rstd and g = dy * weight (the formulas of
// layernorm_bwd):
//   dx = rstd * (g - (sum(g) + xhat * sum(g * xhat)) / cols),  dweight = sum over rows of dy * xhat,
//   dbias = sum over rows of dy.
// The grid is one thread-block cluster of CLUSTER blocks, block r taking rows r and r + CLUSTER
// (blocks past the last row contribute nothing). Each thread holds PACKS packs of VEC elements of
// dy, x and the weight in registers, all loaded before the row's one (paired) reduction. With
// CLUSTER 1 (one row) the thread writes dweight and dbias from registers. Otherwise every block
// keeps its rows' terms (f32, dweight's then dbias's, summed over its rows) in dynamic shared
// memory; after a cluster barrier block r sums its share of them over the cluster's blocks through
// distributed shared memory in rank order (deterministic) and writes them; a second barrier keeps
// every block's terms alive until the others have read.
//
// Requires: VEC * sizeof(T) == 16, cols a multiple of VEC and at most BLOCK * PACKS * VEC,
// rows <= 2 CLUSTER (1 when CLUSTER is 1), every buffer and row stride aligned to 16 bytes;
// dynamic shared memory of 2 * cols floats when CLUSTER > 1; sm_90 or later when CLUSTER > 1.
// dbias may be null.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/reduce.cuh"

namespace kiln::layernorm {

template <typename T, int BLOCK, int VEC, int PACKS, int CLUSTER>
__global__ void __launch_bounds__(BLOCK)
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER, 1, 1)
#endif
layernorm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
                   const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                   T* __restrict__ dweight, T* __restrict__ dbias, long long rows, long long cols, long long dy_stride,
                   long long x_stride, long long dx_stride) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  static_assert(VEC * sizeof(T) == 16, "16-byte packs");
  using P = kiln::Pack<T, VEC>;
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
  const unsigned rank = CLUSTER > 1 ? kiln::ptx::cluster_ctarank() : 0u;
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
    P dyv[PACKS], xv[PACKS], wv[PACKS];
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int p = min(t + i * BLOCK, packs - 1);
      dyv[i] = kiln::load_pack<T, VEC>(dyr + p * VEC);
      xv[i] = kiln::load_pack<T, VEC>(xr + p * VEC);
      wv[i] = kiln::load_pack<T, VEC>(weight + p * VEC);
    }
    const float mu = mean[src], rs = rstd[src];

    // The row's sums of g and g * xhat, in one reduction.
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int i = 0; i < PACKS; ++i)
      if (t + i * BLOCK < packs) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float g = kiln::to_float(dyv[i].v[k]) * kiln::to_float(wv[i].v[k]);
          sg += g;
          sgx = fmaf(g, (kiln::to_float(xv[i].v[k]) - mu) * rs, sgx);
        }
      }
    sg = kiln::warp_sum(sg);
    sgx = kiln::warp_sum(sgx);
    if constexpr (BLOCK > 32) {
      if (it > 0) __syncthreads();  // every warp has read the previous row's sums
      if (t % 32 == 0) sums[t / 32] = make_float2(sg, sgx);
      __syncthreads();
      float2 total = sums[0];
#pragma unroll
      for (int i = 1; i < BLOCK / 32; ++i) {
        total.x += sums[i].x;
        total.y += sums[i].y;
      }
      sg = total.x;
      sgx = total.y;
    }
    sg *= inv_cols;
    sgx *= inv_cols;

    T* dxr = dx + row * dx_stride + t * VEC;
    const float keep = valid ? 1.f : 0.f;  // a block past the last row adds nothing
#pragma unroll
    for (int i = 0; i < PACKS; ++i) {
      const int p = t + i * BLOCK;
      if (p < packs) {
        P out, dwp, dbp;
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
          float4 wt, bt;  // four elements' dweight and dbias terms, kept in shared memory as vectors
          float* wq = &wt.x;
          float* bq = &bt.x;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = 4 * q + e;
            const float d = kiln::to_float(dyv[i].v[k]);
            const float xhat = (kiln::to_float(xv[i].v[k]) - mu) * rs;
            const float g = d * kiln::to_float(wv[i].v[k]);
            out.v[k] = kiln::from_float<T>(rs * (g - sg - xhat * sgx));
            wq[e] = d * xhat * keep;
            bq[e] = d * keep;
            dwp.v[k] = kiln::from_float<T>(wq[e]);
            dbp.v[k] = kiln::from_float<T>(bq[e]);
          }
          if constexpr (CLUSTER > 1) {
            float4* wslot = reinterpret_cast<float4*>(terms + p * VEC) + q;
            float4* bslot = reinterpret_cast<float4*>(terms + cols + p * VEC) + q;
            if (it > 0) {
              const float4 w0 = *wslot, b0 = *bslot;
              wt.x += w0.x;
              wt.y += w0.y;
              wt.z += w0.z;
              wt.w += w0.w;
              bt.x += b0.x;
              bt.y += b0.y;
              bt.z += b0.z;
              bt.w += b0.w;
            }
            *wslot = wt;
            *bslot = bt;
          }
        }
        if (valid) kiln::store_pack<T, VEC>(dxr + i * BLOCK * VEC, out);
        if constexpr (CLUSTER == 1) {
          kiln::store_pack<T, VEC>(dweight + p * VEC, dwp);
          if (dbias) kiln::store_pack<T, VEC>(dbias + p * VEC, dbp);
        }
      }
    }
  }

  if constexpr (CLUSTER > 1) {
    kiln::ptx::cluster_sync_aligned();  // every block's terms are in its shared memory
    // dweight's quads, then dbias's (when it is wanted), shared out over the cluster's blocks.
    const int quads = int(cols) / 4, total = dbias ? 2 * quads : quads;
    const int per = (total + CLUSTER - 1) / CLUSTER;
    const int end = min(total, int(rank) * per + per);
    const unsigned base = kiln::ptx::smem_addr(terms);
    for (int j = int(rank) * per + t; j < end; j += BLOCK) {
      const float4 acc = kiln::ptx::cluster_sum_f4<0, CLUSTER>(base + unsigned(j) * 16u);
      T* o = j < quads ? dweight + 4 * j : dbias + 4 * (j - quads);
      o[0] = kiln::from_float<T>(acc.x);
      o[1] = kiln::from_float<T>(acc.y);
      o[2] = kiln::from_float<T>(acc.z);
      o[3] = kiln::from_float<T>(acc.w);
    }
    kiln::ptx::cluster_sync_aligned();  // no block leaves while another may still read its terms
  }
}

}  // namespace kiln::layernorm
