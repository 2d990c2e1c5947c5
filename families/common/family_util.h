// Small helpers every built-in family uses when validating and rendering.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/family.h"
#include "kiln/family_util.h"
#include "kiln/problem.h"

namespace kiln::families {

// device_type and check_access_width are public (kiln/family_util.h), for plugins too.
using kiln::check_access_width;
using kiln::device_type;

// Packs per thread that a row kernel holds in `cache_regs` 32-bit registers (a pack narrower than
// a register still takes one).
inline std::int64_t register_cache_packs(std::int64_t cache_regs, std::int64_t pack_bytes) {
  return cache_regs / std::max<std::int64_t>(1, pack_bytes / 4);
}

// The row kernels' shared-memory cache (rmsnorm, add_rmsnorm): of a row's `packs`, those past the
// register cache (block threads x `cached_per_thread`) that fit in `max_bytes`; the kernel reads
// any rest twice.
inline std::int64_t smem_cache_packs(std::int64_t packs, std::int64_t block, std::int64_t cached_per_thread,
                                     std::int64_t pack_bytes, std::int64_t max_bytes) {
  return std::clamp<std::int64_t>(packs - block * cached_per_thread, 0, max_bytes / pack_bytes);
}

// Block sizes of the one-row kernels (rmsnorm, add_rmsnorm): every multiple of 32 from 64 to
// 1024. The other kernels of those families take powers of two only (their validate says so).
inline const std::vector<std::int64_t>& row_kernel_blocks() {
  static const std::vector<std::int64_t> blocks = [] {
    std::vector<std::int64_t> out;
    for (std::int64_t b = 64; b <= 1024; b += 32) out.push_back(b);
    return out;
  }();
  return blocks;
}

// The one-row kernels' block for a row of `packs` packs at two packs per thread: whole warps,
// so that few threads idle at widths like 5120 (640 16-byte packs of bf16, 320 threads), which a
// power of two would leave with two blocks per SM fewer. At least 64 threads.
inline std::int64_t row_kernel_block(std::int64_t packs) {
  return std::clamp<std::int64_t>((packs + 63) / 64 * 32, 64, 1024);
}

// The few-row backward kernels (rmsnorm_bwd_rows, layernorm_bwd_rows): the launch is one thread-block
// cluster of `cluster` blocks, a block of `block` threads per row, `packs` 16-byte packs of each
// row buffer per thread.
struct FewRowsShape {
  std::int64_t block, packs, cluster;
};
// The heuristic's shape for `rows` rows of `row_packs` 16-byte packs: one pack per thread up to
// 1024 packs, else two; the smallest block from 32 threads that holds the row; the smallest
// cluster that holds the rows, at most 8 blocks (the portable cluster size), each block taking
// two rows past 8. Nothing for 0 or more than 16 rows, or more than 2048 packs.
constexpr std::int64_t k_few_rows_cluster_max = 8;
constexpr std::int64_t k_few_rows_max = 2 * k_few_rows_cluster_max;
inline std::optional<FewRowsShape> few_rows_shape(std::int64_t rows, std::int64_t row_packs) {
  if (rows < 1 || rows > k_few_rows_max || row_packs < 1 || row_packs > 2048) return std::nullopt;
  FewRowsShape s{32, row_packs <= 1024 ? 1 : 2, 1};
  while (s.block < 1024 && s.block * s.packs < row_packs) s.block *= 2;
  while (s.cluster < rows && s.cluster < k_few_rows_cluster_max) s.cluster *= 2;
  return s;
}
// The rows a few-row launch of `cluster` blocks holds: one block a row, two past one block.
inline std::int64_t few_rows_capacity(std::int64_t cluster) { return cluster == 1 ? 1 : 2 * cluster; }
// Whether an op takes the few-row launch for `rows` rows of `cols` elements: up to 8 rows always;
// 9 to 16 (each block then runs its two rows one after the other) only for rows of at most
// `two_rows_max_cols`, the longest for which the one launch beat the op's multi-launch backward on
// Hopper (a second row's latency in every block against the other path's extra launches).
inline bool few_rows_launch(std::int64_t rows, std::int64_t cols, std::int64_t two_rows_max_cols) {
  return rows >= 1 && (rows <= k_few_rows_cluster_max || (rows <= k_few_rows_max && cols <= two_rows_max_cols));
}
// Their tuning space: the heuristic's variant `h` at every block and packs count that `f` accepts
// for `p`.
inline std::vector<Params> few_rows_tuning_space(const Family& f, const Params& h, const Problem& p) {
  std::vector<Params> out;
  for (std::int64_t packs : {1, 2})
    for (std::int64_t block : {32, 64, 128, 256, 512, 1024}) {
      Params c = h;
      c.set("packs", packs).set("block", block);
      if (f.check_problem(c, p).ok()) out.push_back(c);
    }
  return out;
}

// A `kiln tune --shape` list (Family::problem_from_shape): the value it gives `name`, if any.
inline std::optional<std::int64_t> shape_value(const std::vector<std::pair<std::string, std::int64_t>>& shape,
                                               const std::string& name) {
  for (const auto& [n, v] : shape)
    if (n == name) return v;
  return std::nullopt;
}

// `shape` with `defaults` added for the names it does not give.
inline std::vector<std::pair<std::string, std::int64_t>> with_defaults(
    std::vector<std::pair<std::string, std::int64_t>> shape,
    const std::vector<std::pair<std::string, std::int64_t>>& defaults) {
  for (const auto& [name, value] : defaults)
    if (!shape_value(shape, name)) shape.emplace_back(name, value);
  return shape;
}

// A tuning problem whose rows must stay a whole number of sequences (P has `rows` and `seq`):
// rows rounded down to whole sequences, and at least one sequence.
template <class P>
Problem whole_sequences(Problem p) {
  auto q = p.as<P>();
  if (q.seq > 0) {
    q.rows = std::max(q.seq, q.rows / q.seq * q.seq);
    p.set(q);
  }
  return p;
}

}  // namespace kiln::families
