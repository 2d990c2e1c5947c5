// Which tensor-map boxes of a float [rows, cols] tensor the copy engine takes (block scales: 16-byte
// boxes of 4 k-blocks). Each configuration runs in its own child process, so an illegal
// instruction in one leaves the others' answers: prints ok / WRONG / error per configuration.
// nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tma_box_exp.cu -lcuda -o tma_box_exp
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

struct __align__(64) Desc {
  unsigned long long bits[16];
};

__global__ void copy_box(const __grid_constant__ Desc map, float* out, int col, int row, int box_bytes, int box_rows,
                         int dst_off) {
  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = (unsigned)__cvta_generic_to_shared(smem_raw), base = (raw + 1023u) & ~1023u;
  const unsigned b = base + 6144, dst = base + dst_off;
  const unsigned char* smem = smem_raw + (dst - raw);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(box_bytes * box_rows) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(b)
        : "memory");
    unsigned done = 0;
    while (!done)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(b)
                   : "memory");
    for (int i = 0; i < box_bytes * box_rows / 4; ++i) out[i] = reinterpret_cast<const float*>(smem)[i];
  }
}

struct Cfg {
  const char* name;
  CUtensorMapDataType type;
  int es, box_bytes, box_rows;
  CUtensorMapSwizzle swz;
  CUtensorMapL2promotion l2;
  int dst_off;
};

int run(const Cfg& c) {
  cudaFree(0);  // a context for the driver calls (in this child process)
  const int rows = 257, cols = 8;  // 8 floats = 32-byte rows
  std::vector<float> h(rows * cols);
  for (int i = 0; i < rows * cols; ++i) h[i] = float(i);
  float *d, *o;
  cudaMalloc(&d, h.size() * 4);
  cudaMalloc(&o, 64 * 1024);
  cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  Desc map;
  const cuuint64_t dims[2] = {cuuint64_t(cols * 4 / c.es), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols * 4)};
  const cuuint32_t box[2] = {cuuint32_t(c.box_bytes / c.es), cuuint32_t(c.box_rows)};
  const cuuint32_t es[2] = {1, 1};
  CUresult r = cuTensorMapEncodeTiled(reinterpret_cast<CUtensorMap*>(&map), c.type, 2, d, dims, strides, box, es,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, c.swz, c.l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("%-40s encode error %d\n", c.name, int(r));
    return 0;
  }
  for (int j = 0; j < 16; ++j) std::printf(" %016llx", map.bits[j]);
  std::printf("\n");
  const int col = 4 * 4 / c.es, row = 200;  // floats 4.. of rows 200.. (past the end: zeros)
  cudaFuncSetAttribute(copy_box, cudaFuncAttributeMaxDynamicSharedMemorySize, 8192);
  copy_box<<<1, 32, 8192>>>(map, o, col, row, c.box_bytes, c.box_rows, c.dst_off);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("%-40s run error: %s\n", c.name, cudaGetErrorString(e));
    return 0;
  }
  std::vector<float> got(c.box_bytes * c.box_rows / 4);
  cudaMemcpy(got.data(), o, got.size() * 4, cudaMemcpyDeviceToHost);
  int bad = 0;
  const int per_row = c.box_bytes / 4;
  for (int rr = 0; rr < c.box_rows; ++rr)
    for (int j = 0; j < per_row; ++j) {
      const int gr = row + rr, gc = 4 + j;
      const float want = gr < rows && gc < cols ? h[gr * cols + gc] : 0.0f;
      if (got[rr * per_row + j] != want) ++bad;
    }
  std::printf("%-40s %s (%d wrong)\n", c.name, bad ? "WRONG" : "ok", bad);
  return 0;
}

int main() {
  const Cfg cfgs[] = {
      {"u8 16B x128 none L2_256B", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
      {"u8 16B x128 none L2_NONE", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE},
      {"f32 16B x128 none L2_256B", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
      {"f32 16B x128 none L2_NONE", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE},
      {"u8 32B x128 none L2_256B", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 32, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
      {"u8 16B x2 none L2_256B", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 2, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
      {"u8 16B x64 none L2_256B", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 64, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B},
      {"u8 16B x128 none L2_256B dst+2176", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 128, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 2176},
      {"u8 16B x2 none L2_256B dst+2048", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 2, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 2048},
      {"u8 16B x2 none L2_256B dst+16", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 16, 2, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 16},
  };
  for (const Cfg& c : cfgs) {
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      run(c);
      std::fflush(stdout);
      _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
  }
  return 0;
}
