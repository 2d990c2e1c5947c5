// The attention forward kernel for sm_90a (H100) in the FlashAttention-3 design: warp-specialized,
// wgmma on both products, TMA loads into a ring of shared-memory stages with mbarriers.
//
// A block owns 64 * CONSUMERS query rows of one (sequence, head) at a time and has CONSUMERS + 1
// warpgroups:
// - warpgroups 0 .. CONSUMERS - 1 are consumers, 64 query rows each (registers raised by
//   setmaxnreg; two consumers keep the most, three suit small head dims): for every K/V tile,
//   S = Q K^T by wgmma from shared memory (Q rows as A, the K tile as B, both K-major, 128-byte
//   swizzle), the mask (only on tiles that cross the diagonal, a window edge or the end of the
//   keys), the online softmax in registers (base 2, the scale folded into the exponent's
//   multiply-add; a softcap applied first), then O += P V by wgmma with P from registers (the
//   register-A form: the S accumulator fragment of each warp is the m16n8k16 A fragment once
//   rounded to 16 bits) and V from shared memory as an N-major B operand (V is [keys, head_dim_v]
//   row-major: the transposed descriptor form); with overlap, each tile's S = Q K^T is issued
//   together with the previous tile's P V and the softmax runs while P V is in flight; with
//   pingpong (on top of overlap), the consumers issue their batches in turn so that one's softmax
//   overlaps the others' GEMMs;
// - the last warpgroup is the producer (registers lowered): one thread copies each tile's Q and
//   each K/V tile the mask leaves visible into a STAGES-deep ring by bulk tensor copies (TMA,
//   128-byte swizzle applied by the copy engine). Each stage has a `k_full` and a `v_full` barrier
//   (the copies complete their bytes on them; S can start before V lands) and an `empty` one
//   (every consumer thread arrives when done with the stage); `q_empty` tells it the consumers
//   have done with a Q tile.
// A persistent block (PERSISTENT) walks many tiles in turn; the producer loads the next tile's Q
// and keys while the consumers finish the last one.
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

constexpr int k_int_max = 0x7fffffff, k_int_min = -k_int_max - 1;

