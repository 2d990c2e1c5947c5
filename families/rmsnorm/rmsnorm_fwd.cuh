// RMSNorm forward: y = x * rsqrt(mean(x^2) + eps) * w over the last dimension, fp32 accumulation.
//
// One block per row (grid-stride over rows), or, when the host caps the grid and rows are short,
// a few rows per block with the next row's loads in flight during this row's stores. Each thread
// keeps up to k_cached packs of its slice of the row in registers between the reduction and the
// write. The next `smem_packs` packs of the row are kept in dynamic shared memory (the host sizes
// it: rows of 64K bf16 are then read once), and any packs past both caches are re-read in the
// second pass. Rows that fit the register cache use the dynamic shared memory, when the host gives
// it, for the weight instead (staged once per block, read after each reduction). Columns past the
// last whole pack are handled one element at a time, so any row length works.
// inv_rms (optional, f32 [rows]) receives rsqrt(mean(x^2) + eps) per row, for the backward pass.
// Requires: x, y and w aligned to VEC*sizeof(T) bytes, row strides multiples of VEC.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/reduce.cuh"

namespace kiln {

// Registers of row cache per thread: 16, and 8 in 1024-thread blocks (16 made ptxas spill there).
// Every variant runs under a 64-register cap (at least 1024 resident threads per SM): a block's
// warps stall in the reduction, and the other resident blocks keep loads in flight meanwhile; a
// 32-register cache without the cap leaves too few threads per SM to fill the memory pipe (well
// below add_rmsnorm, built this way, at 4096x4096 bf16; docs/benchmarks.md has the figures). The
// host mirrors this rule (families/rmsnorm) to size the shared-memory cache.
template <int BLOCK>
constexpr int rmsnorm_cache_regs() { return BLOCK >= 1024 ? 8 : 16; }

template <typename T, int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, float* __restrict__ inv_rms,
            long long rows, long long cols, long long x_stride, long long y_stride, float eps) {
  using P = Pack<T, VEC>;
  constexpr int k_regs_per_pack = sizeof(P) >= 4 ? int(sizeof(P)) / 4 : 1;
  constexpr int k_cached = rmsnorm_cache_regs<BLOCK>() / k_regs_per_pack;
  // Packs beyond the cache move in batches of 8 registers per thread (4 for 16-byte packs in
  // 1024-thread blocks, where more spilled), all loads of a batch issued before any is used: one
  // outstanding load per thread cannot keep the memory system busy.
  constexpr int k_batch_regs = BLOCK < 1024 ? 8 : sizeof(P) >= 16 ? 4 : 8;
  constexpr int k_batch = k_batch_regs / k_regs_per_pack;
  __shared__ float scratch[33];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  P* spill = reinterpret_cast<P*>(dyn_smem);

  // Row lengths are below 2^31 (checked on the host), so in-row indices are 32-bit.
  const int packs = int(cols / VEC);
  const int n = int(cols);
  const float inv_cols = 1.f / float(cols);
  const int first_uncached = k_cached * BLOCK;
  const int smem_packs = int(dynamic_smem_bytes() / sizeof(P));
  const int smem_end = min(packs, first_uncached + smem_packs);

  // Fewer blocks than rows (the host caps the grid near one wave) and rows that fit half the
  // register cache: each block pipelines its rows, issuing the next row's loads before this row's
  // reduction and stores, so reads and writes overlap even when the grid is a single wave.
  constexpr int k_half = k_cached / 2;
  if (k_half > 0 && gridDim.x < rows && packs <= k_half * BLOCK) {
    P cur[k_half], nxt[k_half];
    long long row = blockIdx.x;
#pragma unroll
    for (int i = 0; i < k_half; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) cur[i] = load_pack<T, VEC>(x + row * x_stride + p * VEC);
    }
    // The weight, the same for every row, staged once in shared memory when the host gave room
    // (see the register-cache path below).
    const bool w_staged = sizeof(P) >= 8 && smem_packs >= packs;
    if constexpr (sizeof(P) >= 8) {
      if (w_staged) {
#pragma unroll
        for (int i = 0; i < k_half; ++i) {
          const int p = int(threadIdx.x) + i * BLOCK;
          if (p < packs) cp_async_pack<T, VEC>(spill + p, w + p * VEC);
        }
        cp_async_wait_all();
      }
    }
    for (;;) {
      const T* xr = x + row * x_stride;
      T* yr = y + row * y_stride;
      const long long next = row + gridDim.x;
      if (next < rows) {
#pragma unroll
        for (int i = 0; i < k_half; ++i) {
          const int p = int(threadIdx.x) + i * BLOCK;
          if (p < packs) nxt[i] = load_pack<T, VEC>(x + next * x_stride + p * VEC);
        }
      }
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < k_half; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float f = to_float(cur[i].v[k]);
            acc = fmaf(f, f, acc);
          }
        }
      }
      for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK) {
        const float f = to_float(xr[j]);
        acc = fmaf(f, f, acc);
      }
      const float scale = rsqrtf(block_sum<BLOCK>(acc, scratch) * inv_cols + eps);
      if (inv_rms != nullptr && threadIdx.x == 0) inv_rms[row] = scale;
