#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

Params params_of(DType t, const RmsNormBwdChoice& c) {
  return Params{{"dtype", std::string(dtype_name(t))}, {"group", std::int64_t(c.group)},
                {"rows", std::int64_t(c.rows)},       {"vec", std::int64_t(c.vec)},
                {"packs", std::int64_t(c.packs)},     {"cluster", std::int64_t(c.cluster)},
                {"sm_threads", std::int64_t(c.sm_threads)}, {"stages", std::int64_t(c.stages)},
                {"recompute", std::int64_t(c.recompute)}, {"dh", std::int64_t(c.dh)}};
}

// The row strides a kernel reads and writes: dy, x, dx, and dh when the problem has one.
std::vector<std::int64_t> row_strides(const RmsNormBwdProblem& q) {
  std::vector<std::int64_t> out{q.dy_row_stride, q.x_row_stride, q.dx_row_stride};
  if (q.dh_row_stride != 0) out.push_back(q.dh_row_stride);
  return out;
}

// The largest dynamic shared memory one block may opt into on sm_90 (227 KiB), and what an SM
// holds (228 KiB, 1 KiB of it reserved per block).
constexpr std::int64_t k_max_block_smem = 227 * 1024;
constexpr std::int64_t k_sm_smem = 228 * 1024;

// Whether bulk copies can bring the problem's rows: sm_90 or later (max_cluster > 1 only there),
// 16-byte aligned buffers and row strides, whole 16-byte packs per row.
bool bulk_able(const Problem& p) {
  const auto q = p.as<RmsNormBwdProblem>();
  const std::int64_t esize = std::int64_t(dtype_size(p.dtype));
  if (q.max_cluster <= 1 || p.alignment < 16 || (q.cols * esize) % 16) return false;
  for (std::int64_t stride : row_strides(q))
    if ((stride * esize) % 16) return false;
  return true;
}
std::int64_t packs16(const Problem& p) {
  return p.as<RmsNormBwdProblem>().cols * std::int64_t(dtype_size(p.dtype)) / 16;
}
// The most 16-byte packs per row the one-block bulk-copy kernel takes: 2048, or with dh what 512
// threads hold at 16 elements each (1024 packs in f16/bf16, 2048 in f32). Past 16 elements a
// thread keeps dw in shared memory and dy, x and w in registers across the row's barrier, and
// the dh loads of the dx pass then spill (validate rejects those variants).
std::int64_t bulk_max_packs(const Problem& p) {
  return p.as<RmsNormBwdProblem>().dh_row_stride != 0 ? 512 * std::int64_t(dtype_size(p.dtype)) : 2048;
}
// Whether the one-block bulk-copy kernel can run the problem.
bool bulk_fits(const Problem& p) { return bulk_able(p) && packs16(p) <= bulk_max_packs(p); }
// The cluster size the clustered bulk kernel takes by default, 0 where it is not the default: rows
// of more packs than one block's ring holds, at most what a cluster of 4 holds at 512 threads x 4
// packs (hidden 65536 in f16/bf16, 32768 in f32); the smallest cluster, 2 or 4, that holds the row
// at 512 x 4 packs per block, on a device with clusters of that size.
int bulk_cluster_default(const Problem& p) {
  const std::int64_t packs = packs16(p);
  if (!bulk_able(p) || packs <= bulk_max_packs(p) || packs > 4 * 512 * 4) return 0;
  const int cluster = packs > 2 * 512 * 4 ? 4 : 2;
  return p.as<RmsNormBwdProblem>().max_cluster >= cluster ? cluster : 0;
}

// Packs of the row that one block of the cluster owns.
std::int64_t packs_per_block(const RmsNormBwdChoice& c, std::int64_t cols) {
  return ceil_div(cols / c.vec, c.cluster);
}

