// The sm_80 path of the GEMM core: mma.sync m16n8k16 (f16 or bf16 operands, fp32 accumulation),
// ldmatrix from the swizzled tiles, a STAGES-deep cp.async pipeline, one CTA per output tile in
// grouped order. 2 x BN/32 warps; each computes a (BM/2) x 32 piece.
//
// e4m3 operands: Ampere has no fp8 tensor-core instruction, so a 16-byte ldmatrix row chunk (16
// e4m3 values of K) is widened in registers to f16 with the exponent bias left 8 short (exact:
// every e4m3 value, subnormals included, is an f16 value times 2^8), and the 2^16 of both operands
// goes into the output scale. Such a chunk is one k16 step whose k order inside the instruction
// differs from the f16 case, identically for A and B, which leaves the dot products unchanged.
#pragma once

#include "common/gemm/gemm_common.cuh"

namespace kiln {
namespace gemm {

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<f16_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four e4m3 bytes (K order 0..3) -> f16 pairs (0, 1) and (2, 3), each value 2^-8 times its e4m3
// value: sign to bit 15, exponent and mantissa shifted into place below an exponent field 8 short.
__device__ __forceinline__ unsigned e4m3x2_lo(unsigned x) {
  const unsigned y = __byte_perm(x, 0u, 0x1404);  // bytes [0, x0, 0, x1]
  return (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
}
__device__ __forceinline__ unsigned e4m3x2_hi(unsigned x) {
  const unsigned y = __byte_perm(x, 0u, 0x3424);  // bytes [0, x2, 0, x3]
  return (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
}

template <int KIND, class TIn, class TOut, int ACT, int BM, int BN, int STAGES, int GROUP>
__global__ void __launch_bounds__(2 * BN) gemm_mma(KILN_GEMM_PARAMS) {
  constexpr int NT = 2 * BN, WN = BN / 32, MI = BM / 32, NI = 4;
  constexpr bool DUAL = KIND == k_gated, FP8 = KIND != k_gated, BLOCK = KIND == k_fp8_block;
  using MmaT = typename Select<FP8, f16_t, TIn>::type;  // what the tensor cores see
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes;
  constexpr int STAGE_BYTES = A_BYTES + (DUAL ? 2 : 1) * B_BYTES;
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  const long long ld = (long long)k * (FP8 ? 1 : 2);
  const int ktiles = int((ld + k_row_bytes - 1) / k_row_bytes);
  const int kblocks = (k + k_scale_block - 1) / k_scale_block;

  int tm, tn;
  tile_coords<GROUP>(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const long long row_a = (long long)tm * BM, row_b = (long long)tn * BN;

  auto load_stage = [&](int kt) {
    const unsigned s = base + (kt % STAGES) * STAGE_BYTES;
    const long long kb = (long long)kt * k_row_bytes;
    load_tile<BM, NT>(s, a, m, ld, row_a, kb, tid);
    load_tile<BN, NT>(s + A_BYTES, b0, n, ld, row_b, kb, tid);
    if (DUAL) load_tile<BN, NT>(s + A_BYTES + B_BYTES, b1, n, ld, row_b, kb, tid);
  };

  // acc1: the up projection (gated); part: block-scaled k-block partial sums. Unused ones are
  // compiled away.
  float acc[MI][NI][4], acc1[MI][NI][4], part[MI][NI][4];
  zero_fragments(acc);
  zero_fragments(acc1);
  zero_fragments(part);
  float(*const dst)[NI][4] = BLOCK ? part : acc;
  float b_blk = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // The stage refilled here was consumed in the previous iteration; the barrier above ordered it.
    if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
    cp_async_commit();
    if (BLOCK) b_blk = __ldg(b_scale + (long long)(row_b / k_scale_block) * kblocks + kt);

    const unsigned sa = base + (kt % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 32 bytes of K per step: two 16-byte chunks
      unsigned af[MI][4], bf[NI / 2][4], bf1[DUAL ? NI / 2 : 1][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int r = wm * (BM / 2) + 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
        ldmatrix_x4(sa + r * k_row_bytes + ((c ^ (r & 7)) << 4), af[mi]);
      }
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        const int q = lane >> 3;
        const int r = wn * 32 + 16 * nj + (q >> 1) * 8 + (lane & 7), c = 2 * kk + (q & 1);
        const unsigned off = r * k_row_bytes + ((c ^ (r & 7)) << 4);
        ldmatrix_x4(sb + off, bf[nj]);
        if (DUAL) ldmatrix_x4(sb + B_BYTES + off, bf1[nj]);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          // bf[nj] holds n-block 2 nj in regs 0, 1 (chunks 2 kk, 2 kk + 1) and 2 nj + 1 in 2, 3.
          const unsigned* bq = bf[ni >> 1] + 2 * (ni & 1);
          if (FP8) {
            const unsigned* x = af[mi];
            const unsigned a_lo[4] = {e4m3x2_lo(x[0]), e4m3x2_lo(x[1]), e4m3x2_hi(x[0]), e4m3x2_hi(x[1])};
            const unsigned a_hi[4] = {e4m3x2_lo(x[2]), e4m3x2_lo(x[3]), e4m3x2_hi(x[2]), e4m3x2_hi(x[3])};
            mma_16816<MmaT>(dst[mi][ni], a_lo, e4m3x2_lo(bq[0]), e4m3x2_hi(bq[0]));
            mma_16816<MmaT>(dst[mi][ni], a_hi, e4m3x2_lo(bq[1]), e4m3x2_hi(bq[1]));
          } else {
            mma_16816<MmaT>(dst[mi][ni], af[mi], bq[0], bq[1]);
            if (DUAL) {
              const unsigned* bu = bf1[ni >> 1] + 2 * (ni & 1);
              mma_16816<MmaT>(acc1[mi][ni], af[mi], bu[0], bu[1]);
            }
          }
        }
    }
    if (BLOCK) {
      float sc[MI][2];
      load_block_scales(sc, a_scale, m, kblocks, kt, int(row_a) + wm * (BM / 2));
      promote_block(acc, part, sc, b_blk);
      zero_fragments(part);
    }
  }
  cp_async_wait<0>();

  const int row0 = int(row_a) + wm * (BM / 2), col0 = int(row_b) + wn * 32;
  if (DUAL) {
    store_fragments<TOut, MI, NI>(out, m, n, row0, col0, [&](int mi, int ni, int e) {
      return gemm_activate(ACT, acc[mi][ni][e]) * acc1[mi][ni][e];
    });
  } else {
    // Widened e4m3 carries 2^-8 per operand.
    const float mul = (BLOCK ? 1.0f : __ldg(a_scale) * __ldg(b_scale)) * 65536.0f;
    store_fragments<TOut, MI, NI>(out, m, n, row0, col0, [&](int mi, int ni, int e) { return acc[mi][ni][e] * mul; });
  }
}

}  // namespace gemm
}  // namespace kiln
