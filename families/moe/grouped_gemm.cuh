// Grouped GEMM over experts, on the GEMM core's pieces (families/common/gemm/): the swizzled
// 128-byte K rows, TMA loads and the warp-specialized wgmma ring of gemm_wgmma.cuh (sm_90a), and
// the mma.sync tiles of gemm_mma.cuh (sm_80 and later).
//
// Layouts (LAYOUT):
//  - contiguous: a [m, k] holds every expert's rows back to back, b [experts, n, k] (K-major),
//    out [m, n]; expert e owns rows [end(e - 1), end(e)) with end(e) = min(m, max(0, offs[0..e]))
//    (the running maximum makes any offs well formed: a decreasing entry gives an empty expert);
//    rows past end(experts - 1) are not written.
//  - masked: a [experts, m, k], out [experts, m, n]; expert e owns rows [e m, e m + clamp(offs[e],
//    0, m)) (offs are per-expert counts); the rest of each expert's m rows is not written.
//  - kgrouped: out [experts, n, k] with out[e] = a_e^T b_e, a [m, n] and b [m, k] grouped by
//    rows as in the contiguous layout (the weight gradient dW_e = dY_e^T X_e); an expert without
//    rows gets zeros.
//  - dgrad: the contiguous layout with b [experts, k, n] (N-major): out = a b_e, the input
//    gradient of a contiguous grouped GEMM that used the same weight, read as it is stored.
// No expert is padded to a tile: a tile stops at its expert's last row (TMA and cp.async read
// past it, into the next expert or zeros, and the stores leave those rows out).
//
// The sm_90a kernels: grouped_wgmma (contiguous and masked with K-major operands, dgrad with an
// N-major b) and grouped_wgmma_kgrouped (both operands row-major, read transposed).
//
// The tile scheduler runs on the device, so nothing waits for the host: every block builds the
// table of expert row ranges and the prefix of per-expert tile counts (tiles_m(e) x tiles_n) in
// shared memory from offs, then maps its work unit u to the expert whose prefix range holds it
// (binary search), and within the expert to (m-tile, n-tile) in grouped order. Units run expert
// by expert, so a wave shares an expert's weights through L2.
#pragma once

#include "common/gemm/gemm_mma.cuh"
#include "common/gemm/gemm_wgmma.cuh"

namespace kiln {
namespace moe {

enum Layout { k_contiguous = 0, k_masked = 1, k_kgrouped = 2, k_dgrad = 3 };
// Scales of the e4m3 kernels (SCALING): none (f16/bf16), rowwise (a per row, b per expert and
// column), or DeepSeek-V3's blocks (a 1x128 per row and 128 of K, b 128x128 per expert).
enum Scaling { k_unscaled = 0, k_rowwise = 1, k_block = 2 };

// The schedule in shared memory: lo[e], hi[e] (expert e's rows) and first[e] (its first unit),
// first[experts] = the unit count; 3 (experts + 1) ints. Built by warp 0 (lane l takes a chunk of
// experts: a local pass, a warp scan over the chunks, a second local pass).
template <int LAYOUT, int BM>
__device__ __forceinline__ void build_schedule(const int* __restrict__ offs, int experts, int m, int tiles_n, int* lo,
                                               int* hi, int* first) {
  const int lane = threadIdx.x & 31;
  const int per = (experts + 31) / 32, e0 = min(experts, lane * per), e1 = min(experts, e0 + per);
  // Contiguous and kgrouped: ends are the running maximum of offs, clamped to [0, m].
  int mx = 0;
  if (LAYOUT != k_masked)
    for (int e = e0; e < e1; ++e) mx = max(mx, min(m, max(0, offs[e])));
  int inc = mx;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc = max(inc, y);
  }
  int prev = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) prev = 0;
  int units = 0;
  for (int e = e0; e < e1; ++e) {
    int l, h;
    if (LAYOUT == k_masked) {
      l = e * m;
      h = l + min(m, max(0, offs[e]));
    } else {
      l = prev;
      h = max(prev, min(m, max(0, offs[e])));
      prev = h;
    }
    lo[e] = l;
    hi[e] = h;
    units += LAYOUT == k_kgrouped ? 0 : (h - l + BM - 1) / BM * tiles_n;
  }
  int u_inc = units;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, u_inc, o);
    if (lane >= o) u_inc += y;
  }
  int at = u_inc - units;
  for (int e = e0; e < e1; ++e) {
    first[e] = at;
    at += (hi[e] - lo[e] + BM - 1) / BM * tiles_n;
  }
  if (lane == 31) first[experts] = u_inc;
}

