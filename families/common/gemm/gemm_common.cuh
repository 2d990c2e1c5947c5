// The GEMM core's pieces shared by both arch paths (gemm_mma.cuh for sm_80, gemm_wgmma.cuh for
// sm_90a): C[M, N] = A[M, K] * B[N, K]^T with both operands K-major (rows of K contiguous).
//
// Shared-memory tiles: every stage holds rows of exactly 128 bytes of K (64 f16/bf16 or 128 e4m3
// elements), 16-byte chunk c of row r stored at chunk c ^ (r % 8): the 128-byte swizzle that wgmma
// descriptors name (mode 1) and that makes ldmatrix conflict-free on the mma.sync path. Tiles start
// 1024-byte aligned (one swizzle atom of 8 rows).
//
// Accumulators of both paths have the mma.sync m16n8 layout: fragment (mi, ni) of a warp holds, in
// lane l, rows 16 mi + l / 4 (+8 for elements 2, 3) and columns 8 ni + 2 (l % 4) (+1 for elements
// 1, 3) relative to the warp's origin. wgmma's m64nN accumulator is that layout with one mi per
// warp of the warpgroup. Epilogues and the block-scale promotion work on it for both paths.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"

namespace kiln {
namespace gemm {

typedef unsigned char u8;

// What a kernel computes (the families' KIND): fp8 with one scale per tensor, fp8 with 1x128 (A)
// and 128x128 (B) block scales, the gated MLP act(A Bg^T) * (A Bu^T) in f16/bf16, and a plain
// f16/bf16 A B^T (wgmma only; the fused LoRA runs it with a tail of extra K steps and a bias).
enum Kind { k_fp8_tensor = 0, k_fp8_block = 1, k_gated = 2, k_half = 3 };
enum Act { k_silu = 0, k_gelu = 1 };

template <bool C, class A, class B>
struct Select {
  typedef A type;
};
template <class A, class B>
struct Select<false, A, B> {
  typedef B type;
};

constexpr int k_row_bytes = 128;  // bytes of K per tile row, per stage
constexpr int k_scale_block = 128;

// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (rows or K past the end).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes global -> shared through L1 (block scales: a row's next k-blocks share its sector);
// src_bytes 0 writes zero.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Loads rows [row0, row0 + ROWS) x bytes [kbyte0, kbyte0 + 128) of a K-major matrix with `rows`
// rows of `ld_bytes` (K * element size, a multiple of 16) into the swizzled tile at `dst`, NT
// threads sharing the work. Chunks past either end are zero-filled, so ragged M, N and K need no
// other care in the main loop.
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile(unsigned dst, const u8* src, long long rows, long long ld_bytes,
                                          long long row0, long long kbyte0, int tid) {
#pragma unroll
  for (int i = tid; i < ROWS * 8; i += NT) {
    const int r = i >> 3, c = i & 7;
    const long long gr = row0 + r, gk = kbyte0 + c * 16;
    const bool ok = gr < rows && gk < ld_bytes;
    const u8* p = ok ? src + gr * ld_bytes + gk : src;
    cp_async_16(dst + r * k_row_bytes + ((c ^ (r & 7)) << 4), p, ok ? 16 : 0);
  }
}

// Output tile t of a tiles_m x tiles_n grid in grouped order: GROUP rows of tiles are walked
// column by column, so consecutive CTAs share B tiles and a group's A rows stay in L2.
template <int GROUP>
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int width = GROUP * tiles_n;
  const int first_m = (t / width) * GROUP;
  const int gsize = min(tiles_m - first_m, GROUP);
  const int in_group = t % width;
  tm = first_m + in_group % gsize;
  tn = in_group / gsize;
}

__device__ __forceinline__ float gemm_activate(int act, float v) {
  if (act == k_silu) return v / (1.0f + __expf(-v));
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

// Stores accumulator fragments: value(mi, ni, e) for the element at (row0 + 16 mi + ..., col0 +
// 8 ni + ...) of the m16n8 layout, rows below m and columns below n only. Pairs of columns go out
// as one 4-byte store when n is even (every pair then starts 4-byte aligned).
template <class TOut, int MI, int NI, class F>
__device__ __forceinline__ void store_fragments(TOut* out, int m, int n, int row0, int col0, F value) {
  const int lane = threadIdx.x & 31;
  const bool pairs = (n & 1) == 0;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * mi + (lane >> 2) + 8 * h;
      if (row >= m) continue;
      TOut* orow = out + (long long)row * n;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = col0 + 8 * ni + 2 * (lane & 3);
        const TOut v0 = from_float<TOut>(value(mi, ni, 2 * h)), v1 = from_float<TOut>(value(mi, ni, 2 * h + 1));
        if (pairs && col + 1 < n) {
          Pack<TOut, 2> p;
          p.v[0] = v0;
          p.v[1] = v1;
          store_pack<TOut, 2>(orow + col, p);
        } else {
          if (col < n) orow[col] = v0;
          if (col + 1 < n) orow[col + 1] = v1;
        }
      }
    }
}

