// The sm_90a path of the GEMM core: wgmma from shared memory (both operands through 128-byte
// swizzle descriptors), warp-specialized. Warpgroups 0 .. BM/64 - 1 are consumers (64 rows of the
// tile each, accumulators in registers, setmaxnreg raised); the last warpgroup is the producer
// (registers lowered) whose one elected thread fills a STAGES-deep ring of shared-memory stages
// with bulk tensor copies (TMA: cp.async.bulk.tensor, tensor maps passed as __grid_constant__
// parameters, the 128-byte swizzle applied by the copy engine, zeros past the matrix edges). Each
// stage has a `full` mbarrier (the copies complete their bytes on it) and an `empty` one
// (consumers -> producer). The grid is persistent: CTA i takes tiles i, i + grid, ... in grouped
// order, and the ring runs on across tiles, so the producer loads the next tile while the
// consumers store this one. Variants with thread-block clusters (gemm_wgmma_cluster) either share
// A across CTAs of adjacent column tiles (CLUSTER) or split one tile's K over CTAs (SPLIT); see
// the notes before gemm_wgmma_body. The mbarrier, TMA and cluster instructions are those of
// common/ptx.cuh; the tensor maps are over bytes, so a copy's box is 128 bytes of K (byte column
// kt * 128) by the tile's rows.
//
// Off sm_90a (no wgmma, no setmaxnreg) the kernel compiles to an empty body: families run this
// path only on devices of compute capability 9.0.
#pragma once

#include "common/gemm/gemm_common.cuh"
#include "common/gemm/staged_store.cuh"
#include "common/gemm/wgmma_kn_ops.cuh"
#include "common/gemm/wgmma_mn_ops.cuh"
#include "common/gemm/wgmma_ops.cuh"
#include "common/ptx.cuh"

namespace kiln {
namespace gemm {

// K-major, 128-byte swizzle: rows of 128 bytes, 8-row atoms 1024 bytes apart (stride byte
// offset); the leading byte offset is unused for this layout and set to 1 by convention.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// M- or N-major (transposed) operand, 128-byte swizzle: 64 elements of M or N in each 128-byte
// row, 8-row atoms of K 1024 bytes apart (stride byte offset), the next 64 elements of M or N
// `lbo` bytes on (leading byte offset, the panel stride).
__device__ __forceinline__ unsigned long long smem_desc_mn(unsigned addr, unsigned lbo) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void warpgroup_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// wgmma_wait<n> for an n in [0, MAX] that unrolling makes a constant.
template <int MAX>
__device__ __forceinline__ void wgmma_wait_upto(int n) {
  if constexpr (MAX == 0) {
    wgmma_wait<0>();
  } else {
    if (n == MAX)
      wgmma_wait<MAX>();
    else
      wgmma_wait_upto<MAX - 1>(n);
  }
}
// Keeps the compiler from moving accumulator reads or writes across wgmma issue and wait.
template <int NI>
__device__ __forceinline__ void fence_fragments(float (&d)[1][NI][4]) {
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][ni][e])::"memory");
}

