// The attention backward's main kernel for sm_90a (H100): warp-specialized, every product on wgmma,
// Q and dO tiles by TMA into a ring of shared-memory stages, dQ added by bulk tensor reductions.
// The workspace of attention_bwd_main (attention_bwd.cuh), whose prep and finish kernels run
// before and after it; every mask, softcap, and both modes.
//
// A block owns BN = 128 keys of one (sequence, query head) and walks the query tiles of BM = 64
// rows that see any of them. Three warpgroups:
// - warpgroups 0 and 1 are consumers, 64 of the keys each (registers raised by setmaxnreg). They
//   first copy K and V into shared memory once (128-byte swizzle, as a tensor copy would). Per query
//   tile: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory (K, V rows as A, the Q and dO
//   tiles as B, all K-major, 128-byte swizzle); P^T = exp2(S^T scale log2e - lse log2e) and dS^T =
//   P^T (dP^T - Dsum) with the mask in registers (softcap: the capped score, and dS^T times 1 -
//   tanh^2); dV += P^T dO and dK += dS^T Q by wgmma with A from registers (the accumulator fragment
//   rounded to 16 bits is the A fragment) and the Q, dO tiles as N-major B operands; dS^T to shared
//   memory ([keys, queries], 128-byte swizzle), then dQ_tile = dS K by wgmma with both operands
//   transposed (dS^T M-major, K N-major), stored (scaled, f32) to the consumer's dQ buffer. At
//   head_dim 128 each consumer computes half of dQ's dims over all 128 keys (after a barrier of the
//   two: both halves of dS^T written); at 64 each computes every dim over its own 64 keys, and
//   consumer 1 adds its tile to consumer 0's stored one (one reduction a tile). dS^T has two buffers:
//   a consumer rewrites one only after both have passed the next tile's barrier, by which time the
//   reads of the one before have completed.
// - warpgroup 2 is the producer (registers lowered): one thread copies each query tile's Q and dO
//   rows into a STAGES-deep ring (bulk tensor copies); one warp writes the tile's lse (base 2, +inf
//   for rows past the sequence or that see no key: P = 0 there) and Dsum into the stage; one thread,
//   the dQ writer, adds each stored dQ tile to the f32 accumulator by bulk tensor reductions, one for
//   each 32 dims (deterministic mode: in key-block order, by the workspace's counter of the query
//   tile, with the tiles walked from the last one down). Each stage's `full` barrier completes on the
//   copies' bytes and the 32 lanes' arrivals, its `empty` barrier on every consumer thread's; each dQ
//   buffer's `dq_full` on the threads of the consumer that completes it, its `dq_empty` once the
//   reduction has read it.
//
// Tensor maps view q and dout as tokens x (heads * head_dim * 2 bytes) with 128-byte-wide boxes of
// BM rows, as the forward's (panel p of a tile of R rows is R rows of 128 bytes at p * R * 128),
// and the dQ accumulator as tokens x (heads * head_dim) f32 in boxes of 64 rows x 32 dims (128
// bytes a row, the same swizzle). Rows past the last token come in as zeros and are not written;
// rows of the next sequence are masked (their lse is +inf, their keys are past lk), and their dQ
// rows are zeros that add nothing.
//
// Off sm_90a the kernel compiles to an empty body: the family selects it for compute capability
// 9.0 only.
#pragma once

#include "attention/attention_bwd.cuh"
#include "attention/attention_fwd_sm90.cuh"