template <int N>
__device__ __forceinline__ void fence_regs(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

template <class T, int D, int DV, int CONSUMERS, int BN, int STAGES, bool OVERLAP, bool PINGPONG, bool PERSISTENT>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    attention_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const int* __restrict__ cu_q, const int* __restrict__ cu_k, T* __restrict__ o,
                       float* __restrict__ lse, int seqlen_q, int seqlen_k, int total_q, int heads, int kv_heads,
                       int window_left, int window_right, int varlen, int reverse, float scale, float softcap,
                       const __grid_constant__ ptx::TmaDesc map_q, const __grid_constant__ ptx::TmaDesc map_k,
                       const __grid_constant__ ptx::TmaDesc map_v, int batch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % 64 == 0 && DV % 64 == 0, "whole 128-byte panels of dims");
  static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "key tiles of whole k16 steps, one wgmma wide");
  static_assert(OVERLAP || !PINGPONG, "pingpong orders the overlapped schedule's batches");
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
  constexpr int BM = 64 * CONSUMERS, PQ = D / 64, PV = DV / 64;
  constexpr int Q_BYTES = BM * D * 2, K_BYTES = BN * D * 2, V_BYTES = BN * DV * 2, STAGE = K_BYTES + V_BYTES;
  constexpr int NS = BN / 8, NO = DV / 8;  // n8 blocks of S and of the output
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned sq = base, skv = sq + Q_BYTES, bars = skv + STAGES * STAGE;
  const unsigned q_full = bars, q_empty = bars + 8u;
  auto k_full = [&](int s) { return bars + 16u + 8u * unsigned(s); };
  auto v_full = [&](int s) { return bars + 16u + 8u * unsigned(STAGES + s); };
  auto empty = [&](int s) { return bars + 16u + 8u * unsigned(2 * STAGES + s); };

  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;

  // Work items: tile i of BM query rows of one (sequence, head), numbered head by head with the
  // query tiles of a head adjacent (they read the same keys from L2) and, when `reverse`, the
  // causal tiles late in the sequence (the most keys) first. Without PERSISTENT the grid is (query
  // tiles, heads, batch) and a block runs its one tile. With it, block j runs units j, j +
  // gridDim.x, ..., loading the next tile's Q and keys while its consumers finish the last; a unit
  // is one tile, or under `reverse` (causal, where a tile's keys grow with its position) a head's
  // tile k and its tile mblocks - 1 - k, which together see about the same number of keys as any
  // other pair: units of equal work keep the blocks' shares even. Pairs only where every block has
  // two tiles or more anyway, so that pairing never makes a small grid's longest block longer.
  const int mblocks = max((seqlen_q + BM - 1) / BM, 1);
  const bool pairs = PERSISTENT && reverse && mblocks * heads * batch >= 2 * int(gridDim.x);
  const int per_head = pairs ? (mblocks + 1) / 2 : mblocks;
  const int first =
      PERSISTENT ? int(blockIdx.x) : (int(blockIdx.z) * heads + int(blockIdx.y)) * mblocks + int(blockIdx.x);
  const int count = PERSISTENT ? per_head * heads * batch : first + 1, stride = PERSISTENT ? int(gridDim.x) : 1;
  // Tile `half` (0 or 1) of unit u, -1 for none.
  auto tile_of = [&](int u, int half) {
    if (!pairs) return half == 0 ? u : -1;
    const int hb = u / per_head, k = u % per_head, mi = half == 0 ? k : mblocks - 1 - k;
    return half == 1 && mi == k ? -1 : hb * mblocks + mi;
  };
  struct Work {
    int h, b, hk, m0, lq, lk, delta, t_begin, t_end;
    long long q0, k0;
  };
  auto work_of = [&](int i) {
    Work w;
    const int hb = i / mblocks, mi = i % mblocks;
    w.h = hb % heads;
    w.b = hb / heads;
    w.hk = w.h / (heads / kv_heads);
    w.m0 = (reverse ? mblocks - 1 - mi : mi) * BM;
    w.q0 = (long long)w.b * seqlen_q;
    w.k0 = (long long)w.b * seqlen_k;
    w.lq = seqlen_q;
    w.lk = seqlen_k;
    if (varlen) {
      w.q0 = cu_q[w.b];
      w.lq = cu_q[w.b + 1] - cu_q[w.b];
      w.k0 = cu_k[w.b];
      w.lk = cu_k[w.b + 1] - cu_k[w.b];
    }
    // The keys any row of the tile sees: [n_begin, n_end), as key tiles [t_begin, t_end).
    w.delta = w.lk - w.lq;
    const int m_last = min(w.m0 + BM, w.lq) - 1;
    int n_end = w.lk, n_begin = 0;
    if (window_right >= 0) n_end = min(n_end, m_last + w.delta + window_right + 1);
    if (window_left >= 0) n_begin = max(0, w.m0 + w.delta - window_left);
    w.t_begin = n_begin / BN;
    w.t_end = n_end > n_begin ? (n_end + BN - 1) / BN : w.t_begin;
    if (w.m0 >= w.lq) w.t_end = w.t_begin;  // no row: nothing to load or store
    return w;
  };

  if (tid == 0) {
    ptx::mbar_init(q_full, 1);
    ptx::mbar_init(q_empty, CONSUMERS * 128);
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(k_full(s), 1);
      ptx::mbar_init(v_full(s), 1);
      ptx::mbar_init(empty(s), CONSUMERS * 128);
    }
    ptx::mbar_init_fence();
  }
  __syncthreads();

  // Registers per thread after setmaxnreg: the producer's few and the consumers' many fill the 64 K
  // registers of the SM that the one block a multiprocessor holds.
  constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 32, CONSUMER_REGS = CONSUMERS == 2 ? 232 : 160;
  static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "registers of one SM");
  if (wg == CONSUMERS) {
    // Producer: one thread issues every copy. Per tile with a visible key: the Q tile once the
    // consumers are done with the last one (`q_empty`), then each visible K/V tile into the ring,
    // whose position runs on across tiles. Nothing for a tile without one (the consumers then wait
    // for nothing either).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (tid == 128 * CONSUMERS) {
      int it = 0, qi = 0;
      for (int u = first; u < count; u += stride)
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
          const int i = tile_of(u, half);
          if (i < 0) continue;
          const Work w = work_of(i);
          if (w.t_begin >= w.t_end) continue;
          if (qi > 0) ptx::mbar_wait(q_empty, unsigned(qi - 1) & 1u);
          ptx::mbar_arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
          for (int p = 0; p < PQ; ++p)
            ptx::tma_load_2d(sq + p * BM * 128, &map_q, w.h * D * 2 + p * 128, int(w.q0) + w.m0, q_full);
          ++qi;
          for (int t = w.t_begin; t < w.t_end; ++t, ++it) {
            const int s = it % STAGES;
            if (it >= STAGES) ptx::mbar_wait(empty(s), ((it / STAGES) + 1) & 1);
            const unsigned st = skv + s * STAGE;
            const int row = int(w.k0) + t * BN;
            ptx::mbar_arrive_expect_tx(k_full(s), K_BYTES);
#pragma unroll
            for (int p = 0; p < PQ; ++p)
              ptx::tma_load_2d(st + p * BN * 128, &map_k, w.hk * D * 2 + p * 128, row, k_full(s));
            ptx::mbar_arrive_expect_tx(v_full(s), V_BYTES);
#pragma unroll
            for (int p = 0; p < PV; ++p)
              ptx::tma_load_2d(st + K_BYTES + p * BN * 128, &map_v, w.hk * DV * 2 + p * 128, row, v_full(s));
          }
        }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
  const int warp_in_wg = (tid / 32) % 4;
  // The current tile's mask, for the thread's first row (elements 0, 1; the row 8 below has 2, 3):
  // a key column col is seen iff col < lk and lo <= col <= hi (lo and hi 8 more for the second
  // row; lo the int range's low end where the window has no left bound, hi at most lk - 1, so that
  // the second row's bound stays in range); key tiles starting below edge_lo or above edge_hi need
  // the mask for some row of the warpgroup.
  int lk = 0, lo = 0, hi = 0, edge_lo = 0, edge_hi = 0, ct_begin = 0, ct_end = 0;

  float acc[1][NO][4], sacc[1][NS][4];
  float row_max[2], row_sum[2];
  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f, cap_out = softcap * k_log2e;
  // Scores enter the exponent as s * mul - max * mul in one multiply-add; the row max of the raw
  // scores is the max of the scaled ones when mul > 0. A softcap (or a scale that is not positive)
  // maps the scores first, and mul is 1.
  const bool premap = capped || !(scale_log2 > 0.0f);
  const float mul = premap ? 1.0f : scale_log2;
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
  // Key tile t's scores (in sacc, complete) to probabilities: softcap (or a scale that is not
  // positive) first, the mask, the online softmax in the base-2 domain (each row's four lanes, lane
  // % 4, share its max and sum); corr is what the output accumulated so far must be multiplied by.
  auto softmax = [&](int t, float(&corr)[2]) {
    if (premap) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sacc[0][j][e] = capped ? cap_out * tanhf(sacc[0][j][e] * cap_in) : sacc[0][j][e] * scale_log2;
    }
    const int n0 = t * BN;
    if (n0 < edge_lo || n0 > edge_hi) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1), below = (e >> 1) * 8;
          const bool seen = col < lk && col >= lo + (lo == k_int_min ? 0 : below) &&
                            col <= hi + below;
          if (!seen) sacc[0][j][e] = neg_inf();
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(sacc[0][j][2 * r], sacc[0][j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // row_max is kept scaled (base 2). A row that has seen no key yet keeps max -inf; 0 then
      // stands in for it, so exp2 gives 0.
      const float mscaled = fmaxf(row_max[r], mx * mul), mbase = mscaled == neg_inf() ? 0.0f : mscaled;
      corr[r] = fast_exp2(row_max[r] - mbase);
      row_max[r] = mscaled;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        sacc[0][j][2 * r] = fast_exp2(fmaf(sacc[0][j][2 * r], mul, -mbase));
        sacc[0][j][2 * r + 1] = fast_exp2(fmaf(sacc[0][j][2 * r + 1], mul, -mbase));
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
  // Pingpong: the consumers issue their batches in turn (consumer 0's batch i, consumer 1's batch
  // i, ..., consumer 0's batch i + 1, ...; named barrier 1 + w is consumer w's turn: it syncs there
  // before issuing and arrives at the next consumer's after), so one's softmax runs while the
  // others' GEMMs hold the tensor cores. Per tile all issue t_end - t_begin + 1 batches (the first
  // key tile's S, then S and the previous P V per key tile, the last P V); consumer 0 waits for no
  // turn before its first batch, and the last consumer skips its last arrival, which nothing would
  // wait for: every arrival of a tile is matched within it.
  int turn = 0,
      turns = 0;  // the batch about to be issued and the tile's batches
  auto order_wait = [&]() {
    if constexpr (PINGPONG) {
      if (wg > 0 || turn > 0) ptx::bar_sync_at<256>(1 + wg);
    }
  };
  auto order_signal = [&]() {
    if constexpr (PINGPONG) {
      if (wg + 1 < CONSUMERS)
        ptx::bar_arrive_at<256>(2 + wg);
      else if (turn + 1 < turns)
        ptx::bar_arrive_at<256>(1);
      ++turn;
    }
  };
  auto stage_of = [](int it) { return it % STAGES; };
  auto phase_of = [](int it) { return unsigned(it / STAGES) & 1u; };

  const long long o_stride = (long long)heads * DV;
  // The ring position and the Q tiles used, counted as the producer counts them.
  int it = 0, qi = 0;
  // Key tiles of the block this warpgroup's rows do not see: it hands their stages back once they
  // have landed (an arrival before then could count in the phase of the stage's previous tile).
  auto skip = [&](int n) {
    for (int i = 0; i < n; ++i, ++it) {
      ptx::mbar_wait(k_full(stage_of(it)), phase_of(it));
      ptx::mbar_arrive(empty(stage_of(it)));
    }
  };
  for (int u = first; u < count; u += stride)
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const int i = tile_of(u, half);
      if (i < 0) continue;
      const Work w = work_of(i);
      if (w.m0 >= w.lq) continue;
      {
        // In 64 bits, clamped to the int range: windows may be as wide as an int.
        const long long wm0 = w.m0 + wg * 64, wm_last = min(w.m0 + wg * 64 + 63, w.lq - 1),
                        row0 = wm0 + warp_in_wg * 16 + (lane >> 2), wl = window_left, wr = window_right;
        auto clamp = [](long long x) { return int(max(min(x, (long long)k_int_max), (long long)k_int_min)); };
        lk = w.lk;
        lo = wl >= 0 ? clamp(row0 + w.delta - wl) : k_int_min;
        hi = int(min(wr >= 0 ? row0 + w.delta + wr : (long long)lk, (long long)lk - 1));
        // A tile is unmasked when it ends by lk and by every row's hi, and starts at or after every
        // row's lo.
        edge_hi = clamp(min((long long)lk - BN, wr >= 0 ? wm0 + w.delta + wr - BN + 1 : (long long)k_int_max));
        edge_lo = wl >= 0 ? clamp(wm_last + w.delta - wl) : k_int_min;
        // The key tiles this warpgroup computes, [ct_begin, ct_end) within the block's: on the
        // serial schedule only those its rows see; the overlapped ones keep the block's (pingpong's
        // turns count the block's batches, and the overlapped loop has no register to spare).
        if constexpr (!OVERLAP) {
          long long nb = 0, ne = lk;
          if (wr >= 0) ne = min(ne, wm_last + w.delta + wr + 1);
          if (wl >= 0) nb = max(nb, wm0 + w.delta - wl);
          ct_begin = int(max((long long)w.t_begin, min(nb / BN, (long long)w.t_end)));
          ct_end = wm0 < w.lq && ne > nb ? int(min((long long)w.t_end, (ne + BN - 1) / BN)) : ct_begin;
          ct_end = max(ct_end, ct_begin);
        } else {
          ct_begin = w.t_begin;
          ct_end = w.t_end;
        }
      }
      gemm::zero_fragments(acc);
      row_max[0] = row_max[1] = neg_inf();
      row_sum[0] = row_sum[1] = 0.0f;
      turn = 0;
      turns = w.t_end - w.t_begin + 1;

      if (w.t_begin < w.t_end) {
        ptx::mbar_wait(q_full, unsigned(qi) & 1u);
        ++qi;
        skip(ct_begin - w.t_begin);
        if (ct_begin == ct_end) {
          ptx::mbar_arrive(q_empty);  // no key of the block for these rows: Q is not read
        } else if constexpr (!OVERLAP) {
          // Serial: S, softmax, P V for each key tile in turn.
          for (int t = ct_begin; t < ct_end; ++t, ++it) {
            const int s = stage_of(it);
            ptx::mbar_wait(k_full(s), phase_of(it));
            issue_s(s);
            gemm::wgmma_wait<0>();
            gemm::fence_fragments(sacc);
            if (t + 1 == ct_end) ptx::mbar_arrive(q_empty);  // the last read of Q is done
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
          // Overlapped: the first key tile's S and softmax; then for each next key tile, its S = Q
          // K^T and the previous tile's P V are issued together, the softmax of the new scores runs
          // while P V is in flight, and the output is rescaled once P V is done; the last key
          // tile's P V at the end.
          {
            ptx::mbar_wait(k_full(stage_of(it)), phase_of(it));
            order_wait();
            issue_s(stage_of(it));
            order_signal();
            gemm::wgmma_wait<0>();
            gemm::fence_fragments(sacc);
            if (ct_begin + 1 == ct_end) ptx::mbar_arrive(q_empty);
            float corr[2];
            softmax(ct_begin, corr);  // the output is still zero: nothing to rescale
            pack_p();
            ++it;
          }
          for (int t = ct_begin + 1; t < ct_end; ++t, ++it) {
            const int s = stage_of(it), sp = stage_of(it - 1);
            ptx::mbar_wait(k_full(s), phase_of(it));
            ptx::mbar_wait(v_full(sp), phase_of(it - 1));
            order_wait();
            issue_s(s);
            issue_pv(sp);
            order_signal();
            gemm::wgmma_wait<1>();  // S done, P V may run on
            gemm::fence_fragments(sacc);
            if (t + 1 == ct_end) ptx::mbar_arrive(q_empty);
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
        skip(w.t_end - ct_end);
      }

      // Rows that saw no key (all masked, or a tile without a visible key) get zeros and lse -inf.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = w.m0 + wg * 64 + warp_in_wg * 16 + (lane >> 2) + 8 * r;
        if (row >= w.lq) continue;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        T *orow = o + (w.q0 + row) * o_stride + (long long)w.h * DV;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
          Pack<T, 2> pk;
          pk.v[0] = from_float<T>(acc[0][j][2 * r] * inv);
          pk.v[1] = from_float<T>(acc[0][j][2 * r + 1] * inv);
          store_pack<T, 2>(orow + j * 8 + 2 * (lane & 3), pk);
        }
        if (lse && (lane & 3) == 0) {
          const long long at =
              varlen ? (long long)w.h * total_q + w.q0 + row : ((long long)w.b * heads + w.h) * seqlen_q + row;
          lse[at] = sum > 0.0f ? (row_max[r] + __log2f(sum)) * k_ln2 : neg_inf();
        }
      }
    }
#endif
}

}  // namespace attention
}  // namespace kiln