// Unit u (below first[experts]) -> expert e, its m-tile and n-tile (GROUP m-tiles per group).
template <int BM, int GROUP>
__device__ __forceinline__ void unit_coords(int u, int experts, const int* lo, const int* hi, const int* first,
                                            int tiles_n, int& e, int& tm, int& tn) {
  int l = 0, h = experts - 1;  // the last expert whose first unit is <= u
  while (l < h) {
    const int mid = (l + h + 1) >> 1;
    if (first[mid] <= u)
      l = mid;
    else
      h = mid - 1;
  }
  e = l;
  const int tiles_m = (hi[e] - lo[e] + BM - 1) / BM;
  gemm::tile_coords<GROUP>(u - first[e], tiles_m, tiles_n, tm, tn);
}

// The sm_90a path (contiguous, masked and dgrad): gemm_wgmma_body's ring without clusters, split-K
// or block scales, over the expert schedule. Warpgroups 0 .. BM/64 - 1 consume, the last produces
// (one thread issues the TMA copies of A's rows at the expert's row and of B's rows e n + tn BN;
// dgrad: of b's rows e k + 64 kt in 64-column boxes, read by wgmma N-major, the rows past k in
// the last stage zeroed by the consumers, as they belong to the next expert).
// The grid is persistent: block i takes units i, i + grid, ... TIn is f16/bf16 (TOut the same), or
// e4m3 codes (u8) with SCALING rowwise, out = acc * a_scale[row] * b_scale[e n + col] (as
// torch._scaled_grouped_mm takes them), or block, a_scale [rows, kblocks] and b_scale [experts,
// ceil(n / 128), kblocks]: a stage is exactly one 128-wide k-block, issued into a partial-sum set,
// waited for, released, and promoted (acc += part * a_scale * b_scale) as the dense core's
// block-scaled loop does; BN <= 128 keeps a tile within one 128-column scale block.
// PINGPONG (unscaled and rowwise): two consumer warpgroups take the block's units in turn, each a
// whole BM x BN tile (BM / 64 wgmma rows of it), so one's epilogue runs while the other's products
// keep the tensor cores busy. A warpgroup starts waiting for its tile's stages only after the
// other has issued its last product (named barriers 2 and 3, arrive / sync in turn): its first
// stage is then at most one phase ahead, which the parity wait tells apart.
// The epilogue (tiles whose width is whole 64-column boxes): each warp stages its 16 rows through
// 2 KiB of shared memory (common/gemm/staged_store.cuh); a warp whose rows all belong to the tile's
// expert, n a multiple of 8, stores them by bulk tensor copies of map_out (the output, boxes of
// 16 rows x 128 bytes), a warp holding an expert's last rows with its lanes' own stores, so no
// row of the next expert is written.
template <class TIn, class TOut, int LAYOUT, int BM, int BN, int STAGES, int SCALING, bool PINGPONG = false>
__global__ void __launch_bounds__((PINGPONG ? 2 : BM / 64) * 128 + 128, 1)
    grouped_wgmma(const TIn* __restrict__ a, const TIn* __restrict__ b, const int* __restrict__ offs,
                  const float* __restrict__ a_scale, const float* __restrict__ b_scale, TOut* __restrict__ out,
                  int experts, int m, int n, int k, const __grid_constant__ ptx::TmaDesc map_a,
                  const __grid_constant__ ptx::TmaDesc map_b, const __grid_constant__ ptx::TmaDesc map_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace gemm;
  constexpr int CONSUMERS = PINGPONG ? 2 : BM / 64, NI = BN / 8;
  constexpr bool STAGED = BN % 64 == 0 && sizeof(TOut) == 2;
  constexpr int OUT_STAGE_BYTES = STAGED ? CONSUMERS * 4 * 2048 : 0;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes, STAGE_BYTES = A_BYTES + B_BYTES;
  constexpr int B_BOX = 64 * k_row_bytes;  // dgrad: 64 rows of k by 64 columns
  static_assert(!PINGPONG || (SCALING != k_block && BM * BN <= 128 * 128), "pingpong: 128 accumulators a thread");
  static_assert(LAYOUT != k_dgrad || (SCALING == k_unscaled && BN % 64 == 0), "dgrad: f16/bf16, 64-column boxes");
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned out_stage = base + STAGES * STAGE_BYTES;
  const unsigned full = out_stage + OUT_STAGE_BYTES, empty = full + 8 * STAGES;
  int* sched = reinterpret_cast<int*>(smem_raw + (empty + 8 * STAGES - raw));
  int *lo = sched, *hi = lo + experts + 1, *first = hi + experts + 1;
  const int tiles_n = (n + BN - 1) / BN;
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
  const int ktiles = int(((long long)k * sizeof(TIn) + k_row_bytes - 1) / k_row_bytes);

  if (threadIdx.x < 32) build_schedule<LAYOUT, BM>(offs, experts, m, tiles_n, lo, hi, first);
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(full + 8 * s, 1);
      ptx::mbar_init(empty + 8 * s, PINGPONG ? 128 : CONSUMERS * 128);
    }
  __syncthreads();
  const int units = first[experts];

  if (wg == CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    if ((threadIdx.x / 32) % 4 == 0) {
      int it = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int e, tm, tn;
        unit_coords<BM, 8>(u, experts, lo, hi, first, tiles_n, e, tm, tn);
        const int row0 = lo[e] + tm * BM, brow = e * n + tn * BN;
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned st = base + s * STAGE_BYTES, bar = full + 8 * s;
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(bar, STAGE_BYTES);
            ptx::tma_load_2d(st, &map_a, kt * k_row_bytes, row0, bar);
            if constexpr (LAYOUT == k_dgrad) {
#pragma unroll
              for (int j = 0; j < BN / 64; ++j)
                ptx::tma_load_2d(st + A_BYTES + j * B_BOX, &map_b, (tn * BN + j * 64) * int(sizeof(TIn)),
                                 e * k + kt * 64, bar);
            } else {
              ptx::tma_load_2d(st + A_BYTES, &map_b, kt * k_row_bytes, brow, bar);
            }
          }
          __syncwarp();
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMERS == 1 ? 240 : 224));
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  static_assert(SCALING != k_block || BN <= k_scale_block, "block scales: one 128-column scale block per tile");
  // dgrad: zero rows [valid, 64) of the stage's b boxes (a swizzled row is still one 128-byte row),
  // split among `threads` consumer threads from `t0`, who then wait for each other on barrier `id`.
  auto zero_b_tail = [&](unsigned st, int valid, int t0, int threads, int id) {
    constexpr int CHUNKS = (BN / 64) * 64 * 8;
    const unsigned sb = st + A_BYTES;
    for (int i = t0; i < CHUNKS; i += threads) {
      const int box = i / 512, r = (i % 512) / 8;
      if (r >= valid)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sb + box * B_BOX + (i % 512) * 16), "r"(0)
                     : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  };
  // A warp's 16 rows of a 64-row accumulator tile into out (expert e's rows below hi[e]); rowwise:
  // times a_scale per row and b_scale per column (columns past n are computed and dropped).
  const unsigned warp_buf = out_stage + unsigned((wg * 4 + (threadIdx.x / 32) % 4) * 2048);
  auto store_tile = [&](const float(&d)[1][NI][4], int e, int row0, int col0) {
    const float* sb = b_scale + (long long)e * n;
    float sa[2] = {1.0f, 1.0f};
    if constexpr (SCALING == k_rowwise) {
      sa[0] = row0 + (lane >> 2) < hi[e] ? __ldg(a_scale + row0 + (lane >> 2)) : 0.0f;
      sa[1] = row0 + (lane >> 2) + 8 < hi[e] ? __ldg(a_scale + row0 + (lane >> 2) + 8) : 0.0f;
    }
    auto value = [&](int, int ni, int q) {
      if constexpr (SCALING == k_rowwise) {
        const int col = col0 + 8 * ni + 2 * (lane & 3) + (q & 1);
        return col < n ? d[0][ni][q] * sa[q >> 1] * __ldg(sb + col) : 0.0f;
      } else {
        return d[0][ni][q];
      }
    };
    if constexpr (STAGED) {
      const int rows = min(16, hi[e] - row0);
      if (rows > 0)
        store_rows_staged<TOut, BN>(warp_buf, &map_out, (n & 7) == 0 && rows == 16, row0, out, row0, rows, n, col0,
                                    value);
    } else {
      store_fragments<TOut, 1, NI>(out, hi[e], n, row0, col0, value);
    }
  };
  if constexpr (PINGPONG) {
    constexpr int MI = BM / 64;
    float acc[MI][1][NI][4];
    int it = 0, j = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, ++j) {
      if ((j & 1) != wg) {  // the other warpgroup's tile: its stages go by
        it += ktiles;
        continue;
      }
      int e, tm, tn;
      unit_coords<BM, 8>(u, experts, lo, hi, first, tiles_n, e, tm, tn);
      if (j > 0) asm volatile("bar.sync %0, 256;\n" ::"r"(2 + ((j - 1) & 1)) : "memory");
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % STAGES;
        const unsigned st = base + s * STAGE_BYTES;
        ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
        if constexpr (LAYOUT == k_dgrad)
          if (k - kt * 64 < 64) zero_b_tail(st, k - kt * 64, threadIdx.x % 128, 128, 4 + wg);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) fence_fragments(acc[mi]);
        warpgroup_arrive();
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const unsigned long long da = smem_desc(st + mi * 64 * k_row_bytes), db = smem_desc(st + A_BYTES);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            if constexpr (LAYOUT == k_dgrad)
              WgmmaKn<TIn, BN>::run(acc[mi], da + 2 * kk, smem_desc_mn(st + A_BYTES + kk * 16 * 128, B_BOX),
                                    kt > 0 || kk > 0);
            else
              Wgmma<TIn, BN>::run(acc[mi], da + 2 * kk, db + 2 * kk, kt > 0 || kk > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) fence_fragments(acc[mi]);
        if (kt > 0) ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
      }
      if (u + (int)gridDim.x < units) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + (j & 1)) : "memory");
      wgmma_wait<0>();
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) fence_fragments(acc[mi]);
      ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
      const int col0 = tn * BN;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) store_tile(acc[mi], e, lo[e] + tm * BM + mi * 64 + warp_in_wg * 16, col0);
    }
    // Shared memory lives until the block exits: the bulk stores must be done reading it.
    if (STAGED && lane == 0) ptx::bulk_wait<0>();
    return;
  }
  // part: a k-block's partial sums (block scales; compiled away otherwise), written by wgmma only,
  // while acc then takes the promotions (a non-wgmma write to a wgmma accumulator would make
  // ptxas serialize every wgmma).
  float acc[1][NI][4], part[1][NI][4];
  auto issue_stage = [&](float(&d)[1][NI][4], unsigned st, int accumulate) {
    const unsigned long long da = smem_desc(st + wg * 64 * k_row_bytes), db = smem_desc(st + A_BYTES);
    fence_fragments(d);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      if constexpr (LAYOUT == k_dgrad)
        WgmmaKn<TIn, BN>::run(d, da + 2 * kk, smem_desc_mn(st + A_BYTES + kk * 16 * 128, B_BOX), accumulate || kk > 0);
      else
        Wgmma<TIn, BN>::run(d, da + 2 * kk, db + 2 * kk, accumulate || kk > 0);
    wgmma_commit();
  };
  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    int e, tm, tn;
    unit_coords<BM, 8>(u, experts, lo, hi, first, tiles_n, e, tm, tn);
    if constexpr (SCALING == k_block) {
      const int row0 = lo[e] + tm * BM + wg * 64 + warp_in_wg * 16, col0 = tn * BN;
      const int kblocks = (k + k_scale_block - 1) / k_scale_block, nblocks = (n + k_scale_block - 1) / k_scale_block;
      const int ra = row0 + (lane >> 2);
      const bool ok0 = ra < hi[e], ok1 = ra + 8 < hi[e];
      const float* sa0 = a_scale + (long long)(ok0 ? ra : 0) * kblocks;
      const float* sa1 = a_scale + (long long)(ok1 ? ra + 8 : 0) * kblocks;
      const float* sbp = b_scale + ((long long)e * nblocks + col0 / k_scale_block) * kblocks;
      zero_fragments(acc);
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % STAGES;
        ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
        issue_stage(part, base + s * STAGE_BYTES, 0);
        const float sb = __ldg(sbp + kt);
        const float sc0 = ok0 ? __ldg(sa0 + kt) * sb : 0.0f, sc1 = ok1 ? __ldg(sa1 + kt) * sb : 0.0f;
        wgmma_wait<0>();
        fence_fragments(part);
        ptx::mbar_arrive(empty + 8 * s);
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          acc[0][ni][0] += part[0][ni][0] * sc0;
          acc[0][ni][1] += part[0][ni][1] * sc0;
          acc[0][ni][2] += part[0][ni][2] * sc1;
          acc[0][ni][3] += part[0][ni][3] * sc1;
        }
      }
      store_tile(acc, e, row0, col0);
      continue;
    }
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % STAGES;
      ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
      if constexpr (LAYOUT == k_dgrad)
        if (k - kt * 64 < 64) zero_b_tail(base + s * STAGE_BYTES, k - kt * 64, threadIdx.x, CONSUMERS * 128, 1);
      issue_stage(acc, base + s * STAGE_BYTES, kt > 0);
      wgmma_wait<1>();
      fence_fragments(acc);
      if (kt > 0) ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_fragments(acc);
    ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    const int row0 = lo[e] + tm * BM + wg * 64 + warp_in_wg * 16, col0 = tn * BN;
    store_tile(acc, e, row0, col0);
  }
  if (STAGED && lane == 0) ptx::bulk_wait<0>();