namespace kiln {
namespace attention {

template <bool B>
struct BoolConstant {
  static constexpr bool value = B;
};

template <class T, int D, int DV, int BMW, int STAGES>
__global__ void __launch_bounds__(384, 1)
    attention_bwd_sm90(const float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                       float* __restrict__ ws, T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ k,
                       const T* __restrict__ v, int seqlen_q, int seqlen_k, int total_q, int total_k, int batch,
                       int heads, int kv_heads, int window_left, int window_right, int flags, float scale,
                       float softcap, const __grid_constant__ ptx::TmaDesc map_q,
                       const __grid_constant__ ptx::TmaDesc map_o, const __grid_constant__ ptx::TmaDesc map_dq) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D % 64 == 0 && DV % 64 == 0 && D <= 128 && DV <= 128, "whole 128-byte panels, up to 128 dims");
  constexpr int BM = 64, BN = 128, PQ = D / 64, PV = DV / 64;
  constexpr int K_BYTES = BN * D * 2, V_BYTES = BN * DV * 2, Q_BYTES = BM * D * 2, O_BYTES = BM * DV * 2;
  constexpr int STAGE = (Q_BYTES + O_BYTES + 2 * BM * 4 + 1023) / 1024 * 1024;  // Q, dO, lse, Dsum
  constexpr int DS_BYTES = BN * BM * 2;                                         // one dS^T buffer
  constexpr int DQ_BYTES = BM * 64 * 4;  // a consumer's f32 dQ tile [64 queries, 64 dims]
  // dQ: at 128 dims each consumer takes 64 of them over all keys, else every dim over its keys.
  constexpr bool SPLIT_DIMS = D == 128;
  constexpr int DQ_N = 64, DQ_STEPS = SPLIT_DIMS ? BN / 16 : 64 / 16;
  constexpr int DQ_TILES = SPLIT_DIMS ? 2 : 1;  // dQ tiles a query tile hands the writer
  static_assert(SPLIT_DIMS || D == DQ_N, "dQ tiles of 64 dims");
  extern __shared__ unsigned char smem_raw[];
  const unsigned base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned sk = base, sv = sk + K_BYTES, sstage = sv + V_BYTES, sds = sstage + STAGES * STAGE;
  const unsigned sdq = sds + 2 * DS_BYTES, bars = sdq + 2 * DQ_BYTES;
  unsigned char* const gen = smem_raw + (base - ptx::smem_addr(smem_raw));  // base, generic pointer
  auto full = [&](int s) { return bars + 8u * unsigned(s); };
  auto empty = [&](int s) { return bars + 8u * unsigned(STAGES + s); };
  // Consumer c's dQ tile: stored (dq_full, its 128 threads) and read by the reduction (dq_empty).
  auto dq_full = [&](int c) { return bars + 8u * unsigned(2 * STAGES + c); };
  auto dq_empty = [&](int c) { return bars + 8u * unsigned(2 * STAGES + 2 + c); };
  auto stage_lse = [&](int s) {
    return reinterpret_cast<float*>(gen + (sstage - base) + s * STAGE + Q_BYTES + O_BYTES);
  };

  static_assert(BMW <= BM, "the workspace's order counters cover this kernel's query tiles");
  const bool varlen = flags & k_bwd_varlen, deterministic = flags & k_bwd_deterministic;
  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
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

