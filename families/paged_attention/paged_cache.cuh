// The paged KV cache's data movement and the merge of attention states.
//
// Cache layout (vLLM's flash layout): key_cache and value_cache [num_blocks, page_size, kv_heads,
// head_dim]; slot s is row s % page_size of block s / page_size, so a slot's kv_heads * head_dim
// elements are contiguous and the cache is, row by row, a [num_blocks * page_size, row] matrix.
//
// reshape_and_cache: token t's key and value rows (row_elems = kv_heads * head_dim elements, at
// any row stride) go to slot slot_mapping[t] (int32 or int64; negative: skipped, a padding token).
// C is the cache element: T itself, or an e4m3 byte (unsigned char) holding x / scale rounded to
// nearest even and saturated to +-448, with IEEE division as quantize_fp8 (gemm/quantize_fp8.cuh)
// and the host's common/fp8.h, so the three agree bit for bit. One warp per token, 8 elements a
// lane per step (16-byte loads; 16- or 8-byte stores).
//
// copy_blocks: pairs[i] = (src, dst) block ids (int32 or int64); block dst of the destination
// pool's K and V becomes a copy of block src of the source pool's, 16 bytes a thread. The pools
// are one for copy-on-write and two for swapping, where one side is pinned host memory the
// kernel reads or writes over the bus (its device-mapped address). Blocks (blockIdx.x: pair, blockIdx.y: key or value,
// blockIdx.z: the chunk of the block) are independent: the caller's pairs must not chain (a dst
// that is another pair's src) or repeat a dst, as KVCacheManager's copy lists never do.
//
// merge_state: two attention states over disjoint key sets, (v_a, s_a) and (v_b, s_b) with v
// [tokens, heads, head_dim] (input dtype) and s [tokens, heads] (f32, natural-log lse, -inf for
// an empty set), become one: m = max(s_a, s_b), w = exp(s - m), v = (w_a v_a + w_b v_b) / (w_a +
// w_b), s = m + log(w_a + w_b); both empty: zeros and -inf. One warp per (token, head); each lane
// reads its elements before it writes them, so v_out may be v_a (or v_b) and s_out s_a (or s_b)
// (the in-place merge).
#pragma once

#include "common/dtype.cuh"
#include "gemm/quantize_fp8.cuh"

namespace kiln {
namespace paged {

__device__ __forceinline__ float neg_inf_f() { return __int_as_float(0xff800000); }

__device__ __forceinline__ long long index_at(const void* p, int i64, long long i) {
  return i64 ? static_cast<const long long*>(p)[i] : (long long)static_cast<const int*>(p)[i];
}

template <class T, class C>
__global__ void __launch_bounds__(128)
    reshape_and_cache(const T* __restrict__ key, const T* __restrict__ value, const void* __restrict__ slot_mapping,
                      C* __restrict__ key_cache, C* __restrict__ value_cache, const float* __restrict__ k_scale,
                      const float* __restrict__ v_scale, int tokens, int row_elems, long long key_stride,
                      long long value_stride, int slot_i64) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * 4 + warp;
  if (t >= tokens) return;
  const long long slot = index_at(slot_mapping, slot_i64, t);
  if (slot < 0) return;
  constexpr bool quantize = sizeof(C) == 1;
  const float ks = quantize ? *k_scale : 1.0f, vs = quantize ? *v_scale : 1.0f;
  for (int half = 0; half < 2; ++half) {
    const T* src = half ? value + t * value_stride : key + t * key_stride;
    C* dst = (half ? value_cache : key_cache) + slot * row_elems;
    const float s = half ? vs : ks;
    for (int c = lane * 8; c < row_elems; c += 32 * 8) {
      const Pack<T, 8> x = load_pack<T, 8>(src + c);
      if constexpr (quantize) {
        Pack<unsigned char, 8> q;
#pragma unroll
        for (int j = 0; j < 8; ++j) q.v[j] = quant::f32_to_e4m3(to_float(x.v[j]) / s);
        store_pack<unsigned char, 8>(reinterpret_cast<unsigned char*>(dst) + c, q);
      } else {
        store_pack<T, 8>(reinterpret_cast<T*>(dst) + c, x);
      }
    }
  }
}

__global__ void __launch_bounds__(256)
    copy_blocks(const unsigned char* src_key, const unsigned char* src_value, unsigned char* dst_key,
                unsigned char* dst_value, const void* __restrict__ pairs, int num_pairs, long long block_bytes,
                int pairs_i64) {
  const int pair = blockIdx.x;
  if (pair >= num_pairs) return;
  const unsigned char* from = blockIdx.y ? src_value : src_key;
  unsigned char* to = blockIdx.y ? dst_value : dst_key;
  const long long src = index_at(pairs, pairs_i64, 2ll * pair), dst = index_at(pairs, pairs_i64, 2ll * pair + 1);
  const uint4* s = reinterpret_cast<const uint4*>(from + src * block_bytes);
  uint4* d = reinterpret_cast<uint4*>(to + dst * block_bytes);
  const long long n = block_bytes / 16;
  for (long long i = (long long)blockIdx.z * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.z * blockDim.x)
    d[i] = s[i];
}

template <class T>
__global__ void __launch_bounds__(128)
    merge_state(const T* v_a, const float* s_a, const T* v_b, const float* s_b, T* v_out, float* s_out, int rows,
                int head_dim) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * 4 + warp;
  if (row >= rows) return;
  const float la = s_a[row], lb = s_b[row], m = fmaxf(la, lb);
  const bool empty = m == neg_inf_f();
  const float wa = empty || la == neg_inf_f() ? 0.0f : expf(la - m);
  const float wb = empty || lb == neg_inf_f() ? 0.0f : expf(lb - m);
  const float sum = wa + wb, inv = empty ? 0.0f : 1.0f / sum;
  const float ca = wa * inv, cb = wb * inv;
  const long long base = row * head_dim;
  for (int c = lane * 8; c < head_dim; c += 32 * 8) {
    const Pack<T, 8> a = load_pack<T, 8>(v_a + base + c), b = load_pack<T, 8>(v_b + base + c);
    Pack<T, 8> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = from_float<T>(ca * to_float(a.v[j]) + cb * to_float(b.v[j]));
    store_pack<T, 8>(v_out + base + c, o);
  }
  // Every lane has read s_a[row] and s_b[row] above; the warp converges before one overwrites them.
  __syncwarp();
  if (lane == 0) s_out[row] = empty ? neg_inf_f() : m + logf(sum);
}

}  // namespace paged
}  // namespace kiln
