// Experiment (nvcc on the GPU machine): kiln's row kernels against candidate changes, one binary.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I templates -I bench/exp bench/exp/row_exp.cu -o row_exp
// Each case: outputs of the candidate against kiln's current kernel (max relative difference), then
// CUDA-event medians after a 256 MiB memset per call, with the copy of the same bytes beside it.
#include <string>

#include "act_and_mul/act_and_mul.cuh"
#include "rmsnorm/rmsnorm_fwd.cuh"
#include "rmsnorm_rope/rmsnorm_rope_fwd.cuh"
#include "exp_util.h"


namespace kiln {

// Candidate GELU (erf) for f16/bf16 outputs: Phi(x) = 0.5 erfc(-x / sqrt 2) from
// e = erfc(a) ~ 2^(a P(a)), a = |x| / sqrt 2 < 4 (P: degree 6, fitted for relative error of e,
// 6.4e-6 at most in f32), 0 beyond (|x| > 5.66: Phi < 7.8e-9).
template <>
struct Activation<3, false> {
  static __device__ __forceinline__ float apply(float v) {
    const float z = v * 0.70710678118654752f;
    const float a = fabsf(z);
    float p = -1.9975821487605572e-05f;
    p = fmaf(p, a, 0.00048200355377048254f);
    p = fmaf(p, a, -0.005204866174608469f);
    p = fmaf(p, a, 0.033868830651044846f);
    p = fmaf(p, a, -0.1523846685886383f);
    p = fmaf(p, a, -0.9171034693717957f);
    p = fmaf(p, a, -1.6280598640441895f);
    float e = exp2f(a * p);
    e = a < 4.f ? e : 0.f;
    const float phi = z >= 0.f ? fmaf(-0.5f, e, 1.f) : 0.5f * e;
    return v * phi;
  }
};

// Sum over the block with one barrier: each warp's sum goes to one of two scratch halves (by
// call parity), every thread adds the warp sums itself. The half written by call n is rewritten
// by call n+2 only after call n+1's barrier, which every thread passes after its reads of call n.
template <int BLOCK>
__device__ __forceinline__ float block_sum1(float v, float* scratch, int parity) {
  constexpr int k_warps = BLOCK / 32;
  v = warp_sum(v);
  if constexpr (k_warps == 1) {
    return v;
  } else {
    float* s = scratch + parity * 32;
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < k_warps; ++i) t += s[i];
    return t;
  }
}

// RMSNorm, rows that fit the register cache: x packs and (PREFETCH_W) w packs loaded before the
// reduction; ONE_BARRIER picks block_sum1.
template <typename T, int BLOCK, int VEC, int CACHED, bool PREFETCH_W, bool ONE_BARRIER>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
rms_v2(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, long long rows, int cols, float eps) {
  using P = Pack<T, VEC>;
  __shared__ float scratch[66];
  const int packs = cols / VEC;
  const float inv_cols = 1.f / float(cols);
  int parity = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    P c[CACHED], wv[PREFETCH_W ? CACHED : 1];
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) c[i] = load_pack<T, VEC>(xr + p * VEC);
    }
    if constexpr (PREFETCH_W) {
#pragma unroll
      for (int i = 0; i < CACHED; ++i) {
        const int p = int(threadIdx.x) + i * BLOCK;
        if (p < packs) wv[i] = load_pack<T, VEC>(w + p * VEC);
      }
    }
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs)
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float f = to_float(c[i].v[k]);
          acc = fmaf(f, f, acc);
        }
    }
    float total;
    if constexpr (ONE_BARRIER) total = block_sum1<BLOCK>(acc, scratch, parity);
    else total = block_sum<BLOCK>(acc, scratch);
    const float scale = rsqrtf(total * inv_cols + eps);
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int p = int(threadIdx.x) + i * BLOCK;
      if (p < packs) {
        P ww;
        if constexpr (PREFETCH_W) ww = wv[i];
        else ww = load_pack<T, VEC>(w + p * VEC);
        P o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = from_float<T>(to_float(c[i].v[k]) * scale * to_float(ww.v[k]));
        store_pack<T, VEC>(yr + p * VEC, o);
      }
    }
  }
}

