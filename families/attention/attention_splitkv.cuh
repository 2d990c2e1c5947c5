// The decode path of the attention forward: short queries against long keys, in two kernels.
//
// attention_splitkv: a block owns 16 * WARPS rows of one (sequence, KV head), where the rows are
// the (query, query head) pairs of that KV head's group packed into the M dimension (row r is
// query r / group of head kv_head * group + r % group), so one block reads each K/V tile once for
// every query head that shares it. With KW key warps, each row warp's work on a tile is divided
// by keys among KW warps, each running its own online softmax over its part of every tile; at the
// end they merge their states through shared memory (the tiles' space), so an SM keeps KW times
// the warps issuing on the same tiles. The key tiles the block's rows can see are divided into
// `splits` contiguous ranges of equal tile counts (the last ones shorter or empty); split s
// computes the softmax over its range alone, with the FlashAttention-2 loop of attention_fwd.cuh
// (cp.async double buffering, mma.sync, online softmax in base 2), each row masked by its own
// query index, and writes its normalized partial output (f32) and partial log-sum-exp (natural
// log; -inf for a row that saw no key in the range). P enters P V as two terms of the input dtype
// (the rounded value and its rounding error), so the partials carry f32-grade probabilities.
//
// attention_combine: one warp per (token, head) merges the partials in split order (fixed, so the
// result is deterministic; launched as a programmatic dependent, it waits for the split kernel
// before it reads): weights exp(lse_s - max_s lse_s), out = sum w_s o_s / sum w_s, lse =
// max + log(sum w_s); a row whose splits all saw nothing gets zeros and lse -inf.
//
// Partial layout: o_part [splits, total_q, heads, head_dim_v], lse_part [splits, total_q, heads],
// tokens as q's rows (padded sequences at b * seqlen_q, packed ones at cu_seqlens_q[b]).
//
// PAGED: k and v are a paged cache [num_blocks, page_size, kv_heads, head_dim(_v)] (vLLM's flash
// layout), sequence b's key j in block block_table[b * max_blocks + j / page_size] at row j %
// page_size, its key count seq_lens[b] (cu_k unused). Each K/V tile's keys are resolved to cache
// rows (slots) two tiles ahead, read from the block table into registers while a tile computes and
// kept in a two-entry shared ring, so the copies of a tile never wait on a block-table read; every
// page size (1 to 128 rows, a power of two) takes the same path, a row at a time, one slot read
// for a row of K and of V.
#pragma once

#include "attention/attention_fwd.cuh"

