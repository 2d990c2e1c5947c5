// Element types for kiln kernels, without the toolkit's cuda_fp16.h / cuda_bf16.h: kernels then
// compile with NVRTC alone (no CUDA include directory at run time) and in tens of milliseconds.
#pragma once

namespace kiln {

struct __align__(2) f16_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(f16_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(static_cast<unsigned>(v.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float f) {
  f16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  bf16_t r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<unsigned short>((u >> 16) | 0x40);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    r.bits = static_cast<unsigned short>(u >> 16);
  }
#endif
  return r;
}

// Two floats as one 32-bit pair of 16-bit elements, `lo` at the lower address (f16_t, bf16_t).
template <typename T> __device__ __forceinline__ unsigned pack_float2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack_float2<f16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned pack_float2<bf16_t>(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return unsigned(from_float<bf16_t>(lo).bits) | (unsigned(from_float<bf16_t>(hi).bits) << 16);
#endif
}

// N elements moved as one aligned access (N * sizeof(T) is 2, 4, 8 or 16 bytes).
template <typename T, int N>
struct __align__(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// Copies one pack from global to shared memory without passing through registers (cp.async,
// sm_80 and newer; 4, 8 or 16 bytes), completed for the calling thread by cp_async_wait_all. Older
// architectures copy through a register. Requires: both addresses aligned to the pack's size.
template <typename T, int N>
__device__ __forceinline__ void cp_async_pack(Pack<T, N>* smem, const T* gmem) {
  constexpr int k_bytes = int(sizeof(Pack<T, N>));
  static_assert(k_bytes == 4 || k_bytes == 8 || k_bytes == 16, "cp.async moves 4, 8 or 16 bytes");
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(gmem), "n"(k_bytes) : "memory");
#else
  *smem = load_pack<T, N>(gmem);
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

}  // namespace kiln