class RmsNormBwd final : public Family {
 public:
  std::string_view name() const override { return "rmsnorm_bwd"; }
  int version() const override { return 5; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"cluster", {1, 2, 4, 8}, {}, "blocks of a thread-block cluster sharing one row (sm_90 and later)"},
        {"dh", {0, 1}, {}, "1: adds a gradient dh to dx (the problem's dh_row_stride is not 0)"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dy, x, w, dx and dh"},
        {"group", {32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512}, {},
         "threads working on one row (powers of two without bulk copies)"},
        {"packs", {1, 2, 4}, {}, "packs of dy and x per thread kept in registers (4: with bulk copies only)"},
        {"recompute", {0, 1}, {}, "1: computes inv_rms = rsqrt(mean(x^2) + eps) from x rather than reading it"},
        {"rows", {1, 2, 4, 8}, {}, "rows in flight per block (one per group)"},
        {"sm_threads", {512, 1024}, {}, "resident threads per SM the kernel is built for (its register cap: 128 or 64)"},
        {"stages", {0, 2, 3, 4, 6}, {}, "row buffers filled by bulk copies (sm_90 and later; at least 3 with clusters); 0: rows read into registers"},
        {"vec", {1, 2, 4, 8}, {}, "elements per memory access"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<RmsNormBwdProblem>({
        bucketed(&RmsNormBwdProblem::rows, "rows", "rows of dy, x and dx"),
        key(&RmsNormBwdProblem::cols, "cols", "elements per row (the hidden size)"),
        key(&RmsNormBwdProblem::dy_row_stride, "dy_row_stride", "elements between two rows of dy"),
        key(&RmsNormBwdProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&RmsNormBwdProblem::dx_row_stride, "dx_row_stride", "elements between two rows of dx"),
        key(&RmsNormBwdProblem::slabs, "slabs", "row slabs, hence partial dw rows (rmsnorm_bwd_slabs)"),
        key(&RmsNormBwdProblem::max_cluster, "max_cluster",
            "the largest cluster the device launches (8 from sm_90, else 1)"),
        key(&RmsNormBwdProblem::dh_row_stride, "dh_row_stride",
            "elements between two rows of dh, the gradient added to dx; 0: no dh"),
        key(&RmsNormBwdProblem::recompute, "recompute",
            "1: inv_rms is computed from x (the inv_rms buffer is not read), 0: read"),
        value(&RmsNormBwdProblem::eps, "eps", "added to mean(x^2) when recompute is 1")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto c = rmsnorm_bwd_choice(params);
    KILN_TRY(check_access_width(name(), params));
    // At most 512 threads per block, so that even at 1024 threads per SM two blocks share an SM.
    if (c.group * c.rows > 512)
      return invalid_argument("rmsnorm_bwd: group * rows must be at most 512 threads (got " +
                              std::to_string(c.group * c.rows) + ")");
    // The 64-register cap pays for blocks that would otherwise be alone or two on an SM; smaller
    // blocks already come many to an SM at 128 registers, and some of them spill under the cap.
    if (c.sm_threads == 1024 && c.group * c.rows < 256)
      return invalid_argument("rmsnorm_bwd: sm_threads=1024 needs blocks of at least 256 threads (got " +
                              std::to_string(c.group * c.rows) + ")");
    if (c.stages == 0) {
      if ((c.group & (c.group - 1)) != 0 || c.packs > 2)
        return invalid_argument("rmsnorm_bwd: without bulk copies, group must be a power of two and packs at most 2");
      return {};
    }
    const std::int64_t esize = std::int64_t(dtype_size(*parse_dtype(*params.get_str("dtype"))));
    if (c.cluster > 1) {
      // The clustered bulk kernel: one block per SM, dw in registers.
      if (c.rows != 1 || c.sm_threads != 512 || c.vec * esize != 16 || c.stages < 3)
        return invalid_argument("rmsnorm_bwd: stages > 0 with cluster > 1 (clustered bulk copies) needs rows=1, "
                                "sm_threads=512, 16-byte packs and stages >= 3");
      if (rmsnorm_bwd_bulk_smem(c, esize) > k_max_block_smem)
        return invalid_argument("rmsnorm_bwd: " + std::to_string(c.stages) + " row buffers of " +
                                std::to_string(2 * c.group * c.packs * 16) + " bytes do not fit in shared memory");
      return {};
    }
    if (c.rows != 1 || c.sm_threads != 512 || c.vec * esize != 16)
      return invalid_argument("rmsnorm_bwd: stages > 0 (bulk copies) needs rows=1, sm_threads=512 and "
                              "16-byte packs");
    if (c.dh && c.packs * c.vec > 16)
      return invalid_argument("rmsnorm_bwd: the bulk-copy kernel with dh=1 takes at most 16 elements per thread");
    const std::int64_t smem = rmsnorm_bwd_bulk_smem(c, esize);
    if (smem > k_max_block_smem || std::max(1, 512 / c.group) * (smem + 1024) > k_sm_smem)
      return invalid_argument("rmsnorm_bwd: " + std::to_string(c.stages) + " row buffers of " +
                              std::to_string(c.group * c.packs * 16) + " bytes do not fit in shared memory");
    return {};
  }

  // Thread-block clusters (cluster > 1) and bulk copies (stages > 0: cp.async.bulk, mbarrier
  // transaction counts) need sm_90 or later; on older archs those kernels only trap.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    const auto c = rmsnorm_bwd_choice(params);
    return (c.cluster == 1 && c.stages == 0) || arch.capability >= 90;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const auto c = rmsnorm_bwd_choice(params);
    Rendered r;
    r.source = "#include \"rmsnorm_bwd/rmsnorm_bwd.cuh\"\n";
    // The options' template arguments default to false: variants without them render as before.
    std::string options;
    if (c.recompute || c.dh) options = std::string(c.recompute ? ", true" : ", false") + (c.dh ? ", true" : ", false");
    if (c.stages > 0 && c.cluster > 1) {
      r.name_expression = std::string("kiln::rmsnorm_bwd_bulk_cluster<") + device_type(*params.get_str("dtype")) +
                          ", " + std::to_string(c.group) + ", " + std::to_string(c.packs) + ", " +
                          std::to_string(c.stages) + ", " + std::to_string(c.cluster) + options + ">";
      return r;
    }
    if (c.stages > 0) {
      r.name_expression = std::string("kiln::rmsnorm_bwd_bulk<") + device_type(*params.get_str("dtype")) + ", " +
                          std::to_string(c.group) + ", " + std::to_string(c.packs) + ", " + std::to_string(c.stages) +
                          options + ">";
      return r;
    }
    r.name_expression = std::string("kiln::rmsnorm_bwd<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(c.group) + ", " + std::to_string(c.rows) + ", " + std::to_string(c.vec) +
                        ", " + std::to_string(c.packs) + ", " + std::to_string(c.cluster) + ", " +
                        std::to_string(c.sm_threads) + options + ">";
    return r;
  }

  // What the heuristic picks over the usual row lengths, alignments and devices with and without
  // clusters, for one row and for many: for rms_norm_backward (a saved inv_rms) and for
  // add_rms_norm_backward in training (recompute, with dh; without dh, the residual output
  // unused, is compiled on first use).
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    std::set<std::string> seen;
    for (const bool fused : {false, true})
      for (DType t : {DType::f32, DType::f16, DType::bf16})
        for (std::int64_t cols : {1, 64, 128, 256, 512, 1024, 2048, 3000, 4096, 5120, 8192, 16384, 32768, 65536})
          for (std::uint32_t align : {16u, 2u})
            for (std::int64_t max_cluster : {1, 8})
              for (std::int64_t rows : {1, 4096}) {
                const Problem p = Problem::of(t, std::max<std::uint32_t>(align, std::uint32_t(dtype_size(t))),
                                              RmsNormBwdProblem{.rows = rows,
                                                                .cols = cols,
                                                                .dy_row_stride = cols,
                                                                .x_row_stride = cols,
                                                                .dx_row_stride = cols,
                                                                .max_cluster = max_cluster,
                                                                .dh_row_stride = fused ? cols : 0,
                                                                .recompute = fused ? 1 : 0,
                                                                .eps = 1e-6});
                // Each choice at both register caps: the tuner may pick either (bulk kernels: 512 only).
                auto c = rmsnorm_bwd_heuristic(p);
                for (int sm_threads : {512, 1024}) {
                  if (c.stages > 0 && sm_threads != 512) continue;
                  c.sm_threads = sm_threads;
                  Params params = params_of(t, c);
                  if (validate(params).ok() && seen.insert(params.canonical()).second) out.push_back(std::move(params));
                }
              }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdProblem>();
    const auto rows = q.rows, cols = q.cols, slabs = q.slabs;
    if (rows < 0 || cols <= 0) return shape_mismatch("rmsnorm_bwd: need rows >= 0 and cols > 0");
    if (cols >= (std::int64_t(1) << 31)) return shape_mismatch("rmsnorm_bwd: rows longer than 2^31 elements");
    if (q.dy_row_stride < cols || q.x_row_stride < cols || q.dx_row_stride < cols ||
        (q.dh_row_stride != 0 && q.dh_row_stride < cols))
      return shape_mismatch("rmsnorm_bwd: row strides must be at least the row length");
    if (q.recompute != 0 && q.recompute != 1) return invalid_argument("rmsnorm_bwd: recompute must be 0 or 1");
    if (q.recompute && !(std::isfinite(q.eps) && q.eps >= 0))
      return invalid_argument("rmsnorm_bwd: eps must be finite and non-negative");
    const auto c = rmsnorm_bwd_choice(params);
    auto options = [](bool recompute, bool dh) {
      return std::string(recompute ? "recompute=1" : "recompute=0") + (dh ? " with dh" : " without dh");
    };
    if (c.recompute != (q.recompute == 1) || c.dh != (q.dh_row_stride != 0))
      return invalid_argument("rmsnorm_bwd: the kernel is for " + options(c.recompute, c.dh) + ", the problem has " +
                              options(q.recompute == 1, q.dh_row_stride != 0));
    if (slabs < (rows > 0 ? 1 : 0) || slabs > std::max<std::int64_t>(rows, 1) || slabs * c.cluster > 0x7fffffff)
      return invalid_argument("rmsnorm_bwd: slabs must be between 1 and the row count");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("rmsnorm_bwd: kernel is for ") + dtype_name(dtype) + ", tensors are " +
                               dtype_name(p.dtype));
    const auto strides = row_strides(q);
    if (p.alignment < c.vec * std::int64_t(dtype_size(dtype)) ||
        std::any_of(strides.begin(), strides.end(), [&](std::int64_t s) { return s % c.vec != 0; }))
      return invalid_argument("rmsnorm_bwd: vec=" + std::to_string(c.vec) +
                              " needs buffers and row strides aligned to vec elements");
    if (c.cluster > q.max_cluster)
      return invalid_argument("rmsnorm_bwd: cluster=" + std::to_string(c.cluster) + " exceeds the device's " +
                              std::to_string(q.max_cluster));
    // Re-read packs keep their dw in the block's partial row, which only one group may update.
    if (c.rows > 1 && packs_per_block(c, cols) > std::int64_t(c.group) * c.packs)
      return invalid_argument("rmsnorm_bwd: rows > 1 needs the row to fit in group * packs packs");
    if (c.stages > 0 && c.cluster > 1) {
      if (!bulk_able(p))
        return invalid_argument("rmsnorm_bwd: stages > 0 (bulk copies) needs sm_90 or later, 16-byte aligned "
                                "buffers, row strides and rows");
      if (cols / c.vec > std::int64_t(c.cluster) * c.group * c.packs)
        return invalid_argument("rmsnorm_bwd: stages > 0 with a cluster needs the row to fit in cluster * group * "
                                "packs packs");
    } else if (c.stages > 0) {
      if (!bulk_fits(p))
        return invalid_argument("rmsnorm_bwd: stages > 0 (bulk copies) needs sm_90 or later, 16-byte aligned "
                                "buffers, row strides and rows, and rows of at most 2048 16-byte packs (1024 "
                                "in f16 and bf16 with dh)");
      if (cols / c.vec > std::int64_t(c.group) * c.packs)
        return invalid_argument("rmsnorm_bwd: stages > 0 needs the row to fit in group * packs packs");
    }
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto c = rmsnorm_bwd_choice(params);
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(p.as<RmsNormBwdProblem>().slabs, 1) * c.cluster);
    g.block.x = std::uint32_t(c.group * c.rows);
    if (c.stages > 0) g.shared_bytes = std::uint32_t(rmsnorm_bwd_bulk_smem(c, std::int64_t(dtype_size(p.dtype))));
    return g;
  }