// Thread-block clusters (CLUSTER > 1): the CLUSTER CTAs of a cluster take output tiles side by
// side along N (same rows of A, CLUSTER consecutive column tiles) and share A: CTA r copies rows
// [r BM / CLUSTER, (r + 1) BM / CLUSTER) of each stage's A tile and multicasts them into every
// CTA of the cluster, so L2 serves each A tile once per cluster instead of once per CTA (the
// decode-sized problems, M = 128, read A once per column tile and are bound by L2 bandwidth).
// A stage may then be refilled only when every CTA of the cluster has released it: each consumer
// warp arrives on the `empty` barrier of every CTA in the cluster. Column tiles past tiles_n
// (tiles_n not a multiple of CLUSTER) still take part in the loads of A and store nothing.
// Those remote arrivals (ptx::mbar_arrive_remote) have the default semantics, release at CTA
// scope, as a local arrive: what they order is the consumers' wgmma reads of the stage, retired
// by wgmma.wait before them. Release at cluster scope would make every arrival a cluster-wide
// memory fence, which makes each k-step and the cluster variants far slower.
//
// Split-K (SPLIT > 1, fp8 only, no CLUSTER): the SPLIT CTAs of a cluster compute the same output
// tile, CTA r over k-steps [r ktiles / SPLIT, (r + 1) ktiles / SPLIT). For decode-sized M every
// CTA streams its whole A tile once per column tile, and an SM takes in A + B at about the same
// rate however the loads are issued (on Hopper every M = 128 tile and cluster shape measured lands
// close to it; docs/benchmarks.md), so A's share of those bytes decides; splitting K lets wider
// column tiles (less A per byte of B) fill the SMs. Each CTA writes its fp32 partial tile to its
// own shared memory, arrives on a `ready` barrier in every CTA of the cluster (release at cluster
// scope, ptx::mbar_arrive_remote_release: a cluster-wide fence, once per tile), then sums rows
// [r BM / SPLIT, ...) of all SPLIT partial tiles in rank order (deterministic: the same sum
// whatever the timing), read through distributed shared memory, and stores them; a `done` barrier
// keeps a partial tile alive until every CTA has read it.
// Block-scaled fp8 (KIND k_fp8_block): one stage is exactly one 128-wide k-block. The producer
// warpgroup's second warp copies the stage's scales (BM rows of a_scale, the tile's one or two
// b_scale blocks) into a small per-stage area beside the ring with cp.async and arrives on the
// stage's `full` barrier when they land, so the consumers read them from shared memory and never
// wait on global memory. Each consumer issues a k-block's batch into one partial-sum set, waits
// for it, releases the stage and promotes (acc += part * a_scale * b_scale, the b scale of each
// column's 128-column block: bn 192 spans two); the two consumers issue in turn (see ORDER).
// bn 256 (HALVES): each k-block goes as two 128-column halves, exactly one scale block each,
// through a 64-column partial-sum set (acc 128 + part 64 registers): issue half 0, wait, promote
// it, then half 1, the stage released after the second; the consumers keep no issue order there
// (with the order these tiles are slower at the large shapes; without it 128 x 256 beats 128 x 192
// and 128 x 128 there; docs/benchmarks.md has the figures).
// DIRECT (block scales, 64 x 32 tiles only: decode-sized M at N = 2112): no scale warp; the
// consumer loads its two rows' a scales and the tile's b scale itself (plain cached loads, one
// group of PSETS = 4 k-blocks ahead) and the full barrier waits for the copies alone; it issues 4
// k-blocks' batches into 4 partial-sum sets of 16 registers back to back, then waits for and
// promotes each in turn. At 128 x 2112 x 7168 that is faster than the scale warp (with 1, 2 or 4
// sets alike: the consumer is not the limit) and close to a probe without scales at all; DIRECT
// with one set is slower than either. On larger tiles DIRECT is slower (64 x 64 at 128 x 4096 x
// 7168, 128 x 256 at 8192^3, 128 x 192 at 4096 x 2112), so they keep the scale warp.
//
// Swapped tiles (BM 16 or 32, fp8 or gated: decode-sized M): wgmma's M is 64, so a 64-row tile
// over a handful of tokens would fill most of each stage's A with zeros and leave little room for
// B, the bytes that decide the time when a GEMM streams its weights. A swapped tile computes out^T
// instead: each consumer warpgroup's 64 rows of the stage's B (gated: of each B, one accumulator
// set per projection) are wgmma's A operand and the stage's BM rows of A its B operand (N = BM),
// both K-major as loaded, so a stage of BM + BN rows (BM + 2 BN) is all data and the ring holds
// several times the weights in flight. The accumulators hold the tile transposed (rows are
// columns of out); the epilogue stores them so (a split-K partial tile is transposed on its way
// into shared memory, and the reduction is the unswapped one), and block scales promote by the
// accumulator's columns (the tile's rows: their a scales) and the tile's one b scale.
//
// How a kernel's tiles leave (gemm_wgmma_body's OUT): fragments stored straight to global memory
// (k_out_direct), or the staged epilogue of staged_store.cuh for 128-row tiles whose width is
// whole 64-column boxes, leaving by bulk tensor stores of an output map when rows are whole 16-byte
// pieces (k_out_map; else the warp's lanes copy them out), or always by the lanes (k_out_copy:
// kernels whose four tensor maps are taken).
enum OutStore { k_out_direct = 0, k_out_map = 1, k_out_copy = 2 };

// A tail (k_half): after a tile's K loop, Tail::steps(tn) more k-steps whose A and B boxes come
// from the tail's own tensor maps (Tail::step), through the same ring: the producer loads them by
// TMA like any k-step, so they are in flight under the K loop. The epilogue adds Tail::bias(col).
// NoTail is the plain GEMM.
struct NoTail {
  __device__ __forceinline__ int steps(int) const { return 0; }
  // The maps and coordinates of tail step j of column tile tn (A's box at column a_col, row tile
  // tm's rows; B's at b_col, b_row).
  __device__ __forceinline__ void step(int, int, const ptx::TmaDesc*&, int&, const ptx::TmaDesc*&, int&, int&) const {}
  __device__ __forceinline__ float bias(int) const { return 0.0f; }
};

template <int KIND, class TIn, class TOut, int ACT, int BM, int BN, int STAGES, int GROUP, int CLUSTER, int SPLIT,
          class Tail = NoTail, int OUT = k_out_direct>
