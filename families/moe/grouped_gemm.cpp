// The grouped_gemm family (families/moe/grouped_gemm.cuh): f16/bf16 operands, fp32 accumulation,
// contiguous, masked and K-grouped layouts; wgmma (sm_90a) or mma.sync.
//
// Heuristic and why: on compute capability 9.0 the wgmma path for every layout (kgrouped's
// row-major operands are read transposed by wgmma itself), else mma. wgmma tiles: 64 x 128 when
// experts average at most 64 rows (decode: a 128-row tile would be mostly rows of the next
// expert, and each expert's weights stream once either way); else the cooperative schedule on
// 128 x 256 where n reaches 1024 (the core's fastest bf16 shape per byte of A and B; with the
// staged epilogue it is ahead of the pingpong schedule on 128 x 128 tiles at every prefill shape
// of the bench, k 2048 to 14336) and 128 x 128 below;
// kgrouped 128 x 256 while the units cover the SMs twice, else 128 x 128. mma: 128 x 128, then
// 64 x 128 and 64 x 64 while fewer units than SMs (the dense core's halving rule). Stages: at
// least 96 KiB of loads in flight (4 to 6), the small wgmma tiles as many as fit (decode is bound
// by bytes in flight), within the device's shared memory after the schedule table of the largest
// expert count.
#include <algorithm>
#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "families/common/family_util.h"
#include "families/common/gemm/gemm_util.h"
#include "families/moe/moe.h"

namespace kiln::families::moe {

void expert_rows(const std::int32_t* offs, std::int64_t experts, std::int64_t m, Layout layout,
                 std::vector<std::int64_t>& lo, std::vector<std::int64_t>& hi) {
  lo.assign(std::size_t(experts), 0);
  hi.assign(std::size_t(experts), 0);
  std::int64_t prev = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t v = std::clamp<std::int64_t>(offs[e], 0, m);
    if (layout == k_masked) {
      lo[e] = e * m;
      hi[e] = e * m + v;
    } else {
      lo[e] = prev;
      hi[e] = prev = std::max(prev, v);
    }
  }
}

