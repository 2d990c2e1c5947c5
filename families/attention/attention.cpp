#include "families/attention/attention.h"

#include "families/attention/attention_bwd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {

bool attention_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v) {
  return std::find(k_attention_head_dims.begin(), k_attention_head_dims.end(), std::pair{head_dim, head_dim_v}) !=
         k_attention_head_dims.end();
}

AttentionTile attention_tile(std::int64_t head_dim, std::int64_t head_dim_v) {
  return {8, std::max(head_dim, head_dim_v) <= 128 ? 64 : 32};
}

std::uint32_t attention_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n) {
  const std::int64_t pq = head_dim + 8, pv = head_dim_v + 8;
  return std::uint32_t(2 * (16 * warps * pq + 2 * block_n * (pq + pv)));
}

bool attention_sm90_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v) {
  return std::find(k_attention_sm90_head_dims.begin(), k_attention_sm90_head_dims.end(),
                   std::pair{head_dim, head_dim_v}) != k_attention_sm90_head_dims.end();
}

std::uint32_t attention_sm90_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n,
                                        int stages) {
  return std::uint32_t(1024 +
                       2 * (16 * std::int64_t(warps) * head_dim + std::int64_t(stages) * block_n * (head_dim + head_dim_v)) +
                       8 * (2 + 3 * stages));
}

int attention_sm90_block_n(std::int64_t head_dim, std::int64_t head_dim_v) {
  return attention_sm90_smem_bytes(head_dim, head_dim_v, 8, 128, 2) <= 227 * 1024 ? 128 : 64;
}

int attention_sm90_stages(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_n) {
  int stages = 4;
  while (stages > 2 && attention_sm90_smem_bytes(head_dim, head_dim_v, warps, block_n, stages) > 227 * 1024) --stages;
  return stages;
}

bool attention_sm90_three_consumers_fit(std::int64_t head_dim_v, int block_n, bool overlap) {
  return head_dim_v / 2 + block_n / 2 + (overlap ? block_n / 4 : 0) <= 96;
}

namespace {

constexpr std::int64_t k_sm80_smem = 163 * 1024, k_sm90_smem = 227 * 1024;

std::int64_t max_smem(std::int64_t cc) { return cc == 0 || cc >= 90 ? k_sm90_smem : k_sm80_smem; }

// The sm_90a kernel (path "wgmma"); Params without a path (older specs) are the sm_80 kernel's.
bool is_wgmma(const Params& params) { return params.get_str("path").value_or("mma") == "wgmma"; }

// The shared memory a variant asks for.
std::uint32_t variant_smem(const Params& params) {
  const auto d = *params.get_int("head_dim"), dv = *params.get_int("head_dim_v");
  const int bn = int(*params.get_int("block_n")), warps = int(*params.get_int("warps"));
  if (is_wgmma(params)) return attention_sm90_smem_bytes(d, dv, warps, bn, attention_sm90_stages(d, dv, warps, bn));
  return attention_smem_bytes(d, dv, warps, bn);
}

// Whether the sm_90a kernel is the one to run: a device of compute capability 9.0 and a head-dim
// pair it has. Its tensor maps need a query and a key token; token counts are no key of the
// problem, so the choice cannot depend on them: the ops never launch without tokens.
bool wgmma_fits(const AttentionProblem& a, std::int64_t cc) {
  return cc == 90 && attention_sm90_head_dims_supported(a.head_dim, a.head_dim_v);
}

// The first token and the length of sequence b's queries and keys.
struct Seq {
  std::int64_t q0, lq, k0, lk;
};
Seq sequence(const AttentionProblem& a, const std::int32_t* cu_q, const std::int32_t* cu_k, std::int64_t b) {
  if (!a.varlen) return {b * a.seqlen_q, a.seqlen_q, b * a.seqlen_k, a.seqlen_k};
  return {cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]};
}

