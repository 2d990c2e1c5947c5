// The attention forward kernel for sm_90a (H100) in the FlashAttention-3 design: warp-specialized,
// wgmma on both products, TMA loads into a ring of shared-memory stages with mbarriers.
//
// A block owns 128 query rows of one (sequence, head) and has three warpgroups:
// - warpgroups 0 and 1 are consumers, 64 query rows each (registers raised by setmaxnreg): for
//   every K/V tile, S = Q K^T by wgmma from shared memory (Q rows as A, the K tile as B, both
//   K-major, 128-byte swizzle), scale or softcap, the mask (only on tiles that cross the diagonal, a
//   window edge or the end of the keys), the online softmax in registers (base 2), then
//   O += P V by wgmma with P from registers (the register-A form: the S accumulator fragment of
//   each warp is the m16n8k16 A fragment once rounded to 16 bits) and V from shared memory as an
//   N-major B operand (V is [keys, head_dim_v] row-major: the transposed descriptor form);
//   with overlap, each tile's S = Q K^T is issued together with the previous tile's P V and the
//   softmax runs while P V is in flight; with pingpong (on top of overlap), the two consumers
//   issue their batches in turn so that one's softmax overlaps the other's GEMMs;
// - warpgroup 2 is the producer (registers lowered): one thread copies the Q tile once and each
//   K/V tile the mask leaves visible into a STAGES-deep ring by bulk tensor copies (TMA, 128-byte
//   swizzle applied by the copy engine). Each stage has a `k_full` and a `v_full` barrier (the
//   copies complete their bytes on them; S can start before V lands) and an `empty` one (every
//   consumer thread arrives when done with the stage).
//
// Tensor maps view q, k and v as matrices of tokens x (heads * head_dim * 2 bytes) (jit's
// 128-byte-wide boxes): the box of head h, dims [64 p, 64 p + 64), tokens [r, r + rows) starts at
// byte column h * head_dim * 2 + 128 p. Shared tiles are panels of 64 dims: panel p of a tile of
// R rows is R rows of 128 bytes at p * R * 128, the layout the 128-byte swizzle descriptors read.
// Rows past the last token come in as zeros; rows past the end of a sequence but within the
// tensor hold the next sequence's tokens: their keys are masked (column >= lk: p = 0, so their
// values add 0 * v) and their queries' rows are computed and never stored. Output rows are stored
// from registers with per-row guards (no TMA store), lse as the sm_80 kernel writes it.
//
// Off sm_90a the kernel compiles to an empty body: the family selects it for compute capability
// 9.0 only.
#pragma once

#include "attention/attention_fwd.cuh"
#include "attention/wgmma_rs_ops.cuh"
#include "common/gemm/gemm_wgmma.cuh"
#include "common/ptx.cuh"

