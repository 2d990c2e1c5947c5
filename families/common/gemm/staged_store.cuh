// The staged epilogue of the wgmma kernels: a consumer warp's 16 rows of an accumulator tile
// leave through 2 KiB of shared memory, one box of 16 rows x 64 columns (128 bytes of 16-bit
// elements a row) at a time. stmatrix writes the box in the 128-byte swizzle of a tensor map's
// box (conflict-free: the eight rows of each 8 x 8 matrix land in eight different 16-byte bank
// groups), and then either one bulk tensor store copies it out and runs on while the warp moves
// on (stage_box, then bulk_store_box), or the warp's lanes copy it out with plain stores, rows and
// columns clipped (copy_box: an expert's last rows in a grouped GEMM, rows that are not whole
// 16-byte pieces). Storing fragments straight from registers instead (store_fragments) writes
// half of each 32-byte sector per instruction and holds the warp until its stores have left.
#pragma once

#include "common/dtype.cuh"
#include "common/ptx.cuh"

namespace kiln {
namespace gemm {

// Writes fragments ni0 .. ni0 + 7 of the warp's accumulator tile, value(mi, ni, e) as in
// store_fragments (mi 0), to the box at `buf` (1024-byte aligned). The caller makes sure the
// buffer's previous contents have been read (bulk_wait_read by the lane that stored it, then
// __syncwarp; or __syncwarp after copy_box).
template <class TOut, class F>
__device__ __forceinline__ void stage_box(unsigned buf, int ni0, F value) {
  const int lane = threadIdx.x & 31, q = lane >> 3, row = (q & 1) * 8 + (lane & 7);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // Matrices q = 0..3: fragment ni0 + 2j rows 0-7 and 8-15, then fragment ni0 + 2j + 1.
    const int ni = ni0 + 2 * j;
    const unsigned addr = buf + unsigned(row * 128 + (((2 * j + (q >> 1)) ^ (row & 7)) << 4));
    ptx::stmatrix_x4(addr, pack_float2<TOut>(value(0, ni, 0), value(0, ni, 1)),
                     pack_float2<TOut>(value(0, ni, 2), value(0, ni, 3)),
                     pack_float2<TOut>(value(0, ni + 1, 0), value(0, ni + 1, 1)),
                     pack_float2<TOut>(value(0, ni + 1, 2), value(0, ni + 1, 3)));
  }
}

// Stores the staged box to byte column `col_bytes`, row `row` of the map (lane 0 issues; the
// map's bounds clip it), in lane 0's bulk group.
__device__ __forceinline__ void bulk_store_box(unsigned buf, const ptx::TmaDesc* map, int col_bytes, int row) {
  ptx::fence_proxy_async_shared();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    ptx::tma_store_2d(map, col_bytes, row, buf);
    ptx::bulk_commit();
  }
}

// Copies the staged box to out (row-major, n elements a row) at row `row0`, column `col`: its
// first `rows` rows, columns below n; 16-byte pieces when n is a multiple of 8. The warp may
// rewrite the buffer once this returns.
template <class TOut>
__device__ __forceinline__ void copy_box(unsigned buf, TOut* out, long long row0, int rows, int n, int col) {
  const int lane = threadIdx.x & 31;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int p = lane + 32 * i, r = p >> 3, ch = p & 7, c = col + 8 * ch;
    if (r >= rows || c >= n) continue;
    const unsigned src = buf + unsigned(r * 128 + ((ch ^ (r & 7)) << 4));
    TOut* dst = out + (row0 + r) * n + c;
    unsigned v[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(src)
                 : "memory");
    if ((n & 7) == 0) {
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                   : "memory");
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (c + e < n) dst[e].bits = static_cast<unsigned short>(v[e / 2] >> (16 * (e & 1)));
    }
  }
  __syncwarp();
}

// The warp's 16 rows x BN columns (fragments 0 .. BN / 8 - 1 of value) to rows row0 .., columns
// col0 .. of out (n columns), box by box through buf: by bulk tensor stores of the map at row
// map_row when `bulk`, else by the lanes (the first `rows` rows, columns below n).
template <class TOut, int BN, class F>
__device__ __forceinline__ void store_rows_staged(unsigned buf, const ptx::TmaDesc* map, bool bulk, int map_row,
                                                  TOut* out, long long row0, int rows, int n, int col0, F value) {
  static_assert(BN % 64 == 0, "whole 64-column boxes");
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    if (col0 + 64 * c >= n) break;
    if ((threadIdx.x & 31) == 0) ptx::bulk_wait_read<0>();
    __syncwarp();
    stage_box<TOut>(buf, 8 * c, value);
    if (bulk)
      bulk_store_box(buf, map, (col0 + 64 * c) * int(sizeof(TOut)), map_row);
    else
      copy_box<TOut>(buf, out, row0, rows, n, col0 + 64 * c);
  }
}

}  // namespace gemm
}  // namespace kiln
