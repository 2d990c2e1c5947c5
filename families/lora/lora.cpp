// The lora_shrink and lora_gemm families (families/lora/lora.cuh).
//
// Heuristic and why:
//  - lora_gemm: wgmma on compute capability 9.0, else mma. wgmma tiles as the grouped GEMM's:
//    64 x 128 for at most 64 rows (decode: W streams once either way, and a 128-row tile would be
//    half empty), 128 x 256 where n reaches 1024, 128 x 128 below. mma: 128 x 128, halved to
//    64 x 128 and 64 x 64 while fewer tiles than SMs. Stages: at least 96 KiB of loads in flight
//    (4 to 6), 8 for the 64 x 128 wgmma tile (decode is bound by bytes in flight), within the
//    device's shared memory.
//  - lora_gemm decode (at most 64 rows, compute capability 9.0 and later, without t): the
//    smallest of 16, 32, 64 rows holding them, 128 columns, split-K over a cluster of the widest
//    split in {8, 4, 2} whose CTAs number at most two per SM with at least 4 k-steps each (a few
//    rows stream W over every SM, not one CTA per 128 columns); 3 stages, small enough that every
//    cluster fits the first wave (one 6-stage CTA per SM left clusters for a second wave).
//  - lora_gemm core (one adapter, sm_90a, more than 64 rows: core_path): the GEMM core's tiles by
//    its cost model (gemm::wgmma_cost over 128 x 256, 128 x 128, 128 x 64), those whose width
//    divides the slice ends; the core's stage depths. No clusters: two CTAs sharing x by multicast
//    were slower at 8192 x 4096 x 4096 on Hopper.
//  - lora_shrink: one 64 x 64 mma tile (the rank side is at most 3 x 128 columns; the cost is
//    reading x and A once), 4 stages; the K splits (shrink_splits) are part of the problem because
//    lora_gemm reads that many partial sums. At 32 rows or fewer (decode) 32-row tiles and 2 stages
//    of 4 k-steps: a split's range, often 4 k-steps, is then one trip to memory per adapter pass
//    (the tuner's pick on Hopper for 16 rows at ranks 16 and 64), and multi-adapter passes spread
//    over z up to two blocks per SM. Writing t (one split): stages of several k-steps, so
//    each row of x is read 256 or 512 contiguous bytes at a time (one k-step, 128-byte pieces of
//    64 rows, is clearly slower). 32-row tiles, 4 stages of 4 k-steps, while even those do not
//    outnumber the SMs; 64-row tiles, 3 stages of 4 k-steps, while those fill at most one wave;
//    past that 3 stages of 2 k-steps, small enough for two CTAs on an SM. On Hopper at 4096 x
//    4096 the 32-row tiles are the fastest the tuner finds; at 8192 x 4096 (rank 16, one slice)
//    64-row tiles of 4 k-steps; with two slices, 2 k-steps.
#include "families/lora/lora.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"
#include "families/common/gemm/gemm_util.h"

