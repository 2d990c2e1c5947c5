// The moe folder registers the routing families (moe_topk, moe_sort, moe_gather, moe_combine) and
// the grouped GEMM over experts (grouped_gemm, grouped_gemm_fp8).
#include "kiln/family.h"

void kiln_register_kernels_moe_routing(kiln::Registry& r);
void kiln_register_kernels_grouped_gemm(kiln::Registry& r);

void kiln_register_family_moe(kiln::Registry& r) {
  kiln_register_kernels_moe_routing(r);
  kiln_register_kernels_grouped_gemm(r);
}