namespace kiln {
namespace attention {

// The two 16-bit values of a register as floats, the low half first.
template <class T>
__device__ __forceinline__ float2 unpack2(unsigned r);
template <>
__device__ __forceinline__ float2 unpack2<f16_t>(unsigned r) {
  float lo, hi;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(r));
  return make_float2(lo, hi);
}
template <>
__device__ __forceinline__ float2 unpack2<bf16_t>(unsigned r) {
  return make_float2(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
}

// `lo` and `hi` as the rounded pair (returned) and what rounding lost (`rest`, also rounded).
template <class T>
__device__ __forceinline__ unsigned pack2_split(float lo, float hi, unsigned& rest) {
  const unsigned r = pack2<T>(lo, hi);
  const float2 back = unpack2<T>(r);
  rest = pack2<T>(lo - back.x, hi - back.y);
  return r;
}

// load_rows of attention_fwd.cuh, partly unrolled: with one or two warps a tile takes dozens of
// 16-byte copies per thread, and fully unrolled their addresses crowd out the accumulator.
template <int ROWS, int COLS, int PITCH, int NT, class T>
__device__ __forceinline__ void load_rows_rolled(unsigned dst, const T* src, long long stride, int valid, int tid) {
  constexpr int CHUNKS = COLS / 8, TOTAL = ROWS * CHUNKS;
#pragma unroll 4
  for (int i = tid; i < TOTAL; i += NT) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const bool ok = r < valid;
    const T* p = ok ? src + r * stride + c * 8 : src;
    gemm::cp_async_16(dst + unsigned(r * PITCH + c * 8) * 2u, p, ok ? 16 : 0);
  }
}

// K and V tile rows scattered through a paged cache of one layout (head_dim_v = head_dim): row r of
// both at slots[r] * stride, read once for the two copies. When the threads divide a row's chunks
// evenly, each keeps one column and walks the rows, so the smem offsets are constants.
template <int ROWS, int COLS, int PITCH, int NT, class T>
__device__ __forceinline__ void load_kv_paged(unsigned dst_k, unsigned dst_v, const T* k, const T* v,
                                              long long stride, const int* slots, int valid, int tid) {
  constexpr int CHUNKS = COLS / 8;
  auto copy = [&](int r, int c) {
    const bool ok = r < valid;
    const long long off = ok ? (long long)slots[r] * stride + c * 8 : 0;
    const unsigned d = unsigned(r * PITCH + c * 8) * 2u;
    gemm::cp_async_16(dst_k + d, k + off, ok ? 16 : 0);
    gemm::cp_async_16(dst_v + d, v + off, ok ? 16 : 0);
  };
  if constexpr (NT % CHUNKS == 0) {
    const int c = tid % CHUNKS;
#pragma unroll 8
    for (int r = tid / CHUNKS; r < ROWS; r += NT / CHUNKS) copy(r, c);
  } else {
#pragma unroll 4
    for (int i = tid; i < ROWS * CHUNKS; i += NT) copy(i / CHUNKS, i % CHUNKS);
  }
}

template <class T, int D, int DV, int WARPS, int BN, bool PAGED = false, int KW = 1>
__global__ void __launch_bounds__(WARPS * KW * 32, 1)
    attention_splitkv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const int* __restrict__ cu_q, const int* __restrict__ cu_k, float* __restrict__ o_part,
                      float* __restrict__ lse_part, int seqlen_q, int seqlen_k, int total_q, int heads,
                      int kv_heads, int window_left, int window_right, int varlen, int splits, float scale,
                      float softcap, const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                      int max_blocks, int page_shift, int overlap_previous) {
  static_assert(D % 16 == 0 && DV % 16 == 0 && BN % (16 * KW) == 0, "each key warp takes whole m16n8k16 steps");
  static_assert(!PAGED || D == DV, "the paged caches share one layout");
  constexpr int NT = WARPS * KW * 32, BM = 16 * WARPS;
  constexpr int BNW = BN / KW;  // keys of each tile a key warp takes
  constexpr int PQ = D + 8, PV = DV + 8;  // shared row pitch, elements
  constexpr int Q_BYTES = BM * PQ * 2, K_BYTES = BN * PQ * 2, V_BYTES = BN * PV * 2, STAGE = K_BYTES + V_BYTES;
  constexpr int NS = BNW / 8, NO = DV / 8;  // n8 blocks of a key warp's S and of the output
  // After the loop, key warps 1.. hand their state (acc, max, sum per lane) to key warp 0 here.
  constexpr int MERGE_FLOATS = NO * 4 + 4;
  static_assert(KW == 1 || (KW - 1) * WARPS * 32 * MERGE_FLOATS * 4 <= Q_BYTES + 2 * STAGE,
                "the merge fits in the tiles' shared memory");
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned sq = ptx::smem_addr(smem), skv = sq + Q_BYTES;

  const int tid = threadIdx.x, lane = tid & 31;
  // Row warp `warp` owns 16 packed rows; key warp wk takes keys [wk * BNW, (wk + 1) * BNW)
  // of every tile with its own online softmax, merged with the other key warps' at the end.
  const int warp = (tid >> 5) % WARPS, wk = (tid >> 5) / WARPS;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int split = int(blockIdx.x) % splits, mblock = int(blockIdx.x) / splits;
  // Launched as a programmatic dependent (sm_90): normally every block waits for the previous
  // kernel before it reads anything. With overlap_previous the previous kernel writes nothing this
  // one reads (the cascade's prefix pass before its own pass), so the blocks run beside it and wait
  // only before they end, and a kernel waiting on this one has waited on both. Either way the next
  // kernel may launch once every block has started.
  if (!overlap_previous) ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int group = heads / kv_heads;
  long long q0 = (long long)b * seqlen_q, k0 = (long long)b * seqlen_k;
  int lq = seqlen_q, lk = seqlen_k;
  if (varlen) {
    q0 = cu_q[b];
    lq = cu_q[b + 1] - cu_q[b];
    if (!PAGED) {
      k0 = cu_k[b];
      lk = cu_k[b + 1] - cu_k[b];
    }
  }
  if (PAGED) {
    k0 = 0;
    lk = seq_lens[b];
  }
  const int rows = lq * group, m0 = mblock * BM;
  if (m0 >= rows) {
    if (overlap_previous) ptx::grid_dependency_wait();
    return;
  }
  const long long q_stride = (long long)heads * D, k_stride = (long long)kv_heads * D;
  const long long v_stride = (long long)kv_heads * DV;
  const T* qp = q + q0 * q_stride + (long long)hk * group * D;
  const T* kp = k + k0 * k_stride + (long long)hk * D;
  const T* vp = v + k0 * v_stride + (long long)hk * DV;

  // The keys any row of the block sees, [n_begin, n_end), from its first and last query.
  const int delta = lk - lq, i_first = m0 / group, i_last = (min(m0 + BM, rows) - 1) / group;
  int n_end = lk, n_begin = 0;
  if (window_right >= 0) n_end = min(n_end, i_last + delta + window_right + 1);
  if (window_left >= 0) n_begin = max(0, i_first + delta - window_left);
  const int v_begin = n_begin / BN, v_end = n_end > n_begin ? (n_end + BN - 1) / BN : v_begin;
  // This split's share of those tiles.
  const int per = (v_end - v_begin + splits - 1) / splits;
  const int t_begin = min(v_end, v_begin + split * per), t_end = min(v_end, t_begin + per);

  // Paged: the cache rows (slots) of a tile's keys, in ring entry 0 or 1 (the tile's stage). Each
  // thread resolves keys tid, tid + NT, ... of a tile; rows past the keys get slot 0 (never read).
  constexpr int SLOTS = (BN + NT - 1) / NT;
  __shared__ int slot_ring[PAGED ? 2 * BN : 1];
  const int* table = PAGED ? block_table + (long long)b * max_blocks : nullptr;
  auto fetch_slots = [&](int t, int (&out)[SLOTS]) {
    const int n0 = t * BN, page_mask = (1 << page_shift) - 1;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const int idx = tid + i * NT, n = n0 + idx;
      out[i] = idx < BN && n < lk ? (table[n >> page_shift] << page_shift) + (n & page_mask) : 0;
    }
  };
  auto store_slots = [&](const int (&in)[SLOTS], int entry) {
#pragma unroll
    for (int i = 0; i < SLOTS; ++i)
      if (tid + i * NT < BN) slot_ring[entry * BN + tid + i * NT] = in[i];
  };
  auto load_kv = [&](int t, int stage) {
    const unsigned s = skv + unsigned(stage * STAGE);
    const int n0 = t * BN;
    if constexpr (PAGED) {
      load_kv_paged<BN, D, PQ, NT>(s, s + K_BYTES, kp, vp, k_stride, slot_ring + stage * BN, lk - n0, tid);
    } else {
      load_rows_rolled<BN, D, PQ, NT>(s, kp + (long long)n0 * k_stride, k_stride, lk - n0, tid);
      load_rows_rolled<BN, DV, PV, NT>(s + K_BYTES, vp + (long long)n0 * v_stride, v_stride, lk - n0, tid);
    }
  };
  {
    // Q rows in packed order; rows past the group's last are zero-filled.
    constexpr int CHUNKS = D / 8, TOTAL = BM * CHUNKS;
#pragma unroll 4
    for (int i = tid; i < TOTAL; i += NT) {
      const int r = i / CHUNKS, c = i % CHUNKS, gr = m0 + r;
      const bool ok = gr < rows;
      const T* p = ok ? qp + (long long)(gr / group) * q_stride + (gr % group) * D + c * 8 : q;
      gemm::cp_async_16(sq + unsigned(r * PQ + c * 8) * 2u, p, ok ? 16 : 0);
    }
  }
  if constexpr (PAGED) {
    if (t_begin < t_end) {
      int first[SLOTS], second[SLOTS];
      fetch_slots(t_begin, first);
      fetch_slots(t_begin + 1, second);
      store_slots(first, 0);
      store_slots(second, 1);
      __syncthreads();
    }
  }
  if (t_begin < t_end) load_kv(t_begin, 0);
  gemm::cp_async_commit();

  float acc[NO][4];