#endif
}

// The sm_90a weight gradient (kgrouped): out[e] = a_e^T b_e, the tile BM rows of out[e] (columns of
// a) by BN columns (columns of b), reduced over the expert's rows 64 at a time. Both operands stay
// row-major as they are in memory: a stage holds 64 rows of a's BM columns and of b's BN columns
// in 64-column TMA boxes (128-byte swizzle), which wgmma reads in their transposed forms (WgmmaMn:
// A M-major, B N-major). Warpgroup wg takes a's box wg (64 rows of out[e]); the last produces.
// The rows past the expert's last row in its last stage belong to the next expert (or are TMA's
// zeros past m): the consumer zeroes them in its A box before the wgmma, so they add nothing.
// Units are (expert, m-tile, n-tile), expert by expert; the grid is persistent. An expert without
// rows stores zeros. Tiles leave through the staged epilogue, as grouped_wgmma's do.
template <class T, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    grouped_wgmma_kgrouped(const T* __restrict__ a, const T* __restrict__ b, const int* __restrict__ offs,
                           const float* __restrict__, const float* __restrict__, T* __restrict__ out, int experts,
                           int m, int n, int k, const __grid_constant__ ptx::TmaDesc map_a,
                           const __grid_constant__ ptx::TmaDesc map_b, const __grid_constant__ ptx::TmaDesc map_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace gemm;
  constexpr int CONSUMERS = BM / 64, NI = BN / 8, BOX = 64 * 128;
  constexpr int A_BYTES = CONSUMERS * BOX, STAGE_BYTES = A_BYTES + (BN / 64) * BOX;
  static_assert(BN % 64 == 0, "kgrouped: 64-column boxes");
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned out_stage = base + STAGES * STAGE_BYTES;
  const unsigned full = out_stage + CONSUMERS * 4 * 2048, empty = full + 8 * STAGES;
  int* sched = reinterpret_cast<int*>(smem_raw + (empty + 8 * STAGES - raw));
  int *lo = sched, *hi = lo + experts + 1, *first = hi + experts + 1;
  const int tiles_m = (n + BM - 1) / BM, tiles_n = (k + BN - 1) / BN, per = tiles_m * tiles_n;
  const int units = experts * per;
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;

  if (threadIdx.x < 32) build_schedule<k_kgrouped, BM>(offs, experts, m, tiles_n, lo, hi, first);
  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(full + 8 * s, 1);
      ptx::mbar_init(empty + 8 * s, CONSUMERS * 128);
    }
  __syncthreads();

  if (wg == CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    if ((threadIdx.x / 32) % 4 == 0) {
      int it = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int e = u / per;
        int tm, tn;
        tile_coords<8>(u % per, tiles_m, tiles_n, tm, tn);
        const int r0 = lo[e], ktiles = (hi[e] - r0 + 63) / 64;
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned st = base + s * STAGE_BYTES, bar = full + 8 * s;
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(bar, STAGE_BYTES);
#pragma unroll
            for (int j = 0; j < CONSUMERS; ++j)
              ptx::tma_load_2d(st + j * BOX, &map_a, (tm * BM + j * 64) * int(sizeof(T)), r0 + kt * 64, bar);
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)
              ptx::tma_load_2d(st + A_BYTES + j * BOX, &map_b, (tn * BN + j * 64) * int(sizeof(T)), r0 + kt * 64, bar);
          }
          __syncwarp();
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMERS == 1 ? 240 : 224));
  const int warp_in_wg = (threadIdx.x / 32) % 4, tid_in_wg = threadIdx.x % 128;
  float acc[1][NI][4];
  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int e = u / per;
    int tm, tn;
    tile_coords<8>(u % per, tiles_m, tiles_n, tm, tn);
    const int rows = hi[e] - lo[e], ktiles = (rows + 63) / 64;
    const int row0 = tm * BM + wg * 64 + warp_in_wg * 16, col0 = tn * BN;
    T* const out_e = out + (long long)e * n * k;
    if (ktiles == 0) {
      // acc is written by wgmma only (any other write makes ptxas wait on every wgmma).
      store_fragments<T, 1, NI>(out_e, n, k, row0, col0, [](int, int, int) { return 0.0f; });
      continue;
    }
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % STAGES;
      const unsigned st = base + s * STAGE_BYTES, sa = st + wg * BOX;
      ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
      const int valid = rows - kt * 64;
      if (valid < 64) {
        // A swizzled row is still one 128-byte row: zero rows [valid, 64) of this warpgroup's box.
        for (int i = valid * 8 + tid_in_wg; i < 64 * 8; i += 128)
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sa + i * 16), "r"(0) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
      fence_fragments(acc);
      warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        WgmmaMn<T, BN>::run(acc, smem_desc_mn(sa + kk * 16 * 128, BOX),
                            smem_desc_mn(st + A_BYTES + kk * 16 * 128, BOX), kt > 0 || kk > 0);
      wgmma_commit();
      wgmma_wait<1>();
      fence_fragments(acc);
      if (kt > 0) ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_fragments(acc);
    ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    // The staged epilogue (common/gemm/staged_store.cuh): bulk tensor stores of map_out (every
    // expert's [n, k] as experts x n rows) where the warp's 16 rows are all below n and k is a
    // multiple of 8, else the lanes' own stores.
    if (row0 < n)
      store_rows_staged<T, BN>(out_stage + unsigned((wg * 4 + warp_in_wg) * 2048), &map_out,
                               (k & 7) == 0 && row0 + 16 <= n, e * n + row0, out_e, row0, min(16, n - row0), k, col0,
                               [&](int, int ni, int q) { return acc[0][ni][q]; });
  }
  // Shared memory lives until the block exits: the bulk stores must be done reading it.
  if (lane == 0) ptx::bulk_wait<0>();
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Loads ROWS reduction rows [r0, r0 + ROWS) x columns [c0, c0 + COLS) of a row-major matrix with
// `cols` columns (a multiple of 8) into a tile of rows PITCH bytes apart; rows outside [r_lo, r_hi)
// and columns past `cols` are zero-filled (the rows of other experts add nothing).
template <class T, int ROWS, int COLS, int PITCH, int NT>
__device__ __forceinline__ void load_rows_tile(unsigned dst, const T* src, int cols, int r0, int r_lo, int r_hi,
                                               int c0, int tid) {
  constexpr int CHUNKS = COLS * 2 / 16;
#pragma unroll
  for (int i = tid; i < ROWS * CHUNKS; i += NT) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const int gr = r0 + r, gc = c0 + c * 8;
    const bool ok = gr >= r_lo && gr < r_hi && gc < cols;
    const T* p = ok ? src + (long long)gr * cols + gc : src;
    gemm::cp_async_16(dst + r * PITCH + c * 16, p, ok ? 16 : 0);
  }
}

