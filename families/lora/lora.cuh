// Fused LoRA on the GEMM core's pieces (families/common/gemm/).
//
// out = x W^T + [s (x A^T)] B^T + bias, computed as one GEMM over a longer K:
//   [x | t] @ [W | B]^T,  t = s x A^T (M x rank),
// so the low-rank term lands in the base GEMM's accumulators and the output is written once.
//
// The kernels:
//  - lora_shrink_mma: u = x A^T in fp32 (tensor cores, mma.sync), written as `splits` partial
//    sums over ranges of K (u [splits, m, slices * rp], rp = rank rounded up to 8), so small-M
//    calls spread over the SMs. Deterministic: no atomics. Or (TOUT) t = scale x A^T itself.
//  - lora_gemm_{mma,wgmma}: the base GEMM's K loop over x and W (cp.async / TMA into the core's
//    128-byte swizzled stages), then "tail" stages of 64 rank columns each: the A side of a tail
//    stage is t = scale * (sum of u's partials, in split order) rounded to the operand type, the B
//    side rows of the adapter's B. Bias in the epilogue.
//  - lora_gemm_core (sm_90a, one adapter): the GEMM core's kernel with its tail k-steps loaded by
//    TMA from the shrink's t and B.
//
// Adapters (multi-adapter serving, Punica / S-LoRA style): `idx` [m] gives each row's adapter
// (null: every row uses adapter 0; an index outside [0, adapters), -1 included, means none). A is
// [adapters, slices * r, k], B [adapters, n, r], ranks [adapters] (null: r; each clamped to [0, r])
// and scales [adapters] f32 (null: scale0). Slices (merged QKV, gate_up): output columns
// [lo(s), hi(s)) belong to slice s, whose low-rank product uses rows [s r, s r + rank) of A. A tile
// of rows runs one tail pass per distinct adapter among its rows (ascending), per slice its
// columns touch, per 64 rank columns; rows of other adapters and columns of other slices load as
// zeros. Sorted or segmented rows (prefill) give one adapter per tile; a decode batch of mixed
// adapters costs one tail pass per adapter present, reading only that adapter's A and B: no sort,
// no gather of weights, no per-adapter launch.
#pragma once

#include "common/gemm/gemm_mma.cuh"
#include "common/gemm/gemm_wgmma.cuh"