#pragma unroll
      for (int i = 0; i < k_half; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) {
          const P wv = w_staged ? spill[p] : load_pack<T, VEC>(w + p * VEC);
          P out;
#pragma unroll
          for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(cur[i].v[k]) * scale * to_float(wv.v[k]));
          store_pack<T, VEC>(yr + p * VEC, out);
        }
      }
      for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK)
        yr[j] = from_float<T>(to_float(xr[j]) * scale * to_float(w[j]));
      if (next >= rows) return;
#pragma unroll
      for (int i = 0; i < k_half; ++i) cur[i] = nxt[i];
      row = next;
    }
  }

  // Rows that fit the register cache: the weight is loaded right behind x, so that no row waits
  // for it after its reduction. 1024-thread blocks (an 8-register row cache) keep it in registers,
  // loaded for each row; smaller blocks with packs of 8 bytes and more stage it in shared memory
  // (the host sizes it), copied once per block with cp.async, which takes no registers. Both are
  // faster than reading the weight after the reduction (bf16, 4096x2048 and 1x16384); staging
  // 4-byte packs (fewer than 2048 rows) is slower at 512 rows, so those keep the weight load after
  // the reduction. A loop of its own, so that the longer rows' path keeps its registers.
  constexpr bool k_w_regs = BLOCK >= 1024;
  constexpr bool k_w_smem = !k_w_regs && sizeof(P) >= 8;
  if (packs <= first_uncached && (k_w_regs || (k_w_smem && smem_packs >= packs))) {
    // One barrier per row's reduction instead of two (block_sum_alternating).
    __shared__ __align__(16) float sums[2][32];
    int parity = 0;
    bool first = true;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
      const T* xr = x + row * x_stride;
      T* yr = y + row * y_stride;
      P cached[k_cached], wr[k_w_regs ? k_cached : 1];
#pragma unroll
      for (int i = 0; i < k_cached; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) cached[i] = load_pack<T, VEC>(xr + p * VEC);
      }
      if constexpr (k_w_smem) {
        // Each thread copies, and later reads, only its own packs: no barrier needed.
        if (first) {
#pragma unroll
          for (int i = 0; i < k_cached; ++i) {
            const int p = int(threadIdx.x) + i * BLOCK;
            if (p < packs) cp_async_pack<T, VEC>(spill + p, w + p * VEC);
          }
          first = false;
        }
      } else {
#pragma unroll
        for (int i = 0; i < k_cached; ++i) {
          const int p = int(threadIdx.x) + i * BLOCK;
          if (p < packs) wr[i] = load_pack<T, VEC>(w + p * VEC);
        }
      }
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < k_cached; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float f = to_float(cached[i].v[k]);
            acc = fmaf(f, f, acc);
          }
        }
      }
      for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK) {
        const float f = to_float(xr[j]);
        acc = fmaf(f, f, acc);
      }
      if constexpr (k_w_smem) cp_async_wait_all();
      const float scale = rsqrtf(block_sum_alternating<BLOCK>(acc, sums, parity) * inv_cols + eps);
      if (inv_rms != nullptr && threadIdx.x == 0) inv_rms[row] = scale;