// The mma.sync path (every layout; sm_80 and later): 2 x BN/32 warps, each a (BM/2) x 32 piece of
// the tile, a STAGES-deep cp.async ring, one block per unit (the grid covers every unit the
// layout can have; blocks past the unit count return). Contiguous and masked stages hold 128-byte
// K rows swizzled as the GEMM core's; kgrouped stages hold 64 reduction rows of a's and b's
// columns (row pitch padded by 16 bytes: conflict-free), read by ldmatrix.trans; dgrad stages
// a's K rows as contiguous does and b's as kgrouped does (rows past k zero). e4m3 operands
// (TIn u8, contiguous and masked, SCALING as grouped_wgmma's) are widened to f16 in registers as
// gemm_mma.cuh does (exact, 2^-8 per operand, restored in the epilogue); block scales promote a
// partial-sum set after each 128-wide k-block (one stage) with gemm_common.cuh's helpers.
template <class TIn, class TOut, int LAYOUT, int BM, int BN, int STAGES, int SCALING>
__global__ void __launch_bounds__(2 * BN) grouped_mma(const TIn* __restrict__ a, const TIn* __restrict__ b,
                                                      const int* __restrict__ offs, const float* __restrict__ a_scale,
                                                      const float* __restrict__ b_scale, TOut* __restrict__ out,
                                                      int experts, int m, int n, int k) {
  using namespace gemm;
  using T = TIn;
  constexpr int NT = 2 * BN, WN = BN / 32, MI = BM / 32, NI = 4;
  constexpr bool KG = LAYOUT == k_kgrouped, FP8 = sizeof(TIn) == 1;
  constexpr bool B_ROWS = KG || LAYOUT == k_dgrad;  // b staged as 64 rows of its columns
  static_assert(!(B_ROWS && FP8), "kgrouped and dgrad take f16/bf16 operands");
  using MmaT = typename Select<FP8, f16_t, TIn>::type;
  constexpr int PA = 2 * BM + 16, PB = 2 * BN + 16;  // kgrouped row pitches
  constexpr int A_BYTES = KG ? 64 * PA : BM * k_row_bytes, B_BYTES = B_ROWS ? 64 * PB : BN * k_row_bytes;
  constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + 1023) / 1024 * 1024;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  int* sched = reinterpret_cast<int*>(smem_raw + (base + STAGES * STAGE_BYTES - raw));
  int *lo = sched, *hi = lo + experts + 1, *first = hi + experts + 1;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  // kgrouped: the tile is over out[e]'s n rows (BM) and k columns (BN).
  const int rows_out = KG ? n : 0, cols_out = KG ? k : n;
  const int tiles_n = ((KG ? k : n) + BN - 1) / BN;

  if (tid < 32) build_schedule<LAYOUT, BM>(offs, experts, m, tiles_n, lo, hi, first);
  __syncthreads();
  int e, tm, tn;
  if (KG) {
    const int tiles_m = (n + BM - 1) / BM, per = tiles_m * tiles_n;
    if ((int)blockIdx.x >= experts * per) return;
    e = blockIdx.x / per;
    tile_coords<8>(blockIdx.x % per, tiles_m, tiles_n, tm, tn);
  } else {
    if ((int)blockIdx.x >= first[experts]) return;
    unit_coords<BM, 8>(blockIdx.x, experts, lo, hi, first, tiles_n, e, tm, tn);
  }
  const int r_lo = lo[e], r_hi = hi[e];
  const long long ld = (long long)k * sizeof(TIn);
  const u8* au = reinterpret_cast<const u8*>(a);
  const u8* bu = reinterpret_cast<const u8*>(b) + (KG ? 0 : (long long)e * n * ld);
  const int row_a = KG ? tm * BM : r_lo + tm * BM, row_b = tn * BN;
  const int ktiles = KG ? (r_hi - r_lo + 63) / 64 : int((ld + k_row_bytes - 1) / k_row_bytes);

  auto load_stage = [&](int kt) {
    const unsigned s = base + (kt % STAGES) * STAGE_BYTES;
    if (KG) {
      load_rows_tile<T, 64, BM, PA, NT>(s, a, n, r_lo + kt * 64, r_lo, r_hi, row_a, tid);
      load_rows_tile<T, 64, BN, PB, NT>(s + A_BYTES, b, k, r_lo + kt * 64, r_lo, r_hi, row_b, tid);
    } else if (B_ROWS) {  // dgrad: expert e's [k, n] weight, rows past k zero
      load_tile<BM, NT>(s, au, r_hi, ld, row_a, (long long)kt * k_row_bytes, tid);
      load_rows_tile<T, 64, BN, PB, NT>(s + A_BYTES, b + (long long)e * k * n, n, kt * 64, 0, k, row_b, tid);
    } else {
      const long long kb = (long long)kt * k_row_bytes;
      load_tile<BM, NT>(s, au, r_hi, ld, row_a, kb, tid);
      load_tile<BN, NT>(s + A_BYTES, bu, n, ld, row_b, kb, tid);
    }
  };

  constexpr bool BLOCK = SCALING == k_block;
  static_assert(!BLOCK || BN <= k_scale_block, "block scales: one 128-column scale block per tile");
  float acc[MI][NI][4], part[MI][NI][4];
  zero_fragments(acc);
  zero_fragments(part);
  float(*const dst)[NI][4] = BLOCK ? part : acc;
  const int kblocks = (k + k_scale_block - 1) / k_scale_block;
  const float* b_blocks =
      BLOCK ? b_scale + ((long long)e * ((n + k_scale_block - 1) / k_scale_block) + row_b / k_scale_block) * kblocks
            : b_scale;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
    cp_async_commit();
    const unsigned sa = base + (kt % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned af[MI][4], bf[NI / 2][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if (KG) {
          const int q = lane >> 3;
          const int r = 16 * kk + (q >> 1) * 8 + (lane & 7), c = wm * (BM / 2) + 16 * mi + (q & 1) * 8;
          ldmatrix_x4_trans(sa + r * PA + c * 2, af[mi]);
        } else {
          const int r = wm * (BM / 2) + 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
          ldmatrix_x4(sa + r * k_row_bytes + ((c ^ (r & 7)) << 4), af[mi]);
        }
      }
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        const int q = lane >> 3;
        if (B_ROWS) {
          const int r = 16 * kk + (q & 1) * 8 + (lane & 7), c = wn * 32 + 16 * nj + (q >> 1) * 8;
          ldmatrix_x4_trans(sb + r * PB + c * 2, bf[nj]);
        } else {
          const int r = wn * 32 + 16 * nj + (q >> 1) * 8 + (lane & 7), c = 2 * kk + (q & 1);
          ldmatrix_x4(sb + r * k_row_bytes + ((c ^ (r & 7)) << 4), bf[nj]);
        }
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const unsigned* bq = bf[ni >> 1] + 2 * (ni & 1);
          if constexpr (FP8) {
            // A 16-byte chunk is one k16 step of widened values, the k order inside the
            // instruction the same for A and B (gemm_mma.cuh).
            const unsigned* x = af[mi];
            const unsigned a_lo[4] = {e4m3x2_lo(x[0]), e4m3x2_lo(x[1]), e4m3x2_hi(x[0]), e4m3x2_hi(x[1])};
            const unsigned a_hi[4] = {e4m3x2_lo(x[2]), e4m3x2_lo(x[3]), e4m3x2_hi(x[2]), e4m3x2_hi(x[3])};
            mma_16816<MmaT>(dst[mi][ni], a_lo, e4m3x2_lo(bq[0]), e4m3x2_hi(bq[0]));
            mma_16816<MmaT>(dst[mi][ni], a_hi, e4m3x2_lo(bq[1]), e4m3x2_hi(bq[1]));
          } else {
            mma_16816<MmaT>(acc[mi][ni], af[mi], bq[0], bq[1]);
          }
        }
    }
    if constexpr (BLOCK) {
      float sc[MI][2];
      load_block_scales(sc, a_scale, r_hi, kblocks, kt, row_a + wm * (BM / 2));
      promote_block(acc, part, sc, __ldg(b_blocks + kt));
      zero_fragments(part);
    }
  }
  cp_async_wait<0>();
  const int row0 = row_a + wm * (BM / 2), col0 = row_b + wn * 32;
  if (KG) {
    store_fragments<TOut, MI, NI>(out + (long long)e * n * k, rows_out, cols_out, row0, col0,
                                  [&](int mi, int ni, int q) { return acc[mi][ni][q]; });
  } else if (SCALING == k_block) {
    store_fragments<TOut, MI, NI>(out, r_hi, cols_out, row0, col0,
                                  [&](int mi, int ni, int q) { return acc[mi][ni][q] * 65536.0f; });
  } else if (SCALING == k_rowwise) {
    // store_fragments asks only for rows below r_hi; columns past n are computed and dropped.
    const float* sb = b_scale + (long long)e * n;
    store_fragments<TOut, MI, NI>(out, r_hi, cols_out, row0, col0, [&](int mi, int ni, int q) {
      const int row = row0 + 16 * mi + (lane >> 2) + 8 * (q >> 1), col = col0 + 8 * ni + 2 * (lane & 3) + (q & 1);
      const float widened = FP8 ? 65536.0f : 1.0f;
      return col < n ? acc[mi][ni][q] * widened * __ldg(a_scale + row) * __ldg(sb + col) : 0.0f;
    });
  } else {
    store_fragments<TOut, MI, NI>(out, r_hi, cols_out, row0, col0, [&](int mi, int ni, int q) { return acc[mi][ni][q]; });
  }
}

}  // namespace moe
}  // namespace kiln
