#include "families/paged_attention/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "common/half.h"
#include "families/attention/attention.h"
#include "families/attention/attention_splitkv.h"
#include "families/common/family_util.h"

namespace kiln::families {

bool paged_page_size_supported(std::int64_t page_size) {
  return page_size == 1 || page_size == 8 || page_size == 16 || page_size == 32 || page_size == 64 ||
         page_size == 128;
}

std::int64_t paged_decode_splits(std::int64_t batch, std::int64_t max_seqlen_q, std::int64_t heads,
                                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t max_seq_len,
                                 std::int64_t sm_count, std::int64_t cc) {
  if (batch <= 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || max_seqlen_q <= 0) return 1;
  const std::int64_t bn = attention_tile(head_dim, head_dim).block_n;
  const std::int64_t tiles = (max_seq_len + bn - 1) / bn;
  const std::int64_t sms = sm_count > 0 ? sm_count : 132;
  const std::int64_t rows = max_seqlen_q * (heads / kv_heads);
  const int warps = attention_splitkv_warps(rows);
  const std::int64_t blocks = batch * kv_heads * ((rows + 16 * warps - 1) / (16 * warps));
  return attention_split_count(blocks, tiles,
                               sms * attention_splitkv_blocks_per_sm(head_dim, head_dim, warps, int(bn), cc,
                                                                     attention_splitkv_key_warps(warps, int(bn))));
}

std::int64_t paged_decode_workspace_elements(std::int64_t splits, std::int64_t total_q, std::int64_t heads,
                                             std::int64_t head_dim) {
  return splits * total_q * heads * (head_dim + 1);
}

namespace {

const char* dtype_param(DType t) { return t == DType::bf16 ? "bf16" : "f16"; }

Status dtype_matches(std::string_view family, const Params& params, const Problem& p) {
  const auto dtype = *parse_dtype(*params.get_str("dtype"));
  if (dtype != p.dtype)
    return unsupported_dtype(std::string(family) + ": kernel is for " + dtype_name(dtype) + ", tensors are " +
                             dtype_name(p.dtype));
  return {};
}

std::int64_t read_index(const void* p, bool i64, std::int64_t i) {
  return i64 ? static_cast<const std::int64_t*>(p)[i] : std::int64_t(static_cast<const std::int32_t*>(p)[i]);
}

// ---- reshape_and_cache ----

class ReshapeAndCache final : public Family {
 public:
  std::string_view name() const override { return "reshape_and_cache"; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"cache", {}, {"same", "fp8_e4m3"}, "cache element: the input dtype, or e4m3 bytes (x / scale)"},
        {"dtype", {}, {"f16", "bf16"}, "element type of key and value"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = ReshapeAndCacheProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::tokens, "tokens", "rows of key and value"),
        key(&P::row_elems, "row_elems", "kv_heads * head_dim"),
        value(&P::slots, "slots", "rows of each cache (num_blocks * page_size)"),
        value(&P::key_stride, "key_stride", "elements between two tokens of key"),
        value(&P::value_stride, "value_stride", "elements between two tokens of value"),
        value(&P::slot_i64, "slot_i64", "1: slot_mapping is int64"),
        key(&P::fp8, "fp8", "1: the caches hold e4m3 bytes")});
    return fields;
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const char* t = device_type(*params.get_str("dtype"));
    const bool fp8 = *params.get_str("cache") == "fp8_e4m3";
    Rendered r;
    r.source = "#include \"paged_attention/paged_cache.cuh\"\n";
    r.name_expression = std::string("kiln::paged::reshape_and_cache<") + t + ", " + (fp8 ? "unsigned char" : t) + ">";
    return r;
  }
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* d : {"f16", "bf16"})
      for (const char* c : {"same", "fp8_e4m3"}) out.push_back(make(d, c));
    return out;
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<ReshapeAndCacheProblem>();
    KILN_TRY(dtype_matches(name(), params, p));
    if ((*params.get_str("cache") == "fp8_e4m3") != (a.fp8 != 0))
      return invalid_argument("reshape_and_cache: the kernel's cache element differs from the problem's");
    if (a.tokens < 0 || a.row_elems <= 0 || a.slots < 0 || a.row_elems % 8)
      return shape_mismatch("reshape_and_cache: kv_heads * head_dim must be a positive multiple of 8");
    if (a.tokens > 0 && (a.key_stride < a.row_elems || a.value_stride < a.row_elems || a.key_stride % 8 ||
                         a.value_stride % 8))
      return invalid_argument("reshape_and_cache: token strides must cover a row and be multiples of 8 elements");
    if (p.alignment < 16) return invalid_argument("reshape_and_cache: key, value and the caches must be 16-byte aligned");
    if (a.tokens > 0x7fffffff || a.row_elems > 0x7fffffff)
      return invalid_argument("reshape_and_cache: tokens and row elements must stay below 2^31");
    return {};
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    const auto a = p.as<ReshapeAndCacheProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>((a.tokens + 3) / 4, 1));
    g.block.x = 128;
    return g;
  }
  Params heuristic(const Problem& p) const override {
    return make(dtype_param(p.dtype), p.as<ReshapeAndCacheProblem>().fp8 ? "fp8_e4m3" : "same");
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    // Few tokens over many slots: the conformance test draws slots at random, and two tokens
    // sharing one would race.
    std::vector<Problem> out;
    for (auto [tokens, row, slots, i64, fp8] :
         {std::tuple{2, 8 * 128, 16384, 1, 0}, std::tuple{1, 2 * 64, 4096, 0, 0}, std::tuple{2, 4 * 128, 8192, 1, 1}})
      out.push_back(Problem::of(dtype, 16,
                                ReshapeAndCacheProblem{.tokens = tokens,
                                                       .row_elems = row,
                                                       .slots = slots,
                                                       .key_stride = row,
                                                       .value_stride = row,
                                                       .slot_i64 = i64,
                                                       .fp8 = fp8}));
    return out;
  }
  std::vector<BufferSpec> buffers(const Params& params, const Problem& p) const override {
    const auto a = p.as<ReshapeAndCacheProblem>();
    const DType cache = *params.get_str("cache") == "fp8_e4m3" ? DType::u8 : p.dtype;
    const std::int64_t rows = a.tokens > 0 ? (a.tokens - 1) * a.key_stride + a.row_elems : 0;
    const std::int64_t vrows = a.tokens > 0 ? (a.tokens - 1) * a.value_stride + a.row_elems : 0;
    return {{"key", BufferRole::input, p.dtype, rows},
            {"value", BufferRole::input, p.dtype, vrows},
            {"slot_mapping", BufferRole::input, a.slot_i64 ? DType::i64 : DType::i32, a.tokens, std::max<std::int64_t>(a.slots, 1)},
            {"key_cache", BufferRole::output, cache, a.slots * a.row_elems},
            {"value_cache", BufferRole::output, cache, a.slots * a.row_elems},
            {"k_scale", BufferRole::input, DType::f32, 1},
            {"v_scale", BufferRole::input, DType::f32, 1}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<ReshapeAndCacheProblem>();
    for (std::size_t i = 0; i < 7; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.tokens));
    out.add(int(a.row_elems));
    out.add(static_cast<long long>(a.key_stride));
    out.add(static_cast<long long>(a.value_stride));
    out.add(int(a.slot_i64));
  }
  Status cpu_reference(const Params& params, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7 || !b[0] || !b[1] || !b[2] || !b[3] || !b[4])
      return invalid_argument("reshape_and_cache: the reference takes key, value, slot_mapping, key_cache, value_cache, "
                              "k_scale, v_scale");
    const auto a = p.as<ReshapeAndCacheProblem>();
    const bool fp8 = *params.get_str("cache") == "fp8_e4m3";
    if (fp8 && (!b[5] || !b[6])) return invalid_argument("reshape_and_cache: an fp8 cache needs k_scale and v_scale");
    for (std::int64_t t = 0; t < a.tokens; ++t) {
      const std::int64_t slot = read_index(b[2], a.slot_i64 != 0, t);
      if (slot < 0) continue;
      if (slot >= a.slots) return invalid_argument("reshape_and_cache: slot " + std::to_string(slot) + " past the cache");
      for (int half = 0; half < 2; ++half) {
        const void* src = b[half];
        void* dst = b[3 + half];
        const std::int64_t stride = half ? a.value_stride : a.key_stride;
        const float scale = fp8 ? *static_cast<const float*>(b[5 + half]) : 1.0f;
        for (std::int64_t c = 0; c < a.row_elems; ++c) {
          const double x = load_as_double(src, p.dtype, t * stride + c);
          const std::int64_t at = slot * a.row_elems + c;
          if (fp8) static_cast<std::uint8_t*>(dst)[at] = float_to_e4m3(float(x) / scale);
          else store_from_double(dst, p.dtype, at, x);
        }
      }
    }
    return {};
  }

 private:
  static Params make(const std::string& dtype, const std::string& cache) {
    return Params{{"cache", cache}, {"dtype", dtype}};
  }
};

