// The gemm folder registers three kernel families that share the GEMM core of families/common/gemm/:
// FP8 quantization, the FP8 GEMM and the fused gated MLP.
#include "kiln/family.h"

void kiln_register_kernels_quantize_fp8(kiln::Registry& r);
void kiln_register_kernels_fp8_gemm(kiln::Registry& r);
void kiln_register_kernels_gated_mlp(kiln::Registry& r);

void kiln_register_family_gemm(kiln::Registry& r) {
  kiln_register_kernels_quantize_fp8(r);
  kiln_register_kernels_fp8_gemm(r);
  kiln_register_kernels_gated_mlp(r);
}
