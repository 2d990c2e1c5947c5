#include "families/rmsnorm_bwd/rmsnorm_bwd_rows.h"
#include "families/rmsnorm_bwd/rmsnorm_bwd.h"
#include "families/common/family_util.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "common/half.h"

namespace kiln::families {
namespace {

// The heuristic's shape for p, or nothing when the kernel cannot hold its rows (alignment is
// check_problem's).
std::optional<FewRowsShape> choice_for(const Problem& p) {
  const auto q = p.as<RmsNormBwdRowsProblem>();
  const std::int64_t vec = 16 / std::int64_t(dtype_size(p.dtype));
  if (q.cols % vec) return std::nullopt;
  return few_rows_shape(q.rows, q.cols / vec);
}

// Contiguous rows, with the options of add_rms_norm_backward (recompute, dh) when `fused`.
Problem contiguous(DType t, std::int64_t rows, std::int64_t cols, bool fused) {
  return Problem::of(t, 16,
                     RmsNormBwdRowsProblem{.rows = rows,
                                           .cols = cols,
                                           .dy_row_stride = cols,
                                           .x_row_stride = cols,
                                           .dx_row_stride = cols,
                                           .dh_row_stride = fused ? cols : 0,
                                           .recompute = fused ? 1 : 0,
                                           .eps = 1e-6});
}

Params params_of(DType t, const FewRowsShape& c, const RmsNormBwdRowsProblem& q) {
  return Params{{"dtype", std::string(dtype_name(t))},
                {"block", c.block},
                {"vec", 16 / std::int64_t(dtype_size(t))},
                {"packs", c.packs},
                {"cluster", c.cluster},
                {"recompute", q.recompute ? 1 : 0},
                {"dh", q.dh_row_stride ? 1 : 0}};
}

class RmsNormBwdRows final : public Family {
 public:
  std::string_view name() const override { return "rmsnorm_bwd_rows"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {32, 64, 128, 256, 512, 1024}, {}, "threads per block (one row a block)"},
        {"cluster", {1, 2, 4, 8}, {}, "blocks in the launch's one cluster, each taking one row, or two with 2 or more blocks"},
        {"dh", {0, 1}, {}, "1 adds dh (the residual output's gradient) to dx"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dy, x, w, dx, dw and dh"},
        {"packs", {1, 2}, {}, "16-byte packs of each row buffer a thread holds in registers"},
        {"recompute", {0, 1}, {}, "1 computes inv_rms from x instead of reading it"},
        {"vec", {4, 8}, {}, "elements per access: 16 bytes"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<RmsNormBwdRowsProblem>({
        bucketed(&RmsNormBwdRowsProblem::rows, "rows", "rows of dy, x and dx (at most twice the cluster; 1 for a cluster of 1)"),
        key(&RmsNormBwdRowsProblem::cols, "cols", "elements per row"),
        key(&RmsNormBwdRowsProblem::dy_row_stride, "dy_row_stride", "elements between two rows of dy"),
        key(&RmsNormBwdRowsProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&RmsNormBwdRowsProblem::dx_row_stride, "dx_row_stride", "elements between two rows of dx"),
        key(&RmsNormBwdRowsProblem::dh_row_stride, "dh_row_stride", "elements between two rows of dh; 0: no dh"),
        key(&RmsNormBwdRowsProblem::recompute, "recompute", "1 computes inv_rms from x"),
        value(&RmsNormBwdRowsProblem::eps, "eps", "added to mean(x^2) with recompute")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto esize = std::int64_t(dtype_size(*parse_dtype(*params.get_str("dtype"))));
    if (*params.get_int("vec") * esize != 16)
      return invalid_argument("rmsnorm_bwd_rows: vec must make 16-byte accesses");
    return {};
  }

  // Clusters need sm_90 or later.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return *params.get_int("cluster") == 1 || arch.capability >= 90;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"rmsnorm_bwd/rmsnorm_bwd_rows.cuh\"\n";
    r.name_expression = std::string("kiln::rmsnorm_bwd_rows<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(*params.get_int("block")) + ", " + std::to_string(*params.get_int("vec")) +
                        ", " + std::to_string(*params.get_int("packs")) + ", " +
                        std::to_string(*params.get_int("cluster")) + ", " +
                        (*params.get_int("recompute") ? "true" : "false") + ", " +
                        (*params.get_int("dh") ? "true" : "false") + ">";
    return r;
  }

  // What the heuristic picks for 1, 2, 4 and 8 rows (9 to 16 take the 8-row variants) of the usual
  // hidden sizes, with and without the options of add_rms_norm_backward, in every dtype.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    std::vector<std::string> seen;
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (std::int64_t rows : {1, 2, 4, 8})
        for (std::int64_t cols : {896, 2048, 2880, 3072, 3584, 4096, 5120, 7168, 8192})
          for (bool fused : {false, true}) {
            const Problem p = contiguous(t, rows, cols, fused);
            if (!choice_for(p)) continue;
            const Params h = heuristic(p);
            if (std::find(seen.begin(), seen.end(), h.canonical()) == seen.end()) {
              seen.push_back(h.canonical());
              out.push_back(h);
            }
          }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdRowsProblem>();
    const auto rows = q.rows, cols = q.cols;
    if (rows < 0 || cols <= 0) return shape_mismatch("rmsnorm_bwd_rows: need rows >= 0 and cols > 0");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("rmsnorm_bwd_rows: kernel is for ") + dtype_name(dtype) +
                               ", tensors are " + dtype_name(p.dtype));
    for (std::int64_t s : {q.dy_row_stride, q.x_row_stride, q.dx_row_stride})
      if (s < cols) return shape_mismatch("rmsnorm_bwd_rows: row strides must be at least the row length");
    if (q.dh_row_stride != 0 && q.dh_row_stride < cols)
      return shape_mismatch("rmsnorm_bwd_rows: dh's row stride must be at least the row length (0: no dh)");
    if ((*params.get_int("recompute") == 1) != (q.recompute != 0) ||
        (*params.get_int("dh") == 1) != (q.dh_row_stride != 0))
      return invalid_argument("rmsnorm_bwd_rows: the variant's recompute and dh must match the problem's");
    if (q.recompute && (!(q.eps >= 0) || !std::isfinite(q.eps)))
      return invalid_argument("rmsnorm_bwd_rows: eps must be finite and non-negative");
    if (rows > few_rows_capacity(*params.get_int("cluster")))
      return invalid_argument("rmsnorm_bwd_rows: a cluster of " + std::to_string(*params.get_int("cluster")) +
                              " holds at most " + std::to_string(few_rows_capacity(*params.get_int("cluster"))) +
                              " rows, not " + std::to_string(rows));
    const auto vec = *params.get_int("vec");
    bool strides_ok = true;
    for (std::int64_t s : {q.dy_row_stride, q.x_row_stride, q.dx_row_stride, q.dh_row_stride}) strides_ok &= s % vec == 0;
    if (p.alignment < 16 || !strides_ok || cols % vec)
      return invalid_argument("rmsnorm_bwd_rows: needs 16-byte aligned buffers and row strides and rows of whole "
                              "16-byte packs");
    if (cols / vec > *params.get_int("block") * *params.get_int("packs"))
      return invalid_argument("rmsnorm_bwd_rows: rows of at most block * packs packs");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    const auto cluster = *params.get_int("cluster");
    g.grid.x = std::uint32_t(cluster);
    g.block.x = std::uint32_t(*params.get_int("block"));
    g.shared_bytes = cluster > 1 ? std::uint32_t(p.as<RmsNormBwdRowsProblem>().cols * 4) : 0u;
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto q = p.as<RmsNormBwdRowsProblem>();
    if (const auto c = choice_for(p)) return params_of(p.dtype, *c, q);
    // Out of the kernel's reach: the largest shape, which check_problem refuses for p.
    return params_of(p.dtype, {1024, 2, 8}, q);
  }

  // Every block and packs count that holds the row, at the heuristic's cluster.
  std::vector<Params> tuning_space(const Problem& p) const override {
    return few_rows_tuning_space(*this, heuristic(p), p);
  }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 3, 8})
      for (std::int64_t cols : {896, 4096, 8192})
        for (bool fused : {false, true}) out.push_back(contiguous(dtype, rows, cols, fused));
    // Padded rows, all options.
    out.push_back(Problem::of(dtype, 16, RmsNormBwdRowsProblem{.rows = 5,
                                                               .cols = 2048,
                                                               .dy_row_stride = 2112,
                                                               .x_row_stride = 2080,
                                                               .dx_row_stride = 2176,
                                                               .dh_row_stride = 2096,
                                                               .recompute = 1,
                                                               .eps = 1e-6}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<RmsNormBwdRowsProblem>();
    const auto rows = q.rows, cols = q.cols;
    auto extent = [&](std::int64_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"dy", BufferRole::input, p.dtype, extent(q.dy_row_stride)},
            {"x", BufferRole::input, p.dtype, extent(q.x_row_stride)},
            {"w", BufferRole::input, p.dtype, cols},
            {"inv_rms", BufferRole::input, DType::f32, q.recompute ? 0 : rows},
            {"dx", BufferRole::output, p.dtype, extent(q.dx_row_stride)},
            {"dw", BufferRole::output, p.dtype, cols},
            {"dh", BufferRole::input, p.dtype, q.dh_row_stride ? extent(q.dh_row_stride) : 0}};
  }