namespace {

namespace g = gemm;

const char* const k_layouts[] = {"contiguous", "masked", "kgrouped", "dgrad"};

struct Variant {
  bool wgmma;
  int layout, bm, bn, stages;
  bool pingpong = false;  // wgmma: two consumer warpgroups taking whole tiles in turn
};

int layout_index(const std::string& s) {
  for (int i = 0; i < 4; ++i)
    if (s == k_layouts[i]) return i;
  return 0;
}

Variant variant_of(const Params& p) {
  return {*p.get_str("path") == "wgmma", layout_index(*p.get_str("layout")), int(*p.get_int("bm")),
          int(*p.get_int("bn")), int(*p.get_int("stages")), *p.get_str("schedule") == "pingpong"};
}

// The rules of the pingpong schedule: wgmma, a whole tile's accumulators in one warpgroup (128 a
// thread), not the K-grouped kernel.
std::string pingpong_error(const Variant& v) {
  if (!v.pingpong) return {};
  if (!v.wgmma) return "the pingpong schedule is wgmma's";
  if (v.bm * v.bn > 128 * 128) return "pingpong tiles hold at most 128 x 128 elements (one warpgroup's accumulators)";
  if (v.layout == k_kgrouped) return "kgrouped has no pingpong schedule";
  return {};
}

// Threads of a block: wgmma, a producer warpgroup and BM / 64 consumers (pingpong: 2); mma, 2 BN.
std::uint32_t block_threads(const Variant& v) {
  if (!v.wgmma) return std::uint32_t(2 * v.bn);
  return std::uint32_t(((v.pingpong ? 2 : v.bm / 64) + 1) * 128);
}

const ParamDef k_schedule_param = {"schedule", {}, {"cooperative", "pingpong"},
                                   "wgmma: both consumer warpgroups on one tile, or each on its own tile in turn "
                                   "(one's epilogue under the other's products)"};

std::int64_t schedule_bytes(std::int64_t experts) { return 12 * (experts + 1); }

// One stage of the ring: 128-byte K rows of A and B (wgmma kgrouped and dgrad: 64 reduction rows
// of the row-major operands' columns, the same bytes), or, on the mma path, 64 reduction rows of a
// row-major operand's columns with 16 bytes of padding (kgrouped: both, dgrad: b), rounded to
// the 1024-byte swizzle atom.
std::int64_t stage_bytes(const Variant& v) {
  if (v.layout == k_kgrouped && !v.wgmma) return (64 * (2 * v.bm + 16) + 64 * (2 * v.bn + 16) + 1023) / 1024 * 1024;
  if (v.layout == k_dgrad && !v.wgmma) return (128 * v.bm + 64 * (2 * v.bn + 16) + 1023) / 1024 * 1024;
  return std::int64_t(v.bm + v.bn) * 128;
}

// The wgmma kernels store tiles whose width is whole 64-column boxes through 2 KiB of shared
// memory per consumer warp (the staged epilogue; kgrouped tiles are always 64-column boxes).
bool staged_epilogue(const Variant& v) { return v.wgmma && v.bn % 64 == 0; }

std::int64_t shared_bytes(const Variant& v, std::int64_t experts) {
  const std::int64_t staged = staged_epilogue(v) ? (v.pingpong ? 2 : v.bm / 64) * 4 * 2048 : 0;
  return 1024 + v.stages * (stage_bytes(v) + (v.wgmma ? 16 : 0)) + staged + schedule_bytes(experts);
}

int default_stages(Variant v, std::int64_t cc) {
  const std::int64_t stage = stage_bytes(v);
  v.stages = int(std::clamp<std::int64_t>((96 * 1024 + stage - 1) / stage, 4, 6));
  if (v.wgmma && stage <= 24 * 1024) v.stages = 8;
  while (v.stages > 2 && shared_bytes(v, k_max_experts) > g::max_shared_bytes(cc)) --v.stages;
  return v.stages;
}

Params make(const Variant& v, const std::string& dtype) {
  return Params{{"path", v.wgmma ? "wgmma" : "mma"}, {"dtype", dtype},          {"layout", k_layouts[v.layout]},
                {"bm", std::int64_t(v.bm)},          {"bn", std::int64_t(v.bn)}, {"stages", std::int64_t(v.stages)},
                {"schedule", v.pingpong ? "pingpong" : "cooperative"}};
}

std::int64_t cdiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Work units a launch may have: the exact count for masked and kgrouped, a bound for contiguous
// (each expert adds at most one partial m-tile).
std::int64_t unit_bound(const Variant& v, const GroupedGemmProblem& q) {
  if (v.layout == k_kgrouped) return q.experts * cdiv(q.n, v.bm) * cdiv(q.k, v.bn);
  const std::int64_t tiles_n = cdiv(q.n, v.bn);
  if (v.layout == k_masked) return q.experts * cdiv(q.m, v.bm) * tiles_n;
  return (cdiv(q.m, v.bm) + q.experts) * tiles_n;
}

class GroupedGemm final : public Family {
 public:
  std::string_view name() const override { return "grouped_gemm"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"path", {}, {"mma", "wgmma"}, "mma: mma.sync (sm_80 and later); wgmma: warp-specialized wgmma (sm_90a)"},
        {"dtype", {}, {"f16", "bf16"}, "element type of a, b and out"},
        {"layout", {}, {"contiguous", "masked", "kgrouped", "dgrad"},
         "rows grouped by offsets, per-expert counts, the weight gradient, or the input gradient (weight [experts, k, n])"},
        {"bm", {64, 128}, {}, "tile rows"},
        {"bn", {64, 128, 256}, {}, "tile columns (256: wgmma only)"},
        {"stages", {2, 3, 4, 5, 6, 7, 8}, {}, "shared-memory pipeline depth"},
        k_schedule_param};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<GroupedGemmProblem>(
        {bucketed(&GroupedGemmProblem::m, "m", "rows of a (masked: rows per expert)"),
         key(&GroupedGemmProblem::n, "n", "columns of out (kgrouped: columns of a)"),
         key(&GroupedGemmProblem::k, "k", "the reduction (kgrouped: columns of b; dgrad: rows of each b)"),
         key(&GroupedGemmProblem::experts, "experts", "experts (groups)"),
         key(&GroupedGemmProblem::layout, "layout", "0 contiguous, 1 masked, 2 kgrouped, 3 dgrad")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const Variant v = variant_of(params);
    if (!v.wgmma && v.bn > 128) return invalid_argument("grouped_gemm: the mma path takes bn <= 128");
    if (const std::string e = pingpong_error(v); !e.empty()) return invalid_argument("grouped_gemm: " + e);
    if (shared_bytes(v, k_max_experts) > 227 * 1024)
      return invalid_argument("grouped_gemm: " + std::to_string(shared_bytes(v, k_max_experts)) +
                              " bytes of shared memory exceed 227 KiB");
    return {};
  }
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    const Variant v = variant_of(params);
    if (v.wgmma ? !(arch.capability == 90 && arch.suffix == 'a') : arch.capability < 80) return false;
    return shared_bytes(v, k_max_experts) <= g::max_shared_bytes(arch.capability);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const Variant v = variant_of(params);
    Rendered r;
    r.source = "#include \"moe/grouped_gemm.cuh\"\n";
    const std::string t = device_type(*params.get_str("dtype"));
    const std::string tile = std::to_string(v.layout) + ", " + std::to_string(v.bm) + ", " + std::to_string(v.bn) + ", " +
                             std::to_string(v.stages);
    if (v.wgmma && v.layout == k_kgrouped)
      r.name_expression = "kiln::moe::grouped_wgmma_kgrouped<" + t + ", " + std::to_string(v.bm) + ", " +
                          std::to_string(v.bn) + ", " + std::to_string(v.stages) + ">";
    else
      r.name_expression = std::string("kiln::moe::") + (v.wgmma ? "grouped_wgmma<" : "grouped_mma<") + t + ", " + t +
                          ", " + tile + (v.pingpong ? ", 0, true>" : ", 0>");
    return r;
  }

