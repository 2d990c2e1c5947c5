// Rotary position embedding applied to q and k in one launch, fp32 math.
//
// Work item: VEC rotation pairs of one head of one token, as two VEC-wide loads and two stores of
// q or k, one at offset `pair` in each half of the head. neox pairs (i, i + HEAD_DIM/2), so the
// item holds VEC pairs split across its two packs; gptj pairs (2i, 2i + 1), so each pack holds
// VEC / 2 whole pairs. Either way a warp's accesses are contiguous, and an item reads VEC cos and
// VEC sin values of the token's cache row, which every head of the token shares (they stay in L1). Items are numbered token-major, q heads before k heads, pairs fastest, so
// neighbouring threads read neighbouring bytes. Each element is read and written by one thread,
// which is what makes q_out == q (in place) safe.
//
// A position id outside [0, max_pos) cannot be reported from the kernel; its token's outputs are
// written as NaN instead of reading outside the cache.
// Requires: q, k, q_out, k_out and their token strides aligned to VEC elements; cos and sin aligned
// to min(VEC * sizeof(C), 16) bytes; HEAD_DIM / 2 a multiple of VEC.
#pragma once

#include "common/dtype.cuh"
#include "rope/rope_util.cuh"

namespace kiln {

template <typename T, typename C, int HEAD_DIM, bool NEOX, int VEC, typename Index>
__device__ __forceinline__ void rope_qk_items(const T* q, const T* k, const C* __restrict__ cos,
                                              const C* __restrict__ sin, const long long* __restrict__ position_ids,
                                              T* q_out, T* k_out, Index total, Index per_token, int q_heads,
                                              long long max_pos, long long q_stride, long long k_stride,
                                              long long q_out_stride, long long k_out_stride, Index first, Index step) {
  constexpr int k_pairs = HEAD_DIM / 2;
  constexpr int k_chunks = k_pairs / VEC;
  using P = Pack<T, VEC>;
  for (Index idx = first; idx < total; idx += step) {
    const Index token = idx / per_token;
    const int r = int(idx - token * per_token);
    const int head = r / k_chunks;
    const int pair = (r - head * k_chunks) * VEC;

    const T* src;
    T* dst;
    if (head < q_heads) {
      src = q + (long long)token * q_stride + head * HEAD_DIM;
      dst = q_out + (long long)token * q_out_stride + head * HEAD_DIM;
    } else {
      const int h = head - q_heads;
      src = k + (long long)token * k_stride + h * HEAD_DIM;
      dst = k_out + (long long)token * k_out_stride + h * HEAD_DIM;
    }

    const long long pos = position_ids[token];
    const bool pos_ok = pos >= 0 && pos < max_pos;
    const float k_nan = __int_as_float(0x7fc00000);

    if constexpr (NEOX || VEC == 1) {
      float c[VEC], s[VEC];
      if (pos_ok) {
        load_floats<C, VEC>(cos + pos * k_pairs + pair, c);
        load_floats<C, VEC>(sin + pos * k_pairs + pair, s);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) c[j] = s[j] = k_nan;
      }
      if constexpr (NEOX) {
        const P a = load_pack<T, VEC>(src + pair);
        const P b = load_pack<T, VEC>(src + pair + k_pairs);
        P oa, ob;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float x1 = to_float(a.v[j]), x2 = to_float(b.v[j]);
          oa.v[j] = from_float<T>(x1 * c[j] - x2 * s[j]);
          ob.v[j] = from_float<T>(x2 * c[j] + x1 * s[j]);
        }
        store_pack<T, VEC>(dst + pair, oa);
        store_pack<T, VEC>(dst + pair + k_pairs, ob);
      } else {
        // gptj, one pair: it spans two one-element packs.
        const P a = load_pack<T, 1>(src + 2 * pair);
        const P b = load_pack<T, 1>(src + 2 * pair + 1);
        P oa, ob;
        const float x0 = to_float(a.v[0]), x1 = to_float(b.v[0]);
        oa.v[0] = from_float<T>(x0 * c[0] - x1 * s[0]);
        ob.v[0] = from_float<T>(x1 * c[0] + x0 * s[0]);
        store_pack<T, 1>(dst + 2 * pair, oa);
        store_pack<T, 1>(dst + 2 * pair + 1, ob);
      }
    } else {
      // gptj: the item's two packs are taken at the same offsets as neox's, `pair` into each half
      // of the head (VEC / 2 whole pairs each), so that each load and store instruction of a warp
      // covers one contiguous span; the VEC contiguous elements at 2 * pair would make every
      // instruction touch every other 16 bytes.
      constexpr int k_half = VEC / 2;
      float ca[k_half], sa[k_half], cb[k_half], sb[k_half];
      if (pos_ok) {
        load_floats<C, k_half>(cos + pos * k_pairs + pair / 2, ca);
        load_floats<C, k_half>(sin + pos * k_pairs + pair / 2, sa);
        load_floats<C, k_half>(cos + pos * k_pairs + (k_pairs + pair) / 2, cb);
        load_floats<C, k_half>(sin + pos * k_pairs + (k_pairs + pair) / 2, sb);
      } else {
#pragma unroll
        for (int j = 0; j < k_half; ++j) ca[j] = sa[j] = cb[j] = sb[j] = k_nan;
      }
      const P a = load_pack<T, VEC>(src + pair);
      const P b = load_pack<T, VEC>(src + pair + k_pairs);
      P oa, ob;
#pragma unroll
      for (int j = 0; j < k_half; ++j) {
        const float a0 = to_float(a.v[2 * j]), a1 = to_float(a.v[2 * j + 1]);
        oa.v[2 * j] = from_float<T>(a0 * ca[j] - a1 * sa[j]);
        oa.v[2 * j + 1] = from_float<T>(a1 * ca[j] + a0 * sa[j]);
        const float b0 = to_float(b.v[2 * j]), b1 = to_float(b.v[2 * j + 1]);
        ob.v[2 * j] = from_float<T>(b0 * cb[j] - b1 * sb[j]);
        ob.v[2 * j + 1] = from_float<T>(b1 * cb[j] + b0 * sb[j]);
      }
      store_pack<T, VEC>(dst + pair, oa);
      store_pack<T, VEC>(dst + pair + k_pairs, ob);
    }
  }
}

