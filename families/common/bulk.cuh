// Bulk copies from global to shared memory (cp.async.bulk, sm_90 and later) completed on an
// mbarrier: one thread posts a copy of a contiguous range and the bytes it expects; every thread
// that needs the data waits for the barrier's phase. Memory-bound kernels use a ring of such
// buffers so the next rows are in flight while a row is reduced, with no registers holding them.
// Requires: addresses and sizes multiples of 16 bytes. On older architectures these are never
// called (the host selects them for sm_90 and later only) and compile to nothing.
#pragma once

namespace kiln {
namespace bulk {

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Called by one thread; the barrier completes a phase after `count` arrivals and their bytes.
__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
  // Makes the initialized barrier visible to the copy engine before its first use.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrives on `bar` and announces `bytes` of copies that will complete on its current phase.
__device__ __forceinline__ void arrive_expect(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void copy(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_address(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_address(bar))
               : "memory");
#endif
}

// Waits until the phase with the given parity (0 for the first, 1 for the second, ...) completed.
__device__ __forceinline__ void wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
  unsigned done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

}  // namespace bulk
}  // namespace kiln
