// MoE routing kernels: top-k gating (softmax, or DeepSeek-V3's sigmoid + bias + group-limited
// top-k), the counting sort of (token, slot) entries by expert, the gather of token rows into
// expert-sorted rows and the weighted combine back to token order. Every result is deterministic:
// ties between experts go to the lower index, sorted rows keep (token, slot) order within an
// expert, and sums run in a fixed order.
#pragma once

#include "common/dtype.cuh"

namespace kiln {
namespace moe {

enum Scoring { k_softmax = 0, k_sigmoid_group = 1 };

// NVRTC has no INFINITY macro.
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// The better of two candidates (value v, index i; i < 0 is no candidate): the larger value, the
// lower index on a tie. NaN never wins.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  if (i < 0 || v != v) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The best of s[0 .. count) that `taken` (a bit per entry, in shared memory) does not mark, over
// the warp: every lane returns the same (value, index); index -1 when none is left.
__device__ __forceinline__ void warp_best(const float* s, const unsigned* taken, int count, float& v, int& i) {
  const int lane = threadIdx.x & 31;
  v = 0.0f;
  i = -1;
  for (int e = lane; e < count; e += 32)
    if (!((taken[e >> 5] >> (e & 31)) & 1u) && better(s[e], e, v, i)) {
      v = s[e];
      i = e;
    }
  warp_argmax(v, i);
}

// One warp per token, WARPS tokens per block. Shared memory per warp: scores [experts] and, for
// sigmoid scoring, the biased choice scores [experts], then the taken bits [experts / 32 + 1].
// Softmax: probabilities p = softmax(logits) (fp32), the top_k largest (logits order: the
// selection never depends on exp's rounding), weights p or, with renormalize, p / sum(selected p).
// Sigmoid + group: s = sigmoid(logit), choice = s + bias; each of n_group groups of
// experts / n_group scores the sum of its two best choices, the topk_group best groups stay, the
// top_k best choices among their experts are picked, weights s (renormalized over the picked when
// asked) times `scale`. Fewer than top_k selectable experts (NaN logits) leave id -1, weight 0.
template <class T, int MODE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    moe_topk(const T* __restrict__ logits, const float* __restrict__ bias, float* __restrict__ weights,
             int* __restrict__ ids, int tokens, int experts, int top_k, int n_group, int topk_group, int renormalize,
             float scale) {
  extern __shared__ float smem_f[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int words = experts / 32 + 1;
  const int per_warp = (MODE == k_sigmoid_group ? 2 : 1) * experts + words;
  float* s = smem_f + warp * per_warp;
  float* choice = s + experts;  // sigmoid scoring only
  unsigned* taken = reinterpret_cast<unsigned*>(s + per_warp - words);
  const long long t = (long long)blockIdx.x * WARPS + warp;
  if (t >= tokens) return;
  const T* row = logits + t * experts;
  for (int w = lane; w < words; w += 32) taken[w] = 0u;
  float total = 0.0f;
  if constexpr (MODE == k_softmax) {
    float mx = neg_inf();
    for (int e = lane; e < experts; e += 32) {
      const float v = to_float(row[e]);
      s[e] = v;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int e = lane; e < experts; e += 32) total += expf(s[e] - mx);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    __syncwarp();
    float mine = 0.0f;
    int mine_id = -1;
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      float v;
      int i;
      warp_best(s, taken, experts, v, i);
      const float p = i >= 0 ? expf(v - mx) / total : 0.0f;
      if (lane == j) {
        mine = p;
        mine_id = i;
      }
      sum += p;
      if (i >= 0 && lane == 0) taken[i >> 5] |= 1u << (i & 31);
      __syncwarp();
    }
    if (lane < top_k) {
      weights[t * top_k + lane] = renormalize && sum > 0.0f ? mine / sum : mine;
      ids[t * top_k + lane] = mine_id;
    }
  } else {
    for (int e = lane; e < experts; e += 32) {
      const float v = 1.0f / (1.0f + expf(-to_float(row[e])));
      s[e] = v;
      choice[e] = v + bias[e];
    }
    __syncwarp();
    // Lane g < n_group scores group g: the sum of its two best choices (one for one-expert groups).
    const int gsize = experts / n_group;
    float gscore = 0.0f;
    if (lane < n_group) {
      float b0 = neg_inf(), b1 = neg_inf();
      for (int e = lane * gsize; e < (lane + 1) * gsize; ++e) {
        const float c = choice[e];
        if (c > b0) {
          b1 = b0;
          b0 = c;
        } else if (c > b1) {
          b1 = c;
        }
      }
      gscore = gsize > 1 ? b0 + b1 : b0;
    }
    // The topk_group best groups; every expert of the other groups is marked taken.
    unsigned kept = 0u;
    for (int j = 0; j < topk_group; ++j) {
      float v = gscore;
      int i = lane < n_group && !((kept >> lane) & 1u) ? lane : -1;
      warp_argmax(v, i);
      if (i >= 0) kept |= 1u << i;
    }
    for (int e = lane; e < experts; e += 32)
      if (!((kept >> (e / gsize)) & 1u)) atomicOr(&taken[e >> 5], 1u << (e & 31));
    __syncwarp();
    float mine = 0.0f;
    int mine_id = -1;
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      float v;
      int i;
      warp_best(choice, taken, experts, v, i);
      const float w = i >= 0 ? s[i] : 0.0f;
      if (lane == j) {
        mine = w;
        mine_id = i;
      }
      sum += w;
      if (i >= 0 && lane == 0) taken[i >> 5] |= 1u << (i & 31);
      __syncwarp();
    }
    if (lane < top_k) {
      const float w = renormalize && sum > 0.0f ? mine / sum : mine;
      weights[t * top_k + lane] = w * scale;
      ids[t * top_k + lane] = mine_id;
    }
  }
}

// The counting sort of n = tokens x top_k entries by expert, in one block of 1024 threads:
// offsets [experts + 1] (expert e's rows are [offsets[e], offsets[e + 1])), row_of [n] (the
// sorted row of entry i, -1 for an id outside [0, experts), which is dropped) and src_of [n] (the
// entry of sorted row r, -1 past the last row). Within an expert rows keep entry order: a chunk of
// 1024 entries at a time, an entry's rank is the count of equal ids before it (in its warp by
// __match_any_sync, in earlier warps from per-warp counts), plus what earlier chunks placed.
// Shared memory: counts [experts] and running [experts] (int), per-warp counts [32][experts] (u16).
__global__ void __launch_bounds__(1024)
    moe_sort(const int* __restrict__ expert_ids, int* __restrict__ offsets, int* __restrict__ row_of,
             int* __restrict__ src_of, int n, int experts) {
  extern __shared__ int smem_i[];
  int* count = smem_i;
  int* running = count + experts;
  unsigned short* wcount = reinterpret_cast<unsigned short*>(running + experts);
  __shared__ int warp_total[32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int e = tid; e < experts; e += 1024) {
    count[e] = 0;
    running[e] = 0;
  }
  for (int e = tid; e < 32 * experts; e += 1024) wcount[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += 1024) {
    const int e = expert_ids[i];
    if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Exclusive scan of the counts into running (each expert's first row), 1024 experts per pass.
  int carry = 0;
  for (int e0 = 0; e0 < experts; e0 += 1024) {
    const int e = e0 + tid;
    const int c = e < experts ? count[e] : 0;
    int x = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = warp_total[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_total[lane] = w;
    }
    __syncthreads();
    const int before = carry + (warp ? warp_total[warp - 1] : 0) + x - c;
    if (e < experts) {
      running[e] = before;
      offsets[e] = before;
    }
    carry += warp_total[31];
    __syncthreads();
  }
  if (tid == 0) offsets[experts] = carry;
  const unsigned lt = (1u << lane) - 1u;
  for (int c0 = 0; c0 < n; c0 += 1024) {
    const int i = c0 + tid;
    const int raw = i < n ? expert_ids[i] : -1;
    const bool ok = raw >= 0 && raw < experts;
    const int e = ok ? raw : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const bool leader = ok && (peers & lt) == 0u;
    if (leader) wcount[warp * experts + e] = (unsigned short)__popc(peers);
    __syncthreads();
    int row = -1;
    if (ok) {
      int before = running[e] + __popc(peers & lt);
      for (int w = 0; w < warp; ++w) before += wcount[w * experts + e];
      row = before;
      src_of[row] = i;
    }
    if (i < n) row_of[i] = row;
    __syncthreads();
    if (leader) {
      atomicAdd(&running[e], __popc(peers));
      wcount[warp * experts + e] = 0;
    }
    __syncthreads();
  }
  for (int r = carry + tid; r < n; r += 1024) src_of[r] = -1;
}

// out[r, :] = x[src_of[r] / top_k, :] (times weights[src_of[r]] when WEIGHTED), zeros where
// src_of[r] < 0; one block per row, VEC elements per access, fp32 products.
template <class T, int VEC, int WEIGHTED>
__global__ void __launch_bounds__(128)
    moe_gather(const T* __restrict__ x, const int* __restrict__ src_of, const float* __restrict__ weights,
               T* __restrict__ out, int rows, int tokens, int top_k, int hidden) {
  const long long r = blockIdx.x;
  if (r >= rows) return;
  const int src = src_of[r];
  const bool ok = src >= 0 && src / top_k < tokens;
  const float w = WEIGHTED && ok ? weights[src] : 1.0f;
  const T* in = x + (ok ? (long long)(src / top_k) * hidden : 0);
  T* o = out + r * hidden;
  for (int c = threadIdx.x * VEC; c < hidden; c += 128 * VEC) {
    Pack<T, VEC> v;
    if (ok) {
      v = load_pack<T, VEC>(in + c);
      if (WEIGHTED) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = from_float<T>(to_float(v.v[j]) * w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v.v[j] = from_float<T>(0.0f);
    }
    store_pack<T, VEC>(o + c, v);
  }
}

// out[t, :] = sum over j < top_k of w[t, j] * y[row_of[t * top_k + j], :] (w = 1 without
// WEIGHTED), in j order with fp32 accumulation; entries whose row is outside [0, rows) add
// nothing. One block per token.
template <class T, int VEC, int WEIGHTED>
__global__ void __launch_bounds__(128)
    moe_combine(const T* __restrict__ y, const int* __restrict__ row_of, const float* __restrict__ weights,
                T* __restrict__ out, int tokens, int rows, int top_k, int hidden) {
  const long long t = blockIdx.x;
  if (t >= tokens) return;
  for (int c = threadIdx.x * VEC; c < hidden; c += 128 * VEC) {
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int q = 0; q < top_k; ++q) {
      const int r = row_of[t * top_k + q];
      if (r < 0 || r >= rows) continue;
      const float w = WEIGHTED ? weights[t * top_k + q] : 1.0f;
      const Pack<T, VEC> v = load_pack<T, VEC>(y + (long long)r * hidden + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += w * to_float(v.v[j]);
    }
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(acc[j]);
    store_pack<T, VEC>(out + t * hidden + c, o);
  }
}

}  // namespace moe
}  // namespace kiln