namespace kiln {
namespace lora {

using gemm::u8;

constexpr int k_none = 0x7fffffff;
constexpr int k_chunk = 64;  // rank columns per tail stage (128 bytes of f16/bf16)

__device__ __forceinline__ int adapter_of(const int* idx, int row, int adapters) {
  if (!idx) return 0;
  const int a = __ldg(idx + row);
  return a >= 0 && a < adapters ? a : -1;
}

// The smallest adapter above `prev` among rows [row0, row0 + rows) below m, for the whole warp
// (every lane must call); k_none when there is none.
__device__ __forceinline__ int next_adapter(const int* idx, int adapters, int row0, int rows, int m, int prev) {
  if (!idx) return prev < 0 && row0 < m ? 0 : k_none;
  const int lane = threadIdx.x & 31;
  int best = k_none;
  for (int r = lane; r < rows && row0 + r < m; r += 32) {
    const int a = adapter_of(idx, row0 + r, adapters);
    if (a > prev && a < best) best = a;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
  return best;
}

__device__ __forceinline__ void st_shared_v4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The low-rank side of a lora_gemm launch.
template <class T>
struct Tail {
  const float* u;
  const T* b;
  const int* idx;
  const int* ranks;
  const float* scales;
  int m, n, r, adapters, slices, n1, n2, splits;
  float scale0;

  __device__ __forceinline__ int rp() const { return (r + 7) & ~7; }
  __device__ __forceinline__ int rank(int a) const { return ranks ? min(max(__ldg(ranks + a), 0), r) : r; }
  __device__ __forceinline__ float scale(int a) const { return scales ? __ldg(scales + a) : scale0; }
  __device__ __forceinline__ int lo(int s) const { return s == 0 ? 0 : s == 1 ? n1 : n2; }
  __device__ __forceinline__ int hi(int s) const { return s + 1 >= slices ? n : s == 0 ? n1 : n2; }
  __device__ __forceinline__ bool hits(int s, int col0, int cols) const {
    return lo(s) < col0 + cols && hi(s) > col0 && lo(s) < hi(s);
  }
};

// One tail stage: adapter a, slice s, rank columns [r0, r0 + 64).
struct TailIter {
  int a = -1, s = 0, r0 = 0;
};

// Advances `it` to the tile's next tail stage (rows [row0, row0 + rows), columns [col0, col0 +
// cols)); false when there is none. Every lane of the warp must call.
template <class T>
__device__ __forceinline__ bool tail_next(TailIter& it, const Tail<T>& t, int row0, int rows, int col0, int cols) {
  if (it.a >= 0) {
    it.r0 += k_chunk;
    if (it.r0 < t.rank(it.a)) return true;
    for (int s = it.s + 1; s < t.slices; ++s)
      if (t.hits(s, col0, cols)) {
        it.s = s;
        it.r0 = 0;
        return true;
      }
  }
  for (;;) {
    const int a = next_adapter(t.idx, t.adapters, row0, rows, t.m, it.a);
    if (a == k_none) return false;
    it.a = a;
    if (t.rank(a) <= 0) continue;
    for (int s = 0; s < t.slices; ++s)
      if (t.hits(s, col0, cols)) {
        it.s = s;
        it.r0 = 0;
        return true;
      }
    return false;
  }
}

template <class T>
__device__ __forceinline__ int tail_count(const Tail<T>& t, int row0, int rows, int col0, int cols) {
  TailIter it;
  int c = 0;
  while (tail_next(it, t, row0, rows, col0, cols)) ++c;
  return c;
}

__device__ __forceinline__ unsigned pair_bits(unsigned short lo, unsigned short hi) {
  return unsigned(lo) | (unsigned(hi) << 16);
}

// Eight values as one 16-byte row chunk of T, element 0 in the low half of .x.
template <class T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  unsigned short b[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) b[e] = from_float<T>(v[e]).bits;
  return make_uint4(pair_bits(b[0], b[1]), pair_bits(b[2], b[3]), pair_bits(b[4], b[5]), pair_bits(b[6], b[7]));
}

// Writes tail stage `it` into the swizzled tiles at dst_a (ROWS_A rows of t) and dst_b (ROWS_B rows
// of B), NT threads sharing the work with plain loads and shared stores (a rank need not make
// 16-byte rows, and t is summed from fp32 partials on the way). Loads are batched ahead of their
// stores (BATCH chunks of B, BATCH_A of t a thread): the loads, not the stores, are what a tail
// stage waits on. Deeper batches spill in the wgmma producer's 56 registers.
template <class T, int ROWS_A, int ROWS_B, int NT>
__device__ __forceinline__ void load_tail(unsigned dst_a, unsigned dst_b, const Tail<T>& t, const TailIter& it,
                                          int row0, int col0, int tid) {
  constexpr int BATCH = 2, BATCH_A = 1;
  const int rank = t.rank(it.a), rp = t.rp();
  const float sc = t.scale(it.a);
  const int ucols = t.slices * rp;
  const long long split_stride = (long long)t.m * ucols;
#pragma unroll 1
  for (int i0 = tid; i0 < ROWS_A * 8; i0 += BATCH_A * NT) {
    float v[BATCH_A][8];
#pragma unroll
    for (int q = 0; q < BATCH_A; ++q) {
      const int i = i0 + q * NT, r = i >> 3, c = i & 7;
      const int row = row0 + r, rr = it.r0 + 8 * c;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[q][e] = 0.0f;
      if (i < ROWS_A * 8 && row < t.m && rr < rank && adapter_of(t.idx, row, t.adapters) == it.a) {
        const float* p = t.u + (long long)row * ucols + it.s * rp + rr;
#pragma unroll 1
        for (int z = 0; z < t.splits; ++z, p += split_stride) {
          const float4 lo = __ldg(reinterpret_cast<const float4*>(p)), hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
          v[q][0] += lo.x;
          v[q][1] += lo.y;
          v[q][2] += lo.z;
          v[q][3] += lo.w;
          v[q][4] += hi.x;
          v[q][5] += hi.y;
          v[q][6] += hi.z;
          v[q][7] += hi.w;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) v[q][e] = rr + e < rank ? v[q][e] * sc : 0.0f;
      }
    }
#pragma unroll
    for (int q = 0; q < BATCH_A; ++q) {
      const int i = i0 + q * NT, r = i >> 3, c = i & 7;
      if (i < ROWS_A * 8) st_shared_v4(dst_a + r * gemm::k_row_bytes + ((c ^ (r & 7)) << 4), pack8<T>(v[q]));
    }
  }
  const int lo = t.lo(it.s), hi = t.hi(it.s);
  const bool vec = (t.r & 7) == 0;
  const T* bb = t.b + (long long)it.a * t.n * t.r;
#pragma unroll 1
  for (int i0 = tid; i0 < ROWS_B * 8; i0 += BATCH * NT) {
    uint4 w[BATCH];
#pragma unroll
    for (int q = 0; q < BATCH; ++q) {
      const int i = i0 + q * NT, r = i >> 3, c = i & 7;
      const int col = col0 + r, rr = it.r0 + 8 * c;
      w[q] = make_uint4(0u, 0u, 0u, 0u);
      if (i < ROWS_B * 8 && col >= lo && col < hi && rr < rank) {
        const T* p = bb + (long long)col * t.r + rr;
        if (vec) {
          w[q] = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
          unsigned short e8[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) e8[e] = rr + e < rank ? p[e].bits : (unsigned short)0;
          w[q] = make_uint4(pair_bits(e8[0], e8[1]), pair_bits(e8[2], e8[3]), pair_bits(e8[4], e8[5]),
                            pair_bits(e8[6], e8[7]));
        }
      }
    }
#pragma unroll
    for (int q = 0; q < BATCH; ++q) {
      const int i = i0 + q * NT, r = i >> 3, c = i & 7;
      if (i >= ROWS_B * 8) continue;
      // Elements past the rank (a rank that is not a multiple of 8) read as zeros.
      const int keep = rank - (it.r0 + 8 * c);
      uint4 x = w[q];
      if (vec && keep < 8) {
        x.x = keep >= 2 ? x.x : keep == 1 ? (x.x & 0xffffu) : 0u;
        x.y = keep >= 4 ? x.y : keep == 3 ? (x.y & 0xffffu) : 0u;
        x.z = keep >= 6 ? x.z : keep == 5 ? (x.z & 0xffffu) : 0u;
        x.w = keep == 7 ? (x.w & 0xffffu) : 0u;
      }
      st_shared_v4(dst_b + r * gemm::k_row_bytes + ((c ^ (r & 7)) << 4), x);
    }
  }
}

// ---- shrink: u[z] = x A^T over K range z, fp32 ----

// Grid: x = row tiles x column tiles of u (BN columns of the slices * rp), y = splits. 2 x BN/32
// warps, each a (BM/2) x 32 piece (gemm_mma.cuh's layout). Each distinct adapter among the tile's
// rows is one pass over the split's K range with the other rows loaded as zeros; passes
// accumulate into the same fragments (their rows are disjoint). A's rows past an adapter's rank
// load as zeros, so u is zero there.
//
// A stage holds KSUB k-steps (128 bytes of K each, in the core's swizzled tiles): each row of x is
// read KSUB x 128 contiguous bytes at a time. The shrink is a read of x, and 128-byte pieces of 64
// rows per stage leave DRAM far below its bandwidth.
//
// TOUT: the fused GEMM's operand itself, t = scale0 (x A^T) rounded to T, in one split, each
// slice's rank columns padded with zeros to whole 64-column chunks (t [m, slices * chunks * 64]):
// lora_gemm_core loads its rank tail from it by TMA.
template <class T, int BM, int BN, int STAGES, bool TOUT, int KSUB>
__global__ void __launch_bounds__(2 * BN)
    lora_shrink_mma(const T* __restrict__ x, const T* __restrict__ a, const int* __restrict__ idx,
                    const int* __restrict__ ranks, void* __restrict__ u_out, int m, int k, int r, int adapters,
                    int slices, int splits, float scale0) {
  using namespace gemm;
  constexpr int NT = 2 * BN, WN = BN / 32, MI = BM / 32, NI = 4;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes, SUB_BYTES = A_BYTES + B_BYTES,
                STAGE_BYTES = KSUB * SUB_BYTES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int row_ad[BM], passes[BM + 1];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  const int rp = TOUT ? (r + k_chunk - 1) / k_chunk * k_chunk : (r + 7) & ~7, ucols = slices * rp;
  const int tiles_c = (ucols + BN - 1) / BN;
  const int tm = blockIdx.x / tiles_c, tc = blockIdx.x % tiles_c, z = blockIdx.y;
  const int row0 = tm * BM, c0 = tc * BN;
  const long long ld = (long long)k * sizeof(T);
  const int ktiles = int((ld + k_row_bytes - 1) / k_row_bytes);
  const int kt0 = int((long long)ktiles * z / splits), nk = int((long long)ktiles * (z + 1) / splits) - kt0;

  for (int i = tid; i < BM; i += NT) row_ad[i] = row0 + i < m ? adapter_of(idx, row0 + i, adapters) : -1;
  if (warp == 0) {
    int prev = -1, c = 0;
    for (;;) {
      prev = next_adapter(idx, adapters, row0, BM, m, prev);
      if (prev == k_none) break;
      if (lane == 0) passes[c] = prev;
      ++c;
    }
    if (lane == 0) passes[BM] = c;
  }
  __syncthreads();
  // Stages per pass (KSUB k-steps each; a stage never spans two passes), and stages in all.
  const int per_pass = (nk + KSUB - 1) / KSUB;
  const int steps = passes[BM] * per_pass;
  const u8* xb = reinterpret_cast<const u8*>(x);
  const u8* ab = reinterpret_cast<const u8*>(a);
  // The end of this split's K range in bytes (the last stage of a pass may run past it).
  const long long kend = min((long long)(kt0 + nk) * k_row_bytes, ld);

  // Stage j: its k-step q in sub-tile q; a row's 16-byte chunks go to consecutive threads, so each
  // row is read KSUB x 128 contiguous bytes.
  auto load_stage = [&](int j) {
    const unsigned st = base + (j % STAGES) * STAGE_BYTES;
    const int ad = passes[j / per_pass];
    const int rank = ranks ? min(max(__ldg(ranks + ad), 0), r) : r;
    const long long kb = (long long)(kt0 + (j % per_pass) * KSUB) * k_row_bytes;
#pragma unroll
    for (int i = tid; i < BM * 8 * KSUB; i += NT) {
      const int rr = i / (8 * KSUB), q = (i / 8) % KSUB, c = i & 7;
      const long long gk = kb + q * k_row_bytes + c * 16;
      const bool ok = row_ad[rr] == ad && gk < kend;
      cp_async_16(st + q * SUB_BYTES + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), ok ? xb + (row0 + rr) * ld + gk : xb,
                  ok ? 16 : 0);
    }
#pragma unroll
    for (int i = tid; i < BN * 8 * KSUB; i += NT) {
      const int rr = i / (8 * KSUB), q = (i / 8) % KSUB, c = i & 7;
      const int col = c0 + rr, s = col / rp, qq = col - s * rp;
      const long long gk = kb + q * k_row_bytes + c * 16;
      const bool ok = s < slices && qq < rank && gk < kend;
      const u8* p = ok ? ab + ((long long)ad * slices * r + s * r + qq) * ld + gk : ab;
      cp_async_16(st + q * SUB_BYTES + A_BYTES + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), p, ok ? 16 : 0);
    }
  };