// The CPU computation for one (sequence, query head): keys in blocks of 64 with an online softmax,
// fp64 throughout; K and V of the head's KV head converted once.
void attend_head(const AttentionProblem& a, DType dtype, std::span<void* const> buf, const Seq& s, std::int64_t b,
                 std::int64_t h, std::vector<double>& kd, std::vector<double>& vd) {
  const std::int64_t d = a.head_dim, dv = a.head_dim_v, hk = h / (a.heads / a.kv_heads);
  kd.resize(std::size_t(s.lk * d));
  vd.resize(std::size_t(s.lk * dv));
  for (std::int64_t j = 0; j < s.lk; ++j) {
    for (std::int64_t c = 0; c < d; ++c)
      kd[std::size_t(j * d + c)] = load_as_double(buf[1], dtype, ((s.k0 + j) * a.kv_heads + hk) * d + c);
    for (std::int64_t c = 0; c < dv; ++c)
      vd[std::size_t(j * dv + c)] = load_as_double(buf[2], dtype, ((s.k0 + j) * a.kv_heads + hk) * dv + c);
  }
  constexpr std::int64_t block = 64;
  std::vector<double> qd(static_cast<std::size_t>(d)), acc(static_cast<std::size_t>(dv)), score(block);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const std::int64_t delta = s.lk - s.lq;
  for (std::int64_t i = 0; i < s.lq; ++i) {
    for (std::int64_t c = 0; c < d; ++c)
      qd[std::size_t(c)] = load_as_double(buf[0], dtype, ((s.q0 + i) * a.heads + h) * d + c);
    std::int64_t lo = 0, hi = s.lk;  // visible keys [lo, hi)
    if (a.window_left >= 0) lo = std::max<std::int64_t>(lo, i + delta - a.window_left);
    if (a.window_right >= 0) hi = std::min<std::int64_t>(hi, i + delta + a.window_right + 1);
    double mx = neg_inf, sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::int64_t j0 = lo; j0 < hi; j0 += block) {
      const std::int64_t n = std::min(block, hi - j0);
      double bmax = neg_inf;
      for (std::int64_t j = 0; j < n; ++j) {
        const double* kr = kd.data() + (j0 + j) * d;
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c) dot += qd[std::size_t(c)] * kr[c];
        double sc = dot * a.scale;
        if (a.softcap > 0) sc = a.softcap * std::tanh(sc / a.softcap);
        score[std::size_t(j)] = sc;
        bmax = std::max(bmax, sc);
      }
      const double m_new = std::max(mx, bmax);
      const double corr = mx == neg_inf ? 0.0 : std::exp(mx - m_new);
      sum *= corr;
      for (double& o : acc) o *= corr;
      for (std::int64_t j = 0; j < n; ++j) {
        const double p = std::exp(score[std::size_t(j)] - m_new);
        sum += p;
        const double* vr = vd.data() + (j0 + j) * dv;
        for (std::int64_t c = 0; c < dv; ++c) acc[std::size_t(c)] += p * vr[c];
      }
      mx = m_new;
    }
    const double inv = sum > 0 ? 1.0 / sum : 0.0;
    for (std::int64_t c = 0; c < dv; ++c)
      store_from_double(buf[5], dtype, ((s.q0 + i) * a.heads + h) * dv + c, acc[std::size_t(c)] * inv);
    if (buf[6]) {
      const std::int64_t at = a.varlen ? h * a.total_q + s.q0 + i : (b * a.heads + h) * a.seqlen_q + i;
      static_cast<float*>(buf[6])[at] = sum > 0 ? float(mx + std::log(sum)) : -std::numeric_limits<float>::infinity();
    }
  }
}

Status check_shape(const AttentionProblem& a) {
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.total_q < 0 || a.total_k < 0)
    return shape_mismatch("attention: sizes must be non-negative");
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads)
    return shape_mismatch("attention: heads (" + std::to_string(a.heads) + ") must be a positive multiple of kv_heads (" +
                          std::to_string(a.kv_heads) + ")");
  if (a.head_dim <= 0 || a.head_dim_v <= 0) return shape_mismatch("attention: head dims must be positive");
  if (a.window_left < -1 || a.window_right < -1)
    return invalid_argument("attention: window sizes must be -1 (unbounded) or non-negative");
  if (a.causal && a.window_right != 0) return invalid_argument("attention: causal needs window_right 0");
  if (!std::isfinite(a.scale) || !std::isfinite(a.softcap) || a.softcap < 0)
    return invalid_argument("attention: scale must be finite and softcap finite and non-negative");
  if (!a.varlen && (a.total_q != a.batch * a.seqlen_q || a.total_k != a.batch * a.seqlen_k))
    return shape_mismatch("attention: padded layouts have batch * seqlen tokens");
  return {};
}

