// Fused RMSNorm + RoPE (neox): n = x * rsqrt(mean(x^2 over the row) + eps) * w, then per head
// y[j] = n[j] cos[j] - n[j + d/2] sin[j] and y[j + d/2] = n[j + d/2] cos[j + d/2] + n[j] sin[j + d/2]
// for j < d/2, with cos/sin rows of the full head_dim d taken at the token's position in its
// sequence. fp32 math; n never leaves registers.
//
// One block per row (token), grid-stride over rows. A work item is VEC rotation pairs of one head:
// a pack from the head's first half and the matching pack d/2 further, so both partners of every
// pair are in the same thread. Each thread keeps its first k_cached items in registers between the
// reduction and the write; rows with more items re-read the rest. Every element is read and written
// by one thread, after the block-wide reduction's barrier, so y may be x (in place).
// Requires: x, y and w aligned to VEC elements, cos and sin to min(VEC * sizeof(C), 16) bytes;
// hidden a multiple of HEAD_DIM, HEAD_DIM / 2 a multiple of VEC.
#pragma once

#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "rope/rope_util.cuh"

namespace kiln {

// w points at the weight, or at its copy in shared memory; cos_row and sin_row at the token's rows,
// in global or shared memory.
template <typename T, typename C, int HEAD_DIM, int VEC>
__device__ __forceinline__ void rmsnorm_rope_item(const Pack<T, VEC>& lo, const Pack<T, VEC>& hi, int off, int pair,
                                                  const T* w, const C* cos_row, const C* sin_row, float scale, T* yr) {
  constexpr int k_half = HEAD_DIM / 2;
  const Pack<T, VEC> w_lo = load_pack<T, VEC>(w + off), w_hi = load_pack<T, VEC>(w + off + k_half);
  float c_lo[VEC], c_hi[VEC], s_lo[VEC], s_hi[VEC];
  load_floats<C, VEC>(cos_row + pair, c_lo);
  load_floats<C, VEC>(cos_row + pair + k_half, c_hi);
  load_floats<C, VEC>(sin_row + pair, s_lo);
  load_floats<C, VEC>(sin_row + pair + k_half, s_hi);
  Pack<T, VEC> o_lo, o_hi;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float n_lo = to_float(lo.v[j]) * scale * to_float(w_lo.v[j]);
    const float n_hi = to_float(hi.v[j]) * scale * to_float(w_hi.v[j]);
    o_lo.v[j] = from_float<T>(n_lo * c_lo[j] - n_hi * s_lo[j]);
    o_hi.v[j] = from_float<T>(n_hi * c_hi[j] + n_lo * s_hi[j]);
  }
  store_pack<T, VEC>(yr + off, o_lo);
  store_pack<T, VEC>(yr + off + k_half, o_hi);
}

template <typename T, int VEC>
__device__ __forceinline__ float sum_squares(const Pack<T, VEC>& a, const Pack<T, VEC>& b, float acc) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float fa = to_float(a.v[j]), fb = to_float(b.v[j]);
    acc = fmaf(fa, fa, acc);
    acc = fmaf(fb, fb, acc);
  }
  return acc;
}

// On Hopper, at least 1024 threads resident per SM (64 registers at most): with fewer, too few
// bytes are in flight while blocks wait at the reduction's barrier (the bound is faster at 32768 x
// 4096 bf16; docs/benchmarks.md). sm_80's ptxas spills some f16 variants under that cap, and the
// gain is unmeasured there, so it keeps the plain bound.
#if __CUDA_ARCH__ >= 900
#define KILN_RMSNORM_ROPE_MIN_BLOCKS(BLOCK) (1024 / (BLOCK) > 0 ? 1024 / (BLOCK) : 1)
#else
#define KILN_RMSNORM_ROPE_MIN_BLOCKS(BLOCK) 1
#endif