namespace kiln {
namespace attention {

template <int N>
__device__ __forceinline__ void fence_regs(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

template <class T, int D, int DV, int BN, int STAGES, bool OVERLAP, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
    attention_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const int* __restrict__ cu_q, const int* __restrict__ cu_k, T* __restrict__ o,
                       float* __restrict__ lse, int seqlen_q, int seqlen_k, int total_q, int heads, int kv_heads,
                       int window_left, int window_right, int varlen, int reverse, float scale, float softcap,
                       const __grid_constant__ ptx::TmaDesc map_q, const __grid_constant__ ptx::TmaDesc map_k,
                       const __grid_constant__ ptx::TmaDesc map_v) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % 64 == 0 && DV % 64 == 0, "whole 128-byte panels of dims");
  static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "key tiles of whole k16 steps, one wgmma wide");
  static_assert(OVERLAP || !PINGPONG, "pingpong orders the overlapped schedule's batches");
  constexpr int BM = 128, PQ = D / 64, PV = DV / 64;
  constexpr int Q_BYTES = BM * D * 2, K_BYTES = BN * D * 2, V_BYTES = BN * DV * 2, STAGE = K_BYTES + V_BYTES;
  constexpr int NS = BN / 8, NO = DV / 8;  // n8 blocks of S and of the output
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned sq = base, skv = sq + Q_BYTES, bars = skv + STAGES * STAGE;
  const unsigned q_full = bars;
  auto k_full = [&](int s) { return bars + 8u + 8u * unsigned(s); };
  auto v_full = [&](int s) { return bars + 8u + 8u * unsigned(STAGES + s); };
  auto empty = [&](int s) { return bars + 8u + 8u * unsigned(2 * STAGES + s); };

  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
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

  // The keys any row of the block sees: [n_begin, n_end), as tiles [t_begin, t_end).
  const int delta = lk - lq, m_last = min(m0 + BM, lq) - 1;
  int n_end = lk, n_begin = 0;
  if (window_right >= 0) n_end = min(n_end, m_last + delta + window_right + 1);
  if (window_left >= 0) n_begin = max(0, m0 + delta - window_left);
  const int t_begin = n_begin / BN, t_end = n_end > n_begin ? (n_end + BN - 1) / BN : t_begin;

  if (tid == 0) {
    ptx::mbar_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(k_full(s), 1);
      ptx::mbar_init(v_full(s), 1);
      ptx::mbar_init(empty(s), 2 * 128);
    }
    ptx::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 2) {
    // Producer: one thread issues every copy; nothing when no key is visible (the consumers then
    // wait for nothing either).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 256 && t_begin < t_end) {
      ptx::mbar_arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
      for (int p = 0; p < PQ; ++p)
        ptx::tma_load_2d(sq + p * BM * 128, &map_q, h * D * 2 + p * 128, int(q0) + m0, q_full);
      for (int t = t_begin, it = 0; t < t_end; ++t, ++it) {
        const int s = it % STAGES;
        if (it >= STAGES) ptx::mbar_wait(empty(s), ((it / STAGES) + 1) & 1);
        const unsigned st = skv + s * STAGE;
        const int row = int(k0) + t * BN;
        ptx::mbar_arrive_expect_tx(k_full(s), K_BYTES);
#pragma unroll
        for (int p = 0; p < PQ; ++p) ptx::tma_load_2d(st + p * BN * 128, &map_k, hk * D * 2 + p * 128, row, k_full(s));
        ptx::mbar_arrive_expect_tx(v_full(s), V_BYTES);
#pragma unroll
        for (int p = 0; p < PV; ++p)
          ptx::tma_load_2d(st + K_BYTES + p * BN * 128, &map_v, hk * DV * 2 + p * 128, row, v_full(s));
      }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int warp_in_wg = (tid / 32) % 4;
  const int wm0 = m0 + wg * 64, wm_last = min(wm0 + 63, lq - 1);  // this warpgroup's rows
  const int row0 = wm0 + warp_in_wg * 16 + (lane >> 2);             // elements 0, 1; row0 + 8: 2, 3

  float acc[1][NO][4], sacc[1][NS][4];
  gemm::zero_fragments(acc);
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.0f, 0.0f};
  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f, cap_out = softcap * k_log2e;
  // This warpgroup's 64 rows of panel 0 of Q; panel p is BM * 128 bytes on (p * BM * 8 in
  // descriptor units), k16 step j of a panel 32 bytes (2 units) on.
  const unsigned long long q_desc = gemm::smem_desc(sq + wg * 64 * 128);

  // S = Q K^T for the tile in stage s: D / 16 k16 steps, 4 per 128-byte panel. Returns with the
  // batch committed, in flight.
  auto issue_s = [&](int s) {
    const unsigned long long k_desc = gemm::smem_desc(skv + s * STAGE);
    gemm::fence_fragments(sacc);
    gemm::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      gemm::Wgmma<T, BN>::run(sacc, q_desc + (kk / 4) * (BM * 8) + 2 * (kk % 4),
                              k_desc + (kk / 4) * (BN * 8) + 2 * (kk % 4), kk > 0);
    gemm::wgmma_commit();
  };
  // O += P V for the tile in stage s, P from pa: keys 16 kk .. 16 kk + 15 are the rows 2048 kk
  // bytes into each V panel. Returns with the batch committed, in flight.
  unsigned pa[BN / 16][4];
  auto issue_pv = [&](int s) {
    const unsigned sv = skv + s * STAGE + K_BYTES;
    gemm::fence_fragments(acc);
    fence_regs(pa);
    gemm::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      WgmmaRs<T, DV>::run(acc, pa[kk], gemm::smem_desc_mn(sv + kk * 16 * 128, BN * 128), 1);
    gemm::wgmma_commit();
  };
  // Tile t's scores (in sacc, complete) to probabilities: scale or softcap in the base-2 domain,
  // the mask, the online softmax (each row's four lanes, lane % 4, share its max and sum); corr is
  // what the output accumulated so far must be multiplied by.
  auto softmax = [&](int t, float(&corr)[2]) {
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sacc[0][j][e] = capped ? cap_out * tanhf(sacc[0][j][e] * cap_in) : sacc[0][j][e] * scale_log2;
    const int n0 = t * BN;
    const bool edge = n0 + BN > lk || (window_right >= 0 && n0 + BN - 1 > wm0 + delta + window_right) ||
                      (window_left >= 0 && n0 < wm_last + delta - window_left);
    if (edge) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1), row = row0 + (e >> 1) * 8;
          const bool seen = col < lk && (window_right < 0 || col <= row + delta + window_right) &&
                            (window_left < 0 || col >= row + delta - window_left);
          if (!seen) sacc[0][j][e] = neg_inf();
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(sacc[0][j][2 * r], sacc[0][j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen no key yet keeps max -inf; 0 then stands in for it, so exp2 gives 0.
      const float mbase = mx == neg_inf() ? 0.0f : mx;
      corr[r] = fast_exp2(row_max[r] - mbase);
      row_max[r] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        sacc[0][j][2 * r] = fast_exp2(sacc[0][j][2 * r] - mbase);
        sacc[0][j][2 * r + 1] = fast_exp2(sacc[0][j][2 * r + 1] - mbase);
        sum += sacc[0][j][2 * r] + sacc[0][j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * corr[r] + sum;
    }
  };
  auto rescale = [&](const float(&corr)[2]) {
#pragma unroll
    for (int j = 0; j < NO; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][j][e] *= corr[e >> 1];
  };
  // P as the A operand: n8 blocks 2 kk and 2 kk + 1 of the row pair make the k16 step kk.
  auto pack_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = pack2<T>(sacc[0][2 * kk][0], sacc[0][2 * kk][1]);
      pa[kk][1] = pack2<T>(sacc[0][2 * kk][2], sacc[0][2 * kk][3]);
      pa[kk][2] = pack2<T>(sacc[0][2 * kk + 1][0], sacc[0][2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(sacc[0][2 * kk + 1][2], sacc[0][2 * kk + 1][3]);
    }
  };
  // Pingpong: the two consumers issue their batches in turn (consumer 0's batch i, consumer 1's
  // batch i, consumer 0's batch i + 1, ...; named barriers 1 and 2, each consumer arriving after it
  // issues and syncing before), so one's softmax runs while the other's GEMMs hold the tensor
  // cores. Both issue t_end - t_begin + 1 batches (the first tile's S, then S and the previous P V
  // per tile, the last P V); consumer 1 skips its last arrival, which nothing would wait for.
  int batch = 0;
  const int batches = t_end - t_begin + 1;
  auto order_wait = [&]() {
    if constexpr (PINGPONG) {
      if (wg == 1)
        ptx::bar_sync<1, 256>();
      else if (batch > 0)
        ptx::bar_sync<2, 256>();
    }
  };
  auto order_signal = [&]() {
    if constexpr (PINGPONG) {
      if (wg == 0)
        ptx::bar_arrive<1, 256>();
      else if (batch + 1 < batches)
        ptx::bar_arrive<2, 256>();
      ++batch;
    }
  };
  auto stage_of = [](int it) { return it % STAGES; };
  auto phase_of = [](int it) { return unsigned(it / STAGES) & 1u; };

  if (t_begin < t_end) {
    ptx::mbar_wait(q_full, 0);
    if constexpr (!OVERLAP) {
      // Serial: S, softmax, P V for each tile in turn.
      for (int t = t_begin, it = 0; t < t_end; ++t, ++it) {
        const int s = stage_of(it);
        ptx::mbar_wait(k_full(s), phase_of(it));
        issue_s(s);
        gemm::wgmma_wait<0>();
        gemm::fence_fragments(sacc);
        float corr[2];
        softmax(t, corr);
        rescale(corr);
        pack_p();
        ptx::mbar_wait(v_full(s), phase_of(it));
        issue_pv(s);
        gemm::wgmma_wait<0>();
        gemm::fence_fragments(acc);
        fence_regs(pa);
        ptx::mbar_arrive(empty(s));
      }
    } else {
      // Overlapped: the first tile's S and softmax; then for each next tile, its S = Q K^T and the
      // previous tile's P V are issued together, the softmax of the new scores runs while P V is
      // in flight, and the output is rescaled once P V is done; the last tile's P V at the end.
      {
        ptx::mbar_wait(k_full(0), 0);
        order_wait();
        issue_s(0);
        order_signal();
        gemm::wgmma_wait<0>();
        gemm::fence_fragments(sacc);
        float corr[2];
        softmax(t_begin, corr);  // the output is still zero: nothing to rescale
        pack_p();
      }
      int it = 1;
      for (int t = t_begin + 1; t < t_end; ++t, ++it) {
        const int s = stage_of(it), sp = stage_of(it - 1);
        ptx::mbar_wait(k_full(s), phase_of(it));
        ptx::mbar_wait(v_full(sp), phase_of(it - 1));
        order_wait();
        issue_s(s);
        issue_pv(sp);
        order_signal();
        gemm::wgmma_wait<1>();  // S done, P V may run on
        gemm::fence_fragments(sacc);
        float corr[2];
        softmax(t, corr);
        gemm::wgmma_wait<0>();
        gemm::fence_fragments(acc);
        fence_regs(pa);
        ptx::mbar_arrive(empty(sp));
        rescale(corr);
        pack_p();
      }
      const int sp = stage_of(it - 1);
      ptx::mbar_wait(v_full(sp), phase_of(it - 1));
      order_wait();
      issue_pv(sp);
      order_signal();
      gemm::wgmma_wait<0>();
      gemm::fence_fragments(acc);
      fence_regs(pa);
      ptx::mbar_arrive(empty(sp));
    }
  }

  // Rows that saw no key (all masked) get zeros and lse -inf.
  const long long o_stride = (long long)heads * DV;
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
      pk.v[0] = from_float<T>(acc[0][j][2 * r] * inv);
      pk.v[1] = from_float<T>(acc[0][j][2 * r + 1] * inv);
      store_pack<T, 2>(orow + j * 8 + 2 * (lane & 3), pk);
    }
    if (lse && (lane & 3) == 0) {
      const long long at = varlen ? (long long)h * total_q + q0 + row : ((long long)b * heads + h) * seqlen_q + row;
      lse[at] = sum > 0.0f ? (row_max[r] + __log2f(sum)) * k_ln2 : neg_inf();
    }
  }
#endif
}

}  // namespace attention
}  // namespace kiln