// ---- copy_blocks ----

class CopyBlocks final : public Family {
 public:
  std::string_view name() const override { return "copy_blocks"; }
  int version() const override { return 2; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {{"vec_bytes", {16}, {}, "bytes each thread copies per step"}};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = CopyBlocksProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::pairs, "pairs", "(src, dst) block pairs"),
        key(&P::block_bytes, "block_bytes", "bytes of one block of one cache"),
        value(&P::num_blocks, "num_blocks", "blocks of each destination cache"),
        value(&P::pairs_i64, "pairs_i64", "1: pairs is int64"),
        value(&P::src_blocks, "src_blocks", "blocks of each source cache")});
    return fields;
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"paged_attention/paged_cache.cuh\"\n";
    r.name_expression = "kiln::paged::copy_blocks";
    return r;
  }
  std::vector<Params> catalog() const override { return {Params{{"vec_bytes", std::int64_t(16)}}}; }
  Status check_problem(const Params&, const Problem& p) const override {
    const auto a = p.as<CopyBlocksProblem>();
    if (a.pairs < 0 || a.num_blocks < 0 || a.src_blocks < 0 || a.block_bytes <= 0 || a.block_bytes % 16)
      return shape_mismatch("copy_blocks: a block must be a positive multiple of 16 bytes");
    if (p.alignment < 16) return invalid_argument("copy_blocks: the caches must be 16-byte aligned");
    if (a.pairs > 0x7fffffff) return invalid_argument("copy_blocks: at most 2^31 - 1 pairs");
    return {};
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    const auto a = p.as<CopyBlocksProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(a.pairs, 1));
    g.grid.y = 2;
    g.grid.z = std::uint32_t(std::clamp<std::int64_t>((a.block_bytes / 16 + 255) / 256, 1, 65535));
    g.block.x = 256;
    return g;
  }
  Params heuristic(const Problem&) const override { return Params{{"vec_bytes", std::int64_t(16)}}; }
  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16) return {};  // the caches are bytes; the problem's dtype is unused
    // One pair: random pairs could chain or repeat a destination.
    return {Problem::of(DType::f16, 16, CopyBlocksProblem{.pairs = 1, .block_bytes = 16 * 8 * 128 * 2, .num_blocks = 64, .pairs_i64 = 1, .src_blocks = 64}),
            Problem::of(DType::f16, 16, CopyBlocksProblem{.pairs = 1, .block_bytes = 1 * 2 * 64 * 2, .num_blocks = 512, .pairs_i64 = 0, .src_blocks = 96})};
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<CopyBlocksProblem>();
    return {{"src_key", BufferRole::input, DType::u8, a.src_blocks * a.block_bytes},
            {"src_value", BufferRole::input, DType::u8, a.src_blocks * a.block_bytes},
            {"dst_key", BufferRole::output, DType::u8, a.num_blocks * a.block_bytes},
            {"dst_value", BufferRole::output, DType::u8, a.num_blocks * a.block_bytes},
            {"pairs", BufferRole::input, a.pairs_i64 ? DType::i64 : DType::i32, 2 * a.pairs,
             std::max<std::int64_t>(std::min(a.num_blocks, a.src_blocks), 1)}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<CopyBlocksProblem>();
    for (std::size_t i = 0; i < 5; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.pairs));
    out.add(static_cast<long long>(a.block_bytes));
    out.add(int(a.pairs_i64));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5 || !b[0] || !b[1] || !b[2] || !b[3] || !b[4])
      return invalid_argument("copy_blocks: the reference takes src_key, src_value, dst_key, dst_value, pairs");
    const auto a = p.as<CopyBlocksProblem>();
    for (std::int64_t i = 0; i < a.pairs; ++i) {
      const std::int64_t src = read_index(b[4], a.pairs_i64 != 0, 2 * i), dst = read_index(b[4], a.pairs_i64 != 0, 2 * i + 1);
      if (src < 0 || src >= a.src_blocks || dst < 0 || dst >= a.num_blocks)
        return invalid_argument("copy_blocks: pair " + std::to_string(i) + " names a block outside its pool");
      for (int c = 0; c < 2; ++c) {
        const auto* from = static_cast<const unsigned char*>(b[std::size_t(c)]);
        auto* to = static_cast<unsigned char*>(b[std::size_t(c) + 2]);
        std::memmove(to + dst * a.block_bytes, from + src * a.block_bytes, std::size_t(a.block_bytes));
      }
    }
    return {};
  }
};

