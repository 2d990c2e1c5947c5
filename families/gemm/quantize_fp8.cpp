#include "families/gemm/quantize_fp8.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {
namespace {

const char* const k_mode_names[] = {"amax", "tensor", "row", "tile"};

int mode_index(const std::string& s) {
  for (int i = 0; i < 4; ++i)
    if (s == k_mode_names[i]) return i;
  return -1;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

class QuantizeFp8 final : public Family {
 public:
  std::string_view name() const override { return "quantize_fp8"; }
  int version() const override { return 1; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f32", "f16", "bf16"}, "element type of x"},
        {"mode", {}, {"amax", "tensor", "row", "tile"}, "scale groups: the tensor (two passes), 1x128, 128x128"},
        {"transpose", {0, 1}, {}, "write q as [cols, rows] (tensor and tile modes)"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<QuantizeFp8Problem>({
        bucketed(&QuantizeFp8Problem::rows, "rows", "rows of x (its leading dimensions flattened)"),
        key(&QuantizeFp8Problem::cols, "cols", "elements per row of x"),
        key(&QuantizeFp8Problem::mode, "mode", "0 amax, 1 tensor, 2 row blocks 1x128, 3 tile blocks 128x128"),
        key(&QuantizeFp8Problem::transpose, "transpose", "1: q written as [cols, rows] (modes 1 and 3)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const int mode = mode_index(*params.get_str("mode"));
    if (*params.get_int("transpose") && mode != k_q_tensor && mode != k_q_tile)
      return invalid_argument("quantize_fp8: transpose is for the tensor and tile (weight) modes");
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"gemm/quantize_fp8.cuh\"\n";
    r.name_expression = std::string("kiln::quant::quantize_fp8<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(mode_index(*params.get_str("mode"))) + ", " +
                        std::to_string(*params.get_int("transpose")) + ">";
    return r;
  }

  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f32", "f16", "bf16"})
      for (const char* m : k_mode_names)
        for (std::int64_t t : {0, 1}) {
          Params p{{"dtype", std::string(d)}, {"mode", std::string(m)}, {"transpose", t}};
          if (validate(p).ok()) out.push_back(std::move(p));
        }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto [rows, cols, mode, tr] = p.as<QuantizeFp8Problem>();
    if (rows < 1 || cols < 1) return shape_mismatch("quantize_fp8: rows and cols must be positive");
    if (ceil_div(rows, 128) > 65535 || ceil_div(cols, 128) >= (std::int64_t(1) << 31))
      return shape_mismatch("quantize_fp8: at most 65535 * 128 rows");
    if (mode < 0 || mode > 3) return invalid_argument("quantize_fp8: unknown mode " + std::to_string(mode));
    if (mode != mode_index(*params.get_str("mode")) || tr != *params.get_int("transpose"))
      return invalid_argument("quantize_fp8: kernel is for mode " + *params.get_str("mode") + ", transpose " +
                              std::to_string(*params.get_int("transpose")) + "; the problem asks for " +
                              k_mode_names[mode] + ", " + std::to_string(tr));
    const DType t = *parse_dtype(*params.get_str("dtype"));
    if (t != p.dtype)
      return unsupported_dtype(std::string("quantize_fp8: kernel is for ") + dtype_name(t) + ", x is " +
                               dtype_name(p.dtype));
    if (p.alignment < 16) return invalid_argument("quantize_fp8: x, q and scale need 16-byte aligned addresses");
    return {};
  }

  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    LaunchGeometry g;
    const QuantizeFp8Problem q = p.as<QuantizeFp8Problem>();
    g.grid.x = std::uint32_t(ceil_div(q.cols, 128));
    g.grid.y = std::uint32_t(ceil_div(q.rows, 128));
    g.block.x = 256;
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const QuantizeFp8Problem q = p.as<QuantizeFp8Problem>();
    const auto mode = std::clamp<std::int64_t>(q.mode, 0, 3);
    return Params{{"dtype", std::string(dtype_name(p.dtype))},
                  {"mode", std::string(k_mode_names[mode])},
                  {"transpose", std::int64_t(q.transpose ? 1 : 0)}};
  }

  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }

  // What fp8_gemm's callers quantize: activations per 1x128 block (prefill and decode), a weight
  // per 128x128 tile transposed to K-major, and per-tensor scaling's two passes (amax, then
  // quantize).
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    auto add = [&](std::int64_t rows, std::int64_t cols, std::int64_t mode, std::int64_t transpose) {
      out.push_back(
          problem_from_shape(dtype, {{"rows", rows}, {"cols", cols}, {"mode", mode}, {"transpose", transpose}}).value());
    };
    add(4096, 7168, k_q_row, 0);
    add(128, 7168, k_q_row, 0);
    add(7168, 16384, k_q_tile, 1);
    add(2048, 2048, k_q_tile, 1);
    add(8192, 8192, k_q_amax, 0);
    add(8192, 8192, k_q_tensor, 0);
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const QuantizeFp8Problem qp = p.as<QuantizeFp8Problem>();
    const auto rows = qp.rows, cols = qp.cols, mode = qp.mode;
    const std::int64_t scales = mode == k_q_row    ? rows * ceil_div(cols, 128)
                                : mode == k_q_tile ? ceil_div(rows, 128) * ceil_div(cols, 128)
                                                   : 1;
    return {{"x", BufferRole::input, p.dtype, rows * cols},
            {"q", BufferRole::output, DType::u8, mode == k_q_amax ? 0 : rows * cols},
            {"scale", mode == k_q_tensor ? BufferRole::input : BufferRole::output, DType::f32, scales}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const QuantizeFp8Problem q = p.as<QuantizeFp8Problem>();
    out.add(b[0]);
    out.add(b[1]);
    out.add(b[2]);
    out.add(static_cast<long long>(q.rows));
    out.add(static_cast<long long>(q.cols));
  }

  // The amax pass reads scale[0] as the running maximum (the caller zeroes it), like the kernel.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 3) return invalid_argument("quantize_fp8: reference takes 3 buffers (x, q, scale)");
    const QuantizeFp8Problem qp = p.as<QuantizeFp8Problem>();
    const auto rows = qp.rows, cols = qp.cols, mode = qp.mode;
    const bool tr = qp.transpose != 0;
    auto* q = static_cast<std::uint8_t*>(b[1]);
    auto* scale = static_cast<float*>(b[2]);
    auto x = [&](std::int64_t r, std::int64_t c) { return float(load_as_double(b[0], p.dtype, r * cols + c)); };
    if (mode == k_q_amax) {
      float amax = 0;
      for (std::int64_t i = 0; i < rows * cols; ++i) amax = std::max(amax, std::fabs(x(i / cols, i % cols)));
      scale[0] = std::max(scale[0], amax / k_e4m3_max);
      return {};
    }
    const auto bc = ceil_div(cols, 128), br = ceil_div(rows, 128);
    auto put = [&](std::int64_t r, std::int64_t c, float s) {
      q[tr ? c * rows + r : r * cols + c] = float_to_e4m3(x(r, c) / s);
    };
    if (mode == k_q_tensor) {
      const float s = fp8_clamp_scale(scale[0]);
      scale[0] = s;
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < cols; ++c) put(r, c, s);
      return {};
    }
    const std::int64_t h = mode == k_q_row ? 1 : 128;
    for (std::int64_t r0 = 0; r0 < rows; r0 += h)
      for (std::int64_t c0 = 0; c0 < cols; c0 += 128) {
        const std::int64_t r1 = std::min(rows, r0 + h), c1 = std::min(cols, c0 + 128);
        float amax = 0;
        for (std::int64_t r = r0; r < r1; ++r)
          for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x(r, c)));
        const float s = fp8_scale_for(amax);
        if (mode == k_q_row) scale[r0 * bc + c0 / 128] = s;
        else scale[tr ? (c0 / 128) * br + r0 / 128 : (r0 / 128) * bc + c0 / 128] = s;
        for (std::int64_t r = r0; r < r1; ++r)
          for (std::int64_t c = c0; c < c1; ++c) put(r, c, s);
      }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families

void kiln_register_kernels_quantize_fp8(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::QuantizeFp8>());
}
