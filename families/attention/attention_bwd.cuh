// The attention backward for sm_80 and later (mma.sync m16n8k16, f16 or bf16 operands, fp32
// accumulation), in the FlashAttention-2 design. Three kernels of one argument list:
//
//  - attention_bwd_prep: Dsum[i] = sum_c dO[i, c] * O[i, c] per (query token, head), the dQ
//    accumulator zeroed, and the per-query-tile order counters of the deterministic mode reset.
//  - attention_bwd_main: a block owns BN = 16 * WARPS keys of one (sequence, head) (each warp 16
//    keys) and walks the query tiles of BM rows (64, or 32 at head dim 128 to stay within the
//    registers) that see any of them, two in flight (cp.async).
//    Per tile: S^T = K Q^T and dP^T = V dO^T; P^T = exp(S^T - lse) (scale, softcap and mask as the
//    forward); dS^T = P^T (dP^T - Dsum), times 1 - tanh^2 under softcap; dV += P^T dO and
//    dK += dS^T Q in registers; dS^T goes through shared memory for dQ_tile = dS K, which is added
//    to the f32 dQ accumulator: by atomicAdd (deterministic 0), or (deterministic 1) by plain
//    read-add-write once the tile's counter says every K/V block before this one has added its
//    part, so the sum runs in key-block order on every run. The epilogue writes dK and dV in the
//    input dtype, or with GQA (heads > kv_heads) in f32 per query head into the workspace.
//  - attention_bwd_finish: dQ from its accumulator in the dtype; with GQA, dK and dV summed over
//    each KV head's query heads in head order; rows of packed layouts past the last sequence zero.
//
// Workspace (f32 words): Dsum [heads, total_q] (padded to a multiple of 4); the dQ accumulator
// [total_q, heads, D] (scaled);
// the counters (int) [batch, heads, query tiles]; with GQA, dK and dV per query head [total_k,
// heads, D] and [total_k, heads, DV]. Layouts of q, k, v, out, lse as the forward's.
#pragma once

#include "attention/attention_fwd.cuh"

