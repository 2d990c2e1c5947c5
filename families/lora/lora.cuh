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

// lora_gemm launches as a programmatic dependent of the kernel before it (LoraGemm's
// programmatic_launch): it may start while lora_shrink runs, and waits (ptx::grid_dependency_wait),
// before it reads or writes anything (the decode kernel first prefetches W into L2, which changes
// nothing), until the shrink has finished and its writes are visible. The shrink lets its dependent
// launch at once (ptx::launch_dependents).

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
// Passes over the grid's z dimension: block z takes passes z, z + Z, ... (Z = gridDim.z) and stores
// only the rows of its passes' adapters (block 0 also the rows with no adapter, zeros), so a
// decode batch of many adapters spreads over more SMs; every row is still one pass's sum over
// the same k-steps, so u does not depend on Z.
//
// TOUT: the fused GEMM's operand itself, t = scale0 (x A^T) rounded to T, in one split, each
// slice's rank columns padded with zeros to whole 64-column chunks (t [m, slices * chunks * 64]):
// lora_gemm_core loads its rank tail from it by TMA.
template <class T, int BM, int BN, int STAGES, bool TOUT, int KSUB, int WM>
__global__ void __launch_bounds__(WM * BN)
    lora_shrink_mma(const T* __restrict__ x, const T* __restrict__ a, const int* __restrict__ idx,
                    const int* __restrict__ ranks, void* __restrict__ u_out, int m, int k, int r, int adapters,
                    int slices, int splits, float scale0) {
  using namespace gemm;
  ptx::launch_dependents();
  constexpr int NT = WM * BN, WN = BN / 32, MI = BM / (16 * WM), NI = 4;
  constexpr int A_BYTES = BM * k_row_bytes, B_BYTES = BN * k_row_bytes, SUB_BYTES = A_BYTES + B_BYTES,
                STAGE_BYTES = KSUB * SUB_BYTES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int row_ad[BM], passes[BM + 1];
  __shared__ bool mine[BM];
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
  const int pz = blockIdx.z, pstride = gridDim.z, count = passes[BM];
  if constexpr (!TOUT) {
    for (int i = tid; i < BM; i += NT) {
      int p = 0;
      while (p < count && passes[p] != row_ad[i]) ++p;
      mine[i] = row_ad[i] < 0 ? pz == 0 : p % pstride == pz;
    }
    __syncthreads();
  }
  // Stages per pass (KSUB k-steps each; a stage never spans two passes), and stages in all.
  const int per_pass = (nk + KSUB - 1) / KSUB;
  const int steps = (count > pz ? (count - pz + pstride - 1) / pstride : 0) * per_pass;
  const u8* xb = reinterpret_cast<const u8*>(x);
  const u8* ab = reinterpret_cast<const u8*>(a);
  // The end of this split's K range in bytes (the last stage of a pass may run past it).
  const long long kend = min((long long)(kt0 + nk) * k_row_bytes, ld);

  // Stage j: its k-step q in sub-tile q; a row's 16-byte chunks go to consecutive threads, so each
  // row is read KSUB x 128 contiguous bytes.
  auto load_stage = [&](int j) {
    const unsigned st = base + (j % STAGES) * STAGE_BYTES;
    const int ad = passes[pz + (j / per_pass) * pstride];
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
        const int rr = wm * (BM / WM) + 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
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
    store_fragments<T, MI, NI>(static_cast<T*>(u_out), m, ucols, row0 + wm * (BM / WM), c0 + wn * 32,
                               [&](int mi, int ni, int e) { return acc[mi][ni][e] * scale0; });
  else {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rr = wm * (BM / WM) + 16 * mi + (lane >> 2) + 8 * h;
        if (row0 + rr >= m || !mine[rr]) continue;
        float* urow = static_cast<float*>(u_out) + ((long long)z * m + row0 + rr) * ucols;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int col = c0 + wn * 32 + 8 * ni + 2 * (lane & 3);  // ucols is even
          if (col < ucols) *reinterpret_cast<float2*>(urow + col) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
      }
  }
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
  ptx::grid_dependency_wait();
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
  ptx::grid_dependency_wait();
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

// sm_90, decode-sized calls: split-K over a thread-block cluster, the low-rank term on CUDA cores.
// CTA `krank` of a SPLIT-wide cluster takes k-steps [krank ktiles / SPLIT, (krank + 1) ktiles /
// SPLIT) of one BM x BN output tile, so a few rows of x stream W over tiles x SPLIT CTAs instead
// of one CTA per tile. Warps 0-3 run the K loop (side by side along N, each every row of the tile,
// in mma.sync m16n8k16 fragments, a STAGES-deep cp.async ring over x and W). Each CTA finishes rows
// [r_begin, r_end) of the tile (an even share of the rows below m), and warps 4-5 compute their
// low-rank term meanwhile: lr[row][col] = sum_r t[row][r] B_a[col][r], t = scale_a times u's
// partials summed in split order, rounded to T, B's rows of each row's own adapter, any rank, read
// only where a row needs them (a decode batch over many adapters costs their B bytes and no extra
// passes). That work is a chain of dependent loads (the row's adapter, then its rank, t and B),
// so it runs beside the K loop rather than before it. Then every CTA writes its fp32 partial tile
// to its own shared memory (over the ring), the cluster syncs, and each CTA sums its rows of all
// SPLIT partial tiles in rank order through distributed shared memory (deterministic), adds lr and
// the bias, and stores them.
template <class T, int BM, int BN, int STAGES, int SPLIT>
__global__ void __launch_bounds__(192, BM <= 16 ? 3 : 2)
#if __CUDA_ARCH__ >= 900
__cluster_dims__(SPLIT, 1, 1)
#endif
    lora_gemm_decode(KILN_LORA_GEMM_PARAMS) {
#if __CUDA_ARCH__ >= 900
  using namespace gemm;
  constexpr int NT = 192, NM = 128, NL = 64, WCOLS = BN / 4, NI = WCOLS / 8, MI = BM / 16;
  constexpr int A_BYTES = BM * k_row_bytes, STAGE_BYTES = (BM + BN) * k_row_bytes;
  constexpr int OWN = (BM + SPLIT - 1) / SPLIT, RED_LD = BN + 4, TROWS = OWN < 8 ? OWN : 8, TLD = 3 * 128;
  static_assert(STAGES * STAGE_BYTES >= BM * RED_LD * 4, "the partial tile reuses the ring");
  extern __shared__ unsigned char smem_raw[];
  __shared__ int own_a[OWN], own_rank[OWN];
  __shared__ float own_scale[OWN];
  const unsigned raw = ptx::smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  float* lr = reinterpret_cast<float*>(smem_raw + (base - raw) + STAGES * STAGE_BYTES);  // [OWN][BN]
  float* tbuf = lr + OWN * BN;                                                           // [TROWS][TLD]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int krank = SPLIT > 1 ? int(ptx::cluster_ctarank()) : 0;
  const int tiles_n = (n + BN - 1) / BN, unit = blockIdx.x / SPLIT;
  const int row0 = (unit / tiles_n) * BM, col0 = (unit % tiles_n) * BN;
  const int rows_here = min(BM, m - row0), share = (rows_here + SPLIT - 1) / SPLIT;
  const int r_begin = min(rows_here, krank * share), r_end = min(rows_here, r_begin + share);
  const long long ld = (long long)k * sizeof(T);
  const int ktiles = int((ld + k_row_bytes - 1) / k_row_bytes);
  const int kt0 = int((long long)ktiles * krank / SPLIT), nk = int((long long)ktiles * (krank + 1) / SPLIT) - kt0;

  // W does not depend on the shrink: this CTA's rows of W over its first k-steps go into L2 while
  // the shrink still runs (at most 32 MiB over the grid, so the lines stay until the ring reads
  // them). A prefetch changes no memory and reads nothing the kernel uses before the wait.
  if (tid < BN && col0 + tid < n && nk > 0) {
    const int pf = min(nk, int((32ll << 20) / ((long long)gridDim.x * BN * k_row_bytes)));
    const long long bytes = min((long long)pf * k_row_bytes, ld - (long long)kt0 * k_row_bytes);
    if (bytes > 0)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(reinterpret_cast<const u8*>(w) +
                                                                        (col0 + tid) * ld + (long long)kt0 * k_row_bytes),
                   "r"(unsigned(bytes))
                   : "memory");
  }
  ptx::grid_dependency_wait();

  float acc[MI][NI][4];
  zero_fragments(acc);
  if (warp < 4) {
    auto load_stage = [&](int j) {
      const unsigned st = base + (j % STAGES) * STAGE_BYTES;
      const long long kb = (long long)(kt0 + j) * k_row_bytes;
      load_tile<BM, NM>(st, reinterpret_cast<const u8*>(x), m, ld, row0, kb, tid);
      load_tile<BN, NM>(st + A_BYTES, reinterpret_cast<const u8*>(w), n, ld, col0, kb, tid);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(s);
      cp_async_commit();
    }
    for (int j = 0; j < nk; ++j) {
      cp_async_wait<STAGES - 2>();
      ptx::bar_sync<1, NM>();
      if (j + STAGES - 1 < nk) load_stage(j + STAGES - 1);
      cp_async_commit();
      const unsigned sa = base + (j % STAGES) * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        unsigned af[MI][4], bf[NI / 2][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const int rr = 16 * mi + (lane & 15), c = 2 * kk + (lane >> 4);
          ldmatrix_x4(sa + rr * k_row_bytes + ((c ^ (rr & 7)) << 4), af[mi]);
        }
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {
          const int q = lane >> 3;
          const int rr = warp * WCOLS + 16 * nj + (q >> 1) * 8 + (lane & 7), c = 2 * kk + (q & 1);
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
  } else {
    // The low-rank term of rows [r_begin, r_end), TROWS rows of t at a time.
    const int lt = tid - NM;
    const Tail<T> tail{u, b, idx, ranks, scales, m, n, r, adapters, slices, n1, n2, splits, scale0};
    for (int i = lt; i < OWN; i += NL) {
      int a = -1, rank = 0;
      float sc = 0.0f;
      if (r_begin + i < r_end) {
        a = adapter_of(idx, row0 + r_begin + i, adapters);
        if (a >= 0) {
          rank = tail.rank(a);
          sc = tail.scale(a);
        }
      }
      own_a[i] = a;
      own_rank[i] = rank;
      own_scale[i] = sc;
    }
    ptx::bar_sync<2, NL>();
    const int rp = tail.rp(), ucols = slices * rp;
    const long long split_stride = (long long)m * ucols;
    const bool vec = (r & 7) == 0;
    for (int g0 = r_begin; g0 < r_end; g0 += TROWS) {
      const int gn = min(TROWS, r_end - g0), o0 = g0 - r_begin;
      for (int e = lt; e < gn * ucols; e += NL) {
        const int i = e / ucols, c = e % ucols;
        float v = 0.0f;
        if (c % rp < own_rank[o0 + i]) {
          const float* p = u + (long long)(row0 + g0 + i) * ucols + c;
          float part[16];
#pragma unroll
          for (int z = 0; z < 16; ++z) part[z] = z < splits ? __ldg(p + z * split_stride) : 0.0f;
#pragma unroll
          for (int z = 0; z < 16; ++z)
            if (z < splits) v += part[z];
          v = to_float(from_float<T>(v * own_scale[o0 + i]));
        }
        tbuf[i * TLD + c] = v;
      }
      ptx::bar_sync<2, NL>();
      for (int j = lt; j < BN; j += NL) {
        const int col = col0 + j;
        int sl = 0;
        while (sl + 1 < slices && col >= tail.hi(sl)) ++sl;
        const bool in_slice = col < n && col >= tail.lo(sl) && col < tail.hi(sl);
        float* lrow = lr + o0 * BN + j;
        for (int i = 0; i < gn; ++i) lrow[i * BN] = 0.0f;
        if (!in_slice) continue;
        const float* tcol = tbuf + sl * rp;
        if (vec) {
          // (row, chunk) items in order; a batch loads up to 8 of them, then walks them again.
          auto chunks = [&](int i) { return (own_rank[o0 + i] + 7) >> 3; };
          auto advance = [&](int& i, int& c) {
            if (++c >= chunks(i)) {
              c = 0;
              do ++i;
              while (i < gn && chunks(i) == 0);
            }
          };
          int ci = 0, cc = 0;
          while (ci < gn && chunks(ci) == 0) ++ci;
          while (ci < gn) {
            const int si = ci, sc = cc;
            uint4 q[8];
#pragma unroll
            for (int t = 0; t < 8; ++t)
              if (ci < gn) {
                q[t] = __ldg(reinterpret_cast<const uint4*>(b + ((long long)own_a[o0 + ci] * n + col) * r) + cc);
                advance(ci, cc);
              }
            ci = si;
            cc = sc;
#pragma unroll
            for (int t = 0; t < 8; ++t)
              if (ci < gn) {
                const T* e8 = reinterpret_cast<const T*>(&q[t]);
                const int rank = own_rank[o0 + ci];
                const float* tr = tcol + ci * TLD + 8 * cc;
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                  if (8 * cc + e < rank) d += tr[e] * to_float(e8[e]);
                lrow[ci * BN] += d;
                advance(ci, cc);
              }
          }
        } else {
          for (int i = 0; i < gn; ++i) {
            const int rank = own_rank[o0 + i];
            const T* bp = rank > 0 ? b + ((long long)own_a[o0 + i] * n + col) * r : b;
            float d = 0.0f;
#pragma unroll 8
            for (int c = 0; c < rank; ++c) d += tcol[i * TLD + c] * to_float(bp[c]);
            lrow[i * BN] = d;
          }
        }
      }
      ptx::bar_sync<2, NL>();
    }
  }
  __syncthreads();

  // The partial tile, over the ring.
  if (warp < 4)
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int rr = 16 * mi + (lane >> 2) + 8 * h, c = warp * WCOLS + 8 * ni + 2 * (lane & 3);
          ptx::st_shared_f2(base + 4u * unsigned(rr * RED_LD + c), acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
  if (SPLIT > 1)
    ptx::cluster_sync_aligned();
  else
    __syncthreads();
  const bool pairs = (n & 1) == 0;
  for (int e = tid; e < (r_end - r_begin) * (BN / 4); e += NT) {
    const int rr = r_begin + e / (BN / 4), c = (e % (BN / 4)) * 4;
    const unsigned addr = base + 4u * unsigned(rr * RED_LD + c);
    float4 sum = SPLIT > 1 ? ptx::ld_remote_f4(addr, 0)
                           : *reinterpret_cast<const float4*>(smem_raw + (base - raw) + 4 * (rr * RED_LD + c));
#pragma unroll
    for (int q = 1; q < SPLIT; ++q) {
      const float4 v = ptx::ld_remote_f4(addr, q);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    const float* l4 = lr + (rr - r_begin) * BN + c;
    const float vals[4] = {sum.x + l4[0], sum.y + l4[1], sum.z + l4[2], sum.w + l4[3]};
    const int col = col0 + c;
    T* orow = out + (long long)(row0 + rr) * n;
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      const T v0 = from_float<T>(vals[j] + (bias && col + j < n ? to_float(bias[col + j]) : 0.0f));
      const T v1 = from_float<T>(vals[j + 1] + (bias && col + j + 1 < n ? to_float(bias[col + j + 1]) : 0.0f));
      if (pairs && col + j + 1 < n) {
        Pack<T, 2> pk;
        pk.v[0] = v0;
        pk.v[1] = v1;
        store_pack<T, 2>(orow + col + j, pk);
      } else {
        if (col + j < n) orow[col + j] = v0;
        if (col + j + 1 < n) orow[col + j + 1] = v1;
      }
    }
  }
  // Every CTA's partial tile stays until the whole cluster has read it.
  if (SPLIT > 1) ptx::cluster_sync_aligned();
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
  ptx::grid_dependency_wait();
  const CoreTail<T> tail{&map_t, &map_b, bias, n, n1, n2, slices, chunks, BN};
  // The output leaves through the staged epilogue, copied out by the warps' lanes (the kernel's
  // four tensor maps are the operands').
  gemm::gemm_wgmma_body<gemm::k_half, T, T, 0, BM, BN, STAGES, 8, 1, 1, CoreTail<T>, gemm::k_out_copy>(
      reinterpret_cast<const u8*>(x), reinterpret_cast<const u8*>(w), nullptr, nullptr, nullptr, out, m, n, k,
      (m + BM - 1) / BM, (n + BN - 1) / BN, map_x, map_w, map_w, tail);
}

}  // namespace lora
}  // namespace kiln