  // The query tiles that see any key of this block: [m_begin, m_end).
  int m_begin, m_end;
  visible_query_tiles<BM, BN>(nblock, lq, lk, window_left, window_right, m_begin, m_end);
  // Iteration `it` takes tile tile_of(it): ascending, or descending in deterministic mode, where a
  // tile's key blocks add in ascending order. Walking down, the blocks of a causal mask meet each
  // tile in the same iteration (walking up, block n would reach a tile two iterations before
  // block n - 1 and wait); with a left window, block n - 1 reaches a tile first.
  const int tiles = m_end - m_begin;
  auto tile_of = [&](int it) { return deterministic ? m_end - 1 - it : m_begin + it; };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      ptx::mbar_init(full(s), 1 + 32);
      ptx::mbar_init(empty(s), 2 * 128);
    }
    for (int c = 0; c < 2; ++c) {
      ptx::mbar_init(dq_full(c), 128);
      ptx::mbar_init(dq_empty(c), 1);
    }
    ptx::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 2) {
    // The block's registers are what the launch allocated (168 a thread, 384 threads): two
    // consumers at 240 leave 24 for this warpgroup; asking more would leave setmaxnreg.inc waiting.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    const int warp = (tid / 32) % 4;
    if (warp == 0 && lane == 0) {
      for (int it = 0; it < tiles; ++it) {
        const int s = it % STAGES, m = tile_of(it);
        if (it >= STAGES) ptx::mbar_wait(empty(s), ((it / STAGES) + 1) & 1);
        const unsigned st = sstage + s * STAGE;
        const int qrow = int(q0) + m * BM;
        ptx::mbar_arrive_expect_tx(full(s), Q_BYTES + O_BYTES);
#pragma unroll
        for (int p = 0; p < PQ; ++p) ptx::tma_load_2d(st + p * BM * 128, &map_q, h * D * 2 + p * 128, qrow, full(s));
#pragma unroll
        for (int p = 0; p < PV; ++p)
          ptx::tma_load_2d(st + Q_BYTES + p * BM * 128, &map_o, h * DV * 2 + p * 128, qrow, full(s));
      }
    } else if (warp == 1) {
      for (int it = 0; it < tiles; ++it) {
        const int s = it % STAGES, m = tile_of(it);
        if (it >= STAGES) ptx::mbar_wait(empty(s), ((it / STAGES) + 1) & 1);
        float* sl = stage_lse(s);
#pragma unroll
        for (int i = lane; i < BM; i += 32) {
          const int row = m * BM + i;
          float l = __int_as_float(0x7f800000), ds = 0.0f;
          if (row < lq) {
            const long long at =
                varlen ? (long long)h * total_q + q0 + row : ((long long)b * heads + h) * seqlen_q + row;
            const float x = lse[at];
            if (x != neg_inf()) l = x * k_log2e;
            ds = ws[(long long)h * total_q + q0 + row];  // Dsum: the workspace's first words
          }
          sl[i] = l;
          sl[BM + i] = ds;
        }
        ptx::mbar_arrive(full(s));
      }
    } else if (warp == 2 && lane == 0) {
      // The dQ writer: each stored dQ tile (one a consumer at head dim 128, the consumers' sum at
      // 64) added to the f32 accumulator by two bulk tensor reductions of 32 dims; the buffer is
      // the consumer's again once they have read it. In deterministic mode it first waits for the
      // query tile's counter to reach this block's place among the key blocks that see the tile,
      // then waits for its additions to complete and counts the block in.
      int* counters = nullptr;
      if (deterministic)
        counters = bwd_workspace<D, DV, BMW>(ws, seqlen_q, total_q, total_k, batch, heads).counters +
                   ((long long)b * heads + h) * ((seqlen_q + BMW - 1) / BMW);
      for (int it = 0; it < tiles; ++it) {
        const int m = tile_of(it);
        if (deterministic) {
          int tb, te;
          visible_key_tiles<BM, BN>(m, lq, lk, window_left, window_right, tb, te);
          while (ptx::ld_acquire_gpu(counters + m) != nblock - tb) __nanosleep(32);
          asm volatile("fence.proxy.async.global;\n" ::: "memory");
        }
        for (int c = 0; c < DQ_TILES; ++c) {
          ptx::mbar_wait(dq_full(c), unsigned(it) & 1u);
          const int col = h * D + (SPLIT_DIMS ? c * 64 : 0), row = int(q0) + m * BM;
#pragma unroll
          for (int half = 0; half < 2; ++half)
            asm volatile(
                "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                    reinterpret_cast<unsigned long long>(&map_dq)),
                "r"(col + 32 * half), "r"(row), "r"(sdq + unsigned(c * DQ_BYTES + half * DQ_BYTES / 2))
                : "memory");
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
          if (deterministic && c == DQ_TILES - 1)
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
          else
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
          ptx::mbar_arrive(dq_empty(c));
        }
        if (deterministic) {
          asm volatile("fence.proxy.async.global;\n" ::: "memory");
          ptx::red_release_gpu_add(counters + m, 1);
        }
      }
      // Shared memory lives until the block exits: the reductions must be done with it.
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const BwdWorkspace w = bwd_workspace<D, DV, BMW>(ws, seqlen_q, total_q, total_k, batch, heads);
  const int warp_in_wg = (tid / 32) % 4;
  // The key of accumulator elements 0, 1 of this thread's S^T rows (block-relative); + 8: 2, 3.
  const int krow = wg * 64 + warp_in_wg * 16 + (lane >> 2);
  const bool capped = softcap > 0.0f;
  const float scale_log2 = scale * k_log2e, cap_in = capped ? scale / softcap : 0.0f, cap_out = softcap * k_log2e;
  const int delta = lk - lq;

  float dk_acc[1][D / 8][4], dv_acc[1][DV / 8][4];
  gemm::zero_fragments(dk_acc);
  gemm::zero_fragments(dv_acc);
  // This consumer's 64 rows of K and V, panel 0; panel p is BN * 128 bytes on (BN * 8 units).
  const unsigned long long k_desc = gemm::smem_desc(sk + wg * 64 * 128), v_desc = gemm::smem_desc(sv + wg * 64 * 128);
  // dQ's operands: the dS^T rows (keys) and the K panel this consumer's part reads.
  const int dq_key0 = SPLIT_DIMS ? 0 : wg * 64;
  const unsigned dq_b = sk + (SPLIT_DIMS ? wg : 0) * BN * 128 + dq_key0 * 128;

  // K and V of the block's keys into their panels (128-byte swizzle: 16-byte chunk c of row r at
  // chunk c ^ (r % 8)); rows past the last key token zero, so that no product meets a NaN.
  if (m_begin < m_end) {
    const int ct = tid;  // 0..255, the consumers' threads
    auto load_panels = [&](const T* src, int dims, unsigned dst) {
      const int chunks = dims / 8;  // 16-byte chunks a row
      for (int i = ct; i < BN * chunks; i += 256) {
        const int r = i / chunks, c = i % chunks;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        const long long tok = k0 + n0 + r;
        if (tok < total_k) x = *reinterpret_cast<const uint4*>(src + (tok * kv_heads + hk) * dims + c * 8);
        const unsigned at = dst + unsigned((c / 8) * BN * 128 + r * 128 + (((c % 8) ^ (r & 7)) * 16));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                     : "memory");
      }
    };
    load_panels(k, D, sk);
    load_panels(v, DV, sv);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    ptx::bar_sync<1, 256>();
  }
  for (int it = 0; it < tiles; ++it) {
    const int s = it % STAGES, m = tile_of(it);
    const unsigned st = sstage + s * STAGE, so = st + Q_BYTES;
    ptx::mbar_wait(full(s), unsigned(it / STAGES) & 1u);
    const float* sl = stage_lse(s);
    const int r0 = m * BM;

    // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries each.
    float sacc[1][BM / 8][4], dpacc[1][BM / 8][4];
    {
      const unsigned long long q_desc = gemm::smem_desc(st), o_desc = gemm::smem_desc(so);
      gemm::fence_fragments(sacc);
      gemm::fence_fragments(dpacc);
      gemm::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        gemm::Wgmma<T, BM>::run(sacc, k_desc + (kk / 4) * (BN * 8) + 2 * (kk % 4),
                                q_desc + (kk / 4) * (BM * 8) + 2 * (kk % 4), kk > 0);
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk)
        gemm::Wgmma<T, BM>::run(dpacc, v_desc + (kk / 4) * (BN * 8) + 2 * (kk % 4),
                                o_desc + (kk / 4) * (BM * 8) + 2 * (kk % 4), kk > 0);
      gemm::wgmma_commit();
      gemm::wgmma_wait<0>();
      gemm::fence_fragments(sacc);
      gemm::fence_fragments(dpacc);
    }

    // P^T and dS^T; masked elements and queries that see nothing give 0.
    const bool edge = n0 + BN > lk || r0 + BM > lq ||
                      (window_right >= 0 && n0 + BN - 1 > r0 + delta + window_right) ||
                      (window_left >= 0 && n0 < min(r0 + BM, lq) - 1 + delta - window_left);
    // Under softcap the score is softcap * tanh(scale * qk / softcap), and dS has the derivative
    // of that, 1 - tanh^2 (scale multiplies dK and dQ in the epilogues). The loop is instantiated
    // for each, so that the uncapped one carries no branch.
    auto p_and_ds = [&](auto cap) {
      constexpr bool CAP = decltype(cap)::value;
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = j * 8 + 2 * (lane & 3) + (e & 1);
          float x, dfactor = 1.0f;
          if constexpr (CAP) {
            const float t = tanhf(sacc[0][j][e] * cap_in);
            x = cap_out * t;
            dfactor = 1.0f - t * t;
          } else {
            x = sacc[0][j][e] * scale_log2;
          }
          float p = fast_exp2(x - sl[col]);
          if (edge) {
            const int key = n0 + krow + (e >> 1) * 8, row = r0 + col;
            const bool seen = key < lk && row < lq && (window_right < 0 || key <= row + delta + window_right) &&
                              (window_left < 0 || key >= row + delta - window_left);
            if (!seen) p = 0.0f;
          }
          sacc[0][j][e] = p;
          dpacc[0][j][e] = CAP ? p * (dpacc[0][j][e] - sl[BM + col]) * dfactor : p * (dpacc[0][j][e] - sl[BM + col]);
        }
    };
    if (capped)
      p_and_ds(BoolConstant<true>{});
    else
      p_and_ds(BoolConstant<false>{});
    unsigned pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      pa[kk][0] = pack2<T>(sacc[0][2 * kk][0], sacc[0][2 * kk][1]);
      pa[kk][1] = pack2<T>(sacc[0][2 * kk][2], sacc[0][2 * kk][3]);
      pa[kk][2] = pack2<T>(sacc[0][2 * kk + 1][0], sacc[0][2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(sacc[0][2 * kk + 1][2], sacc[0][2 * kk + 1][3]);
      da[kk][0] = pack2<T>(dpacc[0][2 * kk][0], dpacc[0][2 * kk][1]);
      da[kk][1] = pack2<T>(dpacc[0][2 * kk][2], dpacc[0][2 * kk][3]);
      da[kk][2] = pack2<T>(dpacc[0][2 * kk + 1][0], dpacc[0][2 * kk + 1][1]);
      da[kk][3] = pack2<T>(dpacc[0][2 * kk + 1][2], dpacc[0][2 * kk + 1][3]);
    }

    // dV += P^T dO and dK += dS^T Q: queries along k, the tiles as N-major B operands.
    gemm::fence_fragments(dv_acc);
    gemm::fence_fragments(dk_acc);
    fence_regs(pa);
    fence_regs(da);
    gemm::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) WgmmaRs<T, DV>::run(dv_acc, pa[kk], gemm::smem_desc_mn(so + kk * 16 * 128, BM * 128), 1);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) WgmmaRs<T, D>::run(dk_acc, da[kk], gemm::smem_desc_mn(st + kk * 16 * 128, BM * 128), 1);
    gemm::wgmma_commit();

    // dS^T to its buffer: row = key, 64 queries in 128 bytes, 16-byte chunks swizzled by row % 8.
    const unsigned dsb = sds + unsigned(it & 1) * DS_BYTES;
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * kk + half;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = krow + 8 * r;
          const unsigned at = dsb + unsigned(key * 128 + ((j ^ (key & 7)) * 16) + 4 * (lane & 3));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(da[kk][2 * half + r]) : "memory");
        }
      }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if constexpr (SPLIT_DIMS)
      ptx::bar_sync<1, 256>();
    else if (wg == 0)
      ptx::bar_sync<1, 128>();
    else
      ptx::bar_sync<2, 128>();

    // dQ_tile [64 queries, 64 dims] = dS K over this consumer's keys.
    float dq_acc[1][DQ_N / 8][4];
    gemm::fence_fragments(dq_acc);
    gemm::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < DQ_STEPS; ++kk)
      gemm::WgmmaMn<T, DQ_N>::run(dq_acc, gemm::smem_desc_mn(dsb + (dq_key0 + kk * 16) * 128, BM * 128),
                            gemm::smem_desc_mn(dq_b + kk * 16 * 128, BN * 128), kk > 0);
    gemm::wgmma_commit();
    gemm::wgmma_wait<1>();  // dV and dK done: the stage may be refilled
    gemm::fence_fragments(dv_acc);
    gemm::fence_fragments(dk_acc);
    fence_regs(pa);
    fence_regs(da);
    ptx::mbar_arrive(empty(s));
    gemm::wgmma_wait<0>();
    gemm::fence_fragments(dq_acc);
    // To the dQ writer through this consumer's buffer, once the previous tile's reduction has read
    // it: two halves of [64 rows, 32 dims], 128 bytes a row, 16-byte chunk c of row r at c ^ (r % 8)
    // (the tensor map's swizzle; the 8 rows a store instruction writes then fall in different
    // banks). Queries past the sequence hold zeros (their dS rows are 0): adding them changes
    // nothing. At 64 dims both consumers' tiles are the same dQ elements (over different keys):
    // consumer 0 stores its tile in buffer 0, consumer 1 adds its own to it and hands the sum to
    // the writer, one reduction a tile.
    const int buf = SPLIT_DIMS ? wg : 0;
    const unsigned mydq = sdq + unsigned(buf) * DQ_BYTES;
    const bool adds = !SPLIT_DIMS && wg == 1;
    if (adds)
      ptx::bar_sync<3, 256>();  // consumer 0's stores of this tile are done
    else if (it > 0)
      ptx::mbar_wait(dq_empty(buf), unsigned(it - 1) & 1u);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_in_wg * 16 + (lane >> 2) + 8 * r;