namespace kiln {
namespace attention {

// Bits of the kernels' `flags` argument.
constexpr int k_bwd_varlen = 1, k_bwd_deterministic = 2;

struct BwdWorkspace {
  float* dsum;
  float* dq;
  int* counters;
  float* dk;
  float* dv;
};

template <int D, int DV, int BM>
__device__ __forceinline__ BwdWorkspace bwd_workspace(float* ws, int seqlen_q, int total_q, int total_k, int batch,
                                                      int heads) {
  BwdWorkspace w;
  const long long m_tiles = (seqlen_q + BM - 1) / BM;
  w.dsum = ws;
  w.dq = w.dsum + ((long long)heads * total_q + 3) / 4 * 4;  // 16-byte aligned: vector and bulk adds
  w.counters = reinterpret_cast<int*>(w.dq + (long long)total_q * heads * D);
  w.dk = reinterpret_cast<float*>(w.counters + (long long)batch * heads * m_tiles);
  w.dv = w.dk + (long long)total_k * heads * D;
  return w;
}

#define KILN_ATTENTION_BWD_ARGS                                                                                      \
  const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ o,               \
      const T *__restrict__ dout, const float *__restrict__ lse, const int *__restrict__ cu_q,                       \
      const int *__restrict__ cu_k, float *__restrict__ ws, T *__restrict__ dq, T *__restrict__ dk, T *__restrict__ dv, \
      int seqlen_q, int seqlen_k, int total_q, int total_k, int batch, int heads, int kv_heads, int window_left,     \
      int window_right, int flags, float scale, float softcap

// One block per (BM query rows, head, sequence), 128 threads: a warp per row at a time.
template <class T, int D, int DV, int BM>
__global__ void __launch_bounds__(128) attention_bwd_prep(KILN_ATTENTION_BWD_ARGS) {
  const bool varlen = flags & k_bwd_varlen;
  const int h = blockIdx.y, b = blockIdx.z, m0 = blockIdx.x * BM;
  const BwdWorkspace w = bwd_workspace<D, DV, BM>(ws, seqlen_q, total_q, total_k, batch, heads);
  const int m_tiles = (seqlen_q + BM - 1) / BM;
  if (threadIdx.x == 0 && int(blockIdx.x) < m_tiles) w.counters[((long long)b * heads + h) * m_tiles + blockIdx.x] = 0;
  long long q0 = (long long)b * seqlen_q;
  int lq = seqlen_q;
  if (varlen) {
    q0 = cu_q[b];
    lq = cu_q[b + 1] - cu_q[b];
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = m0 + warp; r < min(m0 + BM, lq); r += 4) {
    const long long tok = q0 + r;
    const T* orow = o + (tok * heads + h) * DV;
    const T* grow = dout + (tok * heads + h) * DV;
    float sum = 0.0f;
    for (int c = lane; c < DV; c += 32) sum += to_float(orow[c]) * to_float(grow[c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) w.dsum[(long long)h * total_q + tok] = sum;
    float* acc = w.dq + (tok * heads + h) * D;
    for (int c = lane; c < D; c += 32) acc[c] = 0.0f;
  }
}

// The key tiles [t_begin, t_end) (tiles of BN keys) that some row of query tile m (tiles of BM
// queries) sees, in a sequence of lq queries and lk keys: the forward kernels' key range, so that
// forward and backward agree on which (query tile, key tile) pairs exist.
template <int BM, int BN>
__device__ __forceinline__ void visible_key_tiles(int m, int lq, int lk, int window_left, int window_right,
                                                  int& t_begin, int& t_end) {
  const int delta = lk - lq, m0 = m * BM, m_last = min(m0 + BM, lq) - 1;
  int n_end = lk, n_begin = 0;
  if (window_right >= 0) n_end = min(n_end, m_last + delta + window_right + 1);
  if (window_left >= 0) n_begin = max(0, m0 + delta - window_left);
  t_begin = n_begin / BN;
  t_end = n_end > n_begin ? (n_end + BN - 1) / BN : t_begin;
}

// The query tiles [m_begin, m_end) (tiles of BM queries) that see any key of key tile `n` (tiles
// of BN keys): visible_key_tiles scanned over the sequence's query tiles. Empty: m_begin = m_end.
template <int BM, int BN>
__device__ __forceinline__ void visible_query_tiles(int n, int lq, int lk, int window_left, int window_right,
                                                    int& m_begin, int& m_end) {
  m_begin = m_end = 0;
  bool found = false;
  for (int m = 0; m < (lq + BM - 1) / BM; ++m) {
    int tb, te;
    visible_key_tiles<BM, BN>(m, lq, lk, window_left, window_right, tb, te);
    if (tb > n || n >= te) continue;
    if (!found) m_begin = m;
    found = true;
    m_end = m + 1;
  }
}

// Adds (a, b) to p[0], p[1] in global memory: one vector reduction on sm_90, two scalar atomics
// before it.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

template <class T, int D, int DV, int WARPS, int BM>
__global__ void __launch_bounds__(WARPS * 32) attention_bwd_main(KILN_ATTENTION_BWD_ARGS) {
  const bool varlen = flags & k_bwd_varlen, deterministic = flags & k_bwd_deterministic;
  static_assert(D % 16 == 0 && DV % 16 == 0 && BM % 16 == 0, "tiles are whole m16n8k16 steps");
  // The dQ tile [BM, D]: RG groups of 16 rows times DG groups of DW dims, a warp each.
  constexpr int RG = BM / 16, DG = WARPS / RG, DW = D / DG;
  static_assert(RG * DG == WARPS && DW * DG == D && DW % 16 == 0, "the warps tile the dQ tile");
  constexpr int NT = WARPS * 32, BN = 16 * WARPS;
  constexpr int PQ = D + 8, PV = DV + 8, PS = BM + 8;  // shared row pitches, elements
  constexpr int K_BYTES = BN * PQ * 2, V_BYTES = BN * PV * 2, Q_BYTES = BM * PQ * 2, O_BYTES = BM * PV * 2;
  constexpr int STAGE = Q_BYTES + O_BYTES + 2 * BM * 4;  // Q, dO, lse (base 2), Dsum
  constexpr int NM = BM / 8;                              // n8 blocks of S^T (queries)
  constexpr int DQ = DW % 64 == 0 ? 64 : DW;              // dQ dims computed at a time
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned sk = ptx::smem_addr(smem), sv = sk + K_BYTES, sstage = sv + V_BYTES;
  const unsigned sds = sstage + 2 * STAGE;  // dS^T [BN][PS]
  unsigned char* const stage_ptr = smem + K_BYTES + V_BYTES;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nblock = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  long long q0 = (long long)b * seqlen_q, k0 = (long long)b * seqlen_k;
  int lq = seqlen_q, lk = seqlen_k;
  if (varlen) {
    q0 = cu_q[b];
    lq = cu_q[b + 1] - cu_q[b];
    k0 = cu_k[b];
    lk = cu_k[b + 1] - cu_k[b];
  }
  const int n0 = nblock * BN;
  if (n0 >= lk) return;
  const int hk = h / (heads / kv_heads);
  const bool gqa = heads != kv_heads;
  const BwdWorkspace w = bwd_workspace<D, DV, BM>(ws, seqlen_q, total_q, total_k, batch, heads);
  const int m_tiles = (seqlen_q + BM - 1) / BM;
  const long long q_stride = (long long)heads * D, k_stride = (long long)kv_heads * D;
  const long long v_stride = (long long)kv_heads * DV, o_stride = (long long)heads * DV;
  const T* qp = q + q0 * q_stride + (long long)h * D;
  const T* gp = dout + q0 * o_stride + (long long)h * DV;

  // The query tiles that see any key of this tile.
  int m_begin, m_end;
  visible_query_tiles<BM, BN>(nblock, lq, lk, window_left, window_right, m_begin, m_end);

  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f;
  const int delta = lk - lq;

  auto load_q = [&](int m, int stage) {
    const unsigned s = sstage + unsigned(stage * STAGE);
    const int r0 = m * BM;
    load_rows<BM, D, PQ, NT>(s, qp + (long long)r0 * q_stride, q_stride, lq - r0, tid);
    load_rows<BM, DV, PV, NT>(s + Q_BYTES, gp + (long long)r0 * o_stride, o_stride, lq - r0, tid);
    float* sl = reinterpret_cast<float*>(stage_ptr + stage * STAGE + Q_BYTES + O_BYTES);
    for (int i = tid; i < BM; i += NT) {
      const int row = r0 + i;
      float l = __int_as_float(0x7f800000);  // +inf: P = 0 for rows past the end or that see nothing
      float ds = 0.0f;
      if (row < lq) {
        const long long at = varlen ? (long long)h * total_q + q0 + row : ((long long)b * heads + h) * seqlen_q + row;
        const float x = lse[at];
        if (x != neg_inf()) l = x * k_log2e;
        ds = w.dsum[(long long)h * total_q + q0 + row];
      }
      sl[i] = l;
      sl[BM + i] = ds;
    }
  };

  load_rows<BN, D, PQ, NT>(sk, k + (k0 + n0) * k_stride + (long long)hk * D, k_stride, lk - n0, tid);
  load_rows<BN, DV, PV, NT>(sv, v + (k0 + n0) * v_stride + (long long)hk * DV, v_stride, lk - n0, tid);
  if (m_begin < m_end) load_q(m_begin, 0);
  gemm::cp_async_commit();

  float dk_acc[D / 8][4], dv_acc[DV / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) dk_acc[j][0] = dk_acc[j][1] = dk_acc[j][2] = dk_acc[j][3] = 0.0f;
#pragma unroll
  for (int j = 0; j < DV / 8; ++j) dv_acc[j][0] = dv_acc[j][1] = dv_acc[j][2] = dv_acc[j][3] = 0.0f;
  const int key0 = n0 + warp * 16 + (lane >> 2);  // the key of accumulator elements 0, 1; key0 + 8: 2, 3

  for (int m = m_begin; m < m_end; ++m) {
    const int stage = (m - m_begin) & 1;
    if (m + 1 < m_end) load_q(m + 1, stage ^ 1);
    gemm::cp_async_commit();
    gemm::cp_async_wait<1>();
    __syncthreads();
    const unsigned sq = sstage + unsigned(stage * STAGE), sg = sq + Q_BYTES;
    const float* sl = reinterpret_cast<const float*>(stage_ptr + stage * STAGE + Q_BYTES + O_BYTES);
    const int r0 = m * BM;

    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys and the tile's BM queries.
    float st[NM][4], dpt[NM][4];
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4];
      gemm::ldmatrix_x4(sk + unsigned((warp * 16 + (lane & 15)) * PQ + kk * 16 + (lane >> 4) * 8) * 2u, a);
#pragma unroll
      for (int nj = 0; nj < NM / 2; ++nj) {
        const int g = lane >> 3, r = nj * 16 + (g >> 1) * 8 + (lane & 7), c = kk * 16 + (g & 1) * 8;
        unsigned bq[4];
        gemm::ldmatrix_x4(sq + unsigned(r * PQ + c) * 2u, bq);
        gemm::mma_16816<T>(st[2 * nj], a, bq[0], bq[1]);
        gemm::mma_16816<T>(st[2 * nj + 1], a, bq[2], bq[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      unsigned a[4];
      gemm::ldmatrix_x4(sv + unsigned((warp * 16 + (lane & 15)) * PV + kk * 16 + (lane >> 4) * 8) * 2u, a);
#pragma unroll
      for (int nj = 0; nj < NM / 2; ++nj) {
        const int g = lane >> 3, r = nj * 16 + (g >> 1) * 8 + (lane & 7), c = kk * 16 + (g & 1) * 8;
        unsigned bg[4];
        gemm::ldmatrix_x4(sg + unsigned(r * PV + c) * 2u, bg);
        gemm::mma_16816<T>(dpt[2 * nj], a, bg[0], bg[1]);
        gemm::mma_16816<T>(dpt[2 * nj + 1], a, bg[2], bg[3]);
      }
    }

    // P^T and dS^T, element by element; masked elements and rows that see nothing give 0.
    const bool edge = n0 + BN > lk || r0 + BM > lq ||
                      (window_right >= 0 && n0 + BN - 1 > r0 + delta + window_right) ||
                      (window_left >= 0 && n0 < min(r0 + BM, lq) - 1 + delta - window_left);
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane & 3) + (e & 1), key = key0 + (e >> 1) * 8, row = r0 + col;
        float x, dfactor = 1.0f;
        if (capped) {
          const float t = tanhf(st[j][e] * cap_in);
          x = softcap * t * k_log2e;
          dfactor = 1.0f - t * t;
        } else {
          x = st[j][e] * scale_log2;
        }
        float p = fast_exp2(x - sl[col]);
        if (edge) {
          const bool seen = key < lk && row < lq && (window_right < 0 || key <= row + delta + window_right) &&
                            (window_left < 0 || key >= row + delta - window_left);
          if (!seen) p = 0.0f;
        }
        st[j][e] = p;
        dpt[j][e] = p * (dpt[j][e] - sl[BM + col]) * dfactor;
      }

    // dV += P^T dO and dK += dS^T Q: the accumulators are the A operands (queries along k).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const unsigned ap[4] = {pack2<T>(st[2 * kk][0], st[2 * kk][1]), pack2<T>(st[2 * kk][2], st[2 * kk][3]),
                              pack2<T>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              pack2<T>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
      const unsigned ad[4] = {pack2<T>(dpt[2 * kk][0], dpt[2 * kk][1]), pack2<T>(dpt[2 * kk][2], dpt[2 * kk][3]),
                              pack2<T>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              pack2<T>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
      for (int nj = 0; nj < DV / 16; ++nj) {
        const int g = lane >> 3, r = kk * 16 + (g & 1) * 8 + (lane & 7), c = nj * 16 + (g >> 1) * 8;
        unsigned bg[4];
        ldmatrix_x4_trans(sg + unsigned(r * PV + c) * 2u, bg);
        gemm::mma_16816<T>(dv_acc[2 * nj], ap, bg[0], bg[1]);
        gemm::mma_16816<T>(dv_acc[2 * nj + 1], ap, bg[2], bg[3]);
      }
#pragma unroll
      for (int nj = 0; nj < D / 16; ++nj) {
        const int g = lane >> 3, r = kk * 16 + (g & 1) * 8 + (lane & 7), c = nj * 16 + (g >> 1) * 8;
        unsigned bq[4];
        ldmatrix_x4_trans(sq + unsigned(r * PQ + c) * 2u, bq);
        gemm::mma_16816<T>(dk_acc[2 * nj], ad, bq[0], bq[1]);
        gemm::mma_16816<T>(dk_acc[2 * nj + 1], ad, bq[2], bq[3]);
      }
      // dS^T to shared memory, [key][query], for dQ.
      const int kr = warp * 16 + (lane >> 2);
      const int qc = kk * 16 + 2 * (lane & 3);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + unsigned(kr * PS + qc) * 2u), "r"(ad[0]));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + unsigned((kr + 8) * PS + qc) * 2u), "r"(ad[1]));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + unsigned(kr * PS + qc + 8) * 2u), "r"(ad[2]));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + unsigned((kr + 8) * PS + qc + 8) * 2u), "r"(ad[3]));
    }
    __syncthreads();

    // dQ tile = dS K: warp w takes queries 16 (w % RG) + 0..15 and dims DW (w / RG) + 0..DW-1; A
    // from dS^T (transposed loads), B = K.
    // DQ dims at a time keep the partial within the registers dK and dV leave.
    int* counter = w.counters + ((long long)b * heads + h) * m_tiles + m;