__device__ __forceinline__ void gemm_wgmma_body(KILN_GEMM_PARAMS, const ptx::TmaDesc& map_a,
                                                const ptx::TmaDesc& map_b0, const ptx::TmaDesc& map_b1,
                                                const Tail& tail = Tail{}, const ptx::TmaDesc* map_out = nullptr) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // SWAP (swapped tiles, see above): wgmma's A is the stage's BN rows of B, its N the BM rows of A,
  // so the accumulators hold the tile transposed: rows are columns of out, columns are rows.
  constexpr bool SWAP = BM < 64;
  constexpr int CONSUMERS = (SWAP ? BN : BM) / 64, NI = (SWAP ? BM : BN) / 8;
  constexpr bool DUAL = KIND == k_gated, FP8 = KIND == k_fp8_tensor || KIND == k_fp8_block,
                 BLOCK = KIND == k_fp8_block, MC = CLUSTER > 1, SK = SPLIT > 1;
  constexpr int CL = CLUSTER * SPLIT;  // CTAs per cluster
  static_assert(!(SK && (MC || !FP8)), "split-K is for fp8 without A multicast");
  static_assert(!SWAP || ((FP8 || DUAL) && !MC && (BN == 64 || BN == 128)),
                "swapped tiles: fp8 or gated, bn 64 or 128, no multicast");
  static_assert(!BLOCK || BN <= 128 || BN == 192 || BN == 160 || BN == 144 || BN == 256,
                "block scales: bn - gcd(bn, 128) <= 128 keeps a tile within two scale blocks (256: two halves)");
  constexpr bool HALVES = BLOCK && BN == 256;  // see above; part0 holds one half
  constexpr int PNI = HALVES ? NI / 2 : NI;
  // Block scales, 64 x 32 tiles (decode-sized M; DIRECT in the notes above): scales straight from
  // global memory into the consumer's registers, and PSETS partial-sum sets.
  constexpr bool DIRECT = BLOCK && BM == 64 && BN == 32;
  constexpr int PSETS = DIRECT ? 4 : 1;
  using MmaT = typename Select<FP8, u8, TIn>::type;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes;
  constexpr int STAGE_BYTES = A_BYTES + (DUAL ? 2 : 1) * B_BYTES;
  constexpr int SCALE_FLOATS = BM + 4;  // per stage: BM a scales, the b scale, padding to 16 bytes
  // The staged epilogue (OUT; staged_store.cuh): 2 KiB per consumer warp after the ring, one box
  // of its 16 rows x 64 columns.
  constexpr bool STAGED = OUT != k_out_direct && !SK && BM == 128 && BN % 64 == 0 && sizeof(TOut) == 2;
  constexpr int OUT_STAGE_BYTES = STAGED ? CONSUMERS * 4 * 2048 : 0;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned out_stage = base + STAGES * STAGE_BYTES;
  const unsigned full = out_stage + OUT_STAGE_BYTES, empty = full + 8 * STAGES, scales = empty + 8 * STAGES;
  // Split-K: the ready and done barriers, then the partial tile (rows of RED_LD floats).
  constexpr int RED_LD = BN + 4;
  const unsigned red_bar = scales + (BLOCK ? STAGES * SCALE_FLOATS * 4 : 0), red = red_bar + 16;

  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
  const int ktiles = int(((long long)k * (FP8 ? 1 : 2) + k_row_bytes - 1) / k_row_bytes);
  const int kblocks = (k + k_scale_block - 1) / k_scale_block;
  // Work units: a row of tiles_m x ceil(tiles_n / CLUSTER) cluster tiles, one per cluster; CTA
  // `rank` of the cluster takes column tile tn_c * CLUSTER + rank.
  const int crank = CL > 1 ? int(ptx::cluster_ctarank()) : 0;
  const int rank = MC ? crank : 0, krank = SK ? crank : 0;
  const int tiles_nc = (tiles_n + CLUSTER - 1) / CLUSTER;
  const int units = tiles_m * tiles_nc, first = blockIdx.x / CL, step = gridDim.x / CL;
  // This CTA's k-steps (all of them without split-K); a range may be empty when ktiles < SPLIT.
  const int kt0 = int((long long)ktiles * krank / SPLIT), kt1 = int((long long)ktiles * (krank + 1) / SPLIT);
  const int nk = kt1 - kt0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(full + 8 * s, BLOCK && !DIRECT ? 1 + 32 : 1);
      ptx::mbar_init(empty + 8 * s, MC ? CONSUMERS * 4 * CLUSTER : CONSUMERS * 128);
    }
    if (SK) {
      ptx::mbar_init(red_bar, SPLIT * CONSUMERS * 4);
      ptx::mbar_init(red_bar + 8, SPLIT * CONSUMERS * 4);
    }
    if (CL > 1) ptx::mbar_init_fence();
  }
  if (CL > 1)
    ptx::cluster_sync();
  else
    __syncthreads();

  if (wg == CONSUMERS) {
    // Producer: one thread issues every copy of the operands; with block scales, a second warp
    // copies the scales.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    const int warp = (threadIdx.x / 32) % 4;
    if (warp == 0) {
      // The whole warp walks the ring (it stays converged for the cluster barrier at the end);
      // lane 0 issues.
      int it = 0;
      for (int u = first; u < units; u += step) {
        int tm, tnc;
        tile_coords<GROUP>(u, tiles_m, tiles_nc, tm, tnc);
        const int tn = tnc * CLUSTER + rank;
        const bool b_valid = !MC || tn < tiles_n;
        const unsigned bytes = A_BYTES + (b_valid ? (DUAL ? 2 : 1) * B_BYTES : 0);
        const int kend = kt1 + tail.steps(tn);
        for (int kt = kt0; kt < kend; ++kt, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned st = base + s * STAGE_BYTES, bar = full + 8 * s;
          const ptx::TmaDesc *ma = &map_a, *mb = &map_b0;
          int a_col = kt * k_row_bytes, b_col = a_col, b_row = tn * BN;
          if (kt >= kt1) tail.step(kt - kt1, tn, ma, a_col, mb, b_col, b_row);
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(bar, bytes);
            if (MC)
              ptx::tma_load_2d_multicast(st + rank * (A_BYTES / CLUSTER), ma, a_col, tm * BM + rank * (BM / CLUSTER),
                                         bar, (unsigned short)((1u << CLUSTER) - 1));
            else
              ptx::tma_load_2d(st, ma, a_col, tm * BM, bar);
            if (b_valid) {
              ptx::tma_load_2d(st + A_BYTES, mb, b_col, b_row, bar);
              if (DUAL) ptx::tma_load_2d(st + A_BYTES + B_BYTES, &map_b1, kt * k_row_bytes, tn * BN, bar);
            }
          }
          __syncwarp();
        }
      }
    } else if (BLOCK && !DIRECT && warp == 1) {
      int it = 0;
      for (int u = first; u < units; u += step) {
        int tm, tnc;
        tile_coords<GROUP>(u, tiles_m, tiles_nc, tm, tnc);
        const int tn = tnc * CLUSTER + rank;
        const bool b_ok = tn * BN < n;
        const float* b_scales = b_scale + (long long)((tn * BN) / k_scale_block) * kblocks;
        for (int kt = kt0; kt < kt1; ++kt, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned dst = scales + s * SCALE_FLOATS * 4;
#pragma unroll
          for (int r = lane; r < BM; r += 32) {
            const int row = tm * BM + r;
            const bool ok = row < m;
            cp_async_4(dst + 4 * r, ok ? a_scale + (long long)row * kblocks + kt : a_scale, ok ? 4 : 0);
          }
          // The tile's b scales: its first 128-column block's and, for bn > 128, the next one's.
          if (lane == 0) cp_async_4(dst + 4 * BM, b_ok ? b_scales + kt : b_scale, b_ok ? 4 : 0);
          if (BN > k_scale_block && lane == 1) {
            const bool ok2 = b_ok && (tn * BN) / k_scale_block + 1 < (n + k_scale_block - 1) / k_scale_block;
            cp_async_4(dst + 4 * (BM + 1), ok2 ? b_scales + kblocks + kt : b_scale, ok2 ? 4 : 0);
          }
          ptx::mbar_arrive_cp_async(full + 8 * s);
        }
      }
    }
    if (CL > 1) ptx::cluster_sync();
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMERS == 1 ? 240 : 224));
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  // acc1: the up projection (gated); part0: a k-block's partial sums (block-scaled). Unused ones
  // are compiled away.
  // parts: DIRECT's partial-sum sets.
  float acc[1][NI][4], acc1[1][NI][4], part0[1][PNI][4], parts[PSETS][1][NI][4];
  // One stage: 4 instructions of 32 bytes of K (+2 per step in descriptor units) into d, plus the
  // up projection into acc1; `accumulate` 0 starts d afresh. Returns with the batch in flight.
  // SWAP: wgmma's A is this warpgroup's 64 rows of the stage's B (gated: of each B, da1 the up
  // projection's), its B the stage's A.
  auto issue_stage = [&](float(&d)[1][NI][4], unsigned st, int accumulate) {
    const unsigned wrows = wg * 64 * k_row_bytes;
    const unsigned long long da = smem_desc(SWAP ? st + A_BYTES + wrows : st + wrows),
                             da1 = SWAP ? smem_desc(st + A_BYTES + B_BYTES + wrows) : da,
                             db = smem_desc(SWAP ? st : st + A_BYTES),
                             db1 = SWAP ? db : smem_desc(st + A_BYTES + B_BYTES);
    fence_fragments(d);
    if (DUAL) fence_fragments(acc1);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Wgmma<MmaT, NI * 8>::run(d, da + 2 * kk, db + 2 * kk, accumulate || kk > 0);
      if (DUAL) Wgmma<MmaT, NI * 8>::run(acc1, da1 + 2 * kk, db1 + 2 * kk, accumulate || kk > 0);
    }
    wgmma_commit();
  };
  // Block scales, bn 256: half h (tile columns [128 h, 128 h + 128), B rows 128 h on: a whole
  // number of 1024-byte swizzle atoms) of one stage into part0, returning with it in flight.
  auto issue_half = [&](unsigned st, int h) {
    if constexpr (HALVES) {
      const unsigned long long da = smem_desc(st + wg * 64 * k_row_bytes),
                               db = smem_desc(st + A_BYTES + h * (BN / 2) * k_row_bytes);
      fence_fragments(part0);
      warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<MmaT, BN / 2>::run(part0, da + 2 * kk, db + 2 * kk, kk > 0);
      wgmma_commit();
    }
  };
  auto settle = [&](float(&d)[1][NI][4]) {
    fence_fragments(d);
    if (DUAL) fence_fragments(acc1);
  };
  // Hands stage s back to the producers (of every CTA of the cluster).
  auto release = [&](int s) {
    if (MC) {
      __syncwarp();
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < CLUSTER; ++r) ptx::mbar_arrive_remote(empty + 8 * s, r);
    } else {
      ptx::mbar_arrive(empty + 8 * s);
    }
  };
  // This thread's two rows' a scales times the b scales of stage s: sc[h][j] for row h (the
  // thread's rows r and r + 8) and the tile's j-th 128-column block (j = 1 only for bn > 128).
  const float* stage_scales = reinterpret_cast<const float*>(smem_raw + (scales - raw));
  const int scale_row = wg * 64 + warp_in_wg * 16 + (lane >> 2);
  constexpr int SB = BN > k_scale_block ? 2 : 1;
  auto read_scales = [&](float(&sc)[2][2], int s) {
    const float* p = stage_scales + s * SCALE_FLOATS;
    const float a0 = p[scale_row], a1 = p[scale_row + 8];
#pragma unroll
    for (int j = 0; j < SB; ++j) {
      const float sb = p[BM + j];
      sc[0][j] = a0 * sb;
      sc[1][j] = a1 * sb;
    }
  };
  // SWAP: the a scales of this thread's columns of the accumulators (rows of the tile: 8 ni +
  // 2 (lane % 4) + q) times the tile's one b scale (bn divides 128), for stage s.
  auto read_scales_swapped = [&](float(&sc)[NI][2], int s) {
    const float* p = stage_scales + s * SCALE_FLOATS;
    const float sb = p[BM];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int q = 0; q < 2; ++q) sc[ni][q] = p[8 * ni + 2 * (lane & 3) + q] * sb;
  };
  // DIRECT: this thread's two rows of a_scale and the tile's b_scale column block (set per tile),
  // and the next PSETS k-blocks' values, fetched (plain cached loads) a group ahead of their use.
  // Only DIRECT's loop calls these; the other block-scaled loops read stage s's shared-memory copy
  // (read_scales).
  const float *sa0 = a_scale, *sa1 = a_scale, *sbc = b_scale;
  bool sa_ok0 = false, sa_ok1 = false, sb_ok[2] = {false, false};
  float pa[PSETS][2], pb[PSETS][2];
  auto fetch_scales = [&](int kt_first) {
    if constexpr (DIRECT) {
#pragma unroll
      for (int j = 0; j < PSETS; ++j) {
        const int kb = kt0 + kt_first + j;
        const bool in = kt_first + j < nk;
        pa[j][0] = in && sa_ok0 ? __ldg(sa0 + kb) : 0.0f;
        pa[j][1] = in && sa_ok1 ? __ldg(sa1 + kb) : 0.0f;
#pragma unroll
        for (int q = 0; q < SB; ++q) pb[j][q] = in && sb_ok[q] ? __ldg(sbc + (long long)q * kblocks + kb) : 0.0f;
      }
    }
  };
  // The scales of a k-block from fetched value set j.
  auto get_scales = [&](float(&sc)[2][2], int j) {
#pragma unroll
    for (int q = 0; q < SB; ++q) {
      sc[0][q] = pa[j][0] * pb[j][q];
      sc[1][q] = pa[j][1] * pb[j][q];
    }
  };
  // Two consumers issue their batches in turn (block scales): consumer 0's batch j, then consumer
  // 1's batch j, then consumer 0's batch j + 1 (named barriers 1 and 2, each consumer arriving
  // after it issues and syncing before). Each waits for its batch before promoting it, so without
  // an order both tend to wait, and promote, at the same time while the tensor cores idle; in
  // turn, one promotes while the other's batch runs (faster with 128 x 192 tiles; slower with
  // bn 256's halves, which keep none).
  constexpr bool ORDER = BLOCK && CONSUMERS == 2 && !HALVES;
  int batch = 0, batches = 0;
  if (ORDER) batches = first < units ? ((units - first + step - 1) / step) * nk : 0;
  auto order_wait = [&]() {
    if (!ORDER) return;
    if (wg == 1)
      ptx::bar_sync<1, 256>();
    else if (batch > 0)
      ptx::bar_sync<2, 256>();
  };
  auto order_signal = [&]() {
    if (!ORDER) return;
    if (wg == 0)
      ptx::bar_arrive<1, 256>();
    else if (batch + 1 < batches)
      ptx::bar_arrive<2, 256>();
    ++batch;
  };
  int it = 0;
  int uiter = 0;  // split-K: units done, the parity of the ready / done barriers
  for (int u = first; u < units; u += step) {
    int tm, tnc;
    tile_coords<GROUP>(u, tiles_m, tiles_nc, tm, tnc);
    const int tn = tnc * CLUSTER + rank;
    const int row0 = tm * BM + wg * 64 + warp_in_wg * 16, col0 = tn * BN;
    if (BLOCK) {
      // One partial-sum set (DIRECT tiles: PSETS): each k-block's batch is waited for, its stage
      // released, then the partial sums promoted. (Two sets, the next batch queued before each
      // promotion, are slower with two consumers: docs/benchmarks.md.)
      zero_fragments(acc);
      if constexpr (DIRECT) {
        const int ra = tm * BM + scale_row;
        sa_ok0 = ra < m;
        sa_ok1 = ra + 8 < m;
        sa0 = a_scale + (long long)ra * kblocks;
        sa1 = sa0 + 8ll * kblocks;
        const int cb = col0 / k_scale_block, nbk = (n + k_scale_block - 1) / k_scale_block;
        sbc = b_scale + (long long)cb * kblocks;
#pragma unroll
        for (int q = 0; q < 2; ++q) sb_ok[q] = col0 < n && cb + q < nbk;
        fetch_scales(0);
      }
      // Columns [0, 8 * n1) of the tile are in its first 128-column scale block, the rest in the
      // next (bn > 128 only; bn - gcd(bn, 128) <= 128 keeps every tile within two blocks).
      const int n1 = SB == 1 ? NI : min(NI, (k_scale_block - col0 % k_scale_block) / 8);
      if constexpr (HALVES) {
        // col0 is a multiple of 256: half h is exactly scale block h of the tile, sc[.][h].
        for (int kt = 0; kt < nk; ++kt, ++it) {
          const int s = it % STAGES;
          ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
          float sc[2][2];
          read_scales(sc, s);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            issue_half(base + s * STAGE_BYTES, h);
            wgmma_wait<0>();
            fence_fragments(part0);
            if (h == 1) release(s);
#pragma unroll
            for (int ni = 0; ni < PNI; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[0][h * PNI + ni][e] += part0[0][ni][e] * sc[e >> 1][h];
          }
        }
      } else if constexpr (DIRECT) {
        // One consumer: PSETS k-blocks at a time, each into its own partial-sum set, issued back to
        // back; then each is waited for (the later ones still running), its stage released and
        // promoted. Every batch completes within the iteration: a batch left in flight across
        // iterations makes ptxas serialize every wgmma (C7514). A remainder of nk % PSETS k-blocks
        // goes one at a time. The group's scales were fetched during the previous group.
        int kt = 0;
        for (; kt + PSETS <= nk; kt += PSETS, it += PSETS) {
          float sc[PSETS][2][2];
#pragma unroll
          for (int j = 0; j < PSETS; ++j) get_scales(sc[j], j);
          fetch_scales(kt + PSETS);
#pragma unroll
          for (int j = 0; j < PSETS; ++j) {
            const int s = (it + j) % STAGES;
            ptx::mbar_wait(full + 8 * s, ((it + j) / STAGES) & 1);
            issue_stage(parts[j], base + s * STAGE_BYTES, 0);
          }
#pragma unroll
          for (int j = 0; j < PSETS; ++j) {
            wgmma_wait_upto<PSETS - 1>(PSETS - 1 - j);
            fence_fragments(parts[j]);
            release((it + j) % STAGES);
            promote_split<BN>(acc, parts[j], sc[j], n1);
          }
        }
        // The remainder: its scales are fetched value sets 0 .. nk - kt - 1.
#pragma unroll
        for (int j = 0; j < PSETS - 1; ++j) {
          if (kt >= nk) break;
          const int s = it % STAGES;
          ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
          float sc[2][2];
          get_scales(sc, j);
          issue_stage(parts[0], base + s * STAGE_BYTES, 0);
          wgmma_wait<0>();
          fence_fragments(parts[0]);
          release(s);
          promote_split<BN>(acc, parts[0], sc, n1);
          ++kt;
          ++it;
        }
      } else {
        for (int kt = 0; kt < nk; ++kt, ++it) {
          const int s = it % STAGES;
          ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
          float sc[2][2], scs[NI][2];
          if constexpr (SWAP)
            read_scales_swapped(scs, s);
          else
            read_scales(sc, s);
          order_wait();
          issue_stage(part0, base + s * STAGE_BYTES, 0);
          order_signal();
          wgmma_wait<0>();
          fence_fragments(part0);
          release(s);
          if constexpr (SWAP) {
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[0][ni][e] += part0[0][ni][e] * scs[ni][e & 1];
          } else {
            promote_split<BN>(acc, part0, sc, n1);
          }
        }
      }
    } else if (nk == 0) {
      // Split-K with fewer k-steps than CTAs: nothing here; the partial tile written below is
      // zero. (acc is left alone: a non-wgmma write to it anywhere makes ptxas serialize every
      // wgmma of the kernel, C7515.)
    } else {
      const int steps = nk + tail.steps(tn);
      for (int kt = 0; kt < steps; ++kt, ++it) {
        const int s = it % STAGES;
        ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
        // Keep one batch in flight: when the previous one is done, its stage goes back.
        issue_stage(acc, base + s * STAGE_BYTES, kt > 0);
        wgmma_wait<1>();
        settle(acc);
        if (kt > 0) release((it - 1) % STAGES);
      }
      wgmma_wait<0>();
      settle(acc);
      release((it - 1) % STAGES);
    }
    if (MC && tn >= tiles_n) continue;
    if (SK) {
      // Our partial tile may be overwritten once every CTA has read the previous one.
      if (uiter > 0) ptx::mbar_wait_acquire_cluster(red_bar + 8, (uiter - 1) & 1);
      // The partial tile as rows of out (SWAP: the accumulators transposed, one float at a time;
      // rows 8 ni + 2 (lane % 4) + q are 2 RED_LD floats apart, 8 banks, so a warp's stores do not
      // conflict).
      const int rl = wg * 64 + warp_in_wg * 16 + (lane >> 2);
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (SWAP) {
#pragma unroll
            for (int q = 0; q < 2; ++q)
              ptx::st_shared_f32(red + 4u * unsigned((8 * ni + 2 * (lane & 3) + q) * RED_LD + rl + 8 * h),
                                 nk > 0 ? acc[0][ni][2 * h + q] : 0.0f);
          } else {
            const unsigned addr = red + 4u * unsigned((rl + 8 * h) * RED_LD + 8 * ni + 2 * (lane & 3));
            ptx::st_shared_f2(addr, nk > 0 ? acc[0][ni][2 * h] : 0.0f, nk > 0 ? acc[0][ni][2 * h + 1] : 0.0f);
          }
        }
      __syncwarp();
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) ptx::mbar_arrive_remote_release(red_bar, r);
      ptx::mbar_wait_acquire_cluster(red_bar, uiter & 1);
      // Rows [krank * ROWS, ...) of the tile: the sum of every CTA's partial rows, in rank order.
      constexpr int ROWS = (BM + SPLIT - 1) / SPLIT, QUADS = BN / 4;
      const int r_begin = krank * ROWS, r_count = min(BM, r_begin + ROWS) - r_begin;
      const float mul = BLOCK ? 1.0f : __ldg(a_scale) * __ldg(b_scale);
      const bool pairs = (n & 1) == 0;
      for (int e = threadIdx.x; e < r_count * QUADS; e += CONSUMERS * 128) {
        const int rr = r_begin + e / QUADS, c = (e % QUADS) * 4;
        const unsigned addr = red + 4u * unsigned(rr * RED_LD + c);
        float4 sum = ptx::ld_remote_f4(addr, 0);
#pragma unroll
        for (int q = 1; q < SPLIT; ++q) {
          const float4 v = ptx::ld_remote_f4(addr, q);
          sum.x += v.x;
          sum.y += v.y;
          sum.z += v.z;
          sum.w += v.w;
        }
        const int row = tm * BM + rr, col = col0 + c;
        if (row >= m) continue;
        TOut* orow = out + (long long)row * n;
        const float vals[4] = {sum.x * mul, sum.y * mul, sum.z * mul, sum.w * mul};
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
          const TOut v0 = from_float<TOut>(vals[j]), v1 = from_float<TOut>(vals[j + 1]);
          if (pairs && col + j + 1 < n) {
            Pack<TOut, 2> pk;
            pk.v[0] = v0;
            pk.v[1] = v1;
            store_pack<TOut, 2>(orow + col + j, pk);
          } else {
            if (col + j < n) orow[col + j] = v0;
            if (col + j + 1 < n) orow[col + j + 1] = v1;
          }
        }
      }
      __syncwarp();
      if (lane == 0)
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) ptx::mbar_arrive_remote_release(red_bar + 8, r);
      ++uiter;
      continue;
    }
    const float mul = FP8 && !BLOCK ? __ldg(a_scale) * __ldg(b_scale) : 1.0f;
    auto value = [&](int, int ni, int e) {
      if constexpr (DUAL)
        return gemm_activate(ACT, acc[0][ni][e]) * acc1[0][ni][e];
      else if constexpr (FP8)
        return acc[0][ni][e] * mul;
      else
        return acc[0][ni][e] + tail.bias(col0 + 8 * ni + 2 * (lane & 3) + (e & 1));
    };
    if constexpr (SWAP) {
      // Element (ni, e) is row 8 ni + 2 (lane % 4) + (e & 1), column 16 warp + lane / 4 + 8 (e / 2)
      // of this warpgroup's 64: lanes of a store write 8 adjacent columns of each of 4 rows.
      const int c = col0 + wg * 64 + warp_in_wg * 16 + (lane >> 2);
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = tm * BM + 8 * ni + 2 * (lane & 3) + (e & 1), col = c + 8 * (e >> 1);
          if (row < m && col < n) out[(long long)row * n + col] = from_float<TOut>(value(0, ni, e));
        }
    } else if constexpr (STAGED) {
      // Each warp's 16 rows, a box of 64 columns at a time, through its own 2 KiB (staged_store.cuh):
      // bulk tensor stores when rows are whole 16-byte pieces (the map clips rows past m), else
      // the lanes' own stores.
      if (row0 < m)
        store_rows_staged<TOut, BN>(out_stage + unsigned((wg * 4 + warp_in_wg) * 2048), map_out,
                                    OUT == k_out_map && (n & 7) == 0, row0, out, row0, min(16, m - row0), n, col0,
                                    value);
    } else {
      store_fragments<TOut, 1, NI>(out, m, n, row0, col0, value);
    }
  }
  // Shared memory lives until the block exits: the bulk stores must be done reading it.
  if (STAGED && lane == 0) ptx::bulk_wait<0>();
  if (CL > 1) ptx::cluster_sync();