  Params heuristic(const Problem& p) const override { return params_of(p.dtype, rmsnorm_bwd_heuristic(p)); }

  // Around the heuristic's choice: its vector width, every shape whose register cache holds the
  // block's packs with at most half of it idle, at both register caps, and the heuristic itself.
  std::vector<Params> tuning_space(const Problem& p) const override {
    const auto q = p.as<RmsNormBwdProblem>();
    const auto h = rmsnorm_bwd_heuristic(p);
    std::vector<Params> out{params_of(p.dtype, h)};
    // Bulk-copy kernels: 2 or 4 packs per thread, 2 or 4 row buffers.
    if (bulk_fits(p)) {
      const std::int64_t packs = q.cols * std::int64_t(dtype_size(p.dtype)) / 16;
      for (int per_thread : {2, 4})
        for (int stages : {2, 4}) {
          const int threads = int(std::max<std::int64_t>(32, (ceil_div(packs, per_thread) + 31) / 32 * 32));
          if (threads > 512) continue;
          const RmsNormBwdChoice c{threads, 1, int(16 / dtype_size(p.dtype)), per_thread, 1, 512, stages,
                                   h.recompute, h.dh};
          Params params = params_of(p.dtype, c);
          if (params == out[0] || !validate(params).ok() || !check_problem(params, p).ok()) continue;
          out.push_back(std::move(params));
        }
    }
    // Clustered bulk kernels past one block's ring: clusters of 2, 4 or 8, 2 or 4 packs per
    // thread, as many row buffers (3, 4 or 6) as fit.
    if (bulk_able(p) && packs16(p) > bulk_max_packs(p)) {
      const std::int64_t esize = std::int64_t(dtype_size(p.dtype)), packs = packs16(p);
      for (int cluster : {2, 4, 8}) {
        if (cluster > q.max_cluster) continue;
        for (int per_thread : {2, 4}) {
          const std::int64_t threads = (ceil_div(packs, std::int64_t(cluster) * per_thread) + 31) / 32 * 32;
          if (threads > 512) continue;
          for (int stages : {6, 4, 3}) {
            const RmsNormBwdChoice c{int(threads), 1, int(16 / esize), per_thread, cluster, 512, stages, h.recompute, h.dh};
            Params params = params_of(p.dtype, c);
            if (!validate(params).ok() || !check_problem(params, p).ok()) continue;
            if (params != out[0]) out.push_back(std::move(params));
            break;  // the deepest ring that fits
          }
        }
      }
    }
    for (int cluster : {1, 2, 4, 8})
      for (int group : {32, 64, 128, 256, 512})
        for (int rows : {1, 2, 4, 8})
          for (int packs : {1, 2})
            for (int sm_threads : {512, 1024}) {
              RmsNormBwdChoice c{group, rows, h.stages > 0 ? 16 / int(dtype_size(p.dtype)) : h.vec,
                                 packs, cluster, sm_threads};
              c.recompute = h.recompute;
              c.dh = h.dh;
              const std::int64_t per_block = packs_per_block(c, q.cols);
              const std::int64_t cache = std::int64_t(group) * packs;
              if (per_block > cache || 2 * per_block <= cache) continue;
              if (rows > std::max<std::int64_t>(1, q.rows)) continue;
              Params params = params_of(p.dtype, c);
              if (params == out[0] || !validate(params).ok() || !check_problem(params, p).ok()) continue;
              out.push_back(std::move(params));
            }
    return out;
  }