  // The heuristic's variants: wgmma's three tiles for every layout (sm_90a), mma's three for every
  // layout at the stages of sm_80 and sm_86, both dtypes.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f16", "bf16"})
      for (int layout = 0; layout < 4; ++layout) {
        for (auto [bm, bn] : {std::pair{64, 128}, {128, 128}, {128, 256}}) {
            Variant v{true, layout, bm, bn, 4};
            v.stages = default_stages(v, 90);
            out.push_back(make(v, d));
          }
        if (layout == k_contiguous || layout == k_dgrad)
          for (auto [bm, bn] : {std::pair{128, 128}, {64, 256}}) {
            Variant v{true, layout, bm, bn, 4, true};
            v.stages = default_stages(v, 90);
            out.push_back(make(v, d));
          }
        for (auto [bm, bn] : {std::pair{128, 128}, {64, 128}, {64, 64}})
          for (std::int64_t cc : {80, 86}) {
            Variant v{false, layout, bm, bn, 4};
            v.stages = default_stages(v, cc);
            Params p = make(v, d);
            if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
          }
      }
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<GroupedGemmProblem>();
    const Variant v = variant_of(params);
    const std::string f = "grouped_gemm";
    if (q.layout < 0 || q.layout > 3) return invalid_argument(f + ": unknown layout " + std::to_string(q.layout));
    if (q.layout != v.layout)
      return invalid_argument(f + ": kernel is for the " + k_layouts[v.layout] + " layout, the problem is " +
                              k_layouts[q.layout]);
    const DType t = *parse_dtype(*params.get_str("dtype"));
    if (t != p.dtype)
      return unsupported_dtype(f + ": kernel is for " + dtype_name(t) + ", tensors are " + dtype_name(p.dtype));
    if (q.m < 1 || q.n < 1 || q.k < 1) return shape_mismatch(f + ": m, n and k must be positive");
    if (q.experts < 1 || q.experts > k_max_experts)
      return shape_mismatch(f + ": experts must be in [1, " + std::to_string(k_max_experts) + "]");
    const std::int64_t lim = std::int64_t(1) << 31;
    const std::int64_t rows_a = q.layout == k_masked ? q.experts * q.m : q.m;
    if (rows_a >= lim || q.experts * q.n >= lim || q.k >= lim || unit_bound(v, q) >= lim)
      return shape_mismatch(f + ": rows, experts x n, k and the tile count must be below 2^31");
    if (q.k % 8) return shape_mismatch(f + ": k must be a multiple of 8 (rows are copied in 16-byte pieces)");
    if ((q.layout == k_kgrouped || q.layout == k_dgrad) && q.n % 8)
      return shape_mismatch(f + ": " + k_layouts[q.layout] + " needs n a multiple of 8 (rows are copied in 16-byte pieces)");
    if (p.alignment < 16) return invalid_argument(f + ": a, b and out need 16-byte aligned base addresses");
    const std::int64_t cc = g::device_cc(p);
    if (v.wgmma && cc != 90)
      return invalid_argument(f + ": the wgmma path needs sm_90a (compute capability 9.0), the device has " +
                              std::to_string(cc / 10) + "." + std::to_string(cc % 10));
    if (!v.wgmma && cc < 80) return invalid_argument(f + ": needs compute capability 8.0 or later");
    if (shared_bytes(v, q.experts) > g::max_shared_bytes(cc))
      return invalid_argument(f + ": the variant needs " + std::to_string(shared_bytes(v, q.experts)) +
                              " bytes of shared memory, more than compute capability " + std::to_string(cc) + " grants");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<GroupedGemmProblem>();
    const Variant v = variant_of(params);
    LaunchGeometry geo;
    const std::int64_t units = unit_bound(v, q);
    geo.grid.x = std::uint32_t(std::clamp<std::int64_t>(v.wgmma ? std::min(units, g::device_sms(p)) : units, 1, 0x7fffffff));
    geo.block.x = block_threads(v);
    geo.shared_bytes = std::uint32_t(shared_bytes(v, q.experts));
    return geo;
  }

  Params heuristic(const Problem& p) const override {
    const auto q = p.as<GroupedGemmProblem>();
    const std::int64_t cc = g::device_cc(p);
    const std::string dtype = p.dtype == DType::f16 ? "f16" : "bf16";
    const int layout = int(std::clamp<std::int64_t>(q.layout, 0, 3));
    Variant v{cc == 90, layout, 128, 128, 4};
    if (v.wgmma && layout == k_kgrouped) {
      // out[e] is n x k: 128 x 256 tiles while they cover the SMs, else 128 x 128.
      v.bn = 256;
      if (unit_bound(v, q) < 2 * g::device_sms(p)) v.bn = 128;
    } else if (v.wgmma) {
      const std::int64_t rows = layout == k_masked ? q.m : q.m / std::max<std::int64_t>(1, q.experts);
      if (rows <= 64)
        v.bm = 64;
      else if (q.n >= 1024)
        v.bn = 256;
    } else {
      const std::int64_t sms = g::device_sms(p);
      if (unit_bound(v, q) < sms) v.bm = 64;
      if (unit_bound(v, q) < sms) v.bn = 64;
    }
    v.stages = default_stages(v, cc);
    return make(v, dtype);
  }

  // Each tile of the heuristic's path at depths 3 to 6 and its default.
  std::vector<Params> tuning_space(const Problem& p) const override {
    const Params h = heuristic(p);
    const Variant base = variant_of(h);
    std::vector<Params> out;
    for (bool pp : {false, true})
      for (int bm : {64, 128})
        for (int bn : {64, 128, 256}) {
          Variant v{base.wgmma, base.layout, bm, bn, 4, pp};
          std::vector<int> depths = {3, 4, 5, 6, default_stages(v, g::device_cc(p))};
          std::sort(depths.begin(), depths.end());
          depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
          for (int s : depths) {
            v.stages = s;
            Params c = make(v, *h.get_str("dtype"));
            if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
          }
        }
    return out;
  }

  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(dtype, with_defaults(shape, {{"layout", k_contiguous}}));
  }

  // The MoE shapes of the bench (Mixtral 8 x 4096 tokens gate_up and down, DeepSeek-V3 256 x 1024
  // tokens gate_up and down, DeepSeek-V3 decode 16 tokens per expert, masked), their weight
  // gradients' form, and small ragged shapes (what the GPU conformance test checks).
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    if (dtype != DType::f16 && dtype != DType::bf16) return out;
    auto add = [&](std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t e, Layout l) {
      out.push_back(Problem::of(dtype, 16, GroupedGemmProblem{.m = m, .n = n, .k = k, .experts = e, .layout = l}));
    };
    add(8 * 4096, 28672, 4096, 8, k_contiguous);
    add(8 * 4096, 4096, 14336, 8, k_contiguous);
    add(256 * 1024, 4096, 7168, 256, k_contiguous);
    add(256 * 1024, 7168, 2048, 256, k_contiguous);
    add(16, 4096, 7168, 256, k_masked);
    add(8 * 4096, 4096, 14336, 8, k_kgrouped);
    add(1000, 392, 264, 8, k_contiguous);
    add(40, 392, 264, 8, k_masked);
    add(1000, 392, 264, 8, k_kgrouped);
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<GroupedGemmProblem>();
    const std::int64_t bound = q.m + 1;
    if (q.layout == k_kgrouped)
      return {{"a", BufferRole::input, p.dtype, q.m * q.n},
              {"b", BufferRole::input, p.dtype, q.m * q.k},
              {"offs", BufferRole::input, DType::i32, q.experts, bound},
              {"out", BufferRole::output, p.dtype, q.experts * q.n * q.k}};
    const std::int64_t rows = q.layout == k_masked ? q.experts * q.m : q.m;
    return {{"a", BufferRole::input, p.dtype, rows * q.k},
            {"b", BufferRole::input, p.dtype, q.experts * q.n * q.k},
            {"offs", BufferRole::input, DType::i32, q.experts, bound},
            {"out", BufferRole::output, p.dtype, rows * q.n}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<GroupedGemmProblem>();
    const Variant v = variant_of(params);
    for (int i = 0; i < 3; ++i) out.add(b[i]);
    out.add(static_cast<void*>(nullptr));  // the kernels' scale pointers, read by grouped_gemm_fp8 only
    out.add(static_cast<void*>(nullptr));
    out.add(b[3]);
    out.add(int(q.experts));
    out.add(int(q.m));
    out.add(int(q.n));
    out.add(int(q.k));
    if (!v.wgmma) return;
    if (q.layout == k_kgrouped) {
      // Both operands row-major over the m reduction rows, in 64-row boxes of 64 columns.
      out.add_tensor_map({b[0], std::uint64_t(q.n * 2), std::uint64_t(q.m), 64, 0});
      out.add_tensor_map({b[1], std::uint64_t(q.k * 2), std::uint64_t(q.m), 64, 0});
      // out [experts, n, k] as experts x n rows of k.
      out.add_tensor_map(g::out_map_request(b[3], q.k, std::uint64_t(q.experts * q.n),
                                            {b[0], std::uint64_t(q.n * 2), std::uint64_t(q.m), 16, 0}));
      return;
    }
    const std::uint64_t row_bytes = std::uint64_t(q.k * 2);
    const std::uint64_t rows_a = std::uint64_t(q.layout == k_masked ? q.experts * q.m : q.m);
    out.add_tensor_map({b[0], row_bytes, rows_a, std::uint32_t(v.bm), 0});
    if (q.layout == k_dgrad)  // every expert's [k, n] weight as one matrix of experts x k rows
      out.add_tensor_map({b[1], std::uint64_t(q.n * 2), std::uint64_t(q.experts * q.k), 64, 0});
    else
      out.add_tensor_map({b[1], row_bytes, std::uint64_t(q.experts * q.n), std::uint32_t(v.bn), 0});
    out.add_tensor_map(g::out_map_request(b[3], q.n, rows_a, {b[0], row_bytes, rows_a, 16, 0}));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 4) return invalid_argument("grouped_gemm: reference takes 4 buffers (a, b, offs, out)");
    const auto q = p.as<GroupedGemmProblem>();
    std::vector<std::int64_t> lo, hi;
    expert_rows(static_cast<const std::int32_t*>(b[2]), q.experts, q.m, Layout(q.layout), lo, hi);
    auto at = [&](int i, std::int64_t idx) { return load_as_double(b[i], p.dtype, idx); };
    if (q.layout == k_kgrouped) {
      std::vector<double> acc(std::size_t(q.n * q.k));
      for (std::int64_t e = 0; e < q.experts; ++e) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t r = lo[e]; r < hi[e]; ++r)
          for (std::int64_t i = 0; i < q.n; ++i) {
            const double av = at(0, r * q.n + i);
            if (av == 0) continue;
            for (std::int64_t j = 0; j < q.k; ++j) acc[i * q.k + j] += av * at(1, r * q.k + j);
          }
        for (std::int64_t i = 0; i < q.n * q.k; ++i) store_from_double(b[3], p.dtype, e * q.n * q.k + i, acc[i]);
      }
      return {};
    }
    std::vector<double> arow(std::size_t(q.k));
    for (std::int64_t e = 0; e < q.experts; ++e)
      for (std::int64_t r = lo[e]; r < hi[e]; ++r) {
        for (std::int64_t x = 0; x < q.k; ++x) arow[x] = at(0, r * q.k + x);
        for (std::int64_t j = 0; j < q.n; ++j) {
          double s = 0;
          if (q.layout == k_dgrad) {  // b [experts, k, n]
            for (std::int64_t x = 0; x < q.k; ++x) s += arow[x] * at(1, (e * q.k + x) * q.n + j);
          } else {
            const std::int64_t w0 = (e * q.n + j) * q.k;
            for (std::int64_t x = 0; x < q.k; ++x) s += arow[x] * at(1, w0 + x);
          }
          store_from_double(b[3], p.dtype, r * q.n + j, s);
        }
      }
    return {};
  }
};