class Attention final : public Family {
 public:
  std::string_view name() const override { return "attention"; }
  int version() const override { return 4; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"path", {}, {"mma", "wgmma"},
         "mma: mma.sync, cp.async (sm_80 and later); wgmma: warp-specialized wgmma, TMA (sm_90a)"},
        {"block_n", {32, 64, 128}, {}, "keys per K/V tile"},
        {"dtype", {}, {"f16", "bf16"}, "element type of q, k, v and out"},
        {"head_dim", {64, 80, 96, 128, 192, 256}, {}, "elements per head of q and k"},
        {"head_dim_v", {64, 80, 96, 128, 192, 256}, {}, "elements per head of v and out"},
        {"warps", {4, 8, 12}, {}, "warps per block, 16 query rows each (wgmma: 8 or 12, two or three consumers)"},
        {"overlap", {0, 1}, {},
         "wgmma: 1 runs each tile's softmax while the previous tile's P V is in flight; mma: 0"},
        {"pingpong", {0, 1}, {},
         "wgmma with overlap 1: 1 has the consumer warpgroups issue their GEMMs in turn; mma: 0"},
        {"persistent", {0, 1}, {},
         "wgmma: 1 launches a block per SM that runs tile after tile, loading the next while it finishes "
         "the last; mma: 0"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<AttentionProblem>({
        key(&AttentionProblem::batch, "batch", "sequences"),
        bucketed(&AttentionProblem::seqlen_q, "seqlen_q", "queries per sequence (varlen: the longest)"),
        key(&AttentionProblem::seqlen_k, "seqlen_k", "keys per sequence (varlen: the longest)"),
        value(&AttentionProblem::total_q, "total_q", "query tokens (rows of q)"),
        value(&AttentionProblem::total_k, "total_k", "key tokens (rows of k and v)"),
        key(&AttentionProblem::heads, "heads", "query heads"),
        key(&AttentionProblem::kv_heads, "kv_heads", "key/value heads (divides heads)"),
        key(&AttentionProblem::head_dim, "head_dim", "elements per head of q and k"),
        key(&AttentionProblem::head_dim_v, "head_dim_v", "elements per head of v and out"),
        key(&AttentionProblem::causal, "causal", "1: causal (window_right 0)"),
        key(&AttentionProblem::varlen, "varlen", "1: packed sequences (cu_seqlens)"),
        key(&AttentionProblem::window_left, "window_left", "keys left of the diagonal seen; -1 unbounded"),
        key(&AttentionProblem::window_right, "window_right", "keys right of the diagonal seen; -1 unbounded"),
        value(&AttentionProblem::scale, "scale", "multiplies Q K^T"),
        value(&AttentionProblem::softcap, "softcap", "> 0: scores become softcap * tanh(score / softcap)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto d = *params.get_int("head_dim"), dv = *params.get_int("head_dim_v");
    if (!attention_head_dims_supported(d, dv))
      return invalid_argument("attention: no kernel for head_dim " + std::to_string(d) + " with head_dim_v " +
                              std::to_string(dv));
    if (is_wgmma(params)) {
      if (!attention_sm90_head_dims_supported(d, dv))
        return invalid_argument("attention: no wgmma kernel for head_dim " + std::to_string(d) + " with head_dim_v " +
                                std::to_string(dv));
      const auto warps = *params.get_int("warps"), bn = *params.get_int("block_n");
      if ((warps != 8 && warps != 12) || bn < 64)
        return invalid_argument("attention: the wgmma kernel takes warps 8 or 12 and block_n 64 or 128");
      if (warps == 12 && !attention_sm90_three_consumers_fit(dv, int(bn), *params.get_int("overlap")))
        return invalid_argument("attention: three consumer warpgroups (warps 12) hold the output and the scores "
                                "only up to head_dim_v / 2 + block_n / 2 (+ block_n / 4 overlapped) = 96 registers");
      if (*params.get_int("pingpong") && !*params.get_int("overlap"))
        return invalid_argument("attention: pingpong orders the overlapped schedule (overlap 1)");
    } else if (*params.get_int("overlap") != 0 || *params.get_int("pingpong") != 0 ||
               *params.get_int("persistent") != 0) {
      return invalid_argument("attention: overlap, pingpong and persistent are for the wgmma kernel");
    } else if (*params.get_int("warps") > 8) {
      return invalid_argument("attention: the mma kernel takes warps 4 or 8");
    }
    if (variant_smem(params) > k_sm90_smem)
      return invalid_argument("attention: the variant needs more than 227 KiB of shared memory");
    return {};
  }

  bool runs_on(const Params& params, const GpuArch& arch) const override {
    if (is_wgmma(params) && !(arch.capability == 90 && arch.suffix == 'a')) return false;
    return variant_smem(params) <= max_smem(arch.capability);
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    Rendered r;
    if (is_wgmma(params)) {
      const auto d = *params.get_int("head_dim"), dv = *params.get_int("head_dim_v");
      const int bn = int(*params.get_int("block_n")), warps = int(*params.get_int("warps"));
      r.source = "#include \"attention/attention_fwd_sm90.cuh\"\n";
      r.name_expression = std::string("kiln::attention::attention_fwd_sm90<") + device_type(*params.get_str("dtype")) +
                          ", " + std::to_string(d) + ", " + std::to_string(dv) + ", " + std::to_string(warps / 4) + ", " +
                          std::to_string(bn) + ", " + std::to_string(attention_sm90_stages(d, dv, warps, bn)) + ", " +
                          (*params.get_int("overlap") ? "true" : "false") + ", " +
                          (*params.get_int("pingpong") ? "true" : "false") + ", " +
                          (*params.get_int("persistent") ? "true" : "false") + ">";
      return r;
    }
    r.source = "#include \"attention/attention_fwd.cuh\"\n";
    r.name_expression = std::string("kiln::attention::attention_fwd<") + device_type(*params.get_str("dtype")) + ", " +
                        std::to_string(*params.get_int("head_dim")) + ", " +
                        std::to_string(*params.get_int("head_dim_v")) + ", " +
                        std::to_string(*params.get_int("warps")) + ", " + std::to_string(*params.get_int("block_n")) +
                        ">";
    return r;
  }

  // The heuristic's variants for every dtype and head-dim pair: the sm_80 kernel's, then the
  // sm_90a kernel's where it has the pair, then the short windows' (heuristic()).
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f16", "bf16"})
      for (const auto& [d, dv] : k_attention_head_dims) out.push_back(make(dtype, d, dv, attention_tile(d, dv)));
    for (const char* dtype : {"f16", "bf16"})
      for (const auto& [d, dv] : k_attention_sm90_head_dims) out.push_back(make_sm90(dtype, d, dv));
    for (const char* dtype : {"f16", "bf16"})
      for (std::int64_t d : {64, 128}) out.push_back(short_window_variant(dtype, d));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionProblem>();
    KILN_TRY(check_shape(a));
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype("attention: kernel is for " + std::string(dtype_name(dtype)) + ", tensors are " +
                               dtype_name(p.dtype));
    if (a.head_dim != *params.get_int("head_dim") || a.head_dim_v != *params.get_int("head_dim_v"))
      return invalid_argument("attention: the kernel is for head dims " + std::to_string(*params.get_int("head_dim")) +
                              "/" + std::to_string(*params.get_int("head_dim_v")) + ", the problem has " +
                              std::to_string(a.head_dim) + "/" + std::to_string(a.head_dim_v));
    if (p.alignment < 16) return invalid_argument("attention: q, k, v and out must be 16-byte aligned");
    if (p.cc && p.cc < 80) return invalid_argument("attention: the kernels need compute capability 8.0 or later");
    if (is_wgmma(params)) {
      if (p.cc && p.cc != 90)
        return invalid_argument("attention: the wgmma kernel needs compute capability 9.0 (sm_90a)");
      if (a.total_q <= 0 || a.total_k <= 0)
        return invalid_argument("attention: the wgmma kernel needs at least one query and one key token");
      // The mask's second row of a thread bounds keys at lk + 7.
      if (a.seqlen_k > 0x7fffffff - 8 || a.total_k > 0x7fffffff - 8)
        return invalid_argument("attention: the wgmma kernel takes fewer than 2^31 - 8 key tokens");
    }
    const auto smem = variant_smem(params);
    if (smem > max_smem(p.cc))
      return invalid_argument("attention: the variant needs " + std::to_string(smem) +
                              " bytes of shared memory, more than the device grants a block");
    const std::int64_t lim = 0x7fffffff;
    if (a.batch > 65535 || a.heads > 65535 || a.seqlen_q > lim || a.seqlen_k > lim || a.total_q > lim ||
        a.total_k > lim)
      return invalid_argument("attention: batch and heads up to 65535, token counts below 2^31");
    if (query_tiles(params, a) * std::max<std::int64_t>(a.heads, 1) * std::max<std::int64_t>(a.batch, 1) > lim)
      return invalid_argument("attention: more than 2^31 - 1 tiles of queries, heads and sequences");
    return {};
  }

  // A persistent variant launches one block per SM (the problem's count; every tile its own block
  // when the count is unknown), which walks the (query tile, head, sequence) grid the others launch.
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionProblem>();
    LaunchGeometry g;
    g.grid.x = std::uint32_t(query_tiles(params, a));
    g.grid.y = std::uint32_t(std::max<std::int64_t>(a.heads, 1));
    g.grid.z = std::uint32_t(std::max<std::int64_t>(a.batch, 1));
    if (*params.get_int("persistent")) {
      const std::int64_t tiles = std::int64_t(g.grid.x) * g.grid.y * g.grid.z;
      g.grid.x = std::uint32_t(p.sm_count > 0 ? std::min<std::int64_t>(tiles, p.sm_count) : tiles);
      g.grid.y = g.grid.z = 1;
    }
    // wgmma: the consumer warps and a producer warpgroup.
    g.block.x = std::uint32_t(32 * *params.get_int("warps") + (is_wgmma(params) ? 128 : 0));
    g.shared_bytes = variant_smem(params);
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto a = p.as<AttentionProblem>();
    const std::string dtype = p.dtype == DType::bf16 ? "bf16" : "f16";
    if (!attention_head_dims_supported(a.head_dim, a.head_dim_v)) return make(dtype, 128, 128, {8, 64});
    if (wgmma_fits(a, p.cc)) {
      const std::int64_t span = window_span(a);
      if (span > 0 && span <= k_short_window && short_window_pair(a.head_dim, a.head_dim_v))
        return short_window_variant(dtype, a.head_dim);
      return make_sm90(dtype, a.head_dim, a.head_dim_v);
    }
    return make(dtype, a.head_dim, a.head_dim_v, attention_tile(a.head_dim, a.head_dim_v));
  }

  std::vector<Params> tuning_space(const Problem& p) const override {
    const auto a = p.as<AttentionProblem>();
    std::vector<Params> out;
    if (!attention_head_dims_supported(a.head_dim, a.head_dim_v)) return {heuristic(p)};
    const std::string dtype = p.dtype == DType::bf16 ? "bf16" : "f16";
    if (wgmma_fits(a, p.cc))
      for (int persistent : {0, 1})
        for (int warps : {8, 12})
          for (int sched : {1, 2, 0})  // overlap; overlap and pingpong; serial
            for (int bn : {128, 64}) {
              Params c = make_sm90(dtype, a.head_dim, a.head_dim_v);
              c.set("warps", std::int64_t(warps)).set("block_n", std::int64_t(bn));
              c.set("overlap", std::int64_t(sched > 0)).set("pingpong", std::int64_t(sched == 2));
              c.set("persistent", std::int64_t(persistent));
              if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
            }
    for (int warps : {4, 8})
      for (int bn : {32, 64, 128}) {
        // The output accumulator and a tile of scores share a thread's registers.
        if (a.head_dim_v / 2 + bn / 2 > 160) continue;
        Params c = make(dtype, a.head_dim, a.head_dim_v, {warps, bn});
        if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
      }
    return out;
  }

  // The key fields with each bounded side of the window at its power-of-two bucket (-1 and 0 as
  // they are). A window decides how many keys a tile sees and the heuristic's choice, so a winner
  // tuned without one does not serve windowed calls, nor one tuned for 128 keys a window of 4096;
  // windows of one bucket share a winner.
  std::string signature(const Problem& problem) const override {
    Problem p = problem;
    auto a = p.as<AttentionProblem>();
    if (a.window_left > 0) a.window_left = tuning_bucket(a.window_left);
    if (a.window_right > 0) a.window_right = tuning_bucket(a.window_right);
    p.set(a);
    return Family::signature(p);
  }

  // The bucket's upper bound in queries per sequence (a padded layout's query tokens follow it)
  // and in each bounded side of the window.
  Problem tuning_problem(const Problem& problem) const override {
    Problem out = Family::tuning_problem(problem);
    auto a = out.as<AttentionProblem>();
    if (!a.varlen) a.total_q = a.batch * a.seqlen_q;
    if (a.window_left > 0) a.window_left = tuning_bucket(a.window_left);
    if (a.window_right > 0) a.window_right = tuning_bucket(a.window_right);
    out.set(a);
    return out;
  }

  // Unnamed fields: padded (total = batch * seqlen), kv_heads = heads, head_dim_v = head_dim,
  // no window, scale 1 / sqrt(head_dim).
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto get = [&](const char* n) { return shape_value(shape, n); };
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(
                                         dtype, with_defaults(shape, {{"batch", 1},
                                                                      {"kv_heads", get("heads").value_or(1)},
                                                                      {"head_dim_v", get("head_dim").value_or(128)},
                                                                      {"causal", 0},
                                                                      {"varlen", 0},
                                                                      {"window_left", -1},
                                                                      {"window_right", get("causal").value_or(0) ? 0 : -1}})));
    auto a = p.as<AttentionProblem>();
    if (!get("total_q")) a.total_q = a.batch * a.seqlen_q;
    if (!get("total_k")) a.total_k = a.batch * a.seqlen_k;
    if (a.scale == 0 && a.head_dim > 0) a.scale = 1.0 / std::sqrt(double(a.head_dim));
    p.set(a);
    return p;
  }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    struct S {
      std::int64_t batch, heads, kv_heads, seq, d, dv, causal;
    };
    // Small shapes every head-dim pair (the GPU conformance test checks them against the CPU
    // reference), GQA, then the benchmark's prefill shapes.
    const S shapes[] = {{2, 8, 2, 256, 64, 64, 1},     {2, 4, 4, 200, 80, 80, 0},    {1, 4, 1, 256, 96, 96, 1},
                        {2, 8, 8, 512, 128, 128, 0},   {2, 8, 2, 512, 128, 128, 1},  {1, 4, 4, 256, 192, 192, 1},
                        {1, 8, 8, 256, 192, 128, 0},   {1, 4, 4, 256, 256, 256, 0},  {4, 32, 32, 4096, 128, 128, 1},
                        {2, 16, 16, 8192, 128, 128, 0}, {4, 32, 32, 4096, 64, 64, 0}, {2, 16, 16, 4096, 256, 256, 1}};
    std::vector<Problem> out;
    for (const S& s : shapes) {
      AttentionProblem a;
      a.batch = s.batch;
      a.seqlen_q = a.seqlen_k = s.seq;
      a.total_q = a.total_k = s.batch * s.seq;
      a.heads = s.heads;
      a.kv_heads = s.kv_heads;
      a.head_dim = s.d;
      a.head_dim_v = s.dv;
      a.causal = s.causal;
      a.window_right = s.causal ? 0 : -1;
      a.scale = 1.0 / std::sqrt(double(s.d));
      out.push_back(Problem::of(dtype, 16, a));
    }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<AttentionProblem>();
    // Padded problems never read cu_seqlens: index bound 1 (zeros) where a harness fills them.
    const std::int64_t bound = a.varlen ? std::max<std::int64_t>(a.total_q, a.total_k) + 1 : 1;
    return {{"q", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim},
            {"k", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim},
            {"v", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim_v},
            {"cu_seqlens_q", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"cu_seqlens_k", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"out", BufferRole::output, p.dtype, a.total_q * a.heads * a.head_dim_v},
            {"lse", BufferRole::output, DType::f32, a.total_q * a.heads}};
  }

  // wgmma: then tensor maps of q, k and v (tokens x heads * head_dim * 2 bytes; boxes of the
  // block's 16 * warps query rows and of block_n keys).
  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<AttentionProblem>();
    for (std::size_t i = 0; i < 7; ++i) out.add(i < b.size() ? b[i] : static_cast<void*>(nullptr));
    out.add(int(a.seqlen_q));
    out.add(int(a.seqlen_k));
    out.add(int(a.total_q));
    out.add(int(a.heads));
    out.add(int(a.kv_heads));
    out.add(int(a.window_left));
    out.add(int(a.window_right));
    out.add(int(a.varlen));
    out.add(int(a.causal));  // reverse: causal blocks with the most keys first
    out.add(float(a.scale));
    out.add(float(a.softcap));
    if (!is_wgmma(params)) return;
    const auto bn = std::uint32_t(*params.get_int("block_n"));
    const auto rows = [](std::int64_t n) { return std::uint64_t(std::max<std::int64_t>(n, 1)); };
    auto at = [&](std::size_t i) { return i < b.size() ? static_cast<const void*>(b[i]) : nullptr; };
    const auto bm = std::uint32_t(16 * *params.get_int("warps"));
    out.add_tensor_map({at(0), std::uint64_t(a.heads * a.head_dim * 2), rows(a.total_q), bm, 0});
    out.add_tensor_map({at(1), std::uint64_t(a.kv_heads * a.head_dim * 2), rows(a.total_k), bn, 0});
    out.add_tensor_map({at(2), std::uint64_t(a.kv_heads * a.head_dim_v * 2), rows(a.total_k), bn, 0});
    out.add(int(a.batch));
  }

  // Buffers as buffers() lists them; lse may be null, cu_seqlens only read when varlen.
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    if (b.size() != 7 || !b[0] || !b[1] || !b[2] || !b[5])
      return invalid_argument("attention: the reference takes q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse");
    const auto a = p.as<AttentionProblem>();
    KILN_TRY(check_shape(a));
    if (a.varlen && (!b[3] || !b[4])) return invalid_argument("attention: varlen needs cu_seqlens_q and cu_seqlens_k");
    const auto* cu_q = static_cast<const std::int32_t*>(b[3]);
    const auto* cu_k = static_cast<const std::int32_t*>(b[4]);
    const std::int64_t tasks = a.batch * a.heads;
    const std::int64_t threads =
        std::clamp<std::int64_t>(std::int64_t(std::thread::hardware_concurrency()), 1, std::min<std::int64_t>(tasks, 64));
    std::atomic<std::int64_t> next{0};
    auto work = [&] {
      std::vector<double> kd, vd;
      for (std::int64_t t; (t = next.fetch_add(1)) < tasks;) {
        const std::int64_t bi = t / a.heads, h = t % a.heads;
        attend_head(a, p.dtype, b, sequence(a, cu_q, cu_k, bi), bi, h, kd, vd);
      }
    };
    if (threads <= 1) {
      work();
      return {};
    }
    std::vector<std::thread> pool;
    for (std::int64_t i = 0; i < threads; ++i) pool.emplace_back(work);
    for (auto& th : pool) th.join();
    return {};
  }

 private:
  // Windows bounded on both sides that see at most this many keys take short_window_variant on
  // sm_90a at head dims 64/64 and 128/128.
  static constexpr std::int64_t k_short_window = 512;
  static bool short_window_pair(std::int64_t d, std::int64_t dv) { return d == dv && (d == 64 || d == 128); }
  // From the window variants table of kiln_bench_gpu on an H100: a query tile of a short window
  // sees few key tiles, so what a tile costs besides its GEMMs decides. Three consumer warpgroups
  // on the serial schedule, each computing only the 64-key tiles its rows see, on persistent blocks
  // that load the next tile while the last finishes, ran causal windows of 128-512 keys at 128/128
  // 1.2-1.35x faster than the variants taken before (the sm_80 kernel's small tiles up to 128 keys,
  // two serial consumers of 128-key tiles above), and 128 keys at 64/64 1.2x faster than the small
  // tiles; 256-512 keys at 64/64 were not compared.
  static Params short_window_variant(const std::string& dtype, std::int64_t d) {
    return make_sm90(dtype, d, d)
        .set("warps", std::int64_t(12))
        .set("block_n", std::int64_t(64))
        .set("overlap", std::int64_t(0))
        .set("pingpong", std::int64_t(0))
        .set("persistent", std::int64_t(1));
  }
  // Blocks of 16 * warps query rows over the longest sequence (at least one).
  static std::int64_t query_tiles(const Params& params, const AttentionProblem& a) {
    const std::int64_t bm = 16 * *params.get_int("warps");
    return std::max<std::int64_t>((a.seqlen_q + bm - 1) / bm, 1);
  }
  // Keys a query sees when both sides of its window are bounded; -1 otherwise.
  static std::int64_t window_span(const AttentionProblem& a) {
    return a.window_left >= 0 && a.window_right >= 0 ? a.window_left + a.window_right + 1 : -1;
  }
  static Params make(const std::string& dtype, std::int64_t d, std::int64_t dv, AttentionTile t) {
    return Params{{"path", std::string("mma")}, {"dtype", dtype}, {"head_dim", d}, {"head_dim_v", dv},
                  {"warps", std::int64_t(t.warps)}, {"block_n", std::int64_t(t.block_n)}, {"overlap", std::int64_t(0)},
                  {"pingpong", std::int64_t(0)}, {"persistent", std::int64_t(0)}};
  }
  // The variant by head dims, from kiln_bench_gpu's variants table on an H100 (full and causal):
  // at 64/64, where the softmax is long against the GEMMs, three consumer warpgroups running their
  // tiles serially overlap one another's softmax with the others' GEMMs best, and persistent blocks
  // hide each tile's start; at 256/256, whose tiles of 64 keys leave little to overlap within a
  // warpgroup, the serial schedule on persistent blocks; the others overlap the softmax with the
  // previous tile's P V, one block per tile (persistent blocks were level there without causal
  // masks and up to 3 % slower with them).
  static Params make_sm90(const std::string& dtype, std::int64_t d, std::int64_t dv) {
    const bool pair64 = d == 64 && dv == 64, pair256 = d == 256 && dv == 256;
    return Params{{"path", std::string("wgmma")},
                  {"dtype", dtype},
                  {"head_dim", d},
                  {"head_dim_v", dv},
                  {"warps", std::int64_t(pair64 ? 12 : 8)},
                  {"block_n", std::int64_t(attention_sm90_block_n(d, dv))},
                  {"overlap", std::int64_t(!pair64 && !pair256)},
                  {"pingpong", std::int64_t(0)},
                  {"persistent", std::int64_t(pair64 || pair256)}};
  }
};

}  // namespace
}  // namespace kiln::families

// The decode path's families (attention_splitkv.cpp).
void kiln_register_kernels_attention_splitkv(kiln::Registry& r);

void kiln_register_family_attention(kiln::Registry& r) {
  (void)r.add(std::make_shared<kiln::families::Attention>());
  kiln_register_kernels_attention_splitkv(r);
  kiln::families::register_attention_bwd(r);
}