  // Training shapes, contiguous, on an H100-sized GPU (132 SMs) without clusters (max_cluster 1,
  // so every GPU runs them): the slab count the typed op would pick for the heuristic's choice.
  // rms_norm_backward's problems, and add_rms_norm_backward's (recompute, dh) at two row counts.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    auto add = [&](std::int64_t rows, std::int64_t cols, bool fused) {
      RmsNormBwdProblem q{.rows = rows,
                          .cols = cols,
                          .dy_row_stride = cols,
                          .x_row_stride = cols,
                          .dx_row_stride = cols,
                          .max_cluster = 1,
                          .dh_row_stride = fused ? cols : 0,
                          .recompute = fused ? 1 : 0,
                          .eps = 1e-6};
      Problem p = Problem::of(dtype, 16, q);
      q.slabs = rmsnorm_bwd_slabs(rmsnorm_bwd_heuristic(p), p, 132);
      p.set(q);
      out.push_back(p);
    };
    for (std::int64_t rows : {16, 512, 4096, 16384})
      for (std::int64_t cols : {2048, 4096, 8192}) add(rows, cols, false);
    for (std::int64_t rows : {16, 4096})
      for (std::int64_t cols : {2048, 4096, 8192}) add(rows, cols, true);
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdProblem>();
    const auto rows = q.rows, cols = q.cols;
    auto extent = [&](std::int64_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"dy", BufferRole::input, p.dtype, extent(q.dy_row_stride)},
            {"x", BufferRole::input, p.dtype, extent(q.x_row_stride)},
            {"w", BufferRole::input, p.dtype, cols},
            {"inv_rms", BufferRole::input, DType::f32, q.recompute ? 0 : rows},
            {"dx", BufferRole::output, p.dtype, extent(q.dx_row_stride)},
            {"partial", BufferRole::output, DType::f32, q.slabs * cols},
            {"dh", BufferRole::input, p.dtype, q.dh_row_stride ? extent(q.dh_row_stride) : 0}};
  }

  // dh, the seventh buffer, may be left out when the problem has none.
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RmsNormBwdProblem>();
    for (int i = 0; i < 6; ++i) out.add(b[i]);
    for (std::int64_t v : {q.rows, q.cols, q.dy_row_stride, q.x_row_stride, q.dx_row_stride, q.slabs})
      out.add(static_cast<long long>(v));
    out.add(b.size() > 6 ? b[6] : nullptr);
    out.add(static_cast<long long>(q.dh_row_stride));
    out.add(static_cast<float>(q.eps));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    const auto q = p.as<RmsNormBwdProblem>();
    if (b.size() != 7 && !(b.size() == 6 && q.dh_row_stride == 0))
      return invalid_argument("rmsnorm_bwd: reference takes 7 buffers (dy, x, w, inv_rms, dx, partial, dh; "
                              "without dh the last may be left out)");
    const auto rows = q.rows, cols = q.cols, slabs = q.slabs;
    if (rows > 0 && slabs < 1) return invalid_argument("rmsnorm_bwd: slabs must be at least 1");
    const RmsNormBwdRowRef a = rmsnorm_bwd_row_ref(p.dtype, q, b);
    auto* partial = static_cast<float*>(b[5]);
    std::vector<double> dw(std::size_t(cols), 0.0);
    for (std::int64_t slab = 0; slab < slabs; ++slab) {
      std::fill(dw.begin(), dw.end(), 0.0);
      for (std::int64_t r = slab; r < rows; r += slabs) rmsnorm_bwd_reference_row(a, r, dw);
      for (std::int64_t c = 0; c < cols; ++c) partial[slab * cols + c] = float(dw[std::size_t(c)]);
    }
    return {};
  }
};

}  // namespace