#pragma unroll
      for (int j = 0; j < DQ_N / 8; ++j) {
        const int chunk = (j % 4) * 2 + ((lane & 3) >> 1);
        const unsigned at =
            mydq + unsigned((j / 4) * (DQ_BYTES / 2) + row * 128 + ((chunk ^ (row & 7)) << 4) + (lane & 1) * 8);
        float x = dq_acc[0][j][2 * r] * scale, y = dq_acc[0][j][2 * r + 1] * scale;
        if (adds) {
          const float2 o = ptx::ld_shared_f2(at);
          x += o.x;
          y += o.y;
        }
        ptx::st_shared_f2(at, x, y);
      }
    }
    if (!SPLIT_DIMS && wg == 0) {
      ptx::bar_arrive<3, 256>();
    } else {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      ptx::mbar_arrive(dq_full(buf));
    }
  }

  // dK (scaled) and dV for this consumer's keys.
  const long long k_stride = (long long)kv_heads * D, v_stride = (long long)kv_heads * DV;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0 + krow + 8 * r;
    if (key >= lk) continue;
    const long long tok = k0 + key;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int c = j * 8 + 2 * (lane & 3);
      const float x0 = dk_acc[0][j][2 * r] * scale, x1 = dk_acc[0][j][2 * r + 1] * scale;
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
      const float x0 = dv_acc[0][j][2 * r], x1 = dv_acc[0][j][2 * r + 1];
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
#endif
}

}  // namespace attention
}  // namespace kiln
