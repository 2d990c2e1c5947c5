#include "families/attention/attention_splitkv.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {

std::int64_t attention_splitkv_blocks_per_sm(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n,
                                             std::int64_t cc, int key_warps) {
  if (cc == 0) cc = 90;
  // Shared memory and threads an SM has: 8.6, 8.9 and 12.x are the smaller consumer parts.
  const bool small = cc == 86 || cc == 87 || cc == 89 || cc >= 120;
  const std::int64_t sm_smem = cc == 80 ? 164 * 1024 : small ? 100 * 1024 : 228 * 1024;
  const std::int64_t sm_threads = small ? 1536 : 2048;
  const std::int64_t block_smem = std::int64_t(attention_smem_bytes(head_dim, head_dim_v, warps, block_n)) +
                                  2 * block_n * 4 + 1024;  // the paged slot ring, the per-block reserve
  const std::int64_t block_warps = std::int64_t(warps) * key_warps;
  const std::int64_t by_regs = 65536 / (block_warps * 32 * 256);
  return std::max<std::int64_t>(1, std::min({sm_smem / block_smem, sm_threads / (32 * block_warps), by_regs}));
}

std::int64_t attention_split_count(std::int64_t row_blocks, std::int64_t tiles, std::int64_t slots) {
  if (row_blocks <= 0 || tiles <= 1 || slots <= 0) return 1;
  // The attention op asks on every call, a model's layers with the same sizes one after another:
  // the last answer of this thread is kept, the search runs when the sizes change.
  thread_local std::int64_t last[4] = {0, 0, 0, 0};
  if (last[0] == row_blocks && last[1] == tiles && last[2] == slots) return last[3];
  const std::int64_t most = std::min(tiles, k_attention_max_splits);
  std::int64_t best = 1, best_cost = std::numeric_limits<std::int64_t>::max();
  for (std::int64_t s = 1; s <= most; ++s) {
    const std::int64_t waves = (row_blocks * s + slots - 1) / slots;
    const std::int64_t cost = waves * ((tiles + s - 1) / s + 1) + (s > 1 ? 1 : 0);
    if (cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  last[0] = row_blocks, last[1] = tiles, last[2] = slots, last[3] = best;
  return best;
}

std::int64_t attention_decode_splits(const AttentionProblem& a, std::int64_t sm_count, std::int64_t cc) {
  if (!attention_head_dims_supported(a.head_dim, a.head_dim_v) || a.heads <= 0 || a.kv_heads <= 0 ||
      a.heads % a.kv_heads || a.batch <= 0)
    return 0;
  if (a.seqlen_q < 1 || a.seqlen_q > k_attention_decode_max_q) return 0;
  const std::int64_t bn = attention_tile(a.head_dim, a.head_dim_v).block_n;
  const std::int64_t tiles = (a.seqlen_k + bn - 1) / bn;
  if (tiles < 2 * k_attention_min_split_tiles) return 0;
  const std::int64_t sms = sm_count > 0 ? sm_count : 132;
  const std::int64_t rows = a.seqlen_q * (a.heads / a.kv_heads);
  const int warps = attention_splitkv_warps(rows);
  const std::int64_t blocks = a.batch * a.kv_heads * ((rows + 16 * warps - 1) / (16 * warps));
  return attention_split_count(blocks, tiles,
                               sms * attention_splitkv_blocks_per_sm(a.head_dim, a.head_dim_v, warps, int(bn), cc,
                                                                     attention_splitkv_key_warps(warps, int(bn))));
}

AttentionSplitKvProblem attention_splitkv_problem(const AttentionProblem& a, std::int64_t splits) {
  return {.batch = a.batch,
          .seqlen_q = a.seqlen_q,
          .seqlen_k = a.seqlen_k,
          .total_q = a.total_q,
          .total_k = a.total_k,
          .heads = a.heads,
          .kv_heads = a.kv_heads,
          .head_dim = a.head_dim,
          .head_dim_v = a.head_dim_v,
          .varlen = a.varlen,
          .window_left = a.window_left,
          .window_right = a.window_right,
          .splits = splits,
          .scale = a.scale,
          .softcap = a.softcap};
}

AttentionCombineProblem attention_combine_problem(const AttentionProblem& a, std::int64_t splits) {
  return {.batch = a.batch,
          .seqlen_q = a.seqlen_q,
          .total_q = a.total_q,
          .heads = a.heads,
          .head_dim_v = a.head_dim_v,
          .varlen = a.varlen,
          .splits = splits};
}

std::int64_t attention_splitkv_workspace_elements(const AttentionProblem& a, std::int64_t splits) {
  return splits * a.total_q * a.heads * (a.head_dim_v + 1);
}

int attention_splitkv_warps(std::int64_t rows) {
  int w = 1;
  while (w < 8 && 16 * w < rows) w *= 2;
  return w;
}

int attention_splitkv_key_warps(int warps, int block_n) { return warps <= 2 && block_n % 32 == 0 ? 2 : 1; }

Status attention_splitkv_check_warps(const char* family, int warps, int key_warps, int block_n) {
  if (block_n % (16 * key_warps))
    return invalid_argument(std::string(family) + ": block_n " + std::to_string(block_n) + " does not divide into " +
                            std::to_string(key_warps) + " key warps of whole 16-key steps");
  if (warps * key_warps > 8)
    return invalid_argument(std::string(family) + ": warps times key_warps must be at most 8");
  return {};
}

namespace {

constexpr std::int64_t k_sm80_smem = 163 * 1024, k_sm90_smem = 227 * 1024;
std::int64_t max_smem(std::int64_t cc) { return cc == 0 || cc >= 90 ? k_sm90_smem : k_sm80_smem; }

Status check_split_shape(const AttentionSplitKvProblem& a) {
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.total_q < 0 || a.total_k < 0)
    return shape_mismatch("attention_splitkv: sizes must be non-negative");
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads)
    return shape_mismatch("attention_splitkv: heads must be a positive multiple of kv_heads");
  if (a.head_dim <= 0 || a.head_dim_v <= 0) return shape_mismatch("attention_splitkv: head dims must be positive");
  if (a.window_left < -1 || a.window_right < -1)
    return invalid_argument("attention_splitkv: window sizes must be -1 (unbounded) or non-negative");
  if (a.splits < 1 || a.splits > 1024) return invalid_argument("attention_splitkv: splits must be 1 to 1024");
  if (!std::isfinite(a.scale) || !std::isfinite(a.softcap) || a.softcap < 0)
    return invalid_argument("attention_splitkv: scale must be finite and softcap finite and non-negative");
  if (!a.varlen && (a.total_q != a.batch * a.seqlen_q || a.total_k != a.batch * a.seqlen_k))
    return shape_mismatch("attention_splitkv: padded layouts have batch * seqlen tokens");
  return {};
}

// One row's softmax over keys [lo, hi) of sequence (q0, k0), query i, head h, from fp64 inputs
// already converted; acc gets the normalized output, the return value the natural-log lse.
double attend_row(const AttentionSplitKvProblem& a, const std::vector<double>& qd, const std::vector<double>& kd,
                  const std::vector<double>& vd, std::int64_t lo, std::int64_t hi, std::vector<double>& acc) {
  const std::int64_t d = a.head_dim, dv = a.head_dim_v;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::fill(acc.begin(), acc.end(), 0.0);
  if (lo >= hi) return neg_inf;
  std::vector<double> sc(std::size_t(hi - lo));
  double mx = neg_inf;
  for (std::int64_t j = lo; j < hi; ++j) {
    double dot = 0;
    for (std::int64_t c = 0; c < d; ++c) dot += qd[std::size_t(c)] * kd[std::size_t(j * d + c)];
    double s = dot * a.scale;
    if (a.softcap > 0) s = a.softcap * std::tanh(s / a.softcap);
    sc[std::size_t(j - lo)] = s;
    mx = std::max(mx, s);
  }
  double sum = 0;
  for (std::int64_t j = lo; j < hi; ++j) {
    const double p = std::exp(sc[std::size_t(j - lo)] - mx);
    sum += p;
    for (std::int64_t c = 0; c < dv; ++c) acc[std::size_t(c)] += p * vd[std::size_t(j * dv + c)];
  }
  for (double& x : acc) x /= sum;
  return mx + std::log(sum);
}

class AttentionSplitKv final : public Family {
 public:
  std::string_view name() const override { return "attention_splitkv"; }
  int version() const override { return 3; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block_n", {32, 64, 128}, {}, "keys per K/V tile"},
        {"dtype", {}, {"f16", "bf16"}, "element type of q, k and v"},
        {"head_dim", {64, 80, 96, 128, 192, 256}, {}, "elements per head of q and k"},
        {"head_dim_v", {64, 80, 96, 128, 192, 256}, {}, "elements per head of v and out"},
        {"key_warps", {1, 2, 4}, {}, "warps dividing each K/V tile's keys, merged at the end"},
        {"warps", {1, 2, 4, 8}, {}, "warps per block along the rows, 16 packed (query, head) rows each"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = AttentionSplitKvProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        key(&P::batch, "batch", "sequences"),
        bucketed(&P::seqlen_q, "seqlen_q", "queries per sequence (varlen: the longest)"),
        key(&P::seqlen_k, "seqlen_k", "keys per sequence (varlen: the longest)"),
        value(&P::total_q, "total_q", "query tokens (rows of q)"),
        value(&P::total_k, "total_k", "key tokens (rows of k and v)"),
        key(&P::heads, "heads", "query heads"),
        key(&P::kv_heads, "kv_heads", "key/value heads (divides heads)"),
        key(&P::head_dim, "head_dim", "elements per head of q and k"),
        key(&P::head_dim_v, "head_dim_v", "elements per head of v and out"),
        key(&P::varlen, "varlen", "1: packed sequences (cu_seqlens)"),
        value(&P::window_left, "window_left", "keys left of the diagonal seen; -1 unbounded"),
        value(&P::window_right, "window_right", "keys right of the diagonal seen; -1 unbounded"),
        key(&P::splits, "splits", "key ranges each row block's keys are divided into"),
        value(&P::scale, "scale", "multiplies Q K^T"),
        value(&P::softcap, "softcap", "> 0: scores become softcap * tanh(score / softcap)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto d = *params.get_int("head_dim"), dv = *params.get_int("head_dim_v");
    if (!attention_head_dims_supported(d, dv))
      return invalid_argument("attention_splitkv: no kernel for head_dim " + std::to_string(d) + " with head_dim_v " +
                              std::to_string(dv));
    if (smem(params) > k_sm90_smem)
      return invalid_argument("attention_splitkv: the variant needs more than 227 KiB of shared memory");
    return attention_splitkv_check_warps("attention_splitkv", int(*params.get_int("warps")),
                                         int(*params.get_int("key_warps")), int(*params.get_int("block_n")));
  }

  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return smem(params) <= max_smem(arch.capability);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"attention/attention_splitkv.cuh\"\n";
    r.name_expression = std::string("kiln::attention::attention_splitkv<") + device_type(*params.get_str("dtype")) +
                        ", " + std::to_string(*params.get_int("head_dim")) + ", " +
                        std::to_string(*params.get_int("head_dim_v")) + ", " +
                        std::to_string(*params.get_int("warps")) + ", " + std::to_string(*params.get_int("block_n")) +
                        ", false, " + std::to_string(*params.get_int("key_warps")) + ">";
    return r;
  }

  // Every warp count the heuristic picks, for every dtype and head-dim pair.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f16", "bf16"})
      for (const auto& [d, dv] : k_attention_head_dims)
        for (int w : {1, 2, 4, 8}) out.push_back(make(dtype, d, dv, w, attention_tile(d, dv).block_n));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    KILN_TRY(check_split_shape(a));
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype("attention_splitkv: kernel is for " + std::string(dtype_name(dtype)) + ", tensors are " +
                               dtype_name(p.dtype));
    if (a.head_dim != *params.get_int("head_dim") || a.head_dim_v != *params.get_int("head_dim_v"))
      return invalid_argument("attention_splitkv: the kernel's head dims differ from the problem's");
    if (p.alignment < 16) return invalid_argument("attention_splitkv: q, k and v must be 16-byte aligned");
    if (p.cc && p.cc < 80) return invalid_argument("attention_splitkv: the kernels need compute capability 8.0 or later");
    if (smem(params) > max_smem(p.cc))
      return invalid_argument("attention_splitkv: the variant needs more shared memory than the device grants a block");
    const std::int64_t lim = 0x7fffffff;
    if (a.batch > 65535 || a.kv_heads > 65535 || a.seqlen_q * a.heads > lim || a.seqlen_k > lim || a.total_q > lim ||
        a.total_k > lim || blocks_x(params, a) > lim)
      return invalid_argument("attention_splitkv: batch and kv_heads up to 65535, token and row counts below 2^31");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>(blocks_x(params, a), 1));
    g.grid.y = std::uint32_t(std::max<std::int64_t>(a.kv_heads, 1));
    g.grid.z = std::uint32_t(std::max<std::int64_t>(a.batch, 1));
    g.block.x = std::uint32_t(32 * *params.get_int("warps") * *params.get_int("key_warps"));
    g.shared_bytes = smem(params);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    const std::string dtype = p.dtype == DType::bf16 ? "bf16" : "f16";
    if (!attention_head_dims_supported(a.head_dim, a.head_dim_v)) return make(dtype, 128, 128, 1, 64);
    const std::int64_t group = a.kv_heads > 0 ? std::max<std::int64_t>(a.heads / a.kv_heads, 1) : 1;
    return make(dtype, a.head_dim, a.head_dim_v, attention_splitkv_warps(a.seqlen_q * group),
                attention_tile(a.head_dim, a.head_dim_v).block_n);
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    if (!attention_head_dims_supported(a.head_dim, a.head_dim_v)) return {heuristic(p)};
    const std::string dtype = p.dtype == DType::bf16 ? "bf16" : "f16";
    std::vector<Params> out;
    for (int w : {1, 2, 4, 8})
      for (int bn : {32, 64, 128})
        for (int kw : {1, 2, 4}) {
          if (a.head_dim_v / 2 + bn / 2 > 160) continue;  // as the one-pass kernel's tuning space
          Params c = make(dtype, a.head_dim, a.head_dim_v, w, bn, kw);
          if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
        }
    if (out.empty()) out.push_back(heuristic(p));
    return out;
  }

  // Decode shapes without masks (every split of every row sees keys), then the benchmark's.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    struct S {
      std::int64_t batch, heads, kv_heads, lq, lk, d, dv, splits;
    };
    const S shapes[] = {{1, 32, 8, 1, 4096, 128, 128, 8}, {2, 8, 2, 4, 1024, 64, 64, 3},
                        {1, 4, 4, 16, 600, 96, 96, 2},    {1, 8, 1, 2, 700, 192, 128, 2},
                        {1, 4, 2, 1, 500, 256, 256, 2},   {1, 4, 4, 1, 777, 80, 80, 3},
                        {1, 16, 2, 1, 2048, 192, 192, 4}, {1, 32, 8, 1, 32768, 128, 128, 32},
                        {8, 32, 8, 1, 32768, 128, 128, 4}};
    std::vector<Problem> out;
    for (const S& s : shapes) {
      AttentionSplitKvProblem a;
      a.batch = s.batch;
      a.seqlen_q = s.lq;
      a.seqlen_k = s.lk;
      a.total_q = s.batch * s.lq;
      a.total_k = s.batch * s.lk;
      a.heads = s.heads;
      a.kv_heads = s.kv_heads;
      a.head_dim = s.d;
      a.head_dim_v = s.dv;
      a.splits = s.splits;
      a.scale = 1.0 / std::sqrt(double(s.d));
      out.push_back(Problem::of(dtype, 16, a));
    }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    const std::int64_t bound = a.varlen ? std::max<std::int64_t>(a.total_q, a.total_k) + 1 : 1;
    const std::int64_t rows = a.splits * a.total_q * a.heads;
    return {{"q", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim},
            {"k", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim},
            {"v", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim_v},
            {"cu_seqlens_q", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"cu_seqlens_k", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"o_part", BufferRole::output, DType::f32, rows * a.head_dim_v},
            {"lse_part", BufferRole::output, DType::f32, rows}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<AttentionSplitKvProblem>();
    for (std::size_t i = 0; i < 7; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.seqlen_q));
    out.add(int(a.seqlen_k));
    out.add(int(a.total_q));
    out.add(int(a.heads));
    out.add(int(a.kv_heads));
    out.add(int(a.window_left));
    out.add(int(a.window_right));
    out.add(int(a.varlen));
    out.add(int(a.splits));
    out.add(float(a.scale));
    out.add(float(a.softcap));
    out.add(static_cast<void*>(nullptr));  // block_table, seq_lens: the contiguous kernel reads neither
    out.add(static_cast<void*>(nullptr));
    out.add(0);
    out.add(0);
    out.add(0);  // overlap_previous: the split kernel of this family waits for the kernel before it
  }

  // The kernel's division of keys, row block by row block (warps and block_n from params), each
  // split's partial in fp64.
  Status cpu_reference(const Params& params, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7 || !b[0] || !b[1] || !b[2] || !b[5] || !b[6])
      return invalid_argument("attention_splitkv: the reference takes q, k, v, cu_seqlens_q, cu_seqlens_k, o_part, "
                              "lse_part");
    const auto a = p.as<AttentionSplitKvProblem>();
    KILN_TRY(check_split_shape(a));
    if (a.varlen && (!b[3] || !b[4]))
      return invalid_argument("attention_splitkv: varlen needs cu_seqlens_q and cu_seqlens_k");
    const auto* cu_q = static_cast<const std::int32_t*>(b[3]);
    const auto* cu_k = static_cast<const std::int32_t*>(b[4]);
    auto* o_part = static_cast<float*>(b[5]);
    auto* lse_part = static_cast<float*>(b[6]);
    const std::int64_t bm = 16 * *params.get_int("warps"), bn = *params.get_int("block_n");
    const std::int64_t d = a.head_dim, dv = a.head_dim_v, group = a.heads / a.kv_heads;
    std::vector<double> qd(static_cast<std::size_t>(d)), kd, vd, acc(static_cast<std::size_t>(dv));
    for (std::int64_t s = 0; s < a.batch; ++s) {
      std::int64_t q0 = s * a.seqlen_q, lq = a.seqlen_q, k0 = s * a.seqlen_k, lk = a.seqlen_k;
      if (a.varlen) q0 = cu_q[s], lq = cu_q[s + 1] - cu_q[s], k0 = cu_k[s], lk = cu_k[s + 1] - cu_k[s];
      const std::int64_t rows = lq * group, delta = lk - lq;
      for (std::int64_t hk = 0; hk < a.kv_heads; ++hk) {
        kd.resize(std::size_t(lk * d));
        vd.resize(std::size_t(lk * dv));
        for (std::int64_t j = 0; j < lk; ++j) {
          for (std::int64_t c = 0; c < d; ++c)
            kd[std::size_t(j * d + c)] = load_as_double(b[1], p.dtype, ((k0 + j) * a.kv_heads + hk) * d + c);
          for (std::int64_t c = 0; c < dv; ++c)
            vd[std::size_t(j * dv + c)] = load_as_double(b[2], p.dtype, ((k0 + j) * a.kv_heads + hk) * dv + c);
        }
        for (std::int64_t m0 = 0; m0 < rows; m0 += bm) {
          const std::int64_t i_first = m0 / group, i_last = (std::min(m0 + bm, rows) - 1) / group;
          std::int64_t n_end = lk, n_begin = 0;
          if (a.window_right >= 0) n_end = std::min(n_end, i_last + delta + a.window_right + 1);
          if (a.window_left >= 0) n_begin = std::max<std::int64_t>(0, i_first + delta - a.window_left);
          const std::int64_t v_begin = n_begin / bn, v_end = n_end > n_begin ? (n_end + bn - 1) / bn : v_begin;
          const std::int64_t per = (v_end - v_begin + a.splits - 1) / a.splits;
          for (std::int64_t r = m0; r < std::min(m0 + bm, rows); ++r) {
            const std::int64_t i = r / group, h = hk * group + r % group;
            for (std::int64_t c = 0; c < d; ++c)
              qd[std::size_t(c)] = load_as_double(b[0], p.dtype, ((q0 + i) * a.heads + h) * d + c);
            std::int64_t lo = 0, hi = lk;  // the row's visible keys
            if (a.window_left >= 0) lo = std::max(lo, i + delta - a.window_left);
            if (a.window_right >= 0) hi = std::min(hi, i + delta + a.window_right + 1);
            for (std::int64_t sp = 0; sp < a.splits; ++sp) {
              const std::int64_t t0 = std::min(v_end, v_begin + sp * per), t1 = std::min(v_end, t0 + per);
              const double l = attend_row(a, qd, kd, vd, std::max(lo, t0 * bn), std::min(hi, t1 * bn), acc);
              const std::int64_t at = ((sp * a.total_q) + q0 + i) * a.heads + h;
              for (std::int64_t c = 0; c < dv; ++c) o_part[at * dv + c] = float(acc[std::size_t(c)]);
              lse_part[at] = float(l);
            }
          }
        }
      }
    }
    return {};
  }

 private:
  // key_warps 0: the heuristic's for the warps and block_n.
  static Params make(const std::string& dtype, std::int64_t d, std::int64_t dv, int warps, int block_n,
                     int key_warps = 0) {
    if (key_warps == 0) key_warps = attention_splitkv_key_warps(warps, block_n);
    return Params{{"dtype", dtype}, {"head_dim", d}, {"head_dim_v", dv}, {"warps", std::int64_t(warps)},
                  {"key_warps", std::int64_t(key_warps)},
                  {"block_n", std::int64_t(block_n)}};
  }
  static std::uint32_t smem(const Params& params) {
    return attention_smem_bytes(*params.get_int("head_dim"), *params.get_int("head_dim_v"),
                                int(*params.get_int("warps")), int(*params.get_int("block_n")));
  }
  static std::int64_t blocks_x(const Params& params, const AttentionSplitKvProblem& a) {
    const std::int64_t bm = 16 * *params.get_int("warps");
    const std::int64_t rows = a.seqlen_q * (a.kv_heads > 0 ? a.heads / a.kv_heads : 1);
    return std::max<std::int64_t>((rows + bm - 1) / bm, 1) * a.splits;
  }
};