namespace kiln::families::lora {
namespace {

namespace g = gemm;

std::int64_t cdiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Elements of K per 128-byte stage (f16/bf16).
constexpr std::int64_t k_step = 64;

// lora_gemm's param `path`, in the schema's order; lora_shrink has none (mma).
enum class Path { mma, wgmma, core, decode };
constexpr const char* k_path_names[] = {"mma", "wgmma", "core", "decode"};

struct Variant {
  Path path;
  int bm, bn, stages;
  int split = 1;
  // The warp-specialized ring of TMA loads and mbarriers (sm_90a): the wgmma and core paths.
  bool ring() const { return path == Path::wgmma || path == Path::core; }
};

Variant variant_of(const Params& p) {
  const auto name = p.get_str("path");
  Path path = Path::mma;
  for (int i = 0; i < 4; ++i)
    if (name && *name == k_path_names[i]) path = Path(i);
  const auto bn = p.get_int("bn");
  const auto split = p.get_int("split");
  return {path, int(*p.get_int("bm")), bn ? int(*bn) : 64, int(*p.get_int("stages")), split ? int(*split) : 1};
}

std::int64_t stage_bytes(const Variant& v) { return std::int64_t(v.bm + v.bn) * 128; }
// The decode path adds the low-rank rows it finishes (fp32, own = ceil(bm / split) rows of bn) and
// min(own, 8) rows of t (3 slices x 128 ranks, fp32) to its ring; the core path the GEMM core's
// staged epilogue.
std::int64_t shared_bytes(const Variant& v) {
  const std::int64_t own = (v.bm + v.split - 1) / v.split;
  std::int64_t extra = v.path == Path::decode ? own * v.bn * 4 + std::min<std::int64_t>(own, 8) * 384 * 4 : 0;
  if (v.path == Path::core) extra = g::staged_epilogue_bytes(g::k_half, g::Tile{true, v.bm, v.bn, v.stages, 8});
  return 1024 + v.stages * (stage_bytes(v) + (v.ring() ? 16 : 0)) + extra;
}

int default_stages(Variant v, std::int64_t cc) {
  const std::int64_t stage = stage_bytes(v);
  v.stages = int(std::clamp<std::int64_t>((96 * 1024 + stage - 1) / stage, 4, 6));
  if (v.ring() && stage <= 24 * 1024) v.stages = 8;
  while (v.stages > 2 && shared_bytes(v) > g::max_shared_bytes(cc)) --v.stages;
  return v.stages;
}

std::string dtype_of(const Problem& p) { return p.dtype == DType::f16 ? "f16" : "bf16"; }

// Adapter of row `row` as the kernels read idx (none: -1), and an adapter's rank and scale.
std::int64_t adapter_at(const std::int32_t* idx, std::int64_t row, std::int64_t adapters) {
  if (!idx) return 0;
  const std::int64_t a = idx[row];
  return a >= 0 && a < adapters ? a : -1;
}
std::int64_t rank_at(const std::int32_t* ranks, std::int64_t a, std::int64_t r) {
  return ranks ? std::clamp<std::int64_t>(ranks[a], 0, r) : r;
}

Status check_common(const std::string& f, DType kernel, const Problem& p, std::int64_t m, std::int64_t k,
                    std::int64_t r, std::int64_t adapters, std::int64_t slices, std::int64_t splits) {
  if (kernel != p.dtype)
    return unsupported_dtype(f + ": kernel is for " + dtype_name(kernel) + ", tensors are " + dtype_name(p.dtype));
  if (m < 1 || k < 1) return shape_mismatch(f + ": m and k must be positive");
  if (k % 8) return shape_mismatch(f + ": k must be a multiple of 8 (rows are copied in 16-byte pieces)");
  if (r < 1 || r > k_max_rank) return shape_mismatch(f + ": rank must be in [1, 128], got " + std::to_string(r));
  if (slices < 1 || slices > k_max_slices) return shape_mismatch(f + ": slices must be 1, 2 or 3");
  if (adapters < 1) return shape_mismatch(f + ": adapters must be positive");
  if (splits < 1 || splits > std::max<std::int64_t>(1, cdiv(k, k_step)) || splits > 16)
    return invalid_argument(f + ": splits must be in [1, min(16, k / 64 rounded up)], got " + std::to_string(splits));
  const std::int64_t lim = std::int64_t(1) << 31;
  if (m >= lim || k >= lim || adapters * slices * r * k >= (std::int64_t(1) << 40) ||
      splits * m * slices * rank_pitch(r) >= lim)
    return shape_mismatch(f + ": sizes must be below 2^31");
  if (p.alignment < 16) return invalid_argument(f + ": tensors need 16-byte aligned base addresses");
  return {};
}

bool writes_t(const Params& p) {
  const auto o = p.get_str("output");
  return o && *o == "t";
}

// lora_shrink's shared memory: stages of ksub k-steps of its 64-column tile.
std::int64_t shrink_shared_bytes(const Params& p) {
  return 1024 + *p.get_int("stages") * *p.get_int("ksub") * (*p.get_int("bm") + 64) * 128;
}

class LoraShrink final : public Family {
 public:
  std::string_view name() const override { return "lora_shrink"; }
  int version() const override { return 4; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f16", "bf16"}, "element type of x and A"},
        {"bm", {32, 64}, {}, "tile rows"},
        {"stages", {2, 3, 4, 5, 6, 7, 8}, {}, "shared-memory pipeline depth"},
        {"output", {}, {"partials", "t"}, "partials: f32 partial sums u; t: the fused GEMM's operand (problem t = 1)"},
        {"ksub", {1, 2, 4}, {}, "k-steps of 128 bytes per stage (each row of x read ksub x 128 bytes at a time)"},
        {"wm", {2, 4}, {}, "warps along the tile's rows (2 x wm warps)"}};
    return defs;
  }
  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    // Each warp takes 16 rows or more (an mma.sync fragment).
    if (*params.get_int("bm") < 16 * *params.get_int("wm"))
      return invalid_argument("lora_shrink: bm must be at least 16 x wm");
    if (shrink_shared_bytes(params) > 227 * 1024)
      return invalid_argument("lora_shrink: the stages exceed 227 KiB of shared memory");
    return {};
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<LoraShrinkProblem>(
        {bucketed(&LoraShrinkProblem::m, "m", "rows of x (tokens)"),
         key(&LoraShrinkProblem::k, "k", "columns of x and of A"),
         key(&LoraShrinkProblem::r, "r", "rank per slice"),
         key(&LoraShrinkProblem::adapters, "adapters", "adapters in A's stack"),
         key(&LoraShrinkProblem::slices, "slices", "output slices (merged QKV: 3, gate_up: 2)"),
         key(&LoraShrinkProblem::splits, "splits", "partial sums over ranges of K"),
         key(&LoraShrinkProblem::multi, "multi", "1: per-row adapter indices and per-adapter ranks"),
         key(&LoraShrinkProblem::t, "t", "1: write t = scale (x A^T) in the element type (one split, no multi)"),
         value(&LoraShrinkProblem::scale, "scale", "t's scale")});
    return fields;
  }
  static Params make(const std::string& dtype, std::int64_t bm, std::int64_t stages, bool t, std::int64_t ksub,
                     std::int64_t wm = 2) {
    return Params{{"dtype", dtype}, {"bm", bm}, {"stages", stages}, {"output", t ? "t" : "partials"}, {"ksub", ksub},
                  {"wm", wm}};
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered out;
    out.source = "#include \"lora/lora.cuh\"\n";
    out.name_expression = std::string("kiln::lora::lora_shrink_mma<") + device_type(*params.get_str("dtype")) + ", " +
                          std::to_string(*params.get_int("bm")) + ", 64, " + std::to_string(*params.get_int("stages")) +
                          (writes_t(params) ? ", true, " : ", false, ") + std::to_string(*params.get_int("ksub")) + ", " +
                          std::to_string(*params.get_int("wm")) + ">";
    return out;
  }
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    // t feeds lora_gemm's core path, which is sm_90a's alone.
    if (writes_t(params) && arch.capability != 90) return false;
    return arch.capability >= 80 && shrink_shared_bytes(params) <= g::max_shared_bytes(arch.capability);
  }
  // The heuristic's picks: partial sums (64-row tiles, 4 stages of one k-step; decode: 32-row
  // tiles, 2 stages of 4 k-steps), and t in 64-row tiles (stages of 4 and of 2 k-steps) and 32-row
  // ones (4 k-steps).
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f16", "bf16"}) {
      out.push_back(make(d, 64, 4, false, 1));
      out.push_back(make(d, 32, 2, false, 4));
      out.push_back(make(d, 64, 3, true, 4, 4));
      out.push_back(make(d, 64, 3, true, 2, 4));
      out.push_back(make(d, 32, 4, true, 4));
    }
    return out;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LoraShrinkProblem>();
    KILN_TRY(check_common("lora_shrink", *parse_dtype(*params.get_str("dtype")), p, q.m, q.k, q.r, q.adapters, q.slices,
                          q.splits));
    if (q.t != 0 && q.t != 1) return invalid_argument("lora_shrink: t must be 0 or 1");
    if (writes_t(params) != (q.t == 1))
      return invalid_argument(std::string("lora_shrink: the variant writes ") + (writes_t(params) ? "t" : "partial sums") +
                              ", the problem asks for " + (q.t ? "t" : "partial sums"));
    if (q.t && (q.splits != 1 || q.multi))
      return invalid_argument("lora_shrink: t is written in one split, for one adapter");
    if (q.t && !std::isfinite(q.scale)) return invalid_argument("lora_shrink: scale must be finite");
    const std::int64_t cc = g::device_cc(p);
    if (cc < 80) return invalid_argument("lora_shrink: needs compute capability 8.0 or later");
    if (q.t && cc != 90) return invalid_argument("lora_shrink: t is for lora_gemm's core path, on sm_90a");
    if (shrink_shared_bytes(params) > g::max_shared_bytes(cc))
      return invalid_argument("lora_shrink: the variant needs more shared memory than the device grants");
    return {};
  }
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<LoraShrinkProblem>();
    const Variant v = variant_of(params);
    LaunchGeometry geo;
    const std::int64_t tiles = std::max<std::int64_t>(1, cdiv(q.m, v.bm) * cdiv(q.slices * pitch(q), 64));
    geo.grid.x = std::uint32_t(tiles);
    geo.grid.y = std::uint32_t(q.splits);
    // Multi-adapter: the tiles' adapter passes spread over z while the blocks number under two per
    // SM (decode).
    if (q.multi)
      geo.grid.z = std::uint32_t(std::clamp<std::int64_t>(2 * g::device_sms(p) / (tiles * q.splits), 1,
                                                          std::min<std::int64_t>(q.adapters, v.bm)));
    geo.block.x = std::uint32_t(64 * *params.get_int("wm"));
    geo.shared_bytes = std::uint32_t(shrink_shared_bytes(params));
    return geo;
  }
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<LoraShrinkProblem>();
    if (!q.t) return q.m <= 32 ? make(dtype_of(p), 32, 2, false, 4) : make(dtype_of(p), 64, 4, false, 1);
    const std::int64_t tiles = cdiv(q.m, 64) * cdiv(q.slices * pitch(q), 64), sms = g::device_sms(p);
    if (2 * tiles <= sms) return make(dtype_of(p), 32, 4, true, 4);
    return tiles <= sms ? make(dtype_of(p), 64, 3, true, 4, 4) : make(dtype_of(p), 64, 3, true, 2, 4);
  }
  std::vector<Params> tuning_space(const Problem& p) const override {
    std::vector<Params> out;
    for (std::int64_t bm : {32, 64})
      for (std::int64_t ksub : {1, 2, 4})
        for (std::int64_t s : {2, 3, 4, 5, 6, 7, 8})
          for (std::int64_t wm : {2, 4}) {
            Params c = make(dtype_of(p), bm, s, p.as<LoraShrinkProblem>().t == 1, ksub, wm);
            if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
          }
    return out;
  }
  // u's columns per slice: rank_pitch for partial sums, t_pitch for t.
  static std::int64_t pitch(const LoraShrinkProblem& q) { return q.t ? t_pitch(q.r) : rank_pitch(q.r); }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(
        dtype, with_defaults(shape, {{"adapters", 1}, {"slices", 1}, {"splits", 1}, {"multi", 0}, {"t", 0}}));
  }
  // Llama hidden 4096 at ranks 16 and 64: prefill (t, and partial sums) and decode (16 splits, 16
  // adapters), and a small ragged multi-adapter case with merged QKV slices.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    if (dtype != DType::f16 && dtype != DType::bf16) return out;
    auto add = [&](LoraShrinkProblem q) { out.push_back(Problem::of(dtype, 16, q)); };
    add({.m = 8192, .k = 4096, .r = 16, .t = 1, .scale = 2.0});
    add({.m = 8192, .k = 4096, .r = 64, .slices = 2, .t = 1, .scale = 0.5});
    add({.m = 8192, .k = 4096, .r = 16, .splits = shrink_splits(8192, 4096, 16, 1, g::k_reference_sms)});
    add({.m = 8192, .k = 4096, .r = 64, .splits = shrink_splits(8192, 4096, 64, 1, g::k_reference_sms)});
    add({.m = 16, .k = 4096, .r = 16, .adapters = 16, .splits = shrink_splits(16, 4096, 16, 1, g::k_reference_sms),
         .multi = 1});
    add({.m = 100, .k = 264, .r = 24, .adapters = 3, .slices = 3, .splits = 2, .multi = 1});
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<LoraShrinkProblem>();
    return {{"x", BufferRole::input, p.dtype, q.m * q.k},
            {"a", BufferRole::input, p.dtype, q.adapters * q.slices * q.r * q.k},
            {"idx", BufferRole::input, DType::i32, q.multi ? q.m : 1, q.adapters},
            {"ranks", BufferRole::input, DType::i32, q.multi ? q.adapters : 1, q.r + 1},
            {"u", BufferRole::output, q.t ? p.dtype : DType::f32, q.splits * q.m * q.slices * pitch(q)}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<LoraShrinkProblem>();
    out.add(b[0]);
    out.add(b[1]);
    out.add(q.multi ? b[2] : static_cast<void*>(nullptr));
    out.add(q.multi ? b[3] : static_cast<void*>(nullptr));
    out.add(b[4]);
    for (std::int64_t v : {q.m, q.k, q.r, q.adapters, q.slices, q.splits}) out.add(int(v));
    out.add(float(q.scale));
  }
  // fp64 sums over each split's K range (the kernel's: split z takes 64-column steps [z s / splits,
  // (z + 1) s / splits) of the s steps), stored f32; t: the one sum times the fp32 scale, stored in
  // the element type, zeros past the rank.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5) return invalid_argument("lora_shrink: reference takes 5 buffers (x, a, idx, ranks, u)");
    const auto q = p.as<LoraShrinkProblem>();
    const auto* idx = q.multi ? static_cast<const std::int32_t*>(b[2]) : nullptr;
    const auto* ranks = q.multi ? static_cast<const std::int32_t*>(b[3]) : nullptr;
    auto* u = static_cast<float*>(b[4]);
    const std::int64_t rp = pitch(q), ucols = q.slices * rp, steps = cdiv(q.k, k_step);
    for (std::int64_t z = 0; z < q.splits; ++z) {
      const std::int64_t k0 = steps * z / q.splits * k_step, k1 = std::min(q.k, steps * (z + 1) / q.splits * k_step);
      for (std::int64_t row = 0; row < q.m; ++row) {
        const std::int64_t a = adapter_at(idx, row, q.adapters);
        const std::int64_t rank = a < 0 ? 0 : rank_at(ranks, a, q.r);
        for (std::int64_t c = 0; c < ucols; ++c) {
          const std::int64_t s = c / rp, rr = c % rp;
          double sum = 0;
          if (rr < rank) {
            const std::int64_t arow = (a * q.slices + s) * q.r + rr;
            for (std::int64_t x = k0; x < k1; ++x)
              sum += load_as_double(b[0], p.dtype, row * q.k + x) * load_as_double(b[1], p.dtype, arow * q.k + x);
          }
          if (q.t)
            store_from_double(b[4], p.dtype, row * ucols + c, double(float(sum) * float(q.scale)));
          else
            u[(z * q.m + row) * ucols + c] = float(sum);
        }
      }
    }
    return {};
  }
};