  // dh, the seventh buffer, may be left out when the problem has none.
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<RmsNormBwdRowsProblem>();
    for (int i = 0; i < 6; ++i) out.add(b[i]);
    for (std::int64_t v : {q.rows, q.cols, q.dy_row_stride, q.x_row_stride, q.dx_row_stride})
      out.add(static_cast<long long>(v));
    out.add(b.size() > 6 ? b[6] : nullptr);
    out.add(static_cast<long long>(q.dh_row_stride));
    out.add(static_cast<float>(q.eps));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    const auto q = p.as<RmsNormBwdRowsProblem>();
    if (b.size() != 7 && !(b.size() == 6 && q.dh_row_stride == 0))
      return invalid_argument("rmsnorm_bwd_rows: reference takes 7 buffers (dy, x, w, inv_rms, dx, dw, dh; "
                              "without dh the last may be left out)");
    const RmsNormBwdRowRef a = rmsnorm_bwd_row_ref(p.dtype, q, b);
    const auto cols = q.cols;
    std::vector<double> dw(std::size_t(cols), 0.0);
    for (std::int64_t r = 0; r < q.rows; ++r) rmsnorm_bwd_reference_row(a, r, dw);
    for (std::int64_t c = 0; c < cols; ++c) store_from_double(b[5], p.dtype, c, dw[std::size_t(c)]);
    return {};
  }
};

}  // namespace

bool rmsnorm_bwd_rows_fits(const Problem& p, int max_cluster) {
  const auto c = choice_for(p);
  if (!c || c->cluster > max_cluster) return false;
  const auto q = p.as<RmsNormBwdRowsProblem>();
  const std::int64_t vec = 16 / std::int64_t(dtype_size(p.dtype));
  if (p.alignment < 16) return false;
  for (std::int64_t s : {q.dy_row_stride, q.x_row_stride, q.dx_row_stride, q.dh_row_stride})
    if (s % vec) return false;
  return true;
}

}  // namespace kiln::families

void kiln_register_kernels_rmsnorm_bwd_rows(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::RmsNormBwdRows>());
}