void rmsnorm_bwd_reference_row(const RmsNormBwdRowRef& a, std::int64_t r, std::vector<double>& dw) {
  const std::int64_t dyo = r * a.dy_stride, xo = r * a.x_stride, dxo = r * a.dx_stride;
  double dot = 0, squares = 0;
  for (std::int64_t c = 0; c < a.cols; ++c) {
    const double x = load_as_double(a.x, a.t, xo + c);
    dot += load_as_double(a.dy, a.t, dyo + c) * load_as_double(a.w, a.t, c) * x;
    squares += x * x;
  }
  const double s = a.recompute ? 1 / std::sqrt(squares / double(a.cols) + a.eps) : double(a.inv_rms[r]);
  const double k = s * s * s * dot / double(a.cols);
  for (std::int64_t c = 0; c < a.cols; ++c) {
    const double dy = load_as_double(a.dy, a.t, dyo + c), x = load_as_double(a.x, a.t, xo + c);
    double dx = s * dy * load_as_double(a.w, a.t, c) - x * k;
    if (a.dh) dx += load_as_double(a.dh, a.t, r * a.dh_stride + c);
    store_from_double(a.dx, a.t, dxo + c, dx);
    dw[std::size_t(c)] += dy * x * s;
  }
}

RmsNormBwdChoice rmsnorm_bwd_choice(const Params& params) {
  return {int(*params.get_int("group")), int(*params.get_int("rows")),    int(*params.get_int("vec")),
          int(*params.get_int("packs")), int(*params.get_int("cluster")), int(*params.get_int("sm_threads")),
          int(params.get_int("stages").value_or(0)),   params.get_int("recompute").value_or(0) == 1,
          params.get_int("dh").value_or(0) == 1};
}

