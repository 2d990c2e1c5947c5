// The attention forward kernel for sm_80 and later (mma.sync m16n8k16, f16 or bf16 operands, fp32
// accumulation), in the FlashAttention-2 design: a block owns 16 * WARPS query rows of one
// (sequence, head), keeps its Q tile in shared memory, and walks the K/V tiles its mask leaves
// visible, two in flight (cp.async); each warp computes S = Q K^T for its 16 rows, applies scale,
// softcap and the mask, updates a running row max and sum (online softmax, base 2), and adds P V
// to its output accumulator in registers. Only tiles that cross a mask boundary (causal diagonal,
// window edges, the end of the keys) are masked element by element; tiles outside the window are
// never loaded.
//
// Layouts: rows of q, k, v and out are tokens, each holding every head (heads * head_dim elements
// for q); padded sequences start at b * seqlen, packed ones at cu_seqlens[b]. lse is [batch,
// heads, seqlen_q] padded, [heads, total_q] packed. Shared-memory rows are padded by 16 bytes, so
// the eight rows an ldmatrix phase reads fall in distinct banks for every head dim.
#pragma once

#include "common/gemm/gemm_mma.cuh"

namespace kiln {
namespace attention {

constexpr float k_log2e = 1.4426950408889634f;
constexpr float k_ln2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as one register of two 16-bit values, `lo` in the low half.
template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<f16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <>
__device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Four transposed 8x8 b16 matrices: the B operand of an m16n8k16 from a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Rows [0, ROWS) of COLS elements, global rows `stride` elements apart from `src`, into the shared
// tile at `dst` (rows PITCH elements apart); rows at or past `valid` are zero-filled and not read.
template <int ROWS, int COLS, int PITCH, int NT, class T>
__device__ __forceinline__ void load_rows(unsigned dst, const T* src, long long stride, int valid, int tid) {
  constexpr int CHUNKS = COLS / 8, TOTAL = ROWS * CHUNKS;
#pragma unroll
  for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
    const int i = it * NT + tid;
    if (TOTAL % NT != 0 && i >= TOTAL) break;
    const int r = i / CHUNKS, c = i % CHUNKS;
    const bool ok = r < valid;
    const T* p = ok ? src + r * stride + c * 8 : src;
    gemm::cp_async_16(dst + unsigned(r * PITCH + c * 8) * 2u, p, ok ? 16 : 0);
  }
}

template <class T, int D, int DV, int WARPS, int BN>
__global__ void __launch_bounds__(WARPS * 32)
    attention_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int* __restrict__ cu_q, const int* __restrict__ cu_k, T* __restrict__ o,
                  float* __restrict__ lse, int seqlen_q, int seqlen_k, int total_q, int heads, int kv_heads,
                  int window_left, int window_right, int varlen, int reverse, float scale, float softcap) {
  static_assert(D % 16 == 0 && DV % 16 == 0 && BN % 16 == 0, "tiles are whole m16n8k16 steps");
  constexpr int NT = WARPS * 32, BM = 16 * WARPS;
  constexpr int PQ = D + 8, PV = DV + 8;  // shared row pitch, elements
  constexpr int Q_BYTES = BM * PQ * 2, K_BYTES = BN * PQ * 2, V_BYTES = BN * PV * 2, STAGE = K_BYTES + V_BYTES;
  constexpr int NS = BN / 8, NO = DV / 8;  // n8 blocks of S and of the output
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned sq = ptx::smem_addr(smem), skv = sq + Q_BYTES;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  // Causal blocks late in the sequence see the most keys: launched first when `reverse`.
  const int mblock = reverse ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  long long q0 = (long long)b * seqlen_q, k0 = (long long)b * seqlen_k;
  int lq = seqlen_q, lk = seqlen_k;
  if (varlen) {
    q0 = cu_q[b];
    lq = cu_q[b + 1] - cu_q[b];
    k0 = cu_k[b];
    lk = cu_k[b + 1] - cu_k[b];
  }
  const int m0 = mblock * BM;
  if (m0 >= lq) return;
  const int hk = h / (heads / kv_heads);
  const long long q_stride = (long long)heads * D, k_stride = (long long)kv_heads * D;
  const long long v_stride = (long long)kv_heads * DV, o_stride = (long long)heads * DV;
  const T* qp = q + (q0 + m0) * q_stride + (long long)h * D;
  const T* kp = k + k0 * k_stride + (long long)hk * D;
  const T* vp = v + k0 * v_stride + (long long)hk * DV;

  // The keys any row of the block sees: [n_begin, n_end).
  const int delta = lk - lq, m_last = min(m0 + BM, lq) - 1;
  int n_end = lk, n_begin = 0;
  if (window_right >= 0) n_end = min(n_end, m_last + delta + window_right + 1);
  if (window_left >= 0) n_begin = max(0, m0 + delta - window_left);
  const int t_begin = n_begin / BN, t_end = n_end > n_begin ? (n_end + BN - 1) / BN : t_begin;

  auto load_kv = [&](int t, int stage) {
    const unsigned s = skv + unsigned(stage * STAGE);
    const int n0 = t * BN;
    load_rows<BN, D, PQ, NT>(s, kp + (long long)n0 * k_stride, k_stride, lk - n0, tid);
    load_rows<BN, DV, PV, NT>(s + K_BYTES, vp + (long long)n0 * v_stride, v_stride, lk - n0, tid);
  };
  load_rows<BM, D, PQ, NT>(sq, qp, q_stride, lq - m0, tid);
  if (t_begin < t_end) load_kv(t_begin, 0);
  gemm::cp_async_commit();

  float acc[NO][4];
#pragma unroll
  for (int j = 0; j < NO; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f, cap_out = softcap * k_log2e;
  const int row0 = m0 + warp * 16 + (lane >> 2);  // the row of elements 0, 1; row0 + 8 holds 2, 3

  for (int t = t_begin; t < t_end; ++t) {
    const int stage = (t - t_begin) & 1;
    // The other stage was read in the previous iteration, which ended in a barrier.
    if (t + 1 < t_end) load_kv(t + 1, stage ^ 1);
    gemm::cp_async_commit();
    gemm::cp_async_wait<1>();
    __syncthreads();
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
        // Matrices: keys 16 nj + 0..7 and + 8..15 (lane >> 4), dims 16 kk + 0..7 and + 8..15.
        const int g = lane >> 3, r = nj * 16 + (g >> 1) * 8 + (lane & 7), c = kk * 16 + (g & 1) * 8;
        unsigned bk[4];
        gemm::ldmatrix_x4(sk + unsigned(r * PQ + c) * 2u, bk);
        gemm::mma_16816<T>(s[2 * nj], a, bk[0], bk[1]);
        gemm::mma_16816<T>(s[2 * nj + 1], a, bk[2], bk[3]);
      }
    }

    // Scores in the base-2 domain: log2(e) * (softcap * tanh(scale * qk / softcap) or scale * qk).
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = capped ? cap_out * tanhf(s[j][e] * cap_in) : s[j][e] * scale_log2;

    const int n0 = t * BN;
    const bool edge = n0 + BN > lk || (window_right >= 0 && n0 + BN - 1 > m0 + delta + window_right) ||
                      (window_left >= 0 && n0 < m_last + delta - window_left);
    if (edge) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1), row = row0 + (e >> 1) * 8;
          const bool seen = col < lk && (window_right < 0 || col <= row + delta + window_right) &&
                            (window_left < 0 || col >= row + delta - window_left);
          if (!seen) s[j][e] = neg_inf();
        }
    }

    // Online softmax: each row's four lanes (lane % 4) share its max and sum.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen no key yet keeps max -inf; 0 then stands in for it, so exp2 gives 0.
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

    // O += P V: P's accumulators are the A operand (n8 blocks 2 kk and 2 kk + 1 make a k16 step).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nj = 0; nj < NO / 2; ++nj) {
        // Matrices: keys 16 kk + 0..7 and + 8..15 (lane >> 3 odd), dims 16 nj + 0..7 and + 8..15.
        const int g = lane >> 3, r = kk * 16 + (g & 1) * 8 + (lane & 7), c = nj * 16 + (g >> 1) * 8;
        unsigned bv[4];
        ldmatrix_x4_trans(sv + unsigned(r * PV + c) * 2u, bv);
        gemm::mma_16816<T>(acc[2 * nj], a, bv[0], bv[1]);
        gemm::mma_16816<T>(acc[2 * nj + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();
  }
  gemm::cp_async_wait<0>();

  // Rows that saw no key (all masked) get zeros and lse -inf.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + 8 * r;
    if (row >= lq) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* orow = o + (q0 + row) * o_stride + (long long)h * DV;
#pragma unroll
    for (int j = 0; j < NO; ++j) {
      Pack<T, 2> pk;
      pk.v[0] = from_float<T>(acc[j][2 * r] * inv);
      pk.v[1] = from_float<T>(acc[j][2 * r + 1] * inv);
      store_pack<T, 2>(orow + j * 8 + 2 * (lane & 3), pk);
    }
    if (lse && (lane & 3) == 0) {
      const long long at = varlen ? (long long)h * total_q + q0 + row : ((long long)b * heads + h) * seqlen_q + row;
      lse[at] = sum > 0.0f ? (row_max[r] + __log2f(sum)) * k_ln2 : neg_inf();
    }
  }
}

}  // namespace attention
}  // namespace kiln