// grouped_gemm_fp8: e4m3 operands (u8 codes), fp32 accumulation, f16 or bf16 out; contiguous and
// masked layouts. Scales rowwise (a_scale per row of a, b_scale [experts, n] per expert and column,
// as torch._scaled_grouped_mm takes them) or DeepSeek-V3's blocks (a_scale [rows, ceil(k/128)],
// b_scale [experts, ceil(n/128), ceil(k/128)], promoted every 128 of K; tiles at most 128 wide).
// The same paths, tiles and heuristic as grouped_gemm's (a stage is 128 bytes of K either way),
// except that rowwise prefill (contiguous, more than 64 rows an expert) with k <= 4096 takes the
// pingpong schedule on 128 x 128 tiles: a short fp8 reduction leaves the epilogue (a scale per row
// and column) a large share of a tile, which pingpong hides under the other tile's products (at
// longer k the cooperative 128 x 256 tile is ahead); the mma path widens e4m3 to f16 in registers
// (sm_80 has no fp8 tensor-core instruction).
class GroupedGemmFp8 final : public Family {
 public:
  std::string_view name() const override { return "grouped_gemm_fp8"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"path", {}, {"mma", "wgmma"}, "mma: mma.sync with e4m3 widened to f16 (sm_80 and later); wgmma: sm_90a"},
        {"out", {}, {"f16", "bf16"}, "output element type"},
        {"layout", {}, {"contiguous", "masked"}, "rows grouped by offsets, or per-expert counts"},
        {"scaling", {}, {"rowwise", "block"}, "a per row and b per expert and column, or DeepSeek-V3's 1x128 / 128x128 blocks"},
        {"bm", {64, 128}, {}, "tile rows"},
        {"bn", {64, 128, 256}, {}, "tile columns (256: wgmma only)"},
        {"stages", {2, 3, 4, 5, 6, 7, 8}, {}, "shared-memory pipeline depth"},
        k_schedule_param};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<GroupedGemmFp8Problem>(
        {bucketed(&GroupedGemmFp8Problem::m, "m", "rows of a (masked: rows per expert)"),
         key(&GroupedGemmFp8Problem::n, "n", "columns of out"), key(&GroupedGemmFp8Problem::k, "k", "the reduction"),
         key(&GroupedGemmFp8Problem::experts, "experts", "experts (groups)"),
         key(&GroupedGemmFp8Problem::layout, "layout", "0 contiguous, 1 masked"),
         key(&GroupedGemmFp8Problem::scaling, "scaling", "1 rowwise, 2 block (1x128 for a, 128x128 for b)")});
    return fields;
  }
  static Variant variant(const Params& p) { return variant_of(p); }
  static Params make8(const Variant& v, const std::string& out, bool block) {
    return Params{{"path", v.wgmma ? "wgmma" : "mma"}, {"out", out},
                  {"layout", k_layouts[v.layout]},        {"scaling", block ? "block" : "rowwise"},
                  {"bm", std::int64_t(v.bm)},             {"bn", std::int64_t(v.bn)},
                  {"stages", std::int64_t(v.stages)},     {"schedule", v.pingpong ? "pingpong" : "cooperative"}};
  }
  static bool block_of(const Params& p) { return *p.get_str("scaling") == "block"; }
  // GroupedGemmProblem's view of the problem (the shared helpers' type).
  static GroupedGemmProblem dense(const GroupedGemmFp8Problem& q) {
    return {.m = q.m, .n = q.n, .k = q.k, .experts = q.experts, .layout = q.layout};
  }
  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const Variant v = variant(params);
    if (!v.wgmma && v.bn > 128) return invalid_argument("grouped_gemm_fp8: the mma path takes bn <= 128");
    if (block_of(params) && v.bn > 128)
      return invalid_argument("grouped_gemm_fp8: block scales take bn <= 128 (one scale block per tile)");
    if (const std::string e = pingpong_error(v); !e.empty()) return invalid_argument("grouped_gemm_fp8: " + e);
    if (block_of(params) && v.pingpong)
      return invalid_argument("grouped_gemm_fp8: block scales run the cooperative schedule (two accumulator sets)");
    if (shared_bytes(v, k_max_experts) > 227 * 1024)
      return invalid_argument("grouped_gemm_fp8: " + std::to_string(shared_bytes(v, k_max_experts)) +
                              " bytes of shared memory exceed 227 KiB");
    return {};
  }
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    const Variant v = variant(params);
    if (v.wgmma ? !(arch.capability == 90 && arch.suffix == 'a') : arch.capability < 80) return false;
    return shared_bytes(v, k_max_experts) <= g::max_shared_bytes(arch.capability);
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const Variant v = variant(params);
    Rendered r;
    r.source = "#include \"moe/grouped_gemm.cuh\"\n";
    r.name_expression = std::string("kiln::moe::") + (v.wgmma ? "grouped_wgmma" : "grouped_mma") +
                        "<kiln::gemm::u8, " + device_type(*params.get_str("out")) + ", " + std::to_string(v.layout) +
                        ", " + std::to_string(v.bm) + ", " + std::to_string(v.bn) + ", " + std::to_string(v.stages) +
                        (block_of(params) ? ", 2" : ", 1") + (v.pingpong ? ", true>" : ">");
    return r;
  }
  // The heuristic's picks for both outputs, layouts and scalings (block: bn <= 128).
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* o : {"f16", "bf16"})
      for (bool block : {false, true})
        for (int layout : {k_contiguous, k_masked}) {
          for (auto [bm, bn] : {std::pair{64, 128}, {128, 128}, {128, 256}}) {
            if (block && bn > 128) continue;
            Variant v{true, layout, bm, bn, 4};
            v.stages = default_stages(v, 90);
            out.push_back(make8(v, o, block));
          }
          if (!block && layout == k_contiguous)
            for (auto [bm, bn] : {std::pair{128, 128}, {64, 256}}) {
              Variant v{true, layout, bm, bn, 4, true};
              v.stages = default_stages(v, 90);
              out.push_back(make8(v, o, block));
            }
          for (auto [bm, bn] : {std::pair{128, 128}, {64, 128}, {64, 64}})
            for (std::int64_t cc : {80, 86}) {
              Variant v{false, layout, bm, bn, 4};
              v.stages = default_stages(v, cc);
              Params p = make8(v, o, block);
              if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
            }
        }
    return out;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<GroupedGemmFp8Problem>();
    const Variant v = variant(params);
    const std::string f = "grouped_gemm_fp8";
    if (q.layout != k_contiguous && q.layout != k_masked)
      return invalid_argument(f + ": layout must be contiguous or masked, got " + std::to_string(q.layout));
    if (q.layout != v.layout)
      return invalid_argument(f + ": kernel is for the " + k_layouts[v.layout] + " layout, the problem is " +
                              k_layouts[q.layout]);
    if (q.scaling != k_fp8_rowwise && q.scaling != k_fp8_block)
      return invalid_argument(f + ": unknown scaling " + std::to_string(q.scaling));
    if ((q.scaling == k_fp8_block) != block_of(params))
      return invalid_argument(f + ": kernel is for " + *params.get_str("scaling") + " scales, the problem asks for " +
                              (q.scaling == k_fp8_block ? "block" : "rowwise"));
    const DType o = *parse_dtype(*params.get_str("out"));
    if (o != p.dtype)
      return unsupported_dtype(f + ": kernel writes " + dtype_name(o) + ", out is " + dtype_name(p.dtype));
    if (q.m < 1 || q.n < 1 || q.k < 1) return shape_mismatch(f + ": m, n and k must be positive");
    if (q.experts < 1 || q.experts > k_max_experts)
      return shape_mismatch(f + ": experts must be in [1, " + std::to_string(k_max_experts) + "]");
    const std::int64_t lim = std::int64_t(1) << 31;
    const std::int64_t rows_a = q.layout == k_masked ? q.experts * q.m : q.m;
    if (rows_a >= lim || q.experts * q.n >= lim || q.k >= lim || unit_bound(v, dense(q)) >= lim)
      return shape_mismatch(f + ": rows, experts x n, k and the tile count must be below 2^31");
    if (q.k % 16) return shape_mismatch(f + ": k must be a multiple of 16 (rows are copied in 16-byte pieces)");
    if (p.alignment < 16) return invalid_argument(f + ": a, b and out need 16-byte aligned base addresses");
    const std::int64_t cc = g::device_cc(p);
    if (v.wgmma && cc != 90)
      return invalid_argument(f + ": the wgmma path needs sm_90a (compute capability 9.0), the device has " +
                              std::to_string(cc / 10) + "." + std::to_string(cc % 10));
    if (!v.wgmma && cc < 80) return invalid_argument(f + ": needs compute capability 8.0 or later");
    if (shared_bytes(v, q.experts) > g::max_shared_bytes(cc))
      return invalid_argument(f + ": the variant needs more shared memory than the device grants");
    return {};
  }
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<GroupedGemmFp8Problem>();
    const Variant v = variant(params);
    LaunchGeometry geo;
    const std::int64_t units = unit_bound(v, dense(q));
    geo.grid.x = std::uint32_t(std::clamp<std::int64_t>(v.wgmma ? std::min(units, g::device_sms(p)) : units, 1, 0x7fffffff));
    geo.block.x = block_threads(v);
    geo.shared_bytes = std::uint32_t(shared_bytes(v, q.experts));
    return geo;
  }
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<GroupedGemmFp8Problem>();
    const int layout = q.layout == k_masked ? k_masked : k_contiguous;
    const std::int64_t cc = g::device_cc(p);
    Variant v{cc == 90, layout, 128, 128, 4};
    const bool block = q.scaling == k_fp8_block;
    if (v.wgmma) {
      const std::int64_t rows = layout == k_masked ? q.m : q.m / std::max<std::int64_t>(1, q.experts);
      if (rows <= 64)
        v.bm = 64;
      else if (layout == k_contiguous && !block && q.k <= 4096)
        v.pingpong = true;  // 128 x 128 tiles in turn: the rowwise epilogue under the other tile's products
      else if (q.n >= 1024)
        v.bn = 256;
    } else {
      if (unit_bound(v, dense(q)) < g::device_sms(p)) v.bm = 64;
      if (unit_bound(v, dense(q)) < g::device_sms(p)) v.bn = 64;
    }
    if (block) v.bn = std::min(v.bn, 128);  // one 128-column scale block per tile
    v.stages = default_stages(v, cc);
    return make8(v, p.dtype == DType::f16 ? "f16" : "bf16", block);
  }
  std::vector<Params> tuning_space(const Problem& p) const override {
    const Params h = heuristic(p);
    std::vector<Params> out;
    for (bool pp : {false, true})
      for (int bm : {64, 128})
        for (int bn : {64, 128, 256}) {
          Variant v{variant(h).wgmma, variant(h).layout, bm, bn, 4, pp};
          std::vector<int> depths = {3, 4, 5, 6, default_stages(v, g::device_cc(p))};
          std::sort(depths.begin(), depths.end());
          depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
          for (int s : depths) {
            v.stages = s;
            Params c = make8(v, *h.get_str("out"), block_of(h));
            if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
          }
        }
    return out;
  }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(dtype, with_defaults(shape, {{"layout", k_contiguous}, {"scaling", k_fp8_rowwise}}));
  }
  // The bench's shapes (the problem's dtype is the output's) and small ragged ones.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    if (dtype != DType::f16 && dtype != DType::bf16) return out;
    for (std::int64_t sc : {k_fp8_rowwise, k_fp8_block}) {
      auto add = [&](std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t e, Layout l) {
        out.push_back(Problem::of(
            dtype, 16, GroupedGemmFp8Problem{.m = m, .n = n, .k = k, .experts = e, .layout = l, .scaling = sc}));
      };
      add(8 * 4096, 28672, 4096, 8, k_contiguous);
      add(8 * 4096, 4096, 14336, 8, k_contiguous);
      add(256 * 1024, 4096, 7168, 256, k_contiguous);
      add(256 * 1024, 7168, 2048, 256, k_contiguous);
      add(16, 4096, 7168, 256, k_masked);
      add(1000, 392, 272, 8, k_contiguous);
      add(40, 392, 272, 8, k_masked);
    }
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<GroupedGemmFp8Problem>();
    const std::int64_t rows = q.layout == k_masked ? q.experts * q.m : q.m;
    const bool block = q.scaling == k_fp8_block;
    const std::int64_t kb = cdiv(q.k, 128);
    return {{"a", BufferRole::input, DType::u8, rows * q.k},
            {"b", BufferRole::input, DType::u8, q.experts * q.n * q.k},
            {"offs", BufferRole::input, DType::i32, q.experts, q.m + 1},
            {"a_scale", BufferRole::input, DType::f32, block ? rows * kb : rows},
            {"b_scale", BufferRole::input, DType::f32, block ? q.experts * cdiv(q.n, 128) * kb : q.experts * q.n},
            {"out", BufferRole::output, p.dtype, rows * q.n}};
  }
  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<GroupedGemmFp8Problem>();
    const Variant v = variant(params);
    for (int i = 0; i < 6; ++i) out.add(b[i]);
    out.add(int(q.experts));
    out.add(int(q.m));
    out.add(int(q.n));
    out.add(int(q.k));
    if (!v.wgmma) return;
    const std::uint64_t rows_a = std::uint64_t(q.layout == k_masked ? q.experts * q.m : q.m);
    out.add_tensor_map({b[0], std::uint64_t(q.k), rows_a, std::uint32_t(v.bm), 0});
    out.add_tensor_map({b[1], std::uint64_t(q.k), std::uint64_t(q.experts * q.n), std::uint32_t(v.bn), 0});
    out.add_tensor_map(g::out_map_request(b[5], q.n, rows_a, {b[0], std::uint64_t(q.k), rows_a, 16, 0}));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 6)
      return invalid_argument("grouped_gemm_fp8: reference takes 6 buffers (a, b, offs, a_scale, b_scale, out)");
    const auto q = p.as<GroupedGemmFp8Problem>();
    std::vector<std::int64_t> lo, hi;
    expert_rows(static_cast<const std::int32_t*>(b[2]), q.experts, q.m, Layout(q.layout), lo, hi);
    const bool block = q.scaling == k_fp8_block;
    const std::int64_t kb = cdiv(q.k, 128), nb = cdiv(q.n, 128);
    const auto* a = static_cast<const std::uint8_t*>(b[0]);
    const auto* w = static_cast<const std::uint8_t*>(b[1]);
    const auto* sa = static_cast<const float*>(b[3]);
    const auto* sb = static_cast<const float*>(b[4]);
    double lut[256];
    for (int i = 0; i < 256; ++i) lut[i] = e4m3_to_float(std::uint8_t(i));
    for (std::int64_t e = 0; e < q.experts; ++e)
      for (std::int64_t r = lo[e]; r < hi[e]; ++r)
        for (std::int64_t j = 0; j < q.n; ++j) {
          const std::uint8_t* wr = w + (e * q.n + j) * q.k;
          double total = 0;
          for (std::int64_t blk = 0; blk < kb; ++blk) {
            double part = 0;
            for (std::int64_t x = blk * 128; x < std::min(q.k, (blk + 1) * 128); ++x) part += lut[a[r * q.k + x]] * lut[wr[x]];
            total += block ? part * double(sa[r * kb + blk]) * double(sb[(e * nb + j / 128) * kb + blk]) : part;
          }
          if (!block) total *= double(sa[r]) * double(sb[e * q.n + j]);
          store_from_double(b[5], p.dtype, r * q.n + j, total);
        }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families::moe

void kiln_register_kernels_grouped_gemm(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::moe::GroupedGemm>());
  (void)r.add(std::make_shared<kiln::families::moe::GroupedGemmFp8>());
}