#pragma unroll
  for (int j = 0; j < NO; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f, cap_out = softcap * k_log2e;
  const int row0 = m0 + warp * 16 + (lane >> 2);  // the packed row of elements 0, 1; row0 + 8 holds 2, 3
  const int qrow[2] = {row0 / group, (row0 + 8) / group};  // their query indices

  for (int t = t_begin; t < t_end; ++t) {
    const int stage = (t - t_begin) & 1;
    // The other stage was read in the previous iteration, which ended in a barrier.
    // Paged: tile t + 2's slots are read from the block table now, into registers, and stored to
    // tile t's ring entry after the barrier below (every thread has issued tile t's copies, the
    // entry's only readers, before it); the barrier ending the iteration publishes them.
    [[maybe_unused]] int next_slots[PAGED ? SLOTS : 1];
    [[maybe_unused]] const bool fetch = PAGED && t + 2 < t_end;
    if constexpr (PAGED) {
      if (fetch) fetch_slots(t + 2, next_slots);
    }
    if (t + 1 < t_end) load_kv(t + 1, stage ^ 1);
    gemm::cp_async_commit();
    gemm::cp_async_wait<1>();
    __syncthreads();
    if constexpr (PAGED) {
      if (fetch) store_slots(next_slots, stage);
    }
    const unsigned sk = skv + unsigned(stage * STAGE), sv = sk + K_BYTES;

    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4];
      gemm::ldmatrix_x4(sq + unsigned((warp * 16 + (lane & 15)) * PQ + kk * 16 + (lane >> 4) * 8) * 2u, a);
#pragma unroll
      for (int nj = 0; nj < NS / 2; ++nj) {
        const int g = lane >> 3, r = wk * BNW + nj * 16 + (g >> 1) * 8 + (lane & 7), c = kk * 16 + (g & 1) * 8;
        unsigned bk[4];
        gemm::ldmatrix_x4(sk + unsigned(r * PQ + c) * 2u, bk);
        gemm::mma_16816<T>(s[2 * nj], a, bk[0], bk[1]);
        gemm::mma_16816<T>(s[2 * nj + 1], a, bk[2], bk[3]);
      }
    }