  float acc[MI][NI][4];
  zero_fragments(acc);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_stage(s);
    cp_async_commit();
  }
  for (int j = 0; j < steps; ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (j + STAGES - 1 < steps) load_stage(j + STAGES - 1);
    cp_async_commit();
#pragma unroll
    for (int kq = 0; kq < 4 * KSUB; ++kq) {
      const int kk = kq & 3;
      const unsigned sa = base + (j % STAGES) * STAGE_BYTES + (kq >> 2) * SUB_BYTES, sb = sa + A_BYTES;
      unsigned af[MI][4], bf[NI / 2][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int rr = wm * (BM / 2) + 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
        ldmatrix_x4(sa + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), af[mi]);
      }
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        const int q = lane >> 3;
        const int rr = wn * 32 + 16 * nj + (q >> 1) * 8 + (lane & 7), c = 2 * kk + (q & 1);
        ldmatrix_x4(sb + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), bf[nj]);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const unsigned* bq = bf[ni >> 1] + 2 * (ni & 1);
          mma_16816<T>(acc[mi][ni], af[mi], bq[0], bq[1]);
        }
    }
  }
  cp_async_wait<0>();
  if constexpr (TOUT)
    store_fragments<T, MI, NI>(static_cast<T*>(u_out), m, ucols, row0 + wm * (BM / 2), c0 + wn * 32,
                               [&](int mi, int ni, int e) { return acc[mi][ni][e] * scale0; });
  else
    store_fragments<float, MI, NI>(static_cast<float*>(u_out) + (long long)z * m * ucols, m, ucols,
                                   row0 + wm * (BM / 2), c0 + wn * 32, [&](int mi, int ni, int e) { return acc[mi][ni][e]; });
}

