#!/usr/bin/env bash
# Regenerates the template copies bench/exp/rms_exp2.cu compares (not committed: they are earlier
# versions of templates/rmsnorm/rmsnorm_fwd.cuh, taken from git and renamed into their own
# namespaces):
#   rms_old.cuh  kiln_old::  the weight read after the reduction (commit 2e62085)
#   rms_c.cuh    kiln_c::    the weight staged in shared memory for packs of 4 bytes and more, in
#                            registers for 1024-thread blocks (commit 9acb926 with that rule)
#   rms_occ.cuh  kiln_occ::  the current template with blocks capped at 32 registers (2048 resident
#                            threads per SM, against 1024), for bench/exp/rms_exp3.cu
#   add_occ{3,4}.cuh kiln_add3::, kiln_add4:: templates/add_rmsnorm/add_rmsnorm_fwd.cuh at 1536 and
#                            2048 resident threads per SM (42 and 32 registers), for
#                            bench/exp/add_exp.cu
set -euo pipefail
cd "$(dirname "$0")/../.."
rename() { sed -e "s/^namespace kiln {/namespace $1 {\nusing namespace kiln;/" -e "s/^}  \/\/ namespace kiln/}  \/\/ namespace $1/" -e '/#include/d'; }
git show 2e62085:templates/rmsnorm/rmsnorm_fwd.cuh | rename kiln_old > bench/exp/rms_old.cuh
git show 9acb926:templates/rmsnorm/rmsnorm_fwd.cuh | rename kiln_c |
  sed 's/constexpr bool k_w_smem = sizeof(P) >= 4;/constexpr bool k_w_smem = sizeof(P) >= 4 \&\& rmsnorm_cache_regs<BLOCK>() > 8;/' \
  > bench/exp/rms_c.cuh
rename kiln_occ < templates/rmsnorm/rmsnorm_fwd.cuh |
  sed 's|__launch_bounds__(BLOCK, 1024 / BLOCK)|__launch_bounds__(BLOCK, 2048 / BLOCK)|' > bench/exp/rms_occ.cuh
for n in 3 4; do
  rename kiln_add$n < templates/add_rmsnorm/add_rmsnorm_fwd.cuh |
    sed "s|__launch_bounds__(BLOCK, 1024 / BLOCK)|__launch_bounds__(BLOCK, $n * 512 / BLOCK)|" > bench/exp/add_occ$n.cuh
done