#pragma unroll
    for (int part = 0; part < DW / DQ; ++part) {
      const int d0 = (warp / RG) * DW + part * DQ;
      float dq_acc[DQ / 8][4];
#pragma unroll
      for (int j = 0; j < DQ / 8; ++j) dq_acc[j][0] = dq_acc[j][1] = dq_acc[j][2] = dq_acc[j][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned a[4];
        {
          const int g = lane >> 3, kr = kk * 16 + (g >> 1) * 8 + (lane & 7), mc = (warp % RG) * 16 + (g & 1) * 8;
          ldmatrix_x4_trans(sds + unsigned(kr * PS + mc) * 2u, a);
        }
#pragma unroll
        for (int nj = 0; nj < DQ / 16; ++nj) {
          const int g = lane >> 3, r = kk * 16 + (g & 1) * 8 + (lane & 7), c = d0 + nj * 16 + (g >> 1) * 8;
          unsigned bk[4];
          ldmatrix_x4_trans(sk + unsigned(r * PQ + c) * 2u, bk);
          gemm::mma_16816<T>(dq_acc[2 * nj], a, bk[0], bk[1]);
          gemm::mma_16816<T>(dq_acc[2 * nj + 1], a, bk[2], bk[3]);
        }
      }
      if (deterministic && part == 0) {
        // Key tiles add in ascending order: this one is number nblock - t_begin among the tile's.
        // Waiting after the first part's products lets a block compute while the one before it
        // adds.
        int tb, te;
        visible_key_tiles<BM, BN>(m, lq, lk, window_left, window_right, tb, te);
        if (tid == 0) {
          while (atomicAdd(counter, 0) != nblock - tb) __nanosleep(32);
          __threadfence();
        }
        __syncthreads();
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r0 + (warp % RG) * 16 + (lane >> 2) + 8 * r;
        if (row >= lq) continue;
        float* acc = w.dq + ((q0 + row) * heads + h) * D + d0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < DQ / 8; ++j) {
          const float x0 = dq_acc[j][2 * r] * scale, x1 = dq_acc[j][2 * r + 1] * scale;
          if (deterministic) {
            volatile float* p = acc + j * 8;
            p[0] = p[0] + x0;
            p[1] = p[1] + x1;
          } else {
            red_add2(acc + j * 8, x0, x1);
          }
        }
      }
    }
    if (deterministic) {
      __threadfence();
      __syncthreads();
      if (tid == 0) atomicAdd(counter, 1);
    }
    // The stage and dS^T are rewritten next iteration: every warp is done reading them.
    __syncthreads();
  }
  gemm::cp_async_wait<0>();

  // dK (scaled) and dV for the warp's keys.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= lk) continue;
    const long long tok = k0 + key;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int c = j * 8 + 2 * (lane & 3);
      const float x0 = dk_acc[j][2 * r] * scale, x1 = dk_acc[j][2 * r + 1] * scale;
      if (gqa) {
        float* p = w.dk + (tok * heads + h) * D + c;
        p[0] = x0;
        p[1] = x1;
      } else {
        Pack<T, 2> pk;
        pk.v[0] = from_float<T>(x0);
        pk.v[1] = from_float<T>(x1);
        store_pack<T, 2>(dk + tok * k_stride + (long long)hk * D + c, pk);
      }
    }