// Block-scaled fp8, the DeepSeek-V3 promotion of the tensor-core partial sums to fp32 every 128 of
// K: acc += part * a_scale[row, kb] * b_scale for the k-block kb just finished. a_scale is
// [m, kblocks] row-major; b_scale is the one scale of the tile's 128-column block. The a scales
// of a thread's rows are loaded apart from their use (and multiplied only there), so a kernel can
// fetch the next k-block's a whole stage before it needs them.
template <int MI>
__device__ __forceinline__ void load_block_scales(float (&s)[MI][2], const float* a_scale, int m, int kblocks, int kb,
                                                  int row0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * mi + (lane >> 2) + 8 * h;
      s[mi][h] = row < m ? __ldg(a_scale + (long long)row * kblocks + kb) : 0.0f;
    }
}

template <int MI, int NI>
__device__ __forceinline__ void promote_block(float (&acc)[MI][NI][4], float (&part)[MI][NI][4],
                                              const float (&sa)[MI][2], float b_scale) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s = sa[mi][h] * b_scale;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        acc[mi][ni][2 * h] += part[mi][ni][2 * h] * s;
        acc[mi][ni][2 * h + 1] += part[mi][ni][2 * h + 1] * s;
      }
    }
}

// The wgmma path's promotion for one 64-row fragment set, with the tile's columns in up to two
// 128-column scale blocks: acc += part * sc[h][j], j = 0 for column groups ni < n1 and 1 after.
// n1 is uniform over the tile; each value it can take gets its own unrolled loop (compile-time
// selects: a run-time compare per column group would double the promotion's instructions).
template <int NI, int N1>
__device__ __forceinline__ void promote_cols(float (&acc)[1][NI][4], float (&part)[1][NI][4], const float (&sc)[2][2]) {
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][ni][e] += part[0][ni][e] * sc[e >> 1][ni < N1 ? 0 : 1];
}
template <int NI, int STEP, int N1>
__device__ __forceinline__ void promote_dispatch(float (&acc)[1][NI][4], float (&part)[1][NI][4], const float (&sc)[2][2],
                                                 int n1) {
  if constexpr (N1 <= STEP) {
    promote_cols<NI, N1>(acc, part, sc);
  } else {
    if (n1 == N1)
      promote_cols<NI, N1>(acc, part, sc);
    else
      promote_dispatch<NI, STEP, N1 - STEP>(acc, part, sc, n1);
  }
}
// BN <= 128 (BN divides 128): one scale block. Otherwise n1 = (128 - col0 % 128) / 8 column
// groups in the first block, a multiple of STEP = gcd(BN, 128) / 8 (col0 is a multiple of BN).
template <int BN>
__device__ __forceinline__ void promote_split(float (&acc)[1][BN / 8][4], float (&part)[1][BN / 8][4],
                                              const float (&sc)[2][2], int n1) {
  constexpr int NI = BN / 8;
  if constexpr (BN <= k_scale_block) {
    promote_cols<NI, NI>(acc, part, sc);
  } else {
    constexpr int G = BN % 128 == 0 ? 128 : BN % 64 == 0 ? 64 : BN % 32 == 0 ? 32 : BN % 16 == 0 ? 16 : 8;
    promote_dispatch<NI, G / 8, 16>(acc, part, sc, n1);
  }
}

template <int MI, int NI>
__device__ __forceinline__ void zero_fragments(float (&acc)[MI][NI][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
}

// The arguments every GEMM kernel takes, in this order (families' pack_args):
//   a [m, k], b0 [n, k], b1 [n, k] (gated: the up projection; else unused), a_scale, b_scale
//   (fp8: f32, one value each or the block grids; gated: unused), out [m, n] (row-major),
//   m, n, k (elements), tiles_m, tiles_n.
#define KILN_GEMM_PARAMS                                                                                  \
  const u8 *__restrict__ a, const u8 *__restrict__ b0, const u8 *__restrict__ b1,                         \
      const float *__restrict__ a_scale, const float *__restrict__ b_scale, TOut *__restrict__ out, int m, \
      int n, int k, int tiles_m, int tiles_n

}  // namespace gemm
}  // namespace kiln