#pragma unroll
      for (int i = 0; i < k_cached; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) {
          P wv;
          if constexpr (k_w_smem) wv = spill[p];
          else wv = wr[i];
          P out;
#pragma unroll
          for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(cached[i].v[k]) * scale * to_float(wv.v[k]));
          store_pack<T, VEC>(yr + p * VEC, out);
        }
      }
      for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK)
        yr[j] = from_float<T>(to_float(xr[j]) * scale * to_float(w[j]));
    }
    return;
  }

  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_stride;
    T* yr = y + row * y_stride;

    P cached[k_cached];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) {
        cached[i] = load_pack<T, VEC>(xr + p * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float f = to_float(cached[i].v[k]);
          acc = fmaf(f, f, acc);
        }
      }
    }
    // Each thread stores to and later reads back only its own packs of `spill`: no barrier needed.
    for (int base = first_uncached + int(threadIdx.x); base < packs; base += k_batch * BLOCK) {
      P batch[k_batch];
#pragma unroll
      for (int u = 0; u < k_batch; ++u)
        if (base + u * BLOCK < packs) batch[u] = load_pack<T, VEC>(xr + (base + u * BLOCK) * VEC);
#pragma unroll
      for (int u = 0; u < k_batch; ++u) {
        const int p = base + u * BLOCK;
        if (p < packs) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float f = to_float(batch[u].v[k]);
            acc = fmaf(f, f, acc);
          }
          if (p < smem_end) spill[p - first_uncached] = batch[u];
        }
      }
    }
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK) {
      const float f = to_float(xr[j]);
      acc = fmaf(f, f, acc);
    }

    const float scale = rsqrtf(block_sum<BLOCK>(acc, scratch) * inv_cols + eps);
    if (inv_rms != nullptr && threadIdx.x == 0) inv_rms[row] = scale;

    auto write_pack = [&](int p, const P& v) {
      const P wv = load_pack<T, VEC>(w + p * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(v.v[k]) * scale * to_float(wv.v[k]));
      store_pack<T, VEC>(yr + p * VEC, out);
    };
#pragma unroll
    for (int i = 0; i < k_cached; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) write_pack(p, cached[i]);
    }
    // Each thread reads back only its own packs: from shared memory, then (rows longer than both
    // caches) from x again.
    int p = first_uncached + int(threadIdx.x);
    for (; p < smem_end; p += BLOCK) write_pack(p, spill[p - first_uncached]);
    for (; p < packs; p += BLOCK) write_pack(p, load_pack<T, VEC>(xr + p * VEC));
    for (int j = packs * VEC + int(threadIdx.x); j < n; j += BLOCK)
      yr[j] = from_float<T>(to_float(xr[j]) * scale * to_float(w[j]));
  }
}

// A compile-time flag for rmsnorm_fwd_bulk's row body.
template <bool B>
struct BulkChecked {
  static constexpr bool value = B;
};

// Rows of 64-128 KiB on sm_90 and later (the host picks it: families/rmsnorm): persistent blocks,
// each taking rows blockIdx.x, blockIdx.x + gridDim.x, ..., each row brought into shared memory by
// two bulk copies (cp.async.bulk), its first and second part. A thread owns PACKS 16-byte packs
// of the row (pack j * BLOCK + t); the first PACKS / 2 of them make up the first part, which the
// thread keeps in registers. After the row's reduction barrier the first part's buffer is free and
// the next row's first part is posted; the second part is written out of shared memory, then a
// second barrier frees its buffer for the next row's second part, and the first part is written
// out of registers while that copy runs. So a row's reads overlap the previous row's stores,
// where the one-block-per-row kernel above reads the next row only when its block starts (faster
// at 4096 x 65536 bf16; docs/benchmarks.md has the figures).
// The weight is read for every row (from L2): in registers it would take as many as the row.
// Requires: sm_90; x, y aligned to 16 bytes, row strides and cols multiples of 16 bytes;
// cols <= BLOCK * PACKS * 16 / sizeof(T); BLOCK * PACKS * 16 bytes of dynamic shared memory.
template <typename T, int BLOCK, int PACKS>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
rmsnorm_fwd_bulk(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, float* __restrict__ inv_rms,
                 long long rows, long long cols, long long x_stride, long long y_stride, float eps) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int k_first = PACKS / 2;  // packs per thread in the first part
  using P = Pack<T, VEC>;
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024 && PACKS >= 2 && PACKS % 2 == 0, "bad block shape");
#if __CUDA_ARCH__ < 900
  __trap();  // never launched: the host picks this kernel on sm_90 and later only