#pragma unroll
    for (int j = 0; j < DV / 8; ++j) {
      const int c = j * 8 + 2 * (lane & 3);
      const float x0 = dv_acc[j][2 * r], x1 = dv_acc[j][2 * r + 1];
      if (gqa) {
        float* p = w.dv + (tok * heads + h) * DV + c;
        p[0] = x0;
        p[1] = x1;
      } else {
        Pack<T, 2> pk;
        pk.v[0] = from_float<T>(x0);
        pk.v[1] = from_float<T>(x1);
        store_pack<T, 2>(dv + tok * v_stride + (long long)hk * DV + c, pk);
      }
    }
  }
}

// Grid-stride over dQ, then (GQA) dK and dV; 256 threads a block.
template <class T, int D, int DV, int BM>
__global__ void __launch_bounds__(256) attention_bwd_finish(KILN_ATTENTION_BWD_ARGS) {
  const bool varlen = flags & k_bwd_varlen;
  const BwdWorkspace w = bwd_workspace<D, DV, BM>(ws, seqlen_q, total_q, total_k, batch, heads);
  const long long step = (long long)gridDim.x * blockDim.x, first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  // Packed layouts: tokens past the last sequence belong to none and get zero gradients.
  const long long q_end = varlen ? cu_q[batch] : total_q, k_end = varlen ? cu_k[batch] : total_k;
  const long long nq = (long long)total_q * heads * D;
  for (long long i = first; i < nq; i += step) {
    const long long tok = i / ((long long)heads * D);
    dq[i] = from_float<T>(tok < q_end ? w.dq[i] : 0.0f);
  }
  const int group = heads / kv_heads;
  if (group == 1) {
    if (!varlen) return;
    const long long k_rows = (long long)total_k - k_end;
    for (long long i = first; i < k_rows * kv_heads * D; i += step) dk[k_end * kv_heads * D + i] = from_float<T>(0.0f);
    for (long long i = first; i < k_rows * kv_heads * DV; i += step)
      dv[k_end * kv_heads * DV + i] = from_float<T>(0.0f);
    return;
  }
  const long long nk = (long long)total_k * kv_heads * D, nv = (long long)total_k * kv_heads * DV;
  for (long long i = first; i < nk; i += step) {
    const long long tok = i / ((long long)kv_heads * D);
    const int hk = int((i / D) % kv_heads), c = int(i % D);
    float s = 0.0f;
    if (tok < k_end)
      for (int g = 0; g < group; ++g) s += w.dk[(tok * heads + hk * group + g) * D + c];
    dk[i] = from_float<T>(s);
  }
  for (long long i = first; i < nv; i += step) {
    const long long tok = i / ((long long)kv_heads * DV);
    const int hk = int((i / DV) % kv_heads), c = int(i % DV);
    float s = 0.0f;
    if (tok < k_end)
      for (int g = 0; g < group; ++g) s += w.dv[(tok * heads + hk * group + g) * DV + c];
    dv[i] = from_float<T>(s);
  }
}

}  // namespace attention
}  // namespace kiln