class AttentionCombine final : public Family {
 public:
  std::string_view name() const override { return "attention_combine"; }
  int version() const override { return 3; }
  // Every block waits (griddepcontrol.wait) before it reads a partial, so the combine launches
  // while the split kernel before it still runs.
  bool programmatic_launch() const override { return true; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"dtype", {}, {"f16", "bf16"}, "element type of out"},
        {"head_dim_v", {64, 80, 96, 128, 192, 256}, {}, "elements per head of out"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    using P = AttentionCombineProblem;
    static const std::vector<ProblemField> fields = problem_fields_of<P>({
        key(&P::batch, "batch", "sequences"),
        key(&P::seqlen_q, "seqlen_q", "queries per sequence (varlen: the longest)"),
        bucketed(&P::total_q, "total_q", "query tokens (rows of out)"),
        key(&P::heads, "heads", "query heads"),
        key(&P::head_dim_v, "head_dim_v", "elements per head of out"),
        key(&P::varlen, "varlen", "1: packed sequences (cu_seqlens_q)"),
        key(&P::splits, "splits", "partials per row"),
        value(&P::lse_token_major, "lse_token_major", "1: lse is [total_q, heads] (the paged ops' layout)")});
    return fields;
  }

  // A padded layout's query tokens are batch * seqlen_q, not the bucket's bound on total_q.
  Problem tuning_problem(const Problem& problem) const override {
    Problem out = Family::tuning_problem(problem);
    auto a = out.as<AttentionCombineProblem>();
    if (!a.varlen) {
      a.total_q = a.batch * a.seqlen_q;
      out.set(a);
    }
    return out;
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    r.source = "#include \"attention/attention_splitkv.cuh\"\n";
    r.name_expression = std::string("kiln::attention::attention_combine<") + device_type(*params.get_str("dtype")) +
                        ", " + std::to_string(*params.get_int("head_dim_v")) + ">";
    return r;
  }

  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f16", "bf16"})
      for (std::int64_t dv : {64, 80, 96, 128, 192, 256})
        out.push_back(Params{{"dtype", std::string(dtype)}, {"head_dim_v", dv}});
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionCombineProblem>();
    if (a.batch < 0 || a.seqlen_q < 0 || a.total_q < 0 || a.heads <= 0 || a.splits < 1 || a.splits > 1024)
      return shape_mismatch("attention_combine: sizes must be non-negative, heads positive, splits 1 to 1024");
    if (!a.varlen && a.total_q != a.batch * a.seqlen_q)
      return shape_mismatch("attention_combine: padded layouts have batch * seqlen_q tokens");
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype("attention_combine: kernel is for " + std::string(dtype_name(dtype)) + ", out is " +
                               dtype_name(p.dtype));
    if (a.head_dim_v != *params.get_int("head_dim_v"))
      return invalid_argument("attention_combine: the kernel's head_dim_v differs from the problem's");
    if (a.total_q * a.heads > 0x7fffffff) return invalid_argument("attention_combine: rows must stay below 2^31");
    return {};
  }

  LaunchGeometry geometry(const Params&, const Problem& p) const override {
    const auto a = p.as<AttentionCombineProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(std::max<std::int64_t>((a.total_q * a.heads + 3) / 4, 1));
    g.block.x = 128;
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto a = p.as<AttentionCombineProblem>();
    const std::int64_t dv = a.head_dim_v == 80 || a.head_dim_v == 96 || a.head_dim_v == 64 || a.head_dim_v == 192 ||
                                    a.head_dim_v == 256
                                ? a.head_dim_v
                                : 128;
    return Params{{"dtype", std::string(p.dtype == DType::bf16 ? "bf16" : "f16")}, {"head_dim_v", dv}};
  }
  std::vector<Params> tuning_space(const Problem& p) const override { return {heuristic(p)}; }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    struct S {
      std::int64_t batch, lq, heads, dv, splits;
    };
    const S shapes[] = {{1, 1, 32, 128, 8}, {4, 4, 8, 64, 3}, {2, 16, 16, 256, 2}, {1, 3, 4, 80, 7},
                        {2, 2, 8, 96, 5},   {1, 8, 8, 192, 4}, {64, 1, 32, 128, 2}};
    std::vector<Problem> out;
    for (const S& s : shapes)
      out.push_back(Problem::of(dtype, 16,
                                AttentionCombineProblem{.batch = s.batch,
                                                        .seqlen_q = s.lq,
                                                        .total_q = s.batch * s.lq,
                                                        .heads = s.heads,
                                                        .head_dim_v = s.dv,
                                                        .varlen = 0,
                                                        .splits = s.splits}));
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<AttentionCombineProblem>();
    const std::int64_t rows = a.total_q * a.heads;
    return {{"o_part", BufferRole::input, DType::f32, a.splits * rows * a.head_dim_v},
            {"lse_part", BufferRole::input, DType::f32, a.splits * rows},
            {"cu_seqlens_q", BufferRole::input, DType::i32, a.batch + 1, a.varlen ? a.total_q + 1 : 1},
            {"out", BufferRole::output, p.dtype, rows * a.head_dim_v},
            {"lse", BufferRole::output, DType::f32, rows}};
  }

  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<AttentionCombineProblem>();
    for (std::size_t i = 0; i < 5; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.batch));
    out.add(int(a.seqlen_q));
    out.add(int(a.total_q));
    out.add(int(a.heads));
    out.add(int(a.varlen));
    out.add(int(a.splits));
    out.add(int(a.lse_token_major));
  }

  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 5 || !b[0] || !b[1] || !b[3])
      return invalid_argument("attention_combine: the reference takes o_part, lse_part, cu_seqlens_q, out, lse");
    const auto a = p.as<AttentionCombineProblem>();
    if (a.varlen && !b[2]) return invalid_argument("attention_combine: varlen needs cu_seqlens_q");
    const auto* o_part = static_cast<const float*>(b[0]);
    const auto* lse_part = static_cast<const float*>(b[1]);
    const std::int64_t n = a.total_q * a.heads, dv = a.head_dim_v;
    const std::int64_t tokens = a.varlen ? static_cast<const std::int32_t*>(b[2])[a.batch] : a.total_q;
    const double neg_inf = -std::numeric_limits<double>::infinity();
    std::vector<double> acc(static_cast<std::size_t>(dv));
    for (std::int64_t row = 0; row < std::min(n, tokens * a.heads); ++row) {
      const std::int64_t t = row / a.heads, h = row % a.heads;
      double mx = neg_inf;
      for (std::int64_t s = 0; s < a.splits; ++s) mx = std::max(mx, double(lse_part[s * n + row]));
      std::fill(acc.begin(), acc.end(), 0.0);
      double wsum = 0;
      for (std::int64_t s = 0; s < a.splits; ++s) {
        const double l = lse_part[s * n + row];
        if (l == neg_inf) continue;
        const double w = std::exp(l - mx);
        wsum += w;
        for (std::int64_t c = 0; c < dv; ++c) acc[std::size_t(c)] += w * o_part[(s * n + row) * dv + c];
      }
      for (std::int64_t c = 0; c < dv; ++c)
        store_from_double(b[3], p.dtype, row * dv + c, wsum > 0 ? acc[std::size_t(c)] / wsum : 0.0);
      if (b[4]) {
        const std::int64_t at = a.lse_token_major ? row
                                : a.varlen        ? h * a.total_q + t
                                                  : ((t / a.seqlen_q) * a.heads + h) * a.seqlen_q + t % a.seqlen_q;
        static_cast<float*>(b[4])[at] = wsum > 0 ? float(mx + std::log(wsum)) : -std::numeric_limits<float>::infinity();
      }
    }
    return {};
  }
};

}  // namespace
}  // namespace kiln::families

void kiln_register_kernels_attention_splitkv(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::AttentionSplitKv>());
  (void)r.add(std::make_shared<kiln::families::AttentionCombine>());
}