// ---- the fused GEMM ----

// The arguments of both paths, in this order.
#define KILN_LORA_GEMM_PARAMS                                                                                   \
  const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ b, const float *__restrict__ u,       \
      const int *__restrict__ idx, const int *__restrict__ ranks, const float *__restrict__ scales,              \
      const T *__restrict__ bias, T *__restrict__ out, int m, int n, int k, int r, int adapters, int slices, int n1, \
      int n2, int splits, float scale0

// The epilogue of both paths: acc + bias[col], rows below m and columns below n.
template <class T, int MI, int NI, class Acc>
__device__ __forceinline__ void store_out(T* out, const T* bias, int m, int n, int row0, int col0, Acc acc) {
  const int lane = threadIdx.x & 31;
  gemm::store_fragments<T, MI, NI>(out, m, n, row0, col0, [&](int mi, int ni, int e) {
    const int col = col0 + 8 * ni + 2 * (lane & 3) + (e & 1);
    return acc(mi, ni, e) + (bias && col < n ? to_float(bias[col]) : 0.0f);
  });
}

// sm_80 and later: gemm_mma.cuh's CTA per output tile (grouped order), 2 x BN/32 warps, a
// STAGES-deep cp.async ring whose steps are the K loop over x and W, then the tile's tail stages
// (written by every thread with load_tail; the ring's barrier orders them like the copies).
template <class T, int BM, int BN, int STAGES>
__global__ void __launch_bounds__(2 * BN, 1) lora_gemm_mma(KILN_LORA_GEMM_PARAMS) {
  using namespace gemm;
  constexpr int NT = 2 * BN, WN = BN / 32, MI = BM / 32, NI = 4;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes, STAGE_BYTES = A_BYTES + B_BYTES;
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / WN, wn = warp % WN;
  const long long ld = (long long)k * sizeof(T);
  const int ktiles = int((ld + k_row_bytes - 1) / k_row_bytes);
  const int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
  int tm, tn;
  tile_coords<8>(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const int row_a = tm * BM, row_b = tn * BN;
  const Tail<T> tail{u, b, idx, ranks, scales, m, n, r, adapters, slices, n1, n2, splits, scale0};
  const int steps = ktiles + tail_count(tail, row_a, BM, row_b, BN);
  TailIter it;

  auto load_stage = [&](int j) {
    const unsigned s = base + (j % STAGES) * STAGE_BYTES;
    if (j < ktiles) {
      const long long kb = (long long)j * k_row_bytes;
      load_tile<BM, NT>(s, reinterpret_cast<const u8*>(x), m, ld, row_a, kb, tid);
      load_tile<BN, NT>(s + A_BYTES, reinterpret_cast<const u8*>(w), n, ld, row_b, kb, tid);
    } else {
      tail_next(it, tail, row_a, BM, row_b, BN);
      load_tail<T, BM, BN, NT>(s, s + A_BYTES, tail, it, row_a, row_b, tid);
    }
  };

  float acc[MI][NI][4];
  zero_fragments(acc);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_stage(s);
    cp_async_commit();
  }
  for (int j = 0; j < steps; ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (j + STAGES - 1 < steps) load_stage(j + STAGES - 1);
    cp_async_commit();
    const unsigned sa = base + (j % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned af[MI][4], bf[NI / 2][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int rr = wm * (BM / 2) + 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
        ldmatrix_x4(sa + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), af[mi]);
      }
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        const int q = lane >> 3;
        const int rr = wn * 32 + 16 * nj + (q >> 1) * 8 + (lane & 7), c = 2 * kk + (q & 1);
        ldmatrix_x4(sb + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), bf[nj]);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const unsigned* bq = bf[ni >> 1] + 2 * (ni & 1);
          mma_16816<T>(acc[mi][ni], af[mi], bq[0], bq[1]);
        }
    }
  }
  cp_async_wait<0>();
  store_out<T, MI, NI>(out, bias, m, n, row_a + wm * (BM / 2), row_b + wn * 32,
                       [&](int mi, int ni, int e) { return acc[mi][ni][e]; });
}

