// The sm_90a path of the GEMM core: wgmma from shared memory (both operands through 128-byte
// swizzle descriptors), warp-specialized. Warpgroups 0 .. BM/64 - 1 are consumers (64 rows of the
// tile each, accumulators in registers, setmaxnreg raised); the last warpgroup is the producer
// (registers lowered) whose one elected thread fills a STAGES-deep ring of shared-memory stages
// with bulk tensor copies (TMA: cp.async.bulk.tensor, tensor maps passed as __grid_constant__
// parameters, the 128-byte swizzle applied by the copy engine, zeros past the matrix edges). Each
// stage has a `full` mbarrier (the copies complete their bytes on it) and an `empty` one
// (consumers -> producer). The grid is persistent: CTA i takes tiles i, i + grid, ... in grouped
// order, and the ring runs on across tiles, so the producer loads the next tile while the
// consumers store this one.
//
// Off sm_90a (no wgmma, no setmaxnreg) the kernel compiles to an empty body: families run this
// path only on devices of compute capability 9.0.
#pragma once

#include "gemm/gemm_common.cuh"
#include "gemm/wgmma_ops.cuh"

namespace kiln {
namespace gemm {

// K-major, 128-byte swizzle: rows of 128 bytes, 8-row atoms 1024 bytes apart (stride byte
// offset); the leading byte offset is unused for this layout and set to 1 by convention.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// A CUtensorMap, opaque (the driver encodes it; jit::encode_tensor_maps).
struct __align__(64) TmaDesc {
  unsigned long long bits[16];
};

// Box (128 bytes x rows) at byte column `col`, row `row` of the map -> shared `dst`; completes
// its bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, int col, int row, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void warpgroup_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across wgmma issue and wait.
template <int NI>
__device__ __forceinline__ void fence_fragments(float (&d)[1][NI][4]) {
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][ni][e])::"memory");
}

template <int KIND, class TIn, class TOut, int ACT, int BM, int BN, int STAGES, int GROUP>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    gemm_wgmma(KILN_GEMM_PARAMS, const __grid_constant__ TmaDesc map_a, const __grid_constant__ TmaDesc map_b0,
               const __grid_constant__ TmaDesc map_b1) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int CONSUMERS = BM / 64, NI = BN / 8;
  constexpr bool DUAL = KIND == k_gated, FP8 = KIND != k_gated, BLOCK = KIND == k_fp8_block;
  using MmaT = typename Select<FP8, u8, TIn>::type;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes;
  constexpr int STAGE_BYTES = A_BYTES + (DUAL ? 2 : 1) * B_BYTES;
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;

  const int wg = threadIdx.x / 128;
  const int ktiles = int(((long long)k * (FP8 ? 1 : 2) + k_row_bytes - 1) / k_row_bytes);
  const int kblocks = (k + k_scale_block - 1) / k_scale_block;
  const int tiles = tiles_m * tiles_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, CONSUMERS * 128);
    }
  }
  __syncthreads();

  if (wg == CONSUMERS) {
    // Producer: one thread issues every copy.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    if (threadIdx.x != CONSUMERS * 128) return;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      int tm, tn;
      tile_coords<GROUP>(t, tiles_m, tiles_n, tm, tn);
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % STAGES;
        if (it >= STAGES) mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
        const unsigned st = base + s * STAGE_BYTES, bar = full + 8 * s;
        mbar_expect_tx(bar, STAGE_BYTES);
        tma_load_2d(st, &map_a, kt * k_row_bytes, tm * BM, bar);
        tma_load_2d(st + A_BYTES, &map_b0, kt * k_row_bytes, tn * BN, bar);
        if (DUAL) tma_load_2d(st + A_BYTES + B_BYTES, &map_b1, kt * k_row_bytes, tn * BN, bar);
      }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMERS == 1 ? 240 : 224));
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  // acc1: the up projection (gated); part: a k-block's partial sums (block-scaled). Unused ones
  // are compiled away.
  float acc[1][NI][4], acc1[1][NI][4], part[1][NI][4];
  // One stage: 4 instructions of 32 bytes of K (+2 per step in descriptor units) into d, plus the
  // up projection into acc1; `accumulate` 0 starts d afresh. Returns with the batch in flight.
  auto issue_stage = [&](float(&d)[1][NI][4], unsigned st, int accumulate) {
    const unsigned long long da = smem_desc(st + wg * 64 * k_row_bytes), db = smem_desc(st + A_BYTES),
                             db1 = smem_desc(st + A_BYTES + B_BYTES);
    fence_fragments(d);
    if (DUAL) fence_fragments(acc1);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Wgmma<MmaT, BN>::run(d, da + 2 * kk, db + 2 * kk, accumulate || kk > 0);
      if (DUAL) Wgmma<MmaT, BN>::run(acc1, da + 2 * kk, db1 + 2 * kk, accumulate || kk > 0);
    }
    wgmma_commit();
  };
  auto settle = [&](float(&d)[1][NI][4]) {
    fence_fragments(d);
    if (DUAL) fence_fragments(acc1);
  };
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int tm, tn;
    tile_coords<GROUP>(t, tiles_m, tiles_n, tm, tn);
    const int row0 = tm * BM + wg * 64 + warp_in_wg * 16, col0 = tn * BN;
    zero_fragments(acc);
    // Block scales of k-block kt, loaded one k-block ahead (their latency hides behind a stage).
    float sa[1][2] = {}, sa_next[1][2] = {}, sb = 0.0f, sb_next = 0.0f;
    const float* b_scales = BLOCK ? b_scale + (long long)(col0 / k_scale_block) * kblocks : nullptr;
    if (BLOCK) {
      load_block_scales(sa, a_scale, m, kblocks, 0, row0);
      sb = __ldg(b_scales);
    }
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(full + 8 * s, (it / STAGES) & 1);
      const unsigned st = base + s * STAGE_BYTES;
      if (BLOCK) {
        // The partial sums are needed in registers now: wait for this stage's batch.
        issue_stage(part, st, 0);
        if (kt + 1 < ktiles) {
          load_block_scales(sa_next, a_scale, m, kblocks, kt + 1, row0);
          sb_next = __ldg(b_scales + kt + 1);
        }
        wgmma_wait<0>();
        settle(part);
        mbar_arrive(empty + 8 * s);
        promote_block(acc, part, sa, sb);
        sa[0][0] = sa_next[0][0];
        sa[0][1] = sa_next[0][1];
        sb = sb_next;
      } else {
        // Keep one batch in flight: when the previous one is done, its stage goes back.
        issue_stage(acc, st, kt > 0);
        wgmma_wait<1>();
        settle(acc);
        if (kt > 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
      }
    }
    if (!BLOCK) {
      wgmma_wait<0>();
      settle(acc);
      mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    }
    if (DUAL) {
      store_fragments<TOut, 1, NI>(out, m, n, row0, col0, [&](int, int ni, int e) {
        return gemm_activate(ACT, acc[0][ni][e]) * acc1[0][ni][e];
      });
    } else {
      const float mul = BLOCK ? 1.0f : __ldg(a_scale) * __ldg(b_scale);
      store_fragments<TOut, 1, NI>(out, m, n, row0, col0, [&](int, int ni, int e) { return acc[0][ni][e] * mul; });
    }
  }
#else
  // Not sm_90a: nothing to run. check_problem refuses this path for such devices; a tuner timing a
  // problem that names another device gets an empty kernel rather than a trap that would poison
  // its CUDA context.
#endif
}

}  // namespace gemm
}  // namespace kiln
