// RMSNorm backward, second stage (rmsnorm_bwd_reduce): dw[c] = sum over slabs of partial[slab, c],
// fp32 in a fixed order, stored in the weight's dtype. Zero slabs give dw = 0.
//
// Params: dtype {f32, f16, bf16} (of dw); block {128, 256, 512, 1024} threads; columns {8, 16, 32}
// adjacent columns per block, block / columns slab lanes striding over the slabs.
// Problem (RmsNormBwdReduceProblem): keys slabs (bucketed) and cols. Buffers: partial
// (f32 [slabs, cols]) in, dw ([cols]) out.
// Heuristic: 128 threads up to 8 slabs, 256 up to 64, 512 beyond (enough loads in flight per
// column); columns: the most of 32, 16, 8 that still gives 256 blocks or more (8 below 2048
// columns), so the grid covers the GPU.
// Launch: a programmatic dependent of the kernel before it (programmatic_launch()), which in the
// typed op is rmsnorm_bwd; on sm_90 and later the blocks wait (griddepcontrol.wait) for it.
#pragma once

#include "kiln/family.h"

namespace kiln::families {

// The second stage's problem; both fields are keys (part of the tuning signature).
struct RmsNormBwdReduceProblem {
  std::int64_t slabs = 0;  // key, bucketed: partial dw rows to sum
  std::int64_t cols = 0;   // key: elements per row (the hidden size)
};

// Threads per block.
int rmsnorm_bwd_reduce_heuristic(const Problem& p);
// Adjacent columns per block.
std::int64_t rmsnorm_bwd_reduce_columns(const Problem& p);

}  // namespace kiln::families