__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// sm_90a: grouped_wgmma's warp-specialized ring (persistent grid, TMA for x and W, one `full` and
// one `empty` mbarrier per stage), the ring running on from a tile's K loop into its tail stages.
// The producer warpgroup writes each tail stage with load_tail (128 threads), makes the writes visible to
// wgmma (fence.proxy.async), and arrives on the stage's `full` barrier without a byte count. The
// consumers count the tile's tail stages with the same iterator.
template <class T, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    lora_gemm_wgmma(KILN_LORA_GEMM_PARAMS, const __grid_constant__ ptx::TmaDesc map_x,
                    const __grid_constant__ ptx::TmaDesc map_w) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace gemm;
  constexpr int CONSUMERS = BM / 64, NI = BN / 8;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes, STAGE_BYTES = A_BYTES + B_BYTES;
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
  const int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN, units = tiles_m * tiles_n;
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
  const int ktiles = int(((long long)k * sizeof(T) + k_row_bytes - 1) / k_row_bytes);
  const Tail<T> tail{u, b, idx, ranks, scales, m, n, r, adapters, slices, n1, n2, splits, scale0};

  if (threadIdx.x == 0)
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(full + 8 * s, 1);
      ptx::mbar_init(empty + 8 * s, CONSUMERS * 128);
    }
  __syncthreads();

  if (wg == CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
    // Warp 0 issues the K loop's copies; the tail stages are written by the whole warpgroup, which
    // then meets at named barrier 2 before one thread marks the stage full.
    const int ptid = threadIdx.x - CONSUMERS * 128;
    int it = 0;
    for (int uu = blockIdx.x; uu < units; uu += gridDim.x) {
      int tm, tn;
      tile_coords<8>(uu, tiles_m, tiles_n, tm, tn);
      const int row0 = tm * BM, col0 = tn * BN;
      if (ptid < 32) {
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
          const unsigned st = base + s * STAGE_BYTES, bar = full + 8 * s;
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(bar, STAGE_BYTES);
            ptx::tma_load_2d(st, &map_x, kt * k_row_bytes, row0, bar);
            ptx::tma_load_2d(st + A_BYTES, &map_w, kt * k_row_bytes, col0, bar);
          }
          __syncwarp();
        }
      } else {
        it += ktiles;
      }
      // The other warps wait here for warp 0 to have issued the K loop: having waited on those
      // stages' `empty` barriers, it leaves each barrier at most one phase behind the tail's wait,
      // which the parity test needs (warps that ran ahead could read an older phase as complete).
      ptx::bar_sync<2, 128>();
      TailIter ti;
      while (tail_next(ti, tail, row0, BM, col0, BN)) {
        const int s = it % STAGES;
        if (it >= STAGES) ptx::mbar_wait(empty + 8 * s, ((it / STAGES) + 1) & 1);
        const unsigned st = base + s * STAGE_BYTES;
        load_tail<T, BM, BN, 128>(st, st + A_BYTES, tail, ti, row0, col0, ptid);
        fence_proxy_async();
        ptx::bar_sync<2, 128>();
        if (ptid == 0) ptx::mbar_arrive(full + 8 * s);
        ++it;
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMERS == 1 ? 240 : 224));
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  float acc[1][NI][4];
  auto issue_stage = [&](unsigned st, int accumulate) {
    const unsigned long long da = smem_desc(st + wg * 64 * k_row_bytes), db = smem_desc(st + A_BYTES);
    fence_fragments(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) Wgmma<T, BN>::run(acc, da + 2 * kk, db + 2 * kk, accumulate || kk > 0);
    wgmma_commit();
  };
  int it = 0;
  for (int uu = blockIdx.x; uu < units; uu += gridDim.x) {
    int tm, tn;
    tile_coords<8>(uu, tiles_m, tiles_n, tm, tn);
    const int steps = ktiles + tail_count(tail, tm * BM, BM, tn * BN, BN);
    for (int j = 0; j < steps; ++j, ++it) {
      const int s = it % STAGES;
      ptx::mbar_wait(full + 8 * s, (it / STAGES) & 1);
      issue_stage(base + s * STAGE_BYTES, j > 0);
      wgmma_wait<1>();
      fence_fragments(acc);
      if (j > 0) ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_fragments(acc);
    ptx::mbar_arrive(empty + 8 * ((it - 1) % STAGES));
    store_out<T, 1, NI>(out, bias, m, n, tm * BM + wg * 64 + warp_in_wg * 16, tn * BN,
                        [&](int, int ni, int e) { return acc[0][ni][e]; });
  }
#endif
}