// ---- merge_state ----

class MergeState final : public Family {
 public:
  std::string_view name() const override { return "merge_state"; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {{"dtype", {}, {"f16", "bf16"}, "element type of the states' v"}};
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = MergeStateProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        bucketed(&P::rows, "rows", "tokens * heads"),
        key(&P::head_dim, "head_dim", "elements of each row of v")});
    return fields;
  }
  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"paged_attention/paged_cache.cuh\"\n";
    r.name_expression = std::string("kiln::paged::merge_state<") + device_type(*params.get_str("dtype")) + ">";
    return r;
  }
  std::vector<Params> catalog() const override {
    return {Params{{"dtype", std::string("f16")}}, Params{{"dtype", std::string("bf16")}}};
  }
  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<MergeStateProblem>();
    KILN_TRY(dtype_matches(name(), params, p));
    if (a.rows < 0 || a.head_dim <= 0 || a.head_dim % 8)
      return shape_mismatch("merge_state: head_dim must be a positive multiple of 8");
    if (p.alignment < 16) return invalid_argument("merge_state: v_a, v_b and v_out must be 16-byte aligned");
    if (a.rows > 0x7fffffff || a.head_dim > 0x7fffffff) return invalid_argument("merge_state: rows must stay below 2^31");
    return {};
  }
  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    const auto a = p.as<MergeStateProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>((a.rows + 3) / 4, 1));
    g.block.x = 128;
    return g;
  }
  Params heuristic(const Problem& p) const override { return Params{{"dtype", std::string(dtype_param(p.dtype))}}; }
  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    return {Problem::of(dtype, 16, MergeStateProblem{.rows = 32 * 32, .head_dim = 128}),
            Problem::of(dtype, 16, MergeStateProblem{.rows = 7 * 8, .head_dim = 264})};
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<MergeStateProblem>();
    return {{"v_a", BufferRole::input, p.dtype, a.rows * a.head_dim},
            {"s_a", BufferRole::input, DType::f32, a.rows},
            {"v_b", BufferRole::input, p.dtype, a.rows * a.head_dim},
            {"s_b", BufferRole::input, DType::f32, a.rows},
            {"v_out", BufferRole::output, p.dtype, a.rows * a.head_dim},
            {"s_out", BufferRole::output, DType::f32, a.rows}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<MergeStateProblem>();
    for (std::size_t i = 0; i < 6; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.rows));
    out.add(int(a.head_dim));
  }
  // In fp64 from the stored values; v_out may alias v_a or v_b (each element is read before it is
  // written), as the kernel allows.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 6 || !b[0] || !b[1] || !b[2] || !b[3] || !b[4] || !b[5])
      return invalid_argument("merge_state: the reference takes v_a, s_a, v_b, s_b, v_out, s_out");
    const auto a = p.as<MergeStateProblem>();
    const double ninf = -std::numeric_limits<double>::infinity();
    for (std::int64_t r = 0; r < a.rows; ++r) {
      const double la = static_cast<const float*>(b[1])[r], lb = static_cast<const float*>(b[3])[r];
      const double m = std::max(la, lb);
      const bool empty = m == ninf;
      const double wa = empty || la == ninf ? 0 : std::exp(la - m), wb = empty || lb == ninf ? 0 : std::exp(lb - m);
      const double sum = wa + wb;
      for (std::int64_t c = 0; c < a.head_dim; ++c) {
        const std::int64_t at = r * a.head_dim + c;
        const double v = empty ? 0.0
                               : (wa * load_as_double(b[0], p.dtype, at) + wb * load_as_double(b[2], p.dtype, at)) / sum;
        store_from_double(b[4], p.dtype, at, v);
      }
      static_cast<float*>(b[5])[r] = empty ? -std::numeric_limits<float>::infinity() : float(m + std::log(sum));
    }
    return {};
  }
};