#else
  extern __shared__ __align__(128) unsigned char smem[];
  T* sx = reinterpret_cast<T*>(smem);
  __shared__ unsigned long long full[2];
  __shared__ float scratch[32];  // a row's reads end before its second barrier, the next row's writes after
  const int t = int(threadIdx.x);
  const int packs = int(cols / VEC);
  const int first_packs = min(packs, k_first * BLOCK);
  const unsigned first_bytes = unsigned(first_packs) * 16u, second_bytes = unsigned(packs - first_packs) * 16u;
  if (t == 0) {
    for (int part = 0; part < 2; ++part) {
      ptx::mbar_init(ptx::smem_addr(&full[part]), 1);
      ptx::mbar_init_fence();
    }
  }
  __syncthreads();
  // Part 0 or 1 of `row` (a part without bytes completes its phase on the arrival alone).
  auto post = [&](int part, long long row) {
    const unsigned bytes = part == 0 ? first_bytes : second_bytes;
    ptx::mbar_arrive_expect_tx(ptx::smem_addr(&full[part]), bytes);
    if (bytes > 0)
      ptx::bulk_copy(ptx::smem_addr(sx + (part == 0 ? 0 : first_packs * VEC)),
                     x + row * x_stride + (part == 0 ? 0 : first_packs * VEC), bytes, ptx::smem_addr(&full[part]));
  };
  if (t == 0 && blockIdx.x < rows) {
    post(0, blockIdx.x);
    post(1, blockIdx.x);
  }
  const float inv_cols = 1.f / float(cols);
  // One row. Unchecked (rows of exactly BLOCK * PACKS packs, the host's choice for whole rows): no
  // pack is tested against the row's end. With a branch around each pack the weight loads of a
  // part could not be issued together and each would wait out an L2 round trip (slower than
  // unchecked at 4096 x 65536 bf16, even with the loads paired by hand).
  auto row_body = [&](auto checked, long long row, long long next, unsigned phase) {
    constexpr bool k_checked = decltype(checked)::value;
    auto in_row = [&](int j) { return !k_checked || j * BLOCK + t < packs; };
    ptx::mbar_wait(ptx::smem_addr(&full[0]), phase);
    P a[k_first];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < k_first; ++j) {
      a[j] = in_row(j) ? *reinterpret_cast<const P*>(sx + (j * BLOCK + t) * VEC) : P{};
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = to_float(a[j].v[k]);
        acc = fmaf(f, f, acc);
      }
    }
    ptx::mbar_wait(ptx::smem_addr(&full[1]), phase);
#pragma unroll
    for (int j = k_first; j < PACKS; ++j)
      if (in_row(j)) {
        const P b = *reinterpret_cast<const P*>(sx + (j * BLOCK + t) * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float f = to_float(b.v[k]);
          acc = fmaf(f, f, acc);
        }
      }
    acc = warp_sum(acc);
    if (t % 32 == 0) scratch[t / 32] = acc;
    __syncthreads();  // the first part is in registers: its buffer takes the next row's
    if (t == 0 && next < rows) post(0, next);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < BLOCK / 32; ++q) sum += scratch[q];
    const float scale = rsqrtf(sum * inv_cols + eps);
    if (inv_rms != nullptr && t == 0) inv_rms[row] = scale;
    // One base pointer per thread: the packs' offsets are immediates.
    const T* wt = w + t * VEC;
    T* yt = y + row * y_stride + t * VEC;
    auto write = [&](int j, const P v) {
      const P wv = load_pack<T, VEC>(wt + j * BLOCK * VEC);
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(v.v[k]) * scale * to_float(wv.v[k]));
      store_pack<T, VEC>(yt + j * BLOCK * VEC, out);
    };