template <typename T, typename C, int HEAD_DIM, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK, KILN_RMSNORM_ROPE_MIN_BLOCKS(BLOCK))
rmsnorm_rope_fwd(const T* x, const T* __restrict__ w, const C* __restrict__ cos, const C* __restrict__ sin, T* y,
                 long long rows, int hidden, long long seq, float eps) {
  static_assert(HEAD_DIM % (2 * VEC) == 0, "a head must hold a whole number of items");
  using P = Pack<T, VEC>;
  constexpr int k_half = HEAD_DIM / 2;
  constexpr int k_chunks = k_half / VEC;
  // Registers of row cache per thread, as in rmsnorm_fwd: 16, or 8 under the 64-register cap of
  // 1024-thread blocks. An item is two packs.
  constexpr int k_cache_regs = BLOCK >= 1024 ? 8 : 16;
  constexpr int k_regs_per_item = int(2 * sizeof(P) + 3) / 4;
  constexpr int k_cached = k_cache_regs / k_regs_per_item;
  __shared__ float scratch[33];
  // The token's cos and sin rows, staged before the reduction (two buffers, alternating by row:
  // a row's copy can start while slower threads still read the previous row's), and, when the host
  // gives dynamic shared memory for it (rows within the register cache), the weight: their latency
  // then passes during the reduction instead of after it, before the first store (faster at 32768
  // tokens x 4096 bf16, head_dim 64; docs/benchmarks.md has the figures).
  constexpr int k_cs_bytes = int(VEC * sizeof(C)) < 16 ? int(VEC * sizeof(C)) : 16;  // the host's cos alignment
  constexpr int k_cs_elems = k_cs_bytes / int(sizeof(C));
  __shared__ __align__(16) C cs_buf[2][2][HEAD_DIM];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  P* w_smem = reinterpret_cast<P*>(dyn_smem);

  const int items = hidden / (2 * VEC);
  // Item `it` is VEC pairs of its head: `pair_of` is their offset in the half-head, `offset_of`
  // the row offset of the first half's pack (the second half's is k_half further).
  auto pair_of = [](int it) { return (it % k_chunks) * VEC; };
  auto offset_of = [&](int it) { return (it / k_chunks) * HEAD_DIM + pair_of(it); };
  const float inv_hidden = 1.f / float(hidden);
  const bool w_staged =
      sizeof(P) >= 4 && items <= k_cached * BLOCK && dynamic_smem_bytes() >= unsigned(hidden * sizeof(T));
  int parity = 0;

  for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const T* xr = x + row * hidden;
    T* yr = y + row * hidden;
    const long long s = row % seq;

    P lo[k_cached], hi[k_cached];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items) {
        const int off = offset_of(it);
        lo[i] = load_pack<T, VEC>(xr + off);
        hi[i] = load_pack<T, VEC>(xr + off + k_half);
      }
    }
    // cos and sin of the token: HEAD_DIM values each, in pieces of k_cs_bytes.
    for (int j = int(threadIdx.x) * k_cs_elems; j < 2 * HEAD_DIM; j += BLOCK * k_cs_elems) {
      const int which = j >= HEAD_DIM, e = j - which * HEAD_DIM;
      const C* src = (which ? sin : cos) + s * HEAD_DIM + e;
      if constexpr (k_cs_bytes >= 4) cp_async_pack<C, k_cs_elems>(reinterpret_cast<Pack<C, k_cs_elems>*>(&cs_buf[parity][which][e]), src);
      else cs_buf[parity][which][e] = *src;
    }
    // The weight of the thread's own items, once per block: only this thread reads them back.
    if constexpr (sizeof(P) >= 4) {
      if (w_staged && row == blockIdx.x) {
#pragma unroll
        for (int i = 0; i < k_cached; ++i) {
          const int it = int(threadIdx.x) + i * BLOCK;
          if (it < items) {
            const int off = offset_of(it);
            cp_async_pack<T, VEC>(w_smem + off / VEC, w + off);
            cp_async_pack<T, VEC>(w_smem + (off + k_half) / VEC, w + off + k_half);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items) acc = sum_squares<T, VEC>(lo[i], hi[i], acc);
    }
    for (int it = int(threadIdx.x) + k_cached * BLOCK; it < items; it += BLOCK) {
      const int off = offset_of(it);
      acc = sum_squares<T, VEC>(load_pack<T, VEC>(xr + off), load_pack<T, VEC>(xr + off + k_half), acc);
    }

    // Each thread waits for its own copies; the reduction's barrier then shows every thread's.
    cp_async_wait_all();
    if constexpr (BLOCK <= 32) __syncthreads();
    const float scale = rsqrtf(block_sum<BLOCK>(acc, scratch) * inv_hidden + eps);
    const C* cos_row = cs_buf[parity][0];
    const C* sin_row = cs_buf[parity][1];
    const T* wp = w_staged ? reinterpret_cast<const T*>(w_smem) : w;

#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items)
        rmsnorm_rope_item<T, C, HEAD_DIM, VEC>(lo[i], hi[i], offset_of(it), pair_of(it), wp, cos_row, sin_row, scale, yr);
    }
    for (int it = int(threadIdx.x) + k_cached * BLOCK; it < items; it += BLOCK) {
      const int off = offset_of(it);
      rmsnorm_rope_item<T, C, HEAD_DIM, VEC>(load_pack<T, VEC>(xr + off), load_pack<T, VEC>(xr + off + k_half), off,
                                             pair_of(it), w, cos_row, sin_row, scale, yr);
    }
  }
}

}  // namespace kiln