// Activation-and-mul with U packs per thread, all loads issued before any arithmetic.
template <typename T, int ACT, int BLOCK, int VEC, int U>
__global__ void __launch_bounds__(BLOCK)
am_v2(const T* x, T* out, long long total_packs, long long packs_per_row, long long d) {
  using P = Pack<T, VEC>;
  const long long base = ((long long)blockIdx.x * BLOCK) * U + threadIdx.x;
  P a[U], b[U];
  long long rowv[U], cv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * BLOCK;
    rowv[u] = i / packs_per_row;
    cv[u] = (i - rowv[u] * packs_per_row) * VEC;
    if (i < total_packs) {
      const T* xr = x + rowv[u] * 2 * d + cv[u];
      a[u] = load_pack<T, VEC>(xr);
      b[u] = load_pack<T, VEC>(xr + d);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * BLOCK;
    if (i < total_packs) {
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        o.v[k] = from_float<T>(activate<ACT, false>(to_float(a[u].v[k])) * to_float(b[u].v[k]));
      store_pack<T, VEC>(out + rowv[u] * d + cv[u], o);
    }
  }
}

// RMSNorm + RoPE (neox), rows in registers; w, cos and sin of the row staged before the reduction:
// cos/sin of the row (head_dim values each) into shared memory by the block, w packs into registers.
template <typename T, int HEAD_DIM, int BLOCK, int VEC, int CACHED>
__global__ void __launch_bounds__(BLOCK, 1024 / BLOCK)
nr_v2(const T* x, const T* __restrict__ w, const T* __restrict__ cos, const T* __restrict__ sin, T* y, long long rows,
      int hidden, long long seq, float eps) {
  using P = Pack<T, VEC>;
  constexpr int k_half = HEAD_DIM / 2;
  constexpr int k_chunks = k_half / VEC;
  __shared__ float scratch[66];
  __shared__ float cs[2][2][HEAD_DIM];  // [parity][cos, sin][j]
  const int items = hidden / (2 * VEC);
  const float inv_hidden = 1.f / float(hidden);
  int parity = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const T* xr = x + row * hidden;
    T* yr = y + row * hidden;
    const long long s = row % seq;
    P lo[CACHED], hi[CACHED], wl[CACHED], wh[CACHED];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items) {
        const int head = it / k_chunks;
        const int off = head * HEAD_DIM + (it - head * k_chunks) * VEC;
        lo[i] = load_pack<T, VEC>(xr + off);
        hi[i] = load_pack<T, VEC>(xr + off + k_half);
      }
    }
    for (int j = threadIdx.x; j < HEAD_DIM; j += BLOCK) {
      cs[parity][0][j] = to_float(cos[s * HEAD_DIM + j]);
      cs[parity][1][j] = to_float(sin[s * HEAD_DIM + j]);
    }
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items) {
        const int head = it / k_chunks;
        const int off = head * HEAD_DIM + (it - head * k_chunks) * VEC;
        wl[i] = load_pack<T, VEC>(w + off);
        wh[i] = load_pack<T, VEC>(w + off + k_half);
        acc = sum_squares<T, VEC>(lo[i], hi[i], acc);
      }
    }
    const float scale = rsqrtf(block_sum1<BLOCK>(acc, scratch, parity) * inv_hidden + eps);
#pragma unroll
    for (int i = 0; i < CACHED; ++i) {
      const int it = int(threadIdx.x) + i * BLOCK;
      if (it < items) {
        const int head = it / k_chunks;
        const int pair = (it - head * k_chunks) * VEC;
        const int off = head * HEAD_DIM + pair;
        Pack<T, VEC> o_lo, o_hi;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float n_lo = to_float(lo[i].v[j]) * scale * to_float(wl[i].v[j]);
          const float n_hi = to_float(hi[i].v[j]) * scale * to_float(wh[i].v[j]);
          o_lo.v[j] = from_float<T>(n_lo * cs[parity][0][pair + j] - n_hi * cs[parity][1][pair + j]);
          o_hi.v[j] = from_float<T>(n_hi * cs[parity][0][pair + j + k_half] + n_lo * cs[parity][1][pair + j + k_half]);
        }
        store_pack<T, VEC>(yr + off, o_lo);
        store_pack<T, VEC>(yr + off + k_half, o_hi);
      }
    }
  }
}

}  // namespace kiln

using kiln::bf16_t;
using namespace exp_util;



static double g_copy_big = 0;