#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = capped ? cap_out * tanhf(s[j][e] * cap_in) : s[j][e] * scale_log2;

    const int n0 = t * BN, nw = n0 + wk * BNW;  // the tile's first key, this key warp's first
    const bool edge = n0 + BN > lk || (window_right >= 0 && n0 + BN - 1 > i_first + delta + window_right) ||
                      (window_left >= 0 && n0 < i_last + delta - window_left);
    if (edge) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nw + j * 8 + 2 * (lane & 3) + (e & 1), qi = qrow[e >> 1];
          const bool seen = col < lk && (window_right < 0 || col <= qi + delta + window_right) &&
                            (window_left < 0 || col >= qi + delta - window_left);
          if (!seen) s[j][e] = neg_inf();
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == neg_inf() ? 0.0f : mx;
      const float corr = fast_exp2(row_max[r] - base);
      row_max[r] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        s[j][2 * r] = fast_exp2(s[j][2 * r] - base);
        s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] - base);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * corr + sum;
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        acc[j][2 * r] *= corr;
        acc[j][2 * r + 1] *= corr;
      }
    }

    // O += P V with P = hi + lo, both in the input dtype: two mma per step.
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk) {
      unsigned a[4], a_lo[4];
      a[0] = pack2_split<T>(s[2 * kk][0], s[2 * kk][1], a_lo[0]);
      a[1] = pack2_split<T>(s[2 * kk][2], s[2 * kk][3], a_lo[1]);
      a[2] = pack2_split<T>(s[2 * kk + 1][0], s[2 * kk + 1][1], a_lo[2]);
      a[3] = pack2_split<T>(s[2 * kk + 1][2], s[2 * kk + 1][3], a_lo[3]);
#pragma unroll
      for (int nj = 0; nj < NO / 2; ++nj) {
        const int g = lane >> 3, r = wk * BNW + kk * 16 + (g & 1) * 8 + (lane & 7), c = nj * 16 + (g >> 1) * 8;
        unsigned bv[4];
        ldmatrix_x4_trans(sv + unsigned(r * PV + c) * 2u, bv);
        gemm::mma_16816<T>(acc[2 * nj], a, bv[0], bv[1]);
        gemm::mma_16816<T>(acc[2 * nj + 1], a, bv[2], bv[3]);
        gemm::mma_16816<T>(acc[2 * nj], a_lo, bv[0], bv[1]);
        gemm::mma_16816<T>(acc[2 * nj + 1], a_lo, bv[2], bv[3]);
      }
    }
    __syncthreads();
  }
  gemm::cp_async_wait<0>();
  if (overlap_previous) ptx::grid_dependency_wait();

  if constexpr (KW > 1) {
    // The lanes of every key warp hold the same rows and columns: key warps 1.. store their state
    // lane by lane, key warp 0 rescales each to the common max and adds it.
    __syncthreads();
    float* merge = reinterpret_cast<float*>(smem);
    if (wk > 0) {
      float* mine = merge + (((wk - 1) * WARPS + warp) * MERGE_FLOATS) * 32 + lane;
#pragma unroll
      for (int j = 0; j < NO; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 32] = acc[j][e];
      mine[(NO * 4) * 32] = row_max[0];
      mine[(NO * 4 + 1) * 32] = row_max[1];
      mine[(NO * 4 + 2) * 32] = row_sum[0];
      mine[(NO * 4 + 3) * 32] = row_sum[1];
    }
    __syncthreads();
    if (wk > 0) return;
#pragma unroll 1
    for (int w = 1; w < KW; ++w) {
      const float* theirs = merge + (((w - 1) * WARPS + warp) * MERGE_FLOATS) * 32 + lane;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_other = theirs[(NO * 4 + r) * 32], s_other = theirs[(NO * 4 + 2 + r) * 32];
        const float mx = fmaxf(row_max[r], m_other);
        const float base = mx == neg_inf() ? 0.0f : mx;
        const float c_mine = fast_exp2(row_max[r] - base), c_other = fast_exp2(m_other - base);
        row_max[r] = mx;
        row_sum[r] = row_sum[r] * c_mine + s_other * c_other;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
          acc[j][2 * r] = acc[j][2 * r] * c_mine + theirs[(j * 4 + 2 * r) * 32] * c_other;
          acc[j][2 * r + 1] = acc[j][2 * r + 1] * c_mine + theirs[(j * 4 + 2 * r + 1) * 32] * c_other;
        }
      }
    }
  }

  // Every row of the block writes every split's partial, an empty split included (zeros, -inf).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + 8 * r;
    if (row >= rows) continue;
    const int h = hk * group + row % group;
    const long long at = ((long long)split * total_q + q0 + qrow[r]) * heads + h;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* orow = o_part + at * DV;