// One thread per item, grid-stride; the item index is 32-bit whenever the total allows it, which
// keeps the per-item divisions cheap.
template <typename T, typename C, int HEAD_DIM, bool NEOX, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
rope_qk(const T* q, const T* k, const C* __restrict__ cos, const C* __restrict__ sin,
        const long long* __restrict__ position_ids, T* q_out, T* k_out, long long tokens, int q_heads, int kv_heads,
        long long max_pos, long long q_stride, long long k_stride, long long q_out_stride, long long k_out_stride) {
  static_assert(HEAD_DIM % (2 * VEC) == 0, "a head must hold a whole number of items");
  constexpr int k_chunks = HEAD_DIM / 2 / VEC;
  const long long per_token = (long long)(q_heads + kv_heads) * k_chunks;
  const long long total = tokens * per_token;
  if (total <= 0x7fffffffLL) {
    rope_qk_items<T, C, HEAD_DIM, NEOX, VEC, unsigned>(
        q, k, cos, sin, position_ids, q_out, k_out, unsigned(total), unsigned(per_token), q_heads, max_pos, q_stride,
        k_stride, q_out_stride, k_out_stride, blockIdx.x * BLOCK + threadIdx.x, gridDim.x * BLOCK);
  } else {
    rope_qk_items<T, C, HEAD_DIM, NEOX, VEC, unsigned long long>(
        q, k, cos, sin, position_ids, q_out, k_out, (unsigned long long)total, (unsigned long long)per_token, q_heads,
        max_pos, q_stride, k_stride, q_out_stride, k_out_stride,
        (unsigned long long)blockIdx.x * BLOCK + threadIdx.x, (unsigned long long)gridDim.x * BLOCK);
  }
}

}  // namespace kiln
