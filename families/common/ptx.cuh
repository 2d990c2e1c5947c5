// The synchronization and asynchronous-copy primitives of sm_90 that kernels build pipelines from:
// mbarriers, bulk copies (cp.async.bulk), bulk tensor copies (TMA), thread-block clusters and
// distributed shared memory, and named barriers. Every family that uses them includes this header;
// none writes its own inline asm for them.
//
// Calling convention (all of namespace kiln::ptx):
// - Shared-memory operands (barriers, copy destinations, distributed-shared-memory offsets) are
//   `unsigned` addresses in the shared state space, as `smem_addr(p)` (or `smem_addr_opaque`)
//   gives for a generic pointer to shared memory. Kernels that lay out shared memory by offsets
//   compute them with plain integer arithmetic; kernels with `__shared__` arrays pass
//   `smem_addr(&full[s])`.
// - Global-memory operands are generic pointers; tensor maps are `const TmaDesc*` to a
//   `__grid_constant__` kernel parameter.
// - An mbarrier is 8 bytes of shared memory, 8-byte aligned.
// - Operations on another CTA of the cluster (`_remote`) take the local address of the same
//   offset and the other CTA's `rank`.
// - A plain name has the instruction's default memory semantics; a stronger ordering is named in
//   the suffix (`_release`, `_acquire_cluster`). `_aligned` forms require every thread of the warp
//   to execute the same call (converged warps).
//
// Architectures: everything but the address conversions, `st_shared_f32`, `st_shared_f2`,
// `ld_shared_f2` and the named barriers needs sm_90. On older architectures those functions
// compile to nothing (values they return are 0): families select the kernels that call them for
// sm_90 and later only, and the same templates still compile for the older targets of the
// catalog.
#pragma once

namespace kiln {
namespace ptx {

// The shared-state-space address of a generic pointer to shared memory. The compiler sees through
// it: the address of a __shared__ variable folds to a constant, and a repeated conversion is done
// once.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The same conversion as an instruction of its own that the compiler neither folds nor hoists:
// done again at every call, from the 64-bit generic pointer, so no shared address is held in a
// register between uses. rmsnorm_bwd's cluster kernels read their partial sums through it;
// with smem_addr, ptxas allocates and schedules them differently.
__device__ __forceinline__ unsigned smem_addr_opaque(const void* p) {
  unsigned addr;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(p));
  return addr;
}

// ---- Shared memory and named barriers (every architecture) ----

__device__ __forceinline__ void st_shared_f32(unsigned addr, float x) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(x) : "memory");
}
__device__ __forceinline__ void st_shared_f2(unsigned addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ float2 ld_shared_f2(unsigned addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// Named barrier ID (1-15; 0 is __syncthreads') for COUNT threads, a multiple of 32: `bar_sync`
// waits until COUNT threads have arrived (itself included); `bar_arrive` arrives without waiting.
template <int ID, int COUNT>
__device__ __forceinline__ void bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
template <int ID, int COUNT>
__device__ __forceinline__ void bar_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
// The same with the barrier ID a run-time value (a warp-uniform one, 1-15).
template <int COUNT>
__device__ __forceinline__ void bar_sync_at(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}
template <int COUNT>
__device__ __forceinline__ void bar_arrive_at(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}

// ---- mbarriers ----

// One thread initializes a barrier: a phase completes after `count` arrivals and the bytes
// announced for it (arrive_expect_tx) have landed.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// After mbar_init, before the barrier's first use by the copy engine or by other CTAs of the
// cluster: makes the initialization visible to them.
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// Arrives and announces `bytes` of copies that will complete on the barrier's current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// Arrives once this thread's earlier cp.async copies have landed. The arrival counts towards the
// barrier's init count (.noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
#endif
}

// Waits until the phase with the given parity (0 for the first phase, 1 for the second, ...)
// has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
  unsigned done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
#endif
}

// As mbar_wait, acquiring at cluster scope what the phase's arrivals released: for a local
// barrier that threads of other CTAs of the cluster arrive on (mbar_arrive_remote_release).
__device__ __forceinline__ void mbar_wait_acquire_cluster(unsigned bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
  unsigned done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Arrives on the barrier at the same offset as `bar` in CTA `rank` of the cluster. Default
// semantics (release at CTA scope), as for a local arrive.
__device__ __forceinline__ void mbar_arrive_remote(unsigned bar, unsigned rank) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{ .reg .b32 r; mapa.shared::cluster.u32 r, %0, %1; mbarrier.arrive.shared::cluster.b64 _, [r]; }" ::"r"(bar),
      "r"(rank)
      : "memory");