// ---- paged_decode ----

constexpr std::int64_t k_sm80_smem = 163 * 1024, k_sm90_smem = 227 * 1024;

// The head dims the paged decode's catalog holds (head_dim_v equal): the heuristic's for the
// standard models; the split kernel takes the others too, compiled on first use.
constexpr std::int64_t k_paged_catalog_dims[] = {64, 128, 256};

class PagedDecode final : public Family {
 public:
  std::string_view name() const override { return "paged_decode"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block_n", {32, 64, 128}, {}, "keys per K/V tile"},
        {"dtype", {}, {"f16", "bf16"}, "element type of q and the caches"},
        {"head_dim", {64, 80, 96, 128, 192, 256}, {}, "elements per head of q, k and v"},
        {"key_warps", {1, 2, 4}, {}, "warps dividing each K/V tile's keys, merged at the end"},
        {"warps", {1, 2, 4, 8}, {}, "warps per block along the rows, 16 packed (query, head) rows each"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = PagedDecodeProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        key(&P::batch, "batch", "requests"),
        bucketed(&P::seqlen_q, "seqlen_q", "queries per request (varlen: the most)"),
        key(&P::max_seq_len, "max_seq_len", "keys of the longest request"),
        value(&P::total_q, "total_q", "query tokens (rows of q)"),
        key(&P::heads, "heads", "query heads"),
        key(&P::kv_heads, "kv_heads", "key/value heads (divides heads)"),
        key(&P::head_dim, "head_dim", "elements per head of q, k and v"),
        key(&P::varlen, "varlen", "1: queries packed through cu_seqlens_q"),
        value(&P::num_blocks, "num_blocks", "blocks of each cache"),
        key(&P::page_size, "page_size", "tokens per block"),
        value(&P::max_blocks, "max_blocks", "columns of block_tables"),
        value(&P::window_left, "window_left", "keys left of the diagonal seen; -1 unbounded"),
        value(&P::window_right, "window_right", "keys right of the diagonal seen; -1 unbounded, 0 causal"),
        key(&P::splits, "splits", "key ranges each row block's keys are divided into"),
        value(&P::scale, "scale", "multiplies Q K^T"),
        value(&P::softcap, "softcap", "> 0: scores become softcap * tanh(score / softcap)"),
        value(&P::overlap_previous, "overlap_previous",
              "1: the kernel before it in the stream writes nothing it reads: it runs beside that kernel")});
    return fields;
  }
  // The split kernel waits (griddepcontrol.wait) for the previous kernel before it reads anything,
  // unless the problem says that kernel writes nothing it reads (overlap_previous); then it waits
  // before it ends. It lets the next kernel (attention_combine, which waits) launch at its start.
  bool programmatic_launch() const override { return true; }

  // Without cu_seqlens_q, q holds batch * seqlen_q rows: the bucket's instance keeps that.
  Problem tuning_problem(const Problem& problem) const override {
    Problem out = Family::tuning_problem(problem);
    auto a = out.as<PagedDecodeProblem>();
    if (!a.varlen) {
      a.total_q = a.batch * a.seqlen_q;
      out.set(a);
    }
    return out;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto d = *params.get_int("head_dim");
    if (!attention_head_dims_supported(d, d))
      return invalid_argument("paged_decode: no kernel for head_dim " + std::to_string(d));
    if (smem(params) > k_sm90_smem)
      return invalid_argument("paged_decode: the variant needs more than 227 KiB of shared memory");
    return attention_splitkv_check_warps("paged_decode", int(*params.get_int("warps")),
                                         int(*params.get_int("key_warps")), int(*params.get_int("block_n")));
  }
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return smem(params) <= (arch.capability == 0 || arch.capability >= 90 ? k_sm90_smem : k_sm80_smem);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const std::string d = std::to_string(*params.get_int("head_dim"));
    Rendered r;
    r.source = "#include \"attention/attention_splitkv.cuh\"\n";
    r.name_expression = std::string("kiln::attention::attention_splitkv<") + device_type(*params.get_str("dtype")) +
                        ", " + d + ", " + d + ", " + std::to_string(*params.get_int("warps")) + ", " +
                        std::to_string(*params.get_int("block_n")) + ", true, " +
                        std::to_string(*params.get_int("key_warps")) + ">";
    return r;
  }

  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f16", "bf16"})
      for (std::int64_t d : k_paged_catalog_dims)
        for (int w : {1, 2, 4, 8}) out.push_back(make(dtype, d, w, attention_tile(d, d).block_n));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<PagedDecodeProblem>();
    KILN_TRY(check_shape(a));
    KILN_TRY(dtype_matches(name(), params, p));
    if (a.head_dim != *params.get_int("head_dim"))
      return invalid_argument("paged_decode: the kernel's head_dim differs from the problem's");
    if (p.alignment < 16) return invalid_argument("paged_decode: q and the caches must be 16-byte aligned");
    if (p.cc && p.cc < 80) return invalid_argument("paged_decode: the kernels need compute capability 8.0 or later");
    if (smem(params) > (p.cc == 0 || p.cc >= 90 ? k_sm90_smem : k_sm80_smem))
      return invalid_argument("paged_decode: the variant needs more shared memory than the device grants a block");
    if (blocks_x(params, a) > 0x7fffffff)
      return invalid_argument("paged_decode: too many row blocks times splits for one grid");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto a = p.as<PagedDecodeProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(blocks_x(params, a), 1));
    g.grid.y = std::uint32_t(std::max<std::int64_t>(a.kv_heads, 1));
    g.grid.z = std::uint32_t(std::max<std::int64_t>(a.batch, 1));
    g.block.x = std::uint32_t(32 * *params.get_int("warps") * *params.get_int("key_warps"));
    g.shared_bytes = smem(params);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto a = p.as<PagedDecodeProblem>();
    const std::string dtype = dtype_param(p.dtype);
    if (!attention_head_dims_supported(a.head_dim, a.head_dim)) return make(dtype, 128, 1, 64);
    const std::int64_t group = a.kv_heads > 0 ? std::max<std::int64_t>(a.heads / a.kv_heads, 1) : 1;
    return make(dtype, a.head_dim, attention_splitkv_warps(a.seqlen_q * group), attention_tile(a.head_dim, a.head_dim).block_n);
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    const auto a = p.as<PagedDecodeProblem>();
    if (!attention_head_dims_supported(a.head_dim, a.head_dim)) return {heuristic(p)};
    std::vector<Params> out;
    for (int w : {1, 2, 4, 8})
      for (int bn : {32, 64, 128})
        for (int kw : {1, 2, 4}) {
          if (a.head_dim / 2 + bn / 2 > 160) continue;  // as the contiguous split kernel's tuning space
          Params c = make(dtype_param(p.dtype), a.head_dim, w, bn, kw);
          if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
        }
    if (out.empty()) out.push_back(heuristic(p));
    return out;
  }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    struct S {
      std::int64_t batch, heads, kv_heads, lq, max_len, d, page, splits;
    };
    const S shapes[] = {{2, 32, 8, 1, 2048, 128, 16, 4}, {3, 8, 2, 3, 700, 64, 1, 2}, {2, 16, 2, 1, 1000, 128, 8, 3},
                        {1, 8, 8, 2, 300, 256, 128, 1}, {4, 32, 8, 1, 4096, 128, 64, 2}, {1, 32, 8, 1, 8192, 128, 32, 16}};
    std::vector<Problem> out;
    for (const S& s : shapes) {
      PagedDecodeProblem a;
      a.batch = s.batch;
      a.seqlen_q = s.lq;
      a.max_seq_len = s.max_len;
      a.total_q = s.batch * s.lq;
      a.heads = s.heads;
      a.kv_heads = s.kv_heads;
      a.head_dim = s.d;
      a.page_size = s.page;
      a.max_blocks = (s.max_len + s.page - 1) / s.page;
      a.num_blocks = a.max_blocks * s.batch + 3;
      a.splits = s.splits;
      a.scale = 1.0 / std::sqrt(double(s.d));
      out.push_back(Problem::of(dtype, 16, a));
    }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<PagedDecodeProblem>();
    const std::int64_t cache = a.num_blocks * a.page_size * a.kv_heads * a.head_dim;
    const std::int64_t rows = a.splits * a.total_q * a.heads;
    return {{"q", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim},
            {"k_cache", BufferRole::input, p.dtype, cache},
            {"v_cache", BufferRole::input, p.dtype, cache},
            {"cu_seqlens_q", BufferRole::input, DType::i32, a.batch + 1, a.varlen ? a.total_q + 1 : 1},
            {"block_tables", BufferRole::input, DType::i32, a.batch * a.max_blocks, std::max<std::int64_t>(a.num_blocks, 1)},
            {"seq_lens", BufferRole::input, DType::i32, a.batch, a.max_seq_len + 1},
            {"o_part", BufferRole::output, DType::f32, rows * a.head_dim},
            {"lse_part", BufferRole::output, DType::f32, rows}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<PagedDecodeProblem>();
    auto at = [&](std::size_t i) { return i < b.size() ? b[i] : static_cast<void*>(nullptr); };
    out.add(at(0));  // q
    out.add(at(1));  // k_cache
    out.add(at(2));  // v_cache
    out.add(at(3));  // cu_seqlens_q
    out.add(static_cast<void*>(nullptr));  // cu_seqlens_k: unused when paged
    out.add(at(6));  // o_part
    out.add(at(7));  // lse_part
    out.add(int(a.seqlen_q));
    out.add(int(a.max_seq_len));
    out.add(int(a.total_q));
    out.add(int(a.heads));
    out.add(int(a.kv_heads));
    out.add(int(a.window_left));
    out.add(int(a.window_right));
    out.add(int(a.varlen));
    out.add(int(a.splits));
    out.add(float(a.scale));
    out.add(float(a.softcap));
    out.add(at(4));  // block_tables
    out.add(at(5));  // seq_lens
    out.add(int(a.max_blocks));
    int shift = 0;
    while ((std::int64_t(1) << shift) < a.page_size) ++shift;
    out.add(shift);
    out.add(int(a.overlap_previous));
  }

  // The contiguous split kernel's reference (attention_splitkv) on the requests' keys gathered
  // from their pages: the same row blocks and key ranges, each split's partial in fp64.
  Status cpu_reference(const Params& params, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 8 || !b[0] || !b[1] || !b[2] || !b[4] || !b[5] || !b[6] || !b[7])
      return invalid_argument("paged_decode: the reference takes q, k_cache, v_cache, cu_seqlens_q, block_tables, "
                              "seq_lens, o_part, lse_part");
    const auto a = p.as<PagedDecodeProblem>();
    KILN_TRY(check_shape(a));
    if (a.varlen && !b[3]) return invalid_argument("paged_decode: varlen needs cu_seqlens_q");
    static const Family* split = Registry::global().find("attention_splitkv");
    if (!split) return internal_error("paged_decode: attention_splitkv is not registered");
    const auto* tables = static_cast<const std::int32_t*>(b[4]);
    const auto* lens = static_cast<const std::int32_t*>(b[5]);
    const std::int64_t row = a.kv_heads * a.head_dim, esize = std::int64_t(dtype_size(p.dtype));
    std::vector<std::int32_t> cu_k{0}, cu_q{0};
    for (std::int64_t s = 0; s < a.batch; ++s) {
      if (lens[s] < 0 || lens[s] > a.max_blocks * a.page_size)
        return shape_mismatch("paged_decode: request " + std::to_string(s) + " has more keys than its table holds");
      cu_k.push_back(cu_k.back() + lens[s]);
      cu_q.push_back(a.varlen ? static_cast<const std::int32_t*>(b[3])[s + 1] : std::int32_t((s + 1) * a.seqlen_q));
    }
    std::vector<unsigned char> k(std::size_t(cu_k.back() * row * esize)), v(k.size());
    for (std::int64_t s = 0; s < a.batch; ++s)
      for (std::int64_t j = 0; j < lens[s]; ++j) {
        const std::int64_t block = tables[s * a.max_blocks + j / a.page_size];
        if (block < 0 || block >= a.num_blocks)
          return invalid_argument("paged_decode: request " + std::to_string(s) + " names block " + std::to_string(block) +
                                  " outside the cache");
        const std::int64_t slot = block * a.page_size + j % a.page_size;
        const std::size_t n = std::size_t(row * esize), to = std::size_t((cu_k[std::size_t(s)] + j) * row * esize);
        std::memcpy(k.data() + to, static_cast<const unsigned char*>(b[1]) + slot * row * esize, n);
        std::memcpy(v.data() + to, static_cast<const unsigned char*>(b[2]) + slot * row * esize, n);
      }
    AttentionSplitKvProblem sp{.batch = a.batch,
                               .seqlen_q = a.seqlen_q,
                               .seqlen_k = a.max_seq_len,
                               .total_q = a.total_q,
                               .total_k = cu_k.back(),
                               .heads = a.heads,
                               .kv_heads = a.kv_heads,
                               .head_dim = a.head_dim,
                               .head_dim_v = a.head_dim,
                               .varlen = 1,
                               .window_left = a.window_left,
                               .window_right = a.window_right,
                               .splits = a.splits,
                               .scale = a.scale,
                               .softcap = a.softcap};
    const Params sparams{{"dtype", *params.get_str("dtype")}, {"head_dim", a.head_dim}, {"head_dim_v", a.head_dim},
                         {"warps", *params.get_int("warps")}, {"block_n", *params.get_int("block_n")},
                         {"key_warps", *params.get_int("key_warps")}};
    void* sb[7] = {b[0], k.data(), v.data(), cu_q.data(), cu_k.data(), b[6], b[7]};
    return split->cpu_reference(sparams, Problem::of(p.dtype, 16, sp), sb);
  }

 private:
  // key_warps 0: the heuristic's for the warps and block_n.
  static Params make(const std::string& dtype, std::int64_t d, int warps, int block_n, int key_warps = 0) {
    if (key_warps == 0) key_warps = attention_splitkv_key_warps(warps, block_n);
    return Params{{"block_n", std::int64_t(block_n)}, {"dtype", dtype}, {"head_dim", d},
                  {"key_warps", std::int64_t(key_warps)}, {"warps", std::int64_t(warps)}};
  }
  static std::uint32_t smem(const Params& params) {
    const auto d = *params.get_int("head_dim");
    return attention_smem_bytes(d, d, int(*params.get_int("warps")), int(*params.get_int("block_n")));
  }
  static std::int64_t blocks_x(const Params& params, const PagedDecodeProblem& a) {
    const std::int64_t bm = 16 * *params.get_int("warps");
    const std::int64_t rows = a.seqlen_q * (a.kv_heads > 0 ? a.heads / a.kv_heads : 1);
    return std::max<std::int64_t>((rows + bm - 1) / bm, 1) * a.splits;
  }
  static Status check_shape(const PagedDecodeProblem& a) {
    if (a.batch < 0 || a.seqlen_q < 0 || a.max_seq_len < 0 || a.total_q < 0 || a.num_blocks < 0 || a.max_blocks < 0)
      return shape_mismatch("paged_decode: sizes must be non-negative");
    if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads)
      return shape_mismatch("paged_decode: heads must be a positive multiple of kv_heads");
    if (a.head_dim <= 0) return shape_mismatch("paged_decode: head_dim must be positive");
    if (!paged_page_size_supported(a.page_size))
      return invalid_argument("paged_decode: page_size must be 1, 8, 16, 32, 64 or 128, not " +
                              std::to_string(a.page_size));
    if (a.max_seq_len > a.max_blocks * a.page_size)
      return shape_mismatch("paged_decode: max_seq_len " + std::to_string(a.max_seq_len) + " is past the " +
                            std::to_string(a.max_blocks) + " blocks of " + std::to_string(a.page_size) +
                            " tokens a block table holds");
    if (a.window_left < -1 || a.window_right < -1)
      return invalid_argument("paged_decode: window sizes must be -1 (unbounded) or non-negative");
    if (a.splits < 1 || a.splits > 1024) return invalid_argument("paged_decode: splits must be 1 to 1024");
    if (a.overlap_previous != 0 && a.overlap_previous != 1)
      return invalid_argument("paged_decode: overlap_previous must be 0 or 1");
    if (!std::isfinite(a.scale) || !std::isfinite(a.softcap) || a.softcap < 0)
      return invalid_argument("paged_decode: scale must be finite and softcap finite and non-negative");
    if (!a.varlen && a.total_q != a.batch * a.seqlen_q)
      return shape_mismatch("paged_decode: without cu_seqlens_q, q has batch * seqlen_q rows");
    const std::int64_t lim = 0x7fffffff;
    if (a.batch > 65535 || a.kv_heads > 65535 || a.seqlen_q * a.heads > lim || a.max_seq_len > lim ||
        a.total_q * a.heads > lim || a.num_blocks * a.page_size > lim || a.batch * a.max_blocks > lim)
      return invalid_argument("paged_decode: batch and kv_heads up to 65535, cache slots, table entries and rows below "
                              "2^31");
    return {};
  }
};

}  // namespace
}  // namespace kiln::families

void kiln_register_family_paged_attention(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::ReshapeAndCache>());
  (void)r.add(std::make_shared<kiln::families::CopyBlocks>());
  (void)r.add(std::make_shared<kiln::families::MergeState>());
  (void)r.add(std::make_shared<kiln::families::PagedDecode>());
}
