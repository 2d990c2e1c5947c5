#include "families/layernorm/layernorm_bwd_rows.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {
namespace {

// The heuristic's shape for p, or nothing when the kernel cannot hold its rows (alignment is
// check_problem's).
std::optional<FewRowsShape> choice_for(const Problem& p) {
  const auto q = p.as<LayerNormBwdRowsProblem>();
  const std::int64_t vec = 16 / std::int64_t(dtype_size(p.dtype));
  if (q.cols % vec) return std::nullopt;
  return few_rows_shape(q.rows, q.cols / vec);
}

Params params_of(DType t, const FewRowsShape& c) {
  return Params{{"dtype", std::string(dtype_name(t))},
                {"block", c.block},
                {"vec", 16 / std::int64_t(dtype_size(t))},
                {"packs", c.packs},
                {"cluster", c.cluster}};
}

Problem contiguous(DType t, std::int64_t rows, std::int64_t cols) {
  return Problem::of(t, 16, LayerNormBwdRowsProblem{.rows = rows, .cols = cols, .dy_row_stride = cols,
                                                    .x_row_stride = cols, .dx_row_stride = cols});
}

class LayerNormBwdRows final : public Family {
 public:
  std::string_view name() const override { return "layernorm_bwd_rows"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {32, 64, 128, 256, 512, 1024}, {}, "threads per block (one row a block)"},
        {"cluster", {1, 2, 4, 8}, {}, "blocks in the launch's one cluster, each taking one row, or two with 2 or more blocks"},
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of dy, x, weight, dx, dweight and dbias"},
        {"packs", {1, 2}, {}, "16-byte packs of each row buffer a thread holds in registers"},
        {"vec", {4, 8}, {}, "elements per access: 16 bytes"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<LayerNormBwdRowsProblem>({
        bucketed(&LayerNormBwdRowsProblem::rows, "rows", "rows of dy, x and dx (at most twice the cluster; 1 for a cluster of 1)"),
        key(&LayerNormBwdRowsProblem::cols, "cols", "elements per row"),
        key(&LayerNormBwdRowsProblem::dy_row_stride, "dy_row_stride", "elements between two rows of dy"),
        key(&LayerNormBwdRowsProblem::x_row_stride, "x_row_stride", "elements between two rows of x"),
        key(&LayerNormBwdRowsProblem::dx_row_stride, "dx_row_stride", "elements between two rows of dx")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto esize = std::int64_t(dtype_size(*parse_dtype(*params.get_str("dtype"))));
    if (*params.get_int("vec") * esize != 16)
      return invalid_argument("layernorm_bwd_rows: vec must make 16-byte accesses");
    return {};
  }

  // Clusters need sm_90 or later.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return *params.get_int("cluster") == 1 || arch.capability >= 90;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"layernorm/layernorm_bwd_rows.cuh\"\n";
    r.name_expression = std::string("kiln::layernorm::layernorm_bwd_rows<") + device_type(*params.get_str("dtype")) +
                        ", " + std::to_string(*params.get_int("block")) + ", " +
                        std::to_string(*params.get_int("vec")) + ", " + std::to_string(*params.get_int("packs")) +
                        ", " + std::to_string(*params.get_int("cluster")) + ">";
    return r;
  }

  // What the heuristic picks for 1, 2, 4 and 8 rows (9 to 16 take the 8-row variants) of the usual
  // hidden sizes, in every dtype.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (DType t : {DType::f32, DType::f16, DType::bf16})
      for (std::int64_t rows : {1, 2, 4, 8})
        for (std::int64_t cols : {768, 896, 1024, 2048, 2880, 3072, 3584, 4096, 5120, 7168, 8192}) {
          const Problem p = contiguous(t, rows, cols);
          if (!choice_for(p)) continue;
          const Params h = heuristic(p);
          if (std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
        }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LayerNormBwdRowsProblem>();
    const auto rows = q.rows, cols = q.cols;
    if (rows < 0 || cols <= 0) return shape_mismatch("layernorm_bwd_rows: need rows >= 0 and cols > 0");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype(std::string("layernorm_bwd_rows: kernel is for ") + dtype_name(dtype) +
                               ", tensors are " + dtype_name(p.dtype));
    for (std::int64_t s : {q.dy_row_stride, q.x_row_stride, q.dx_row_stride})
      if (s < cols) return shape_mismatch("layernorm_bwd_rows: row strides must be at least the row length");
    if (rows > few_rows_capacity(*params.get_int("cluster")))
      return invalid_argument("layernorm_bwd_rows: a cluster of " + std::to_string(*params.get_int("cluster")) +
                              " holds at most " + std::to_string(few_rows_capacity(*params.get_int("cluster"))) +
                              " rows, not " + std::to_string(rows));
    const auto vec = *params.get_int("vec");
    if (p.alignment < 16 || q.dy_row_stride % vec || q.x_row_stride % vec || q.dx_row_stride % vec || cols % vec)
      return invalid_argument("layernorm_bwd_rows: needs 16-byte aligned buffers and row strides and rows of whole "
                              "16-byte packs");
    if (cols / vec > *params.get_int("block") * *params.get_int("packs"))
      return invalid_argument("layernorm_bwd_rows: rows of at most block * packs packs");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    LaunchGeometry g;
    const auto cluster = *params.get_int("cluster");
    g.grid.x = std::uint32_t(cluster);
    g.block.x = std::uint32_t(*params.get_int("block"));
    g.shared_bytes = cluster > 1 ? std::uint32_t(p.as<LayerNormBwdRowsProblem>().cols * 8) : 0u;
    return g;
  }

  Params heuristic(const Problem& p) const override {
    if (const auto c = choice_for(p)) return params_of(p.dtype, *c);
    return params_of(p.dtype, {1024, 2, 8});  // out of reach: check_problem refuses it for p
  }

  // Every block and packs count that holds the row, at the heuristic's cluster.
  std::vector<Params> tuning_space(const Problem& p) const override {
    return few_rows_tuning_space(*this, heuristic(p), p);
  }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    for (std::int64_t rows : {1, 3, 8})
      for (std::int64_t cols : {768, 4096, 8192}) out.push_back(contiguous(dtype, rows, cols));
    // Padded rows.
    out.push_back(Problem::of(dtype, 16, LayerNormBwdRowsProblem{.rows = 5, .cols = 2048, .dy_row_stride = 2112,
                                                                 .x_row_stride = 2080, .dx_row_stride = 2176}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<LayerNormBwdRowsProblem>();
    const auto rows = q.rows, cols = q.cols;
    auto extent = [&](std::int64_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + cols; };
    return {{"dy", BufferRole::input, p.dtype, extent(q.dy_row_stride)},
            {"x", BufferRole::input, p.dtype, extent(q.x_row_stride)},
            {"weight", BufferRole::input, p.dtype, cols},
            {"mean", BufferRole::input, DType::f32, rows},
            {"rstd", BufferRole::input, DType::f32, rows},
            {"dx", BufferRole::output, p.dtype, extent(q.dx_row_stride)},
            {"dweight", BufferRole::output, p.dtype, cols},
            {"dbias", BufferRole::output, p.dtype, cols}};
  }

  // dbias, the eighth buffer, may be null or left out.
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<LayerNormBwdRowsProblem>();
    for (int i = 0; i < 7; ++i) out.add(b[i]);
    out.add(b.size() > 7 ? b[7] : nullptr);
    for (std::int64_t v : {q.rows, q.cols, q.dy_row_stride, q.x_row_stride, q.dx_row_stride})
      out.add(static_cast<long long>(v));
  }

  // The formulas of layernorm_bwd in fp64, the column sums over every row.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 8 && b.size() != 7)
      return invalid_argument("layernorm_bwd_rows: reference takes dy, x, weight, mean, rstd, dx, dweight, dbias");
    const auto q = p.as<LayerNormBwdRowsProblem>();
    const auto rows = q.rows, cols = q.cols;
    const auto* mean = static_cast<const float*>(b[3]);
    const auto* rstd = static_cast<const float*>(b[4]);
    void* dbias = b.size() > 7 ? b[7] : nullptr;
    std::vector<double> dw(std::size_t(cols), 0.0), db(std::size_t(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      const double mu = mean[r], rs = rstd[r];
      double sg = 0, sgx = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const double g = load_as_double(b[0], p.dtype, r * q.dy_row_stride + c) * load_as_double(b[2], p.dtype, c);
        sg += g;
        sgx += g * (load_as_double(b[1], p.dtype, r * q.x_row_stride + c) - mu) * rs;
      }
      for (std::int64_t c = 0; c < cols; ++c) {
        const double dy = load_as_double(b[0], p.dtype, r * q.dy_row_stride + c);
        const double xhat = (load_as_double(b[1], p.dtype, r * q.x_row_stride + c) - mu) * rs;
        const double g = dy * load_as_double(b[2], p.dtype, c);
        store_from_double(b[5], p.dtype, r * q.dx_row_stride + c, rs * (g - (sg + xhat * sgx) / double(cols)));
        dw[std::size_t(c)] += dy * xhat;
        db[std::size_t(c)] += dy;
      }
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      store_from_double(b[6], p.dtype, c, dw[std::size_t(c)]);
      if (dbias) store_from_double(dbias, p.dtype, c, db[std::size_t(c)]);
    }
    return {};
  }
};

}  // namespace

bool layernorm_bwd_rows_fits(const Problem& p, int max_cluster) {
  const auto c = choice_for(p);
  if (!c || c->cluster > max_cluster || p.alignment < 16) return false;
  const auto q = p.as<LayerNormBwdRowsProblem>();
  const std::int64_t vec = 16 / std::int64_t(dtype_size(p.dtype));
  return q.dy_row_stride % vec == 0 && q.x_row_stride % vec == 0 && q.dx_row_stride % vec == 0;
}

void register_layernorm_bwd_rows(Registry& r) { (void)r.add(std::make_shared<LayerNormBwdRows>()); }

}  // namespace kiln::families