#pragma unroll
    for (int j = k_first; j < PACKS; ++j)
      if (in_row(j)) write(j, *reinterpret_cast<const P*>(sx + (j * BLOCK + t) * VEC));
    __syncthreads();  // the second part's buffer is read: it takes the next row's
    if (t == 0 && next < rows) post(1, next);
#pragma unroll
    for (int j = 0; j < k_first; ++j)
      if (in_row(j)) write(j, a[j]);
  };
  const bool whole = packs == PACKS * BLOCK;
  unsigned phase = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, phase ^= 1u) {
    if (whole) row_body(BulkChecked<false>{}, row, row + gridDim.x, phase);
    else row_body(BulkChecked<true>{}, row, row + gridDim.x, phase);
  }
#endif
}

// The sum of one value per thread over a block, to every thread, with one barrier: each warp's sum
// goes to shared memory and every thread adds the BLOCK / 32 of them in the same order. For a
// kernel that reduces once (no reuse of `sums`).
template <int BLOCK>
__device__ __forceinline__ float row_block_sum(float v, float* sums) {
  v = warp_sum(v);
  if constexpr (BLOCK == 32) {
    return v;
  } else {
    if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = v;
    __syncthreads();
    float t = sums[0];
#pragma unroll
    for (int i = 1; i < BLOCK / 32; ++i) t += sums[i];
    return t;
  }
}

// Short rows, for calls of a few rows where one block's latency is the kernel's whole time: one
// block per row, each thread PACKS packs of x and of the weight in registers, both loaded before
// anything else, one barrier, no loop. The fewest instructions between a row's loads and its
// stores; its grid is the row count, so it is for small row counts only (the host's heuristic).
// Requires: cols a multiple of VEC, at most BLOCK * PACKS packs, rows below 2^31; the alignment of
// rmsnorm_fwd.
template <typename T, int BLOCK, int VEC, int PACKS>
__global__ void __launch_bounds__(BLOCK)
rmsnorm_fwd_row(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, float* __restrict__ inv_rms,
                long long rows, long long cols, long long x_stride, long long y_stride, float eps) {
  using P = Pack<T, VEC>;
  __shared__ __align__(16) float sums[BLOCK / 32];
  if (blockIdx.x >= rows) return;  // no rows: the host's grid is never empty
  const int packs = int(cols) / VEC, t = int(threadIdx.x);
  const float inv_cols = 1.f / float(cols);
  const T* xr = x + (long long)blockIdx.x * x_stride;
  // Every load is issued unconditionally, at the last pack for a thread past the row's end (its
  // values are not used): all of them go out together, before the first use of any, where
  // per-pack branches let the compiler wait for x before it requested the weight.
  P xv[PACKS], wv[PACKS];
#pragma unroll
  for (int i = 0; i < PACKS; ++i) {
    const int p = min(t + i * BLOCK, packs - 1);
    xv[i] = load_pack<T, VEC>(xr + p * VEC);
    wv[i] = load_pack<T, VEC>(w + p * VEC);
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (t + i * BLOCK < packs) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = to_float(xv[i].v[k]);
        acc = fmaf(f, f, acc);
      }
    }
  const float scale = rsqrtf(row_block_sum<BLOCK>(acc, sums) * inv_cols + eps);
  if (inv_rms != nullptr && t == 0) inv_rms[blockIdx.x] = scale;
  T* yr = y + (long long)blockIdx.x * y_stride + t * VEC;
#pragma unroll
  for (int i = 0; i < PACKS; ++i)
    if (t + i * BLOCK < packs) {
      P out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(xv[i].v[k]) * scale * to_float(wv[i].v[k]));
      store_pack<T, VEC>(yr + i * BLOCK * VEC, out);
    }
}

}  // namespace kiln