#pragma unroll
    for (int j = 0; j < NO; ++j)
      *reinterpret_cast<float2*>(orow + j * 8 + 2 * (lane & 3)) =
          make_float2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv);
    if ((lane & 3) == 0) lse_part[at] = sum > 0.0f ? (row_max[r] + __log2f(sum)) * k_ln2 : neg_inf();
  }
}

// One warp per (token, head) row of out; 4 rows a block. Tokens past the last packed sequence
// (varlen) are left as they are, as attention_fwd leaves them. lse is [tokens, heads] when
// lse_token_major (the paged ops' layout), else the attention family's. The lanes read the
// splits' lse values together (split s in lane s % 32) and reduce them with a fixed shuffle tree;
// the weighted sum then walks the splits in order, each weight broadcast from its lane. Each lane
// holds four columns (16-byte loads; the workspace is 16-byte aligned, DV a multiple of 16) and
// loads U splits' partial rows before it adds any, so a warp keeps U rows in flight.
template <class T, int DV>
__global__ void __launch_bounds__(128)
    attention_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                      const int* __restrict__ cu_q, T* __restrict__ o, float* __restrict__ lse, int batch,
                      int seqlen_q, int total_q, int heads, int varlen, int splits, int lse_token_major) {
  static_assert(DV % 16 == 0, "whole 16-byte pieces of the partial rows");
  constexpr int P = DV / 4, PER = (P + 31) / 32, U = PER == 1 ? 8 : 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * 4 + warp, n = (long long)total_q * heads;
  if (row >= n) return;
  ptx::grid_dependency_wait();  // the split kernel before it, when launched as its dependent
  const int t = int(row / heads), h = int(row % heads);
  if (varlen && t >= cu_q[batch]) return;
  float mx = neg_inf();
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, lse_part[s * n + row]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float4 acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float wsum = 0.0f;
  auto add = [&](float w, const float4 (&x)[PER]) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      acc[i].x += w * x[i].x;
      acc[i].y += w * x[i].y;
      acc[i].z += w * x[i].z;
      acc[i].w += w * x[i].w;
    }
  };
  auto load = [&](int s, float4 (&x)[PER]) {
    const float4* src = reinterpret_cast<const float4*>(o_part + (s * n + row) * DV);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int p = lane + 32 * i;
      x[i] = P % 32 == 0 || p < P ? __ldg(src + p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  if (mx != neg_inf()) {
    for (int s0 = 0; s0 < splits; s0 += 32) {
      // Split s0 + lane's weight; a split that saw no key weighs 0 (its partial row is zeros).
      const int s = s0 + lane;
      const float l = s < splits ? lse_part[s * n + row] : neg_inf();
      const float mine = l == neg_inf() ? 0.0f : expf(l - mx);
      float part = mine;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
      wsum += part;
      const int count = min(32, splits - s0);
      int j = 0;
      for (; j + U <= count; j += U) {
        float4 x[U][PER];
#pragma unroll
        for (int u = 0; u < U; ++u) load(s0 + j + u, x[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) add(__shfl_sync(0xffffffffu, mine, j + u), x[u]);
      }
      for (; j < count; ++j) {
        float4 x[PER];
        load(s0 + j, x);
        add(__shfl_sync(0xffffffffu, mine, j), x);
      }
    }
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  T* orow = o + row * DV;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int p = lane + 32 * i;
    if (P % 32 != 0 && p >= P) break;
    Pack<T, 4> pk;
    pk.v[0] = from_float<T>(acc[i].x * inv);
    pk.v[1] = from_float<T>(acc[i].y * inv);
    pk.v[2] = from_float<T>(acc[i].z * inv);
    pk.v[3] = from_float<T>(acc[i].w * inv);
    store_pack<T, 4>(orow + 4 * p, pk);
  }
  if (lse && lane == 0) {
    const long long at = lse_token_major ? row
                         : varlen        ? (long long)h * total_q + t
                                         : ((long long)(t / seqlen_q) * heads + h) * seqlen_q + t % seqlen_q;
    lse[at] = wsum > 0.0f ? mx + logf(wsum) : neg_inf();
  }
}

}  // namespace attention
}  // namespace kiln