static void report(const char* name, const std::string& shape, double bytes, double us, double copy_us) {
  const double gbs = bytes / us * 1e-3;
  std::printf("%-34s %-16s %9.1f us %7.0f GB/s %6.1f%% of big copy %6.1f%% of same-size copy\n", name, shape.c_str(),
              us, gbs, 100 * gbs / g_copy_big, 100 * copy_us / us);
}

int main() {
  {
    const size_t n = 512ull << 20;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    const double us = time_us([&] { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); }, 10);
    g_copy_big = 2.0 * n / us * 1e-3;
    std::printf("copy 512 MiB each way: %.1f us, %.0f GB/s\n", us, g_copy_big);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }

  // --- RMSNorm ---
  struct RS { long long rows; int cols; };
  for (RS s : {RS{4096, 2048}, RS{4096, 4096}, RS{4096, 8192}, RS{32768, 2048}, RS{32768, 4096}, RS{32768, 8192}}) {
    const size_t n = size_t(s.rows) * s.cols;
    bf16_t* x = rand_bf16(n, 1);
    bf16_t* w = rand_bf16(s.cols, 2);
    bf16_t *y0, *y1;
    CK(cudaMalloc(&y0, n * 2));
    CK(cudaMalloc(&y1, n * 2));
    const double bytes = 2.0 * n * 2 + s.cols * 2;
    const double cu = copy_us(n * 2);
    const std::string shape = std::to_string(s.rows) + "x" + std::to_string(s.cols);
    std::printf("\n");
    report("copy same bytes", shape, bytes, cu, cu);
    // kiln's heuristic today: 8-byte packs (VEC 4), block so that 8 packs per thread cover the row.
    int block = 64;
    while (block < 512 && block * 8 < s.cols / 4) block *= 2;
    auto run_kiln = [&](bf16_t* y) {
      switch (block) {
        case 64: kiln::rmsnorm_fwd<bf16_t, 64, 4><<<s.rows, 64>>>(x, w, y, nullptr, s.rows, s.cols, s.cols, s.cols, 1e-6f); break;
        case 128: kiln::rmsnorm_fwd<bf16_t, 128, 4><<<s.rows, 128>>>(x, w, y, nullptr, s.rows, s.cols, s.cols, s.cols, 1e-6f); break;
        case 256: kiln::rmsnorm_fwd<bf16_t, 256, 4><<<s.rows, 256>>>(x, w, y, nullptr, s.rows, s.cols, s.cols, s.cols, 1e-6f); break;
        default: kiln::rmsnorm_fwd<bf16_t, 512, 4><<<s.rows, 512>>>(x, w, y, nullptr, s.rows, s.cols, s.cols, s.cols, 1e-6f); break;
      }
    };
    run_kiln(y0);
    CK(cudaDeviceSynchronize());
    report(("kiln block " + std::to_string(block) + " vec 4").c_str(), shape, bytes, time_us([&] { run_kiln(y0); }), cu);
    auto cand = [&](const char* name, auto kernel, int blk) {
      kernel<<<s.rows, blk>>>(x, w, y1, s.rows, s.cols, 1e-6f);
      CK(cudaDeviceSynchronize());
      const double d = max_rel(y1, y0, n);
      const double us = time_us([&] { kernel<<<s.rows, blk>>>(x, w, y1, s.rows, s.cols, 1e-6f); });
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s (diff %.1e)", name, d);
      report(buf, shape, bytes, us, cu);
    };
#define RMS_CANDS(B)                                                                          \
  cand("v2 B" #B " v4 1bar", kiln::rms_v2<bf16_t, B, 4, 8, false, true>, B);                   \
  cand("v2 B" #B " v4 1bar+w", kiln::rms_v2<bf16_t, B, 4, 8, true, true>, B);                  \
  cand("v2 B" #B " v4 2bar+w", kiln::rms_v2<bf16_t, B, 4, 8, true, false>, B);                 \
  cand("v2 B" #B " v8 1bar+w c4", kiln::rms_v2<bf16_t, B, 8, 4, true, true>, B);
    switch (block) {
      case 64: RMS_CANDS(64); break;
      case 128: RMS_CANDS(128); break;
      case 256: RMS_CANDS(256); break;
      default: RMS_CANDS(512); break;
    }
    CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(y0)); CK(cudaFree(y1));
  }

  // --- act_and_mul (GELU erf, SiLU) ---
  struct AS { long long rows; long long d; };
  for (AS s : {AS{4096, 14336}, AS{32768, 14336}, AS{4096, 2048}}) {
    const size_t nx = size_t(s.rows) * s.d * 2, no = size_t(s.rows) * s.d;
    bf16_t* x = rand_bf16(nx, 3);
    bf16_t *o0, *o1;
    CK(cudaMalloc(&o0, no * 2));
    CK(cudaMalloc(&o1, no * 2));
    const double bytes = 2.0 * (nx + no);
    const double cu = copy_us(size_t(bytes / 2));
    const std::string shape = std::to_string(s.rows) + "x" + std::to_string(s.d);
    std::printf("\n");
    report("copy same bytes", shape, bytes, cu, cu);
    auto kiln_am = [&](auto kernel, int vec, bf16_t* o) {
      const long long per_row = s.d / vec, total = s.rows * per_row;
      unsigned shift = 0;
      while (shift < 32 && (1ull << shift) < (unsigned long long)per_row) ++shift;
      const unsigned magic = unsigned(((1ull << 32) * ((1ull << shift) - per_row)) / per_row + 1);
      kernel<<<unsigned((total + 127) / 128), 128>>>(x, o, total, per_row, magic, shift, s.d, 2 * s.d, s.d);
    };
    for (int act : {1, 0}) {
      const char* an = act ? "gelu" : "silu";
      auto k4 = act ? kiln::act_and_mul<bf16_t, 1, 128, 4> : kiln::act_and_mul<bf16_t, 0, 128, 4>;
      auto k8 = act ? kiln::act_and_mul<bf16_t, 1, 128, 8> : kiln::act_and_mul<bf16_t, 0, 128, 8>;
      kiln_am(k4, 4, o0);
      CK(cudaDeviceSynchronize());
      report((std::string("kiln ") + an + " B128 v4").c_str(), shape, bytes, time_us([&] { kiln_am(k4, 4, o0); }), cu);
      report((std::string("kiln ") + an + " B128 v8").c_str(), shape, bytes, time_us([&] { kiln_am(k8, 8, o1); }), cu);
      auto cand = [&](const char* name, auto kernel, int blk, int vec, int u) {
        const long long per_row = s.d / vec, total = s.rows * per_row;
        const unsigned grid = unsigned((total + (long long)blk * u - 1) / ((long long)blk * u));
        kernel<<<grid, blk>>>(x, o1, total, per_row, s.d);
        CK(cudaDeviceSynchronize());
        const double d = max_rel(o1, o0, no);
        const double us = time_us([&] { kernel<<<grid, blk>>>(x, o1, total, per_row, s.d); });
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s %s (diff %.1e)", name, an, d);
        report(buf, shape, bytes, us, cu);
      };
      if (act) {
        auto kf4 = kiln::act_and_mul<bf16_t, 3, 128, 4>;
        auto kf8 = kiln::act_and_mul<bf16_t, 3, 128, 8>;
        auto kf4b = kiln::act_and_mul<bf16_t, 3, 256, 4>;
        for (int variant = 0; variant < 3; ++variant) {
          auto k = variant == 0 ? kf4 : variant == 1 ? kf8 : kf4b;
          const int vec = variant == 1 ? 8 : 4, blk = variant == 2 ? 256 : 128;
          const long long per_row = s.d / vec, total = s.rows * per_row;
          unsigned shift = 0;
          while (shift < 32 && (1ull << shift) < (unsigned long long)per_row) ++shift;
          const unsigned magic = unsigned(((1ull << 32) * ((1ull << shift) - per_row)) / per_row + 1);
          auto go = [&] { k<<<unsigned((total + blk - 1) / blk), blk>>>(x, o1, total, per_row, magic, shift, s.d, 2 * s.d, s.d); };
          go();
          CK(cudaDeviceSynchronize());
          char buf[96];
          std::snprintf(buf, sizeof buf, "fast gelu B%d v%d (diff %.1e)", blk, vec, max_rel(o1, o0, no));
          report(buf, shape, bytes, time_us(go), cu);
        }
        cand("v2 B128 v4 U2", kiln::am_v2<bf16_t, 1, 128, 4, 2>, 128, 4, 2);
        cand("v2 B128 v8 U2", kiln::am_v2<bf16_t, 1, 128, 8, 2>, 128, 8, 2);
        cand("v2 B256 v4 U2", kiln::am_v2<bf16_t, 1, 256, 4, 2>, 256, 4, 2);
        cand("v2 B128 v4 U4", kiln::am_v2<bf16_t, 1, 128, 4, 4>, 128, 4, 4);
        cand("v2 B128 v8 U1", kiln::am_v2<bf16_t, 1, 128, 8, 1>, 128, 8, 1);
      } else {
        cand("v2 B128 v4 U2", kiln::am_v2<bf16_t, 0, 128, 4, 2>, 128, 4, 2);
        cand("v2 B128 v8 U2", kiln::am_v2<bf16_t, 0, 128, 8, 2>, 128, 8, 2);
      }
    }
    CK(cudaFree(x)); CK(cudaFree(o0)); CK(cudaFree(o1));
  }

  // --- RMSNorm + RoPE (hidden 4096, bf16 cos/sin [seq = tokens, head_dim]) ---
  for (long long rows : {4096ll, 32768ll}) {
    for (int hd : {64, 128}) {
      const int hidden = 4096;
      const size_t n = size_t(rows) * hidden;
      bf16_t* x = rand_bf16(n, 4);
      bf16_t* w = rand_bf16(hidden, 5);
      bf16_t* c = rand_bf16(size_t(rows) * hd, 6);
      bf16_t* sn = rand_bf16(size_t(rows) * hd, 7);
      bf16_t *y0, *y1;
      CK(cudaMalloc(&y0, n * 2));
      CK(cudaMalloc(&y1, n * 2));
      const double bytes = 2.0 * n * 2 + hidden * 2 + 2.0 * rows * hd * 2;
      const double cu = copy_us(size_t(bytes / 2));
      const std::string shape = std::to_string(rows) + "x4096 d" + std::to_string(hd);
      std::printf("\n");
      report("copy same bytes", shape, bytes, cu, cu);
      // kiln's heuristic: VEC 8, items = 4096 / 16 = 256, block 128 (two items per thread).
      auto base = [&](bf16_t* y) {
        if (hd == 64) kiln::rmsnorm_rope_fwd<bf16_t, bf16_t, 64, 128, 8><<<rows, 128>>>(x, w, c, sn, y, rows, hidden, rows, 1e-6f);
        else kiln::rmsnorm_rope_fwd<bf16_t, bf16_t, 128, 128, 8><<<rows, 128>>>(x, w, c, sn, y, rows, hidden, rows, 1e-6f);
      };
      base(y0);
      CK(cudaDeviceSynchronize());
      report("kiln B128 v8", shape, bytes, time_us([&] { base(y0); }), cu);
      auto cand = [&](const char* name, auto kernel, int blk) {
        kernel<<<rows, blk>>>(x, w, c, sn, y1, rows, hidden, rows, 1e-6f);
        CK(cudaDeviceSynchronize());
        const double d = max_rel(y1, y0, n);
        const double us = time_us([&] { kernel<<<rows, blk>>>(x, w, c, sn, y1, rows, hidden, rows, 1e-6f); });
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s (diff %.1e)", name, d);
        report(buf, shape, bytes, us, cu);
      };
      // BLOCK x CACHED must cover the row's items (4096 / (2 VEC)).
      if (hd == 64) {
        cand("v2 B256 v8 c1", kiln::nr_v2<bf16_t, 64, 256, 8, 1>, 256);
        cand("v2 B128 v8 c2", kiln::nr_v2<bf16_t, 64, 128, 8, 2>, 128);
        cand("v2 B256 v4 c2", kiln::nr_v2<bf16_t, 64, 256, 4, 2>, 256);
        cand("v2 B128 v4 c4", kiln::nr_v2<bf16_t, 64, 128, 4, 4>, 128);
      } else {
        cand("v2 B256 v8 c1", kiln::nr_v2<bf16_t, 128, 256, 8, 1>, 256);
        cand("v2 B128 v8 c2", kiln::nr_v2<bf16_t, 128, 128, 8, 2>, 128);
        cand("v2 B256 v4 c2", kiln::nr_v2<bf16_t, 128, 256, 4, 2>, 256);
        cand("v2 B128 v4 c4", kiln::nr_v2<bf16_t, 128, 128, 4, 4>, 128);
      }
      CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(c)); CK(cudaFree(sn)); CK(cudaFree(y0)); CK(cudaFree(y1));
    }
  }
  return 0;
}