class LoraGemm final : public Family {
 public:
  std::string_view name() const override { return "lora_gemm"; }
  int version() const override { return 4; }
  // Every kernel waits (griddepcontrol.wait) before it touches memory; the decode path first
  // prefetches its W rows into L2, which changes nothing. So lora_gemm starts while lora_shrink runs.
  bool programmatic_launch() const override { return true; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"path", {}, {"mma", "wgmma", "core", "decode"},
         "mma: mma.sync (sm_80 and later); wgmma: warp-specialized wgmma (sm_90a), the tail written from the "
         "partial sums; core: the GEMM core's wgmma kernel, the tail loaded by TMA from t (problem t = 1); decode: "
         "split-K over a cluster (sm_90), the low-rank term on CUDA cores"},
        {"dtype", {}, {"f16", "bf16"}, "element type of x, W, B, bias and out"},
        {"bm", {16, 32, 64, 128}, {}, "tile rows (16, 32: decode only; 128: not decode)"},
        {"bn", {64, 128, 256}, {}, "tile columns (256: wgmma and core only)"},
        {"stages", {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, {}, "shared-memory pipeline depth"},
        {"split", {1, 2, 4, 8}, {}, "decode: CTAs of a cluster sharing a tile's K (1 for the other paths)"}};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<LoraGemmProblem>(
        {bucketed(&LoraGemmProblem::m, "m", "rows of x and out (tokens)"),
         key(&LoraGemmProblem::n, "n", "columns of out"), key(&LoraGemmProblem::k, "k", "columns of x and of W"),
         key(&LoraGemmProblem::r, "r", "rank per slice"),
         key(&LoraGemmProblem::adapters, "adapters", "adapters in B's stack"),
         key(&LoraGemmProblem::slices, "slices", "output slices"),
         key(&LoraGemmProblem::splits, "splits", "lora_shrink's partial sums"),
         key(&LoraGemmProblem::multi, "multi", "1: per-row adapter indices, per-adapter ranks and scales"),
         key(&LoraGemmProblem::bias, "bias", "1: a bias [n]"),
         key(&LoraGemmProblem::t, "t", "1: u holds t (lora_shrink's output t), for the core path"),
         key(&LoraGemmProblem::n1, "n1", "end of slice 0 (the core tile's width divides it)"),
         key(&LoraGemmProblem::n2, "n2", "end of slice 1 (the core tile's width divides it)"),
         value(&LoraGemmProblem::scale, "scale", "the adapter's scale without multi")});
    return fields;
  }
  static Params make(const Variant& v, const std::string& dtype) {
    return Params{{"path", k_path_names[int(v.path)]},
                  {"dtype", dtype},
                  {"bm", std::int64_t(v.bm)},
                  {"bn", std::int64_t(v.bn)},
                  {"stages", std::int64_t(v.stages)},
                  {"split", std::int64_t(v.split)}};
  }
  // The decode path for a problem: the smallest tile height holding its rows (at most 64), 128
  // columns, 3 stages, and the widest split whose CTAs number at most two per SM with at least 4
  // k-steps each. Small CTAs leave room on the SMs, so every cluster finds a place in the first
  // wave (6 stages, one CTA per SM, ran a second wave of clusters of 4 on an H100).
  static Variant decode_variant(const LoraGemmProblem& q, const Problem& p) {
    Variant v{Path::decode, q.m <= 16 ? 16 : q.m <= 32 ? 32 : 64, 128, 3};
    const std::int64_t tiles = cdiv(q.m, v.bm) * cdiv(q.n, v.bn), ktiles = cdiv(q.k, k_step);
    for (int s : {8, 4, 2})
      if (tiles * s <= 2 * g::device_sms(p) && ktiles >= 4 * s) {
        v.split = s;
        break;
      }
    return v;
  }
  static g::Tile core_tile(const Variant& v) { return g::Tile{true, v.bm, v.bn, v.stages, 8}; }
  // The core path's GEMM as the core's host side sees it: K runs on over the tail's chunks.
  static Problem core_problem(const LoraGemmProblem& q, const Problem& p) {
    Problem gp = Problem::of(p.dtype, 16, g::GemmProblem{.m = q.m, .n = q.n, .k = q.k + q.slices * t_pitch(q.r)});
    gp.sm_count = p.sm_count;
    gp.cc = p.cc;
    return gp;
  }
  // The core path's tile for a problem: the GEMM core's cost model over its candidates whose width
  // divides the slice ends (a tile lies in one slice), and the core's stage depth.
  static Variant core_variant(const LoraGemmProblem& q, const Problem& p) {
    const Problem gp = core_problem(q, p);
    Variant best{Path::core, 128, 64, 4};
    std::int64_t best_cost = -1;
    for (auto [bm, bn] : {std::pair{128, 256}, {128, 128}, {128, 64}}) {
      if ((q.slices >= 2 && q.n1 % bn) || (q.slices >= 3 && q.n2 % bn)) continue;
      const std::int64_t cost = g::wgmma_cost(g::k_half, g::Tile{true, bm, bn, 4, 8}, gp);
      if (best_cost < 0 || cost < best_cost) {
        best_cost = cost;
        best = Variant{Path::core, bm, bn, 4};
      }
    }
    best.stages = g::default_stages(g::k_half, core_tile(best), g::device_cc(p));
    return best;
  }
  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const Variant v = variant_of(params);
    const bool decode = v.path == Path::decode;
    if (!v.ring() && v.bn > 128) return invalid_argument("lora_gemm: the mma and decode paths take bn <= 128");
    if (decode ? v.bm > 64 : v.bm < 64) return invalid_argument("lora_gemm: bm 16 and 32 are the decode path's, 128 the others'");
    if (!decode && v.split != 1) return invalid_argument("lora_gemm: split is the decode path's");
    if (v.path == Path::core) KILN_TRY(g::validate_tile("lora_gemm", g::k_half, core_tile(v)));
    if (shared_bytes(v) > 227 * 1024) return invalid_argument("lora_gemm: the stages exceed 227 KiB of shared memory");
    return {};
  }
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    const Variant v = variant_of(params);
    if (v.ring() ? !(arch.capability == 90 && arch.suffix == 'a') : arch.capability < (v.path == Path::decode ? 90 : 80))
      return false;
    return shared_bytes(v) <= g::max_shared_bytes(arch.capability);
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const Variant v = variant_of(params);
    Rendered out;
    out.source = "#include \"lora/lora.cuh\"\n";
    const bool decode = v.path == Path::decode;
    out.name_expression = std::string("kiln::lora::lora_gemm_") + k_path_names[int(v.path)] + "<" +
                          device_type(*params.get_str("dtype")) + ", " + std::to_string(v.bm) + ", " +
                          std::to_string(v.bn) + ", " + std::to_string(v.stages) +
                          (decode ? ", " + std::to_string(v.split) : std::string()) + ">";
    return out;
  }
  // The heuristic's picks: the core's three tiles and wgmma's three (sm_90a), decode's three tile
  // heights at each split (sm_90), mma's three at the stages of sm_80 and sm_86, both dtypes.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f16", "bf16"}) {
      for (int bn : {256, 128, 64}) {
        Variant v{Path::core, 128, bn, 4};
        v.stages = g::default_stages(g::k_half, core_tile(v), 90);
        out.push_back(make(v, d));
      }
      for (auto [bm, bn] : {std::pair{64, 128}, {128, 128}, {128, 256}}) {
        Variant v{Path::wgmma, bm, bn, 4};
        v.stages = default_stages(v, 90);
        out.push_back(make(v, d));
      }
      for (int bm : {16, 32, 64})
        for (int split : {1, 2, 4, 8}) out.push_back(make(Variant{Path::decode, bm, 128, 3, split}, d));
      for (auto [bm, bn] : {std::pair{128, 128}, {64, 128}, {64, 64}})
        for (std::int64_t cc : {80, 86}) {
          Variant v{Path::mma, bm, bn, 4};
          v.stages = default_stages(v, cc);
          Params p = make(v, d);
          if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
        }
    }
    return out;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto q = p.as<LoraGemmProblem>();
    const Variant v = variant_of(params);
    const std::string f = "lora_gemm";
    KILN_TRY(check_common(f, *parse_dtype(*params.get_str("dtype")), p, q.m, q.k, q.r, q.adapters, q.slices, q.splits));
    if (q.n < 1 || q.n >= (std::int64_t(1) << 31)) return shape_mismatch(f + ": n must be in [1, 2^31)");
    if (q.adapters * q.n * q.r >= (std::int64_t(1) << 40)) return shape_mismatch(f + ": B's stack is too large");
    if (cdiv(q.m, v.bm) * cdiv(q.n, v.bn) * v.split >= (std::int64_t(1) << 31))
      return shape_mismatch(f + ": too many tiles");
    if (q.slices >= 2 && !(0 <= q.n1 && q.n1 <= q.n && (q.slices < 3 || (q.n1 <= q.n2 && q.n2 <= q.n))))
      return invalid_argument(f + ": slice ends must be non-decreasing within [0, n]");
    if (!std::isfinite(q.scale)) return invalid_argument(f + ": scale must be finite");
    if (q.t != 0 && q.t != 1) return invalid_argument(f + ": t must be 0 or 1");
    const bool core = v.path == Path::core;
    if (core != (q.t == 1))
      return invalid_argument(f + ": the " + (core ? "core path takes t (problem t = 1)"
                                                     : "mma, wgmma and decode paths take partial sums (problem t = 0)"));
    if (core) {
      if (q.multi || q.splits != 1) return invalid_argument(f + ": the core path is for one adapter and one split");
      if (q.r % 8) return shape_mismatch(f + ": the core path needs a rank that is a multiple of 8");
      if ((q.slices >= 2 && q.n1 % v.bn) || (q.slices >= 3 && q.n2 % v.bn))
        return invalid_argument(f + ": the core path needs slice ends that are multiples of bn = " +
                                std::to_string(v.bn));
    }
    const std::int64_t cc = g::device_cc(p);
    if (v.ring() && cc != 90)
      return invalid_argument(f + ": the wgmma path needs sm_90a (compute capability 9.0), the device has " +
                              std::to_string(cc / 10) + "." + std::to_string(cc % 10));
    if (!v.ring() && cc < 80) return invalid_argument(f + ": needs compute capability 8.0 or later");
    if (v.path == Path::decode && cc < 90) return invalid_argument(f + ": the decode path needs thread-block clusters (sm_90)");
    if (shared_bytes(v) > g::max_shared_bytes(cc))
      return invalid_argument(f + ": the variant needs more shared memory than the device grants");
    return {};
  }
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto q = p.as<LoraGemmProblem>();
    const Variant v = variant_of(params);
    if (v.path == Path::core) return g::geometry(g::k_half, core_tile(v), core_problem(q, p));
    const std::int64_t tiles = cdiv(q.m, v.bm) * cdiv(q.n, v.bn);
    LaunchGeometry geo;
    geo.grid.x = std::uint32_t(std::clamp<std::int64_t>(
        v.ring() ? std::min(tiles, g::device_sms(p)) : tiles * v.split, 1, 0x7fffffff));
    geo.block.x = std::uint32_t(v.ring() ? (v.bm / 64 + 1) * 128 : v.path == Path::decode ? 192 : 2 * v.bn);
    geo.shared_bytes = std::uint32_t(shared_bytes(v));
    return geo;
  }
  Params heuristic(const Problem& p) const override {
    const auto q = p.as<LoraGemmProblem>();
    const std::int64_t cc = g::device_cc(p);
    if (q.t) return make(core_variant(q, p), dtype_of(p));
    if (cc >= 90 && q.m <= 64) return make(decode_variant(q, p), dtype_of(p));
    Variant v{cc == 90 ? Path::wgmma : Path::mma, 128, 128, 4};
    if (v.ring()) {
      if (q.m <= 64)
        v.bm = 64;
      else if (q.n >= 1024)
        v.bn = 256;
    } else {
      const std::int64_t sms = g::device_sms(p);
      if (cdiv(q.m, v.bm) * cdiv(q.n, v.bn) < sms) v.bm = 64;
      if (cdiv(q.m, v.bm) * cdiv(q.n, v.bn) < sms) v.bn = 64;
    }
    v.stages = default_stages(v, cc);
    return make(v, dtype_of(p));
  }
  std::vector<Params> tuning_space(const Problem& p) const override {
    const Variant base = variant_of(heuristic(p));
    std::vector<Params> out;
    if (base.path == Path::decode) {
      for (int bm : {16, 32, 64})
        for (int bn : {64, 128})
          for (int split : {1, 2, 4, 8})
            for (int st : {3, 4, 6, 8}) {
              Params c = make(Variant{Path::decode, bm, bn, st, split}, dtype_of(p));
              if (bm >= base.bm && validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
            }
      return out;
    }
    for (int bm : {64, 128})
      for (int bn : {64, 128, 256}) {
        Variant v{base.path, bm, bn, 4};
        std::vector<int> depths = {3, 4, 5, 6, default_stages(v, g::device_cc(p))};
        std::sort(depths.begin(), depths.end());
        depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
        for (int s : depths) {
          v.stages = s;
          Params c = make(v, dtype_of(p));
          if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
        }
      }
    return out;
  }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    return Family::problem_from_shape(
        dtype,
        with_defaults(shape, {{"adapters", 1}, {"slices", 1}, {"splits", 1}, {"multi", 0}, {"bias", 0}, {"t", 0},
                              {"n1", 0}, {"n2", 0}}));
  }
  // Llama projection shapes (M 8192 and 16, K 4096, N 4096 rank 16, N 14336 rank 64), decode over 16
  // adapters, and a small ragged merged-QKV case with a bias.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    std::vector<Problem> out;
    if (dtype != DType::f16 && dtype != DType::bf16) return out;
    auto add = [&](LoraGemmProblem q) {
      q.splits = q.t ? 1 : shrink_splits(q.m, q.k, q.r, q.slices, g::k_reference_sms);
      out.push_back(Problem::of(dtype, 16, q));
    };
    add({.m = 8192, .n = 4096, .k = 4096, .r = 16, .t = 1});
    add({.m = 8192, .n = 14336, .k = 4096, .r = 64, .t = 1});
    add({.m = 4096, .n = 22016, .k = 4096, .r = 16, .slices = 2, .bias = 1, .t = 1, .n1 = 11008});
    add({.m = 8192, .n = 4096, .k = 4096, .r = 16});
    add({.m = 16, .n = 4096, .k = 4096, .r = 16});
    add({.m = 16, .n = 4096, .k = 4096, .r = 16, .adapters = 16, .multi = 1});
    add({.m = 100, .n = 200, .k = 264, .r = 24, .adapters = 3, .slices = 3, .multi = 1, .bias = 1, .n1 = 136,
         .n2 = 168});
    return out;
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto q = p.as<LoraGemmProblem>();
    return {{"x", BufferRole::input, p.dtype, q.m * q.k},
            {"w", BufferRole::input, p.dtype, q.n * q.k},
            {"b", BufferRole::input, p.dtype, q.adapters * q.n * q.r},
            {"u", BufferRole::input, q.t ? p.dtype : DType::f32,
             q.t ? q.m * q.slices * t_pitch(q.r) : q.splits * q.m * q.slices * rank_pitch(q.r)},
            {"idx", BufferRole::input, DType::i32, q.multi ? q.m : 1, q.adapters},
            {"ranks", BufferRole::input, DType::i32, q.multi ? q.adapters : 1, q.r + 1},
            {"scales", BufferRole::input, DType::f32, q.multi ? q.adapters : 1},
            {"bias", BufferRole::input, p.dtype, q.bias ? q.n : 1},
            {"out", BufferRole::output, p.dtype, q.m * q.n}};
  }
  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto q = p.as<LoraGemmProblem>();
    const Variant v = variant_of(params);
    void* const none = nullptr;
    const std::uint64_t es = std::uint64_t(dtype_size(p.dtype));
    if (v.path == Path::core) {
      // x, w, bias, out, m, n, k, n1, n2, slices, chunks; tensor maps of x, W, t and B.
      out.add(b[0]);
      out.add(b[1]);
      out.add(q.bias ? b[7] : none);
      out.add(b[8]);
      for (std::int64_t x : {q.m, q.n, q.k, q.n1, q.n2, q.slices, t_pitch(q.r) / 64}) out.add(int(x));
      out.add_tensor_map({b[0], std::uint64_t(q.k) * es, std::uint64_t(q.m), std::uint32_t(v.bm), 0});
      out.add_tensor_map({b[1], std::uint64_t(q.k) * es, std::uint64_t(q.n), std::uint32_t(v.bn), 0});
      out.add_tensor_map({b[3], std::uint64_t(q.slices * t_pitch(q.r)) * es, std::uint64_t(q.m), std::uint32_t(v.bm), 0});
      out.add_tensor_map({b[2], std::uint64_t(q.r) * es, std::uint64_t(q.n), std::uint32_t(v.bn), 0});
      return;
    }
    for (int i = 0; i < 4; ++i) out.add(b[i]);
    for (int i = 4; i < 7; ++i) out.add(q.multi ? b[i] : none);
    out.add(q.bias ? b[7] : none);
    out.add(b[8]);
    for (std::int64_t x : {q.m, q.n, q.k, q.r, q.adapters, q.slices, q.n1, q.n2, q.splits}) out.add(int(x));
    out.add(float(q.scale));
    if (!v.ring()) return;
    const std::uint64_t row_bytes = std::uint64_t(q.k) * dtype_size(p.dtype);
    out.add_tensor_map({b[0], row_bytes, std::uint64_t(q.m), std::uint32_t(v.bm), 0});
    out.add_tensor_map({b[1], row_bytes, std::uint64_t(q.n), std::uint32_t(v.bn), 0});
  }
  // fp64 sums; the low-rank operand is t = scale * (u's partials summed in split order, fp32),
  // rounded to the operand type as the kernel rounds it.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 9)
      return invalid_argument("lora_gemm: reference takes 9 buffers (x, w, b, u, idx, ranks, scales, bias, out)");
    const auto q = p.as<LoraGemmProblem>();
    const auto* u = static_cast<const float*>(b[3]);  // f32 partial sums; with t, read as t below
    const auto* idx = q.multi ? static_cast<const std::int32_t*>(b[4]) : nullptr;
    const auto* ranks = q.multi ? static_cast<const std::int32_t*>(b[5]) : nullptr;
    const auto* scales = q.multi ? static_cast<const float*>(b[6]) : nullptr;
    const std::int64_t rp = rank_pitch(q.r), ucols = q.slices * rp;
    std::vector<double> t(std::size_t(q.slices * q.r));
    for (std::int64_t row = 0; row < q.m; ++row) {
      const std::int64_t a = adapter_at(idx, row, q.adapters);
      const std::int64_t rank = a < 0 ? 0 : rank_at(ranks, a, q.r);
      const float sc = a < 0 ? 0.0f : scales ? scales[a] : float(q.scale);
      for (std::int64_t s = 0; s < q.slices; ++s)
        for (std::int64_t rr = 0; rr < q.r; ++rr) {
          if (q.t) {
            t[s * q.r + rr] = load_as_double(b[3], p.dtype, row * q.slices * t_pitch(q.r) + s * t_pitch(q.r) + rr);
            continue;
          }
          float v = 0.0f;
          for (std::int64_t z = 0; z < q.splits && rr < rank; ++z) v += u[(z * q.m + row) * ucols + s * rp + rr];
          v = rr < rank ? v * sc : 0.0f;
          t[s * q.r + rr] = round_to(p.dtype, double(v));
        }
      for (std::int64_t col = 0; col < q.n; ++col) {
        double sum = 0;
        for (std::int64_t x = 0; x < q.k; ++x)
          sum += load_as_double(b[0], p.dtype, row * q.k + x) * load_as_double(b[1], p.dtype, col * q.k + x);
        std::int64_t s = 0;
        while (s + 1 < q.slices && col >= slice_hi(q, s)) ++s;
        if (a >= 0 && col >= slice_lo(q, s) && col < slice_hi(q, s))
          for (std::int64_t rr = 0; rr < rank; ++rr)
            sum += t[s * q.r + rr] * load_as_double(b[2], p.dtype, (a * q.n + col) * q.r + rr);
        if (q.bias) sum += load_as_double(b[7], p.dtype, col);
        store_from_double(b[8], p.dtype, row * q.n + col, sum);
      }
    }
    return {};
  }

 private:
  static double round_to(DType t, double v) {
    unsigned char buf[4];
    store_from_double(buf, t, 0, v);
    return load_as_double(buf, t, 0);
  }
};

}  // namespace
}  // namespace kiln::families::lora

void kiln_register_family_lora(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::lora::LoraShrink>());
  (void)r.add(std::make_shared<kiln::families::lora::LoraGemm>());
}