#endif
}

// As mbar_arrive_remote with release at cluster scope: this thread's earlier shared-memory
// writes are visible to the CTAs that acquire the phase (mbar_wait_acquire_cluster). A
// cluster-wide fence on every call.
__device__ __forceinline__ void mbar_arrive_remote_release(unsigned bar, unsigned rank) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{ .reg .b32 r; mapa.shared::cluster.u32 r, %0, %1; "
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r]; }" ::"r"(bar),
      "r"(rank)
      : "memory");
#endif
}

// ---- Bulk copies (global -> shared, completing their bytes on an mbarrier) ----

// `bytes` contiguous bytes from `src` to shared `dst`. Addresses and size: multiples of 16 bytes.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#endif
}

// A CUtensorMap, opaque (the driver encodes it; jit::encode_tensor_maps).
struct __align__(64) TmaDesc {
  unsigned long long bits[16];
};

// The box of `map` that starts at column `col`, row `row` (in elements of the map) into shared
// `dst`, completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaDesc* map, int col, int row, unsigned bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
#endif
}

// As tma_load_2d, into the same offset of every CTA of the cluster in `mask` (bit r: rank r),
// completing the bytes on each one's barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const TmaDesc* map, int col, int row, unsigned bar,
                                                      unsigned short mask) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(bar), "h"(mask)
      : "memory");
#endif
}

// ---- Bulk stores (shared -> global) ----

// Orders this thread's earlier generic-proxy writes to shared memory before later async-proxy
// reads of it (a bulk store issued after a barrier or __syncwarp).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Stores the box at shared address `src` to (col, row) of the tensor map (the map's box and
// swizzle; parts past the tensor's edges are not written), in this thread's bulk group.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, int col, int row, unsigned src) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(col), "r"(row), "r"(src)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are still reading their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are incomplete (writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Four 8 x 8 matrices of 16-bit elements to shared memory: lanes 8 i .. 8 i + 7 give the row
// addresses of matrix i, and every lane's r[i] holds the two elements of matrix i at row lane / 4,
// columns 2 (lane % 4) and 2 (lane % 4) + 1 (the mma accumulator fragment layout).
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
#if __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
#endif
}

// ---- Thread-block clusters ----

// This CTA's rank in its cluster (0 without clusters).
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

// Cluster barrier, every thread of every CTA of the cluster: arrive releases this thread's earlier
// memory accesses, wait acquires those of every arrival; together they also order mbarrier
// initialization across the cluster. The plain form may be called from diverged warps.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release; barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync_aligned() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_aligned() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait_aligned() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The value at the offset of shared address `addr` in CTA `rank` of the cluster (distributed
// shared memory).
__device__ __forceinline__ float ld_remote_f32(unsigned addr, unsigned rank) {
  float v = 0.f;
#if __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b32 r; mapa.shared::cluster.u32 r, %1, %2; ld.shared::cluster.f32 %0, [r]; }"
               : "=f"(v)
               : "r"(addr), "r"(rank)
               : "memory");
#endif
  return v;
}
__device__ __forceinline__ float4 ld_remote_f4(unsigned addr, unsigned rank) {
  float4 v = {0.f, 0.f, 0.f, 0.f};
#if __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b32 r; mapa.shared::cluster.u32 r, %4, %5; ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [r]; }"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr), "r"(rank)
               : "memory");
#endif
  return v;
}

// The four floats at shared address `addr` summed over blocks R..C-1 of the cluster: every block's
// load is issued before any is added (the loads overlap), and the sum runs in a fixed order.
template <int R, int C>
__device__ __forceinline__ float4 cluster_sum_f4(unsigned addr) {
  const float4 a = ld_remote_f4(addr, unsigned(R));
  if constexpr (R + 1 == C) {
    return a;
  } else {
    const float4 b = cluster_sum_f4<R + 1, C>(addr);
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
  }
}

// A flag in global memory that blocks of one grid order their work by: an acquire load at GPU
// scope, and a release add at GPU scope (the writes before it, by this thread and those it has
// observed, are visible to a block that acquires the new value).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
#endif
}

// Programmatic dependent launch (sm_90 and later; no-ops before, and without such a launch):
// `grid_dependency_wait` returns once the kernel before this one in the stream has finished and its
// writes are visible; `launch_dependents` lets the kernel after this one launch before this one ends.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace ptx
}  // namespace kiln