std::int64_t rmsnorm_bwd_bulk_smem(const RmsNormBwdChoice& c, std::int64_t esize) {
  const std::int64_t elems = std::int64_t(c.group) * c.packs * (16 / esize);
  // The clustered kernel keeps dw in registers.
  const bool dw_smem = c.cluster == 1 && c.packs * (16 / esize) > 16;
  return std::int64_t(c.stages) * 2 * elems * esize + (dw_smem ? elems * 4 : 0);
}

RmsNormBwdChoice rmsnorm_bwd_heuristic(const Problem& p) {
  const auto q = p.as<RmsNormBwdProblem>();
  const int esize = int(dtype_size(p.dtype));
  const std::int64_t cols = q.cols;
  // Rows of 2049 to 8192 16-byte packs on sm_90 (hidden 32768 and 65536 in bf16): the clustered
  // bulk kernel in the smallest cluster (2 or 4) whose blocks hold the row at 512 threads x 4
  // packs, threads rounded up to whole warps, 3 row buffers (192 KiB at 512 threads). In the
  // bench's variants section on Hopper, at 4096 x 65536 bf16 clusters of 4 x 512 threads are well
  // ahead of the register kernel in clusters of 8 and of clusters of 8 x 256; at 4096 x 32768
  // clusters of 2 x 512 are well ahead of 4 x 256 and 8 x 128 (clusters of 2 fill all 132 SMs of
  // an H100; 30 clusters of 4 fit, 120 SMs). docs/benchmarks.md has the figures. With dh, rows
  // of 1025 to 2048 packs in f16 and bf16 (hidden 8200 to 16384) take it too, in clusters of 2
  // (the one-block kernel would spill there: bulk_max_packs), at two packs per thread: blocks of
  // 257 to 512 threads, whose warps hide the latency of the dh loads as the one-block kernel's do.
  if (const int cluster = bulk_cluster_default(p)) {
    const int per_thread = packs16(p) <= 2048 ? 2 : 4;
    RmsNormBwdChoice c{0, 1, 16 / esize, per_thread, cluster, 512, 3, q.recompute == 1, q.dh_row_stride != 0};
    c.group = int((ceil_div(packs16(p), per_thread * c.cluster) + 31) / 32 * 32);
    return c;
  }
  // Rows of 256 to 2048 16-byte packs on sm_90: the bulk-copy kernel, which is faster than the
  // register kernel at 4096 and 32768 rows of hidden 2048 to 16384 bf16 on Hopper (with dw's second
  // stage; docs/benchmarks.md). Two packs per thread up to 1024 packs, else four; threads rounded
  // up to whole warps; blocks come 512 / threads to an SM; four row buffers while the SM's shared
  // memory for them (rmsnorm_bwd_bulk_smem) stays within 128 KiB, else two.
  if (bulk_fits(p) && cols * esize / 16 >= 256) {
    const std::int64_t packs = cols * esize / 16;
    RmsNormBwdChoice c{0, 1, 16 / esize, packs <= 1024 ? 2 : 4, 1, 512, 4, q.recompute == 1, q.dh_row_stride != 0};
    c.group = int((ceil_div(packs, c.packs) + 31) / 32 * 32);
    if (std::max(1, 512 / c.group) * rmsnorm_bwd_bulk_smem(c, esize) > 128 * 1024) c.stages = 2;
    return c;
  }
  RmsNormBwdChoice c{32, 1, 16 / esize, 1, 1, 512};
  c.recompute = q.recompute == 1;
  c.dh = q.dh_row_stride != 0;
  // The widest access that every row start and the weight allow.
  const auto strides = row_strides(q);
  while (c.vec > 1 && (p.alignment < std::uint32_t(c.vec * esize) || cols < c.vec ||
                       std::any_of(strides.begin(), strides.end(), [&](std::int64_t s) { return s % c.vec != 0; })))
    c.vec /= 2;
  const std::int64_t max_cluster = std::min<std::int64_t>(8, q.max_cluster);
  while (c.cluster * 2 <= max_cluster && packs_per_block(c, cols) > 1024) c.cluster *= 2;
  const std::int64_t per_block = std::max<std::int64_t>(1, packs_per_block(c, cols));
  while (c.group < 512 && 2 * c.group < per_block) c.group *= 2;
  c.packs = per_block > c.group ? 2 : 1;
  while (c.group * c.rows < 256 && c.rows * 2 <= std::min<std::int64_t>(8, q.rows)) c.rows *= 2;
  // The 64-register cap wherever validate allows it: on Hopper it is the fastest variant at every
  // benchmark shape, well ahead of the 128-register one (bench --only variants, docs/benchmarks.md).
  if (c.group * c.rows >= 256) c.sm_threads = 1024;
  return c;
}