// sm_90a, one adapter: the GEMM core's kernel (gemm_wgmma.cuh: persistent, warp-specialized, TMA)
// over x and W, its K loop running on into the rank tail: `chunks` more k-steps per tile whose A
// box is t's (the shrink's TOUT output) and whose B box is the tile's rows of B at the chunk's
// columns (B [n, r]: the copy engine reads zeros past column r). A column tile lies in one slice
// (the host keeps the slice ends on tile boundaries), so its tail is its slice's chunks of t.
template <class T>
struct CoreTail {
  const ptx::TmaDesc* map_t;
  const ptx::TmaDesc* map_b;
  const T* bias_ptr;
  int n, n1, n2, slices, chunks, bn;

  __device__ __forceinline__ int steps(int) const { return chunks; }
  __device__ __forceinline__ void step(int j, int tn, const ptx::TmaDesc*& ma, int& a_col, const ptx::TmaDesc*& mb,
                                       int& b_col, int&) const {
    const int col0 = tn * bn;
    const int s = slices > 2 && col0 >= n2 ? 2 : slices > 1 && col0 >= n1 ? 1 : 0;
    ma = map_t;
    a_col = (s * chunks + j) * gemm::k_row_bytes;
    mb = map_b;
    b_col = j * gemm::k_row_bytes;
  }
  __device__ __forceinline__ float bias(int col) const {
    return bias_ptr && col < n ? to_float(bias_ptr[col]) : 0.0f;
  }
};

template <class T, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    lora_gemm_core(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ out,
                   int m, int n, int k, int n1, int n2, int slices, int chunks,
                   const __grid_constant__ ptx::TmaDesc map_x, const __grid_constant__ ptx::TmaDesc map_w,
                   const __grid_constant__ ptx::TmaDesc map_t, const __grid_constant__ ptx::TmaDesc map_b) {
  const CoreTail<T> tail{&map_t, &map_b, bias, n, n1, n2, slices, chunks, BN};
  gemm::gemm_wgmma_body<gemm::k_half, T, T, 0, BM, BN, STAGES, 8, 1, 1, CoreTail<T>>(
      reinterpret_cast<const u8*>(x), reinterpret_cast<const u8*>(w), nullptr, nullptr, nullptr, out, m, n, k,
      (m + BM - 1) / BM, (n + BN - 1) / BN, map_x, map_w, map_w, tail);
}

}  // namespace lora
}  // namespace kiln
