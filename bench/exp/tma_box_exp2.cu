// Follow-up to tma_box_exp.cu: the scale box at the kernel's real offsets, alone and after a
// 128-byte-swizzled operand box on the same barrier. One child process per case.
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

struct __align__(64) Desc {
  unsigned long long bits[16];
};

__device__ void tma(unsigned dst, const Desc* map, int col, int row, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

__global__ void two(const __grid_constant__ Desc ma, const __grid_constant__ Desc mb, const __grid_constant__ Desc ms,
                    const __grid_constant__ Desc mt, float* out, int with_a, int sc_off, int map_slot, int sc_bytes) {
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = (unsigned)__cvta_generic_to_shared(smem_raw), base = (raw + 1023u) & ~1023u;
  const unsigned b = base + sc_off + 4096;
  const Desc* m = map_slot == 2 ? &ms : &mt;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"((with_a ? 16384 : 0) + sc_bytes) : "memory");
    if (with_a) tma(base, &ma, 0, 0, b);
    tma(base + sc_off, m, 0, 0, b);
    unsigned done = 0;
    while (!done)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(b)
                   : "memory");
    const float* s = reinterpret_cast<const float*>(smem_raw + (base + sc_off - raw));
    for (int i = 0; i < 512; ++i) out[i] = s[i];
  }
}

bool enc(Desc& d, void* p, unsigned long long row_bytes, unsigned long long rows, unsigned box_b, unsigned box_r,
         CUtensorMapSwizzle sw) {
  const cuuint64_t dims[2] = {row_bytes, rows}, strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_b, box_r}, es[2] = {1, 1};
  return cuTensorMapEncodeTiled(reinterpret_cast<CUtensorMap*>(&d), CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, p, dims, strides, box,
                                es, CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

void run_b(int rows, CUtensorMapL2promotion l2) {
  cudaFree(0);
  void* s;
  float* o;
  cudaMalloc(&s, rows * 32);
  cudaMalloc(&o, 4096);
  std::vector<float> h(rows * 8);
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(i);
  cudaMemcpy(s, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  Desc ms;
  const cuuint64_t dims[2] = {32, cuuint64_t(rows)}, strides[1] = {32};
  const cuuint32_t box[2] = {16, 2}, es[2] = {1, 1};
  CUresult r = cuTensorMapEncodeTiled(reinterpret_cast<CUtensorMap*>(&ms), CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, s, dims, strides,
                                      box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, l2,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  cudaFuncSetAttribute(two, cudaFuncAttributeMaxDynamicSharedMemorySize, 16384);
  two<<<1, 32, 16384>>>(ms, ms, ms, ms, o, 0, 2048, 2, 32);
  cudaError_t e = cudaDeviceSynchronize();
  std::printf("b map rows %d l2 %d: encode %d, %s\n", rows, int(l2), int(r), e == cudaSuccess ? "ran" : cudaGetErrorString(e));
}

void run(int with_a, int sc_off, int map_slot, int smem) {
  cudaFree(0);
  void *a, *s;
  float* o;
  cudaMalloc(&a, 257 * 1008);
  cudaMalloc(&s, 257 * 32);
  cudaMalloc(&o, 4096);
  std::vector<float> h(257 * 8);
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(i);
  cudaMemcpy(s, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  Desc ma, mb, ms;
  enc(ma, a, 1008, 257, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
  enc(mb, a, 1008, 257, 128, 128, CU_TENSOR_MAP_SWIZZLE_128B);
  enc(ms, s, 32, 257, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE);
  cudaFuncSetAttribute(two, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  two<<<1, 32, smem>>>(ma, mb, ms, ms, o, with_a, sc_off, map_slot, 2048);
  cudaError_t e = cudaDeviceSynchronize();
  std::vector<float> got(512);
  int bad = 0;
  if (e == cudaSuccess) {
    cudaMemcpy(got.data(), o, 2048, cudaMemcpyDeviceToHost);
    for (int r = 0; r < 128; ++r)
      for (int j = 0; j < 4; ++j) bad += got[r * 4 + j] != h[r * 8 + j];
  }
  std::printf("with_a %d sc_off %6d map %d smem %6d: %s (%d wrong)\n", with_a, sc_off, map_slot, smem,
              e == cudaSuccess ? "ran" : cudaGetErrorString(e), bad);
}

int main() {
  const int cases[][4] = {{0, 2176, 2, 16384},    {1, 16384, 2, 32768},    {0, 163840, 2, 173632},
                          {1, 163840, 2, 173632}, {1, 163840, 3, 173632}, {0, 163840, 3, 173632}};
  for (auto& c : cases) {
    std::fflush(stdout);
    if (fork() == 0) {
      run(c[0], c[1], c[2], c[3]);
      std::fflush(stdout);
      _exit(0);
    }
    int st;
    wait(&st);
  }
  for (int rows : {2, 1, 17})
    for (CUtensorMapL2promotion l2 : {CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_L2_PROMOTION_NONE}) {
      std::fflush(stdout);
      if (fork() == 0) {
        run_b(rows, l2);
        std::fflush(stdout);
        _exit(0);
      }
      int st;
      wait(&st);
    }
}