std::int64_t rmsnorm_bwd_slabs(const RmsNormBwdChoice& c, const Problem& p, int sms, int resident_clusters) {
  const std::int64_t rows = p.as<RmsNormBwdProblem>().rows;
  if (rows <= 0) return 0;
  // The clustered bulk kernel keeps a ring per block across its slab's rows: one slab per cluster
  // the GPU runs at once, or a late cluster would start its whole slab after the others ended.
  // Without the driver's count, as many as the SMs hold by shared memory and threads: an upper
  // bound (registers and GPC packing may allow fewer), so that a workspace sized by it holds what
  // the op launches. Blocks of up to 512 threads and 192 KiB come one to an SM; the smaller ones
  // of rows that dh sends to clusters may come several.
  if (c.stages > 0 && c.cluster > 1) {
    int clusters = resident_clusters;
    if (clusters <= 0) {
      const std::int64_t block_smem = rmsnorm_bwd_bulk_smem(c, std::int64_t(dtype_size(p.dtype))) + 1024;
      const std::int64_t per_sm = std::max<std::int64_t>(1, std::min<std::int64_t>(k_sm_smem / block_smem, 2048 / c.group));
      clusters = std::max(1, int(sms * per_sm / c.cluster));
    }
    return std::min<std::int64_t>(clusters, rows);
  }
  // The kernel's register cap lets an SM hold sm_threads threads.
  const int resident = std::max(1, c.sm_threads / (c.group * c.rows));
  // The GPU may hold fewer clusters of 4 or 8 than SMs / cluster (they must fit in one GPC):
  // smaller slabs then keep the waves even. Rows this wide make the extra partial rows cheap.
  const int spread = c.cluster >= 4 ? c.cluster / 2 : 1;
  const std::int64_t slabs =
      std::max<std::int64_t>(1, std::int64_t(std::max(sms, 1)) * resident / c.cluster * spread);
  return std::min(slabs, ceil_div(rows, c.rows));
}

}  // namespace kiln::families

void kiln_register_kernels_rmsnorm_bwd_reduce(kiln::Registry& r);
void kiln_register_kernels_rmsnorm_bwd_rows(kiln::Registry& r);

// The backward's kernel families: the row pass and the reduction of its partial dw rows, and the
// one-launch backward of a few rows.
void kiln_register_family_rmsnorm_bwd(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RmsNormBwd>());
  kiln_register_kernels_rmsnorm_bwd_reduce(r);
  kiln_register_kernels_rmsnorm_bwd_rows(r);
}