#else
  // Not sm_90a: nothing to run. check_problem refuses this path for such devices; a tuner timing a
  // problem that names another device gets an empty kernel rather than a trap that would poison
  // its CUDA context.
#endif
}

// Threads of a wgmma kernel: a warpgroup per 64 rows of wgmma's A (the tile's rows, or a swapped
// tile's columns) and the producer's.
template <int BM, int BN>
constexpr int wgmma_threads() {
  return ((BM < 64 ? BN : BM) / 64 + 1) * 128;
}

// The kernels: without clusters, and with CLUSTER-wide clusters (the attribute fixes the
// cluster shape at compile time, so a plain launch with a grid that is a multiple of CLUSTER
// forms them). Both take a fourth tensor map, of the output (boxes of 16 rows x 128 bytes), for
// the staged epilogue (staged_store.cuh) of 128-row tiles whose width is a multiple of 64 (no
// split-K): a tile's stores are then a few shared-memory instructions and bulk copies that run
// under the next tile's K loop.
template <int KIND, class TIn, class TOut, int ACT, int BM, int BN, int STAGES, int GROUP>
__global__ void __launch_bounds__(wgmma_threads<BM, BN>(), 1)
    gemm_wgmma(KILN_GEMM_PARAMS, const __grid_constant__ ptx::TmaDesc map_a,
               const __grid_constant__ ptx::TmaDesc map_b0, const __grid_constant__ ptx::TmaDesc map_b1,
               const __grid_constant__ ptx::TmaDesc map_out) {
  gemm_wgmma_body<KIND, TIn, TOut, ACT, BM, BN, STAGES, GROUP, 1, 1, NoTail, k_out_map>(
      a, b0, b1, a_scale, b_scale, out, m, n, k, tiles_m, tiles_n, map_a, map_b0, map_b1, NoTail{}, &map_out);
}

template <int KIND, class TIn, class TOut, int ACT, int BM, int BN, int STAGES, int GROUP, int CLUSTER, int SPLIT>
__global__ void __launch_bounds__(wgmma_threads<BM, BN>(), 1)
#if __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER * SPLIT, 1, 1)
#endif
    gemm_wgmma_cluster(KILN_GEMM_PARAMS, const __grid_constant__ ptx::TmaDesc map_a,
                       const __grid_constant__ ptx::TmaDesc map_b0, const __grid_constant__ ptx::TmaDesc map_b1,
                       const __grid_constant__ ptx::TmaDesc map_out) {
  gemm_wgmma_body<KIND, TIn, TOut, ACT, BM, BN, STAGES, GROUP, CLUSTER, SPLIT, NoTail, k_out_map>(
      a, b0, b1, a_scale, b_scale, out, m, n, k, tiles_m, tiles_n, map_a, map_b0, map_b1, NoTail{}, &map_out);
}

}  // namespace gemm
}  // namespace kiln
