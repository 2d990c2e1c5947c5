#include "families/attention/attention_bwd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/half.h"
#include "families/common/family_util.h"

namespace kiln::families {

bool attention_bwd_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v) {
  return std::find(k_attention_bwd_head_dims.begin(), k_attention_bwd_head_dims.end(),
                   std::pair{head_dim, head_dim_v}) != k_attention_bwd_head_dims.end();
}

bool attention_bwd_sm90_head_dims_supported(std::int64_t head_dim, std::int64_t head_dim_v) {
  return std::find(k_attention_bwd_sm90_head_dims.begin(), k_attention_bwd_sm90_head_dims.end(),
                   std::pair{head_dim, head_dim_v}) != k_attention_bwd_sm90_head_dims.end();
}

std::uint32_t attention_bwd_sm90_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v) {
  // 1024 bytes of alignment slack; K and V of 128 keys; the stages (Q and dO of 64 queries, lse and
  // Dsum, rounded up to 1024 bytes); two dS^T buffers [128, 64]; two f32 dQ tiles [64, 64]; the
  // barriers.
  const std::int64_t stage = (64 * 2 * (head_dim + head_dim_v) + 2 * 64 * 4 + 1023) / 1024 * 1024;
  return std::uint32_t(1024 + 128 * 2 * (head_dim + head_dim_v) + k_attention_bwd_sm90_stages * stage +
                       2 * 128 * 64 * 2 + 2 * 64 * 64 * 4 + 8 * (2 * k_attention_bwd_sm90_stages + 4));
}

int attention_bwd_block_m(std::int64_t head_dim, std::int64_t head_dim_v) {
  return std::max(head_dim, head_dim_v) > 96 ? 32 : 64;
}

int attention_bwd_warps(std::int64_t head_dim, std::int64_t head_dim_v) {
  // 8 warps (128 keys a block) halve the dQ atomics and the Q and dO loads per key; head_dim 80
  // cannot split dQ's columns into multiples of 16 over two warps.
  return head_dim == 80 || head_dim_v == 80 ? 4 : 8;
}

std::int64_t attention_bwd_dsum_words(const AttentionBwdProblem& a) { return (a.heads * a.total_q + 3) / 4 * 4; }

std::int64_t attention_bwd_workspace_elements(const AttentionBwdProblem& a) {
  const std::int64_t bm = attention_bwd_block_m(a.head_dim, a.head_dim_v), m_tiles = (a.seqlen_q + bm - 1) / bm;
  std::int64_t n = attention_bwd_dsum_words(a) + a.total_q * a.heads * a.head_dim + a.batch * a.heads * m_tiles;
  if (a.heads != a.kv_heads) n += a.total_k * a.heads * (a.head_dim + a.head_dim_v);
  return std::max<std::int64_t>(n, 1);
}

std::uint32_t attention_bwd_smem_bytes(std::int64_t head_dim, std::int64_t head_dim_v, int warps, int block_m) {
  const std::int64_t bn = 16 * warps, bm = block_m, pq = head_dim + 8, pv = head_dim_v + 8;
  // K and V tiles; two stages of Q, dO, lse and Dsum; dS^T.
  return std::uint32_t(2 * bn * (pq + pv) + 2 * (2 * bm * (pq + pv) + 8 * bm) + 2 * bn * (bm + 8));
}

namespace {

constexpr std::int64_t k_sm80_smem = 163 * 1024, k_sm90_smem = 227 * 1024;

// The main stage's sm_90a kernel (path "wgmma"); Params without a path are the mma.sync kernel's.
bool is_wgmma(const Params& params) { return params.get_str("path").value_or("mma") == "wgmma"; }

// Where the heuristic takes the sm_90a main kernel: an H100-class device and its head dims (token
// counts are no key of the problem: the ops never launch without tokens).
bool wgmma_fits(const AttentionBwdProblem& a, std::int64_t cc) {
  return cc == 90 && attention_bwd_sm90_head_dims_supported(a.head_dim, a.head_dim_v);
}

struct Seq {
  std::int64_t q0, lq, k0, lk;
};
Seq sequence(const AttentionBwdProblem& a, const std::int32_t* cu_q, const std::int32_t* cu_k, std::int64_t b) {
  if (!a.varlen) return {b * a.seqlen_q, a.seqlen_q, b * a.seqlen_k, a.seqlen_k};
  return {cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]};
}

// Buffer indices (buffers()).
enum Buf { b_q, b_k, b_v, b_out, b_dout, b_lse, b_cu_q, b_cu_k, b_ws, b_dq, b_dk, b_dv, b_count };

// One (sequence, query head) in fp64, K and V of its KV head given as doubles: dq [lq, d] (scale
// included) is assigned; dk [lk, d] (scale included) and dv [lk, dv] are added to. dsum(i) gives
// D of query i.
void head_backward(const AttentionBwdProblem& a, DType dtype, std::span<void* const> buf, const Seq& s,
                   std::int64_t b, std::int64_t h, const std::vector<double>& kd, const std::vector<double>& vd,
                   const std::function<double(std::int64_t)>& dsum, std::vector<double>& dq, std::vector<double>& dk,
                   std::vector<double>& dv) {
  const std::int64_t d = a.head_dim, dvd = a.head_dim_v;
  dq.assign(std::size_t(s.lq * d), 0.0);
  std::vector<double> qi(static_cast<std::size_t>(d)), gi(static_cast<std::size_t>(dvd));
  const std::int64_t delta = s.lk - s.lq;
  for (std::int64_t i = 0; i < s.lq; ++i) {
    const std::int64_t at = a.varlen ? h * a.total_q + s.q0 + i : (b * a.heads + h) * a.seqlen_q + i;
    const double lse = load_as_double(buf[b_lse], DType::f32, at);
    if (!std::isfinite(lse)) continue;  // sees no key: nothing flows through this row
    std::int64_t lo = 0, hi = s.lk;
    if (a.window_left >= 0) lo = std::max<std::int64_t>(lo, i + delta - a.window_left);
    if (a.window_right >= 0) hi = std::min<std::int64_t>(hi, i + delta + a.window_right + 1);
    if (lo >= hi) continue;
    for (std::int64_t c = 0; c < d; ++c) qi[std::size_t(c)] = load_as_double(buf[b_q], dtype, ((s.q0 + i) * a.heads + h) * d + c);
    for (std::int64_t c = 0; c < dvd; ++c)
      gi[std::size_t(c)] = load_as_double(buf[b_dout], dtype, ((s.q0 + i) * a.heads + h) * dvd + c);
    const double di = dsum(i);
    double* dqi = dq.data() + i * d;
    for (std::int64_t j = lo; j < hi; ++j) {
      const double* kj = kd.data() + j * d;
      const double* vj = vd.data() + j * dvd;
      double raw = 0, dp = 0;
      for (std::int64_t c = 0; c < d; ++c) raw += qi[std::size_t(c)] * kj[c];
      for (std::int64_t c = 0; c < dvd; ++c) dp += gi[std::size_t(c)] * vj[c];
      double sc = raw * a.scale, chain = a.scale;
      if (a.softcap > 0) {
        const double t = std::tanh(sc / a.softcap);
        sc = a.softcap * t;
        chain *= 1.0 - t * t;
      }
      const double p = std::exp(sc - lse);
      const double ds = p * (dp - di) * chain;
      for (std::int64_t c = 0; c < d; ++c) {
        dqi[c] += ds * kj[c];
        dk[std::size_t(j * d + c)] += ds * qi[std::size_t(c)];
      }
      for (std::int64_t c = 0; c < dvd; ++c) dv[std::size_t(j * dvd + c)] += p * gi[std::size_t(c)];
    }
  }
}

void load_kv(const AttentionBwdProblem& a, DType dtype, std::span<void* const> buf, const Seq& s, std::int64_t hk,
             std::vector<double>& kd, std::vector<double>& vd) {
  const std::int64_t d = a.head_dim, dv = a.head_dim_v;
  kd.resize(std::size_t(s.lk * d));
  vd.resize(std::size_t(s.lk * dv));
  for (std::int64_t j = 0; j < s.lk; ++j) {
    for (std::int64_t c = 0; c < d; ++c)
      kd[std::size_t(j * d + c)] = load_as_double(buf[b_k], dtype, ((s.k0 + j) * a.kv_heads + hk) * d + c);
    for (std::int64_t c = 0; c < dv; ++c)
      vd[std::size_t(j * dv + c)] = load_as_double(buf[b_v], dtype, ((s.k0 + j) * a.kv_heads + hk) * dv + c);
  }
}

// Runs task(t) for t in [0, tasks) over the hardware threads.
void parallel(std::int64_t tasks, const std::function<void(std::int64_t)>& task) {
  const std::int64_t threads = std::clamp<std::int64_t>(std::int64_t(std::thread::hardware_concurrency()), 1,
                                                        std::max<std::int64_t>(std::min<std::int64_t>(tasks, 64), 1));
  std::atomic<std::int64_t> next{0};
  auto work = [&] {
    for (std::int64_t t; (t = next.fetch_add(1)) < tasks;) task(t);
  };
  if (threads <= 1) {
    work();
    return;
  }
  std::vector<std::thread> pool;
  for (std::int64_t i = 0; i < threads; ++i) pool.emplace_back(work);
  for (auto& th : pool) th.join();
}

Status check_shape(const AttentionBwdProblem& a) {
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.total_q < 0 || a.total_k < 0)
    return shape_mismatch("attention_bwd: sizes must be non-negative");
  if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads)
    return shape_mismatch("attention_bwd: heads must be a positive multiple of kv_heads");
  if (a.head_dim <= 0 || a.head_dim_v <= 0) return shape_mismatch("attention_bwd: head dims must be positive");
  if (a.window_left < -1 || a.window_right < -1)
    return invalid_argument("attention_bwd: window sizes must be -1 (unbounded) or non-negative");
  if (!std::isfinite(a.scale) || !std::isfinite(a.softcap) || a.softcap < 0)
    return invalid_argument("attention_bwd: scale must be finite and softcap finite and non-negative");
  if (!a.varlen && (a.total_q != a.batch * a.seqlen_q || a.total_k != a.batch * a.seqlen_k))
    return shape_mismatch("attention_bwd: padded layouts have batch * seqlen tokens");
  if (a.stage < 0 || a.stage > 2) return invalid_argument("attention_bwd: stage is 0 (prep), 1 (main) or 2 (finish)");
  return {};
}

double dot_dout_out(const AttentionBwdProblem& a, DType dtype, std::span<void* const> buf, std::int64_t tok,
                    std::int64_t h) {
  double s = 0;
  for (std::int64_t c = 0; c < a.head_dim_v; ++c) {
    const std::int64_t at = (tok * a.heads + h) * a.head_dim_v + c;
    s += load_as_double(buf[b_dout], dtype, at) * load_as_double(buf[b_out], dtype, at);
  }
  return s;
}

const char* const k_stages[] = {"prep", "main", "finish"};

std::int64_t stage_of(const Params& params) {
  const std::string s = params.get_str("stage").value_or("main");
  return s == "prep" ? 0 : s == "finish" ? 2 : 1;
}

}  // namespace

Status attention_backward_reference(const AttentionBwdProblem& a, DType dtype, std::span<void* const> buf) {
  KILN_TRY(check_shape(a));
  if (buf.size() < std::size_t(b_count)) return invalid_argument("attention_bwd: the reference takes 12 buffers");
  const auto* cu_q = static_cast<const std::int32_t*>(buf[b_cu_q]);
  const auto* cu_k = static_cast<const std::int32_t*>(buf[b_cu_k]);
  if (a.varlen && (!cu_q || !cu_k)) return invalid_argument("attention_bwd: varlen needs cu_seqlens_q and cu_seqlens_k");
  const std::int64_t d = a.head_dim, dv = a.head_dim_v, group = a.heads / a.kv_heads;
  // Rows no sequence holds keep zeros.
  for (std::int64_t i = 0; i < a.total_q * a.heads * d; ++i) store_from_double(buf[b_dq], dtype, i, 0.0);
  for (std::int64_t i = 0; i < a.total_k * a.kv_heads * d; ++i) store_from_double(buf[b_dk], dtype, i, 0.0);
  for (std::int64_t i = 0; i < a.total_k * a.kv_heads * dv; ++i) store_from_double(buf[b_dv], dtype, i, 0.0);
  parallel(a.batch * a.kv_heads, [&](std::int64_t t) {
    const std::int64_t b = t / a.kv_heads, hk = t % a.kv_heads;
    const Seq s = sequence(a, cu_q, cu_k, b);
    std::vector<double> kd, vd, dq;
    load_kv(a, dtype, buf, s, hk, kd, vd);
    std::vector<double> dk(std::size_t(s.lk * d), 0.0), dvv(std::size_t(s.lk * dv), 0.0);
    for (std::int64_t g = 0; g < group; ++g) {
      const std::int64_t h = hk * group + g;
      head_backward(a, dtype, buf, s, b, h, kd, vd,
                    [&](std::int64_t i) { return dot_dout_out(a, dtype, buf, s.q0 + i, h); }, dq, dk, dvv);
      for (std::int64_t i = 0; i < s.lq; ++i)
        for (std::int64_t c = 0; c < d; ++c)
          store_from_double(buf[b_dq], dtype, ((s.q0 + i) * a.heads + h) * d + c, dq[std::size_t(i * d + c)]);
    }
    for (std::int64_t j = 0; j < s.lk; ++j) {
      for (std::int64_t c = 0; c < d; ++c)
        store_from_double(buf[b_dk], dtype, ((s.k0 + j) * a.kv_heads + hk) * d + c, dk[std::size_t(j * d + c)]);
      for (std::int64_t c = 0; c < dv; ++c)
        store_from_double(buf[b_dv], dtype, ((s.k0 + j) * a.kv_heads + hk) * dv + c, dvv[std::size_t(j * dv + c)]);
    }
  });
  return {};
}

namespace {

class AttentionBwd final : public Family {
 public:
  std::string_view name() const override { return "attention_bwd"; }
  int version() const override { return 2; }

  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"stage", {}, {"prep", "main", "finish"},
         "prep: Dsum and resets; main: dK, dV and the dQ accumulator; finish: dQ (and GQA's dK, dV) in the dtype"},
        {"dtype", {}, {"f16", "bf16"}, "element type of q, k, v, out, dout and the gradients"},
        {"head_dim", {64, 80, 96, 128}, {}, "elements per head of q and k"},
        {"head_dim_v", {64, 80, 96, 128}, {}, "elements per head of v and out"},
        {"warps", {4, 8}, {}, "main: warps per block, 16 keys each"},
        {"block_m", {32, 64}, {}, "query rows a tile (fixed by the head dims: attention_bwd_block_m)"},
        {"path", {}, {"mma", "wgmma"},
         "main: mma: mma.sync, cp.async (sm_80 and later); wgmma: warp-specialized wgmma, TMA (sm_90a; both "
         "modes, softcap; 128 keys a block, 64 queries a tile; warps unused)"},
    };
    return defs;
  }

  const std::vector<ProblemField>& problem_fields() const override {
    using P = AttentionBwdProblem;
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
        key(&P::deterministic, "deterministic", "1: dQ summed in key-tile order"),
        key(&P::stage, "stage", "0 prep, 1 main, 2 finish"),
        value(&P::window_left, "window_left", "keys left of the diagonal seen; -1 unbounded"),
        value(&P::window_right, "window_right", "keys right of the diagonal seen; -1 unbounded, 0 causal"),
        value(&P::scale, "scale", "multiplies Q K^T"),
        value(&P::softcap, "softcap", "> 0: scores become softcap * tanh(score / softcap)")});
    return fields;
  }

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    const auto d = *params.get_int("head_dim"), dv = *params.get_int("head_dim_v");
    if (!attention_bwd_head_dims_supported(d, dv))
      return invalid_argument("attention_bwd: no kernel for head_dim " + std::to_string(d) + " with head_dim_v " +
                              std::to_string(dv));
    if (*params.get_int("block_m") != attention_bwd_block_m(d, dv))
      return invalid_argument("attention_bwd: head dims " + std::to_string(d) + "/" + std::to_string(dv) +
                              " take block_m " + std::to_string(attention_bwd_block_m(d, dv)));
    if (is_wgmma(params)) {
      if (stage_of(params) != 1) return invalid_argument("attention_bwd: the wgmma kernel is the main stage's");
      if (!attention_bwd_sm90_head_dims_supported(d, dv))
        return invalid_argument("attention_bwd: no wgmma kernel for head_dim " + std::to_string(d) +
                                " with head_dim_v " + std::to_string(dv));
      return {};
    }
    // The main kernel's warps tile dQ [block_m, head_dim] as block_m / 16 row groups times column
    // groups of a multiple of 16 dims.
    const std::int64_t warps = *params.get_int("warps"), rows = *params.get_int("block_m") / 16;
    if (warps % rows || d % (warps / rows) || (d / (warps / rows)) % 16)
      return invalid_argument("attention_bwd: " + std::to_string(warps) + " warps cannot tile dQ of head_dim " +
                              std::to_string(d) + " in rows of " + std::to_string(*params.get_int("block_m")));
    return {};
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    const std::string t = device_type(*params.get_str("dtype"));
    const std::string d = std::to_string(*params.get_int("head_dim")), dv = std::to_string(*params.get_int("head_dim_v"));
    const std::string warps = std::to_string(*params.get_int("warps"));
    const std::string bm = std::to_string(*params.get_int("block_m"));
    Rendered r;
    if (is_wgmma(params)) {
      r.source = "#include \"attention/attention_bwd_sm90.cuh\"\n";
      r.name_expression = "kiln::attention::attention_bwd_sm90<" + t + ", " + d + ", " + dv + ", " + bm + ", " +
                          std::to_string(k_attention_bwd_sm90_stages) + ">";
      return r;
    }
    r.source = "#include \"attention/attention_bwd.cuh\"\n";
    switch (stage_of(params)) {
      case 0: r.name_expression = "kiln::attention::attention_bwd_prep<" + t + ", " + d + ", " + dv + ", " + bm + ">"; break;
      case 2: r.name_expression = "kiln::attention::attention_bwd_finish<" + t + ", " + d + ", " + dv + ", " + bm + ">"; break;
      default:
        r.name_expression =
            "kiln::attention::attention_bwd_main<" + t + ", " + d + ", " + dv + ", " + warps + ", " + bm + ">";
    }
    return r;
  }

  bool runs_on(const Params& params, const GpuArch& arch) const override {
    return !is_wgmma(params) || (arch.capability == 90 && arch.suffix == 'a');
  }

  // Every stage for every dtype and head-dim pair (the mma.sync kernel's tile), then the sm_90a
  // main kernel for its pairs.
  std::vector<Params> catalog() const override {
    std::vector<Params> out;
    for (const char* dtype : {"f16", "bf16"})
      for (const auto& [d, dv] : k_attention_bwd_head_dims)
        for (std::int64_t stage = 0; stage < 3; ++stage) out.push_back(make(dtype, d, dv, stage));
    for (const char* dtype : {"f16", "bf16"})
      for (const auto& [d, dv] : k_attention_bwd_sm90_head_dims) out.push_back(make_sm90(dtype, d, dv));
    return out;
  }

  Status check_problem(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionBwdProblem>();
    KILN_TRY(check_shape(a));
    const auto dtype = *parse_dtype(*params.get_str("dtype"));
    if (dtype != p.dtype)
      return unsupported_dtype("attention_bwd: kernel is for " + std::string(dtype_name(dtype)) + ", tensors are " +
                               dtype_name(p.dtype));
    if (a.head_dim != *params.get_int("head_dim") || a.head_dim_v != *params.get_int("head_dim_v"))
      return invalid_argument("attention_bwd: the kernel is for head dims " +
                              std::to_string(*params.get_int("head_dim")) + "/" +
                              std::to_string(*params.get_int("head_dim_v")) + ", the problem has " +
                              std::to_string(a.head_dim) + "/" + std::to_string(a.head_dim_v));
    if (stage_of(params) != a.stage)
      return invalid_argument(std::string("attention_bwd: the kernel is the ") + k_stages[stage_of(params)] +
                              " stage, the problem asks for " + k_stages[a.stage]);
    if (p.alignment < 16) return invalid_argument("attention_bwd: q, k, v, out, dout and the gradients must be 16-byte aligned");
    if (p.cc && p.cc < 80) return invalid_argument("attention_bwd: the kernels need compute capability 8.0 or later");
    if (is_wgmma(params)) {
      if (p.cc && p.cc != 90) return invalid_argument("attention_bwd: the wgmma kernel needs compute capability 9.0 (sm_90a)");
      if (a.total_q <= 0 || a.total_k <= 0)
        return invalid_argument("attention_bwd: the wgmma kernel needs at least one query and one key token");
      if (attention_bwd_sm90_smem_bytes(a.head_dim, a.head_dim_v) > k_sm90_smem)
        return invalid_argument("attention_bwd: the variant needs more than 227 KiB of shared memory");
    } else if (attention_bwd_smem_bytes(a.head_dim, a.head_dim_v, int(*params.get_int("warps")),
                                        int(*params.get_int("block_m"))) > k_sm80_smem) {
      return invalid_argument("attention_bwd: the variant needs more shared memory than sm_80 grants a block");
    }
    const std::int64_t lim = 0x7fffffff;
    if (a.batch > 65535 || a.heads > 65535 || a.seqlen_q > lim || a.seqlen_k > lim || a.total_q * a.heads > lim ||
        a.total_k * a.heads > lim)
      return invalid_argument("attention_bwd: batch and heads up to 65535, token-head rows below 2^31");
    return {};
  }

  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto a = p.as<AttentionBwdProblem>();
    const std::int64_t warps = *params.get_int("warps"), bm = *params.get_int("block_m"), bn = 16 * warps;
    LaunchGeometry g;
    g.grid.y = std::uint32_t(std::max<std::int64_t>(a.heads, 1));
    g.grid.z = std::uint32_t(std::max<std::int64_t>(a.batch, 1));
    switch (stage_of(params)) {
      case 0:
        g.grid.x = std::uint32_t(std::max<std::int64_t>((a.seqlen_q + bm - 1) / bm, 1));
        g.block.x = 128;
        break;
      case 2: {
        // Sized by the key fields (batch x the longest sequences bounds the token counts, which a
        // cached launch may not share); the kernel's loops stride over the rest.
        const std::int64_t n = std::max({a.batch * a.seqlen_q * a.heads * a.head_dim,
                                         a.batch * a.seqlen_k * a.kv_heads * std::max(a.head_dim, a.head_dim_v),
                                         std::int64_t(1)});
        g.grid.x = std::uint32_t(std::clamp<std::int64_t>((n + 255) / 256, 1, 4096));
        g.grid.y = g.grid.z = 1;
        g.block.x = 256;
        break;
      }
      default:
        if (is_wgmma(params)) {
          // Two consumer warpgroups of 64 keys and the producer warpgroup.
          g.grid.x = std::uint32_t(std::max<std::int64_t>((a.seqlen_k + 127) / 128, 1));
          g.block.x = 384;
          g.shared_bytes = attention_bwd_sm90_smem_bytes(a.head_dim, a.head_dim_v);
          break;
        }
        g.grid.x = std::uint32_t(std::max<std::int64_t>((a.seqlen_k + bn - 1) / bn, 1));
        g.block.x = std::uint32_t(32 * warps);
        g.shared_bytes = attention_bwd_smem_bytes(a.head_dim, a.head_dim_v, int(warps), int(bm));
    }
    return g;
  }

  Params heuristic(const Problem& p) const override {
    const auto a = p.as<AttentionBwdProblem>();
    const std::string dtype = p.dtype == DType::bf16 ? "bf16" : "f16";
    if (!attention_bwd_head_dims_supported(a.head_dim, a.head_dim_v)) return make(dtype, 128, 128, a.stage);
    if (a.stage == 1 && wgmma_fits(a, p.cc)) return make_sm90(dtype, a.head_dim, a.head_dim_v);
    return make(dtype, a.head_dim, a.head_dim_v, std::clamp<std::int64_t>(a.stage, 0, 2));
  }

  // The main stage: 64 or 128 keys a block (4 or 8 warps) where the warps tile dQ.
  std::vector<Params> tuning_space(const Problem& p) const override {
    Params h = heuristic(p);
    if (p.as<AttentionBwdProblem>().stage != 1) return {h};
    std::vector<Params> out;
    const auto a = p.as<AttentionBwdProblem>();
    if (wgmma_fits(a, p.cc)) {
      Params c = make_sm90(p.dtype == DType::bf16 ? "bf16" : "f16", a.head_dim, a.head_dim_v);
      if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
    }
    for (std::int64_t warps : {4, 8}) {
      Params c = make(p.dtype == DType::bf16 ? "bf16" : "f16", a.head_dim, a.head_dim_v, 1);
      c.set("warps", warps);
      if (validate(c).ok() && check_problem(c, p).ok()) out.push_back(c);
    }
    return out;
  }

  Problem tuning_problem(const Problem& problem) const override {
    Problem out = Family::tuning_problem(problem);
    auto a = out.as<AttentionBwdProblem>();
    if (!a.varlen) {
      a.total_q = a.batch * a.seqlen_q;
      out.set(a);
    }
    return out;
  }

  // Unnamed fields: padded, kv_heads = heads, head_dim_v = head_dim, no window, scale
  // 1 / sqrt(head_dim), the main stage, fast mode.
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto get = [&](const char* n) { return shape_value(shape, n); };
    KILN_ASSIGN_OR_RETURN(Problem p, Family::problem_from_shape(
                                         dtype, with_defaults(shape, {{"batch", 1},
                                                                      {"kv_heads", get("heads").value_or(1)},
                                                                      {"head_dim_v", get("head_dim").value_or(128)},
                                                                      {"varlen", 0},
                                                                      {"deterministic", 0},
                                                                      {"stage", 1}})));
    auto a = p.as<AttentionBwdProblem>();
    if (!get("total_q")) a.total_q = a.batch * a.seqlen_q;
    if (!get("total_k")) a.total_k = a.batch * a.seqlen_k;
    if (!get("window_left")) a.window_left = -1;
    if (!get("window_right")) a.window_right = -1;
    if (a.scale == 0 && a.head_dim > 0) a.scale = 1.0 / std::sqrt(double(a.head_dim));
    p.set(a);
    return p;
  }

  // The main stage in fast mode (a lone launch of the deterministic one would wait on counters
  // nothing reset): small shapes the GPU conformance test checks, then the benchmark's.
  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (dtype != DType::f16 && dtype != DType::bf16) return {};
    struct S {
      std::int64_t batch, heads, kv_heads, seq, d, causal;
    };
    const S shapes[] = {{2, 4, 4, 256, 64, 1},     {1, 4, 4, 200, 80, 0},      {1, 4, 4, 256, 96, 1},
                        {2, 8, 8, 384, 128, 0},    {2, 8, 2, 256, 128, 1},     {4, 32, 32, 4096, 128, 1},
                        {2, 16, 16, 8192, 128, 0}, {4, 32, 32, 4096, 64, 0}};
    std::vector<Problem> out;
    for (const S& s : shapes) {
      AttentionBwdProblem a;
      a.batch = s.batch;
      a.seqlen_q = a.seqlen_k = s.seq;
      a.total_q = a.total_k = s.batch * s.seq;
      a.heads = s.heads;
      a.kv_heads = s.kv_heads;
      a.head_dim = a.head_dim_v = s.d;
      a.window_right = s.causal ? 0 : -1;
      a.scale = 1.0 / std::sqrt(double(s.d));
      a.stage = 1;
      out.push_back(Problem::of(dtype, 16, a));
    }
    return out;
  }

  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto a = p.as<AttentionBwdProblem>();
    const std::int64_t bound = a.varlen ? std::max<std::int64_t>(a.total_q, a.total_k) + 1 : 1;
    return {{"q", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim},
            {"k", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim},
            {"v", BufferRole::input, p.dtype, a.total_k * a.kv_heads * a.head_dim_v},
            {"out", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim_v},
            {"dout", BufferRole::input, p.dtype, a.total_q * a.heads * a.head_dim_v},
            {"lse", BufferRole::input, DType::f32, a.total_q * a.heads},
            {"cu_seqlens_q", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"cu_seqlens_k", BufferRole::input, DType::i32, a.batch + 1, bound},
            {"workspace", BufferRole::input, DType::f32, attention_bwd_workspace_elements(a)},
            {"dq", BufferRole::output, p.dtype, a.total_q * a.heads * a.head_dim},
            {"dk", BufferRole::output, p.dtype, a.total_k * a.kv_heads * a.head_dim},
            {"dv", BufferRole::output, p.dtype, a.total_k * a.kv_heads * a.head_dim_v}};
  }

  void pack_args(const Params& params, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    const auto a = p.as<AttentionBwdProblem>();
    auto buf = [&](std::size_t i) { return i < b.size() ? b[i] : static_cast<void*>(nullptr); };
    // wgmma: the buffers it takes by pointer (lse, cu_seqlens, workspace, dk, dv, k, v); q, dout and
    // the dQ accumulator come as tensor maps after the scalars.
    if (is_wgmma(params))
      for (std::size_t i : {b_lse, b_cu_q, b_cu_k, b_ws, b_dk, b_dv, b_k, b_v}) out.add(buf(i));
    else
      for (std::size_t i = 0; i < std::size_t(b_count); ++i) out.add(buf(i));
    out.add(int(a.seqlen_q));
    out.add(int(a.seqlen_k));
    out.add(int(a.total_q));
    out.add(int(a.total_k));
    out.add(int(a.batch));
    out.add(int(a.heads));
    out.add(int(a.kv_heads));
    out.add(int(a.window_left));
    out.add(int(a.window_right));
    out.add(int((a.varlen ? 1 : 0) | (a.deterministic ? 2 : 0)));  // flags: k_bwd_varlen, k_bwd_deterministic
    out.add(float(a.scale));
    out.add(float(a.softcap));
    if (!is_wgmma(params)) return;
    // wgmma: tensor maps of q and dout (tokens x heads * head_dim * 2 bytes, boxes of 64 query
    // rows) and of the f32 dQ accumulator (tokens x heads * head_dim, boxes of 64 rows x 32 dims).
    const auto rows = [](std::int64_t n) { return std::uint64_t(std::max<std::int64_t>(n, 1)); };
    auto at = [&](std::size_t i) { return static_cast<const void*>(buf(i)); };
    out.add_tensor_map({at(b_q), std::uint64_t(a.heads * a.head_dim * 2), rows(a.total_q), 64, 0});
    out.add_tensor_map({at(b_dout), std::uint64_t(a.heads * a.head_dim_v * 2), rows(a.total_q), 64, 0});
    const float* dq_acc = buf(b_ws) ? static_cast<const float*>(buf(b_ws)) + attention_bwd_dsum_words(a) : nullptr;
    out.add_tensor_map({dq_acc, std::uint64_t(a.heads * a.head_dim * 4), rows(a.total_q), 64, 32});
  }

  // What the stage's kernel computes, in fp64, on the buffers of buffers(): prep writes the
  // workspace's Dsum, zeroes the dQ accumulator and the counters; main adds dQ to the accumulator
  // and writes dk, dv (GQA: per query head into the workspace); finish writes dq (and GQA's dk, dv).
  // The op's CPU fallback is attention_backward_reference, the three in one.
  Status cpu_reference(const Params& params, const Problem& p, std::span<void* const> buf) const override {
    if (buf.size() != std::size_t(b_count)) return invalid_argument("attention_bwd: the reference takes 12 buffers");
    const auto a = p.as<AttentionBwdProblem>();
    KILN_TRY(check_shape(a));
    const auto* cu_q = static_cast<const std::int32_t*>(buf[b_cu_q]);
    const auto* cu_k = static_cast<const std::int32_t*>(buf[b_cu_k]);
    if (a.varlen && (!cu_q || !cu_k)) return invalid_argument("attention_bwd: varlen needs cu_seqlens");
    const std::int64_t d = a.head_dim, dv = a.head_dim_v, group = a.heads / a.kv_heads;
    const std::int64_t bm = *params.get_int("block_m"), m_tiles = (a.seqlen_q + bm - 1) / bm;
    auto* ws = static_cast<float*>(buf[b_ws]);
    float* dsum = ws;
    float* dqa = dsum + attention_bwd_dsum_words(a);
    auto* counters = reinterpret_cast<std::int32_t*>(dqa + a.total_q * a.heads * d);
    float* dkw = reinterpret_cast<float*>(counters + a.batch * a.heads * m_tiles);
    float* dvw = dkw + a.total_k * a.heads * d;
    const std::int64_t stage = stage_of(params);
    if (stage == 0) {
      for (std::int64_t i = 0; i < a.batch * a.heads * m_tiles; ++i) counters[i] = 0;
      for (std::int64_t b = 0; b < a.batch; ++b) {
        const Seq s = sequence(a, cu_q, cu_k, b);
        for (std::int64_t h = 0; h < a.heads; ++h)
          for (std::int64_t i = 0; i < s.lq; ++i) {
            dsum[h * a.total_q + s.q0 + i] = float(dot_dout_out(a, p.dtype, buf, s.q0 + i, h));
            std::fill_n(dqa + ((s.q0 + i) * a.heads + h) * d, d, 0.0f);
          }
      }
      return {};
    }
    if (stage == 2) {
      const std::int64_t q_end = a.varlen ? cu_q[a.batch] : a.total_q, k_end = a.varlen ? cu_k[a.batch] : a.total_k;
      for (std::int64_t i = 0; i < a.total_q * a.heads * d; ++i)
        store_from_double(buf[b_dq], p.dtype, i, i / (a.heads * d) < q_end ? double(dqa[i]) : 0.0);
      if (group == 1) {
        if (a.varlen) {
          for (std::int64_t i = k_end * a.kv_heads * d; i < a.total_k * a.kv_heads * d; ++i)
            store_from_double(buf[b_dk], p.dtype, i, 0.0);
          for (std::int64_t i = k_end * a.kv_heads * dv; i < a.total_k * a.kv_heads * dv; ++i)
            store_from_double(buf[b_dv], p.dtype, i, 0.0);
        }
        return {};
      }
      for (std::int64_t t = 0; t < a.total_k; ++t)
        for (std::int64_t hk = 0; hk < a.kv_heads; ++hk) {
          for (std::int64_t c = 0; c < d; ++c) {
            double s = 0;
            if (t < k_end)
              for (std::int64_t g = 0; g < group; ++g) s += dkw[(t * a.heads + hk * group + g) * d + c];
            store_from_double(buf[b_dk], p.dtype, (t * a.kv_heads + hk) * d + c, s);
          }
          for (std::int64_t c = 0; c < dv; ++c) {
            double s = 0;
            if (t < k_end)
              for (std::int64_t g = 0; g < group; ++g) s += dvw[(t * a.heads + hk * group + g) * dv + c];
            store_from_double(buf[b_dv], p.dtype, (t * a.kv_heads + hk) * dv + c, s);
          }
        }
      return {};
    }
    parallel(a.batch * a.heads, [&](std::int64_t t) {
      const std::int64_t b = t / a.heads, h = t % a.heads, hk = h / group;
      const Seq s = sequence(a, cu_q, cu_k, b);
      std::vector<double> kd, vd, dq, dk(std::size_t(s.lk * d), 0.0), dvv(std::size_t(s.lk * dv), 0.0);
      load_kv(a, p.dtype, buf, s, hk, kd, vd);
      head_backward(a, p.dtype, buf, s, b, h, kd, vd,
                    [&](std::int64_t i) { return double(dsum[h * a.total_q + s.q0 + i]); }, dq, dk, dvv);
      for (std::int64_t i = 0; i < s.lq; ++i)
        for (std::int64_t c = 0; c < d; ++c) dqa[((s.q0 + i) * a.heads + h) * d + c] += float(dq[std::size_t(i * d + c)]);
      for (std::int64_t j = 0; j < s.lk; ++j) {
        for (std::int64_t c = 0; c < d; ++c) {
          const double x = dk[std::size_t(j * d + c)];
          if (group > 1) dkw[((s.k0 + j) * a.heads + h) * d + c] = float(x);
          else store_from_double(buf[b_dk], p.dtype, ((s.k0 + j) * a.kv_heads + hk) * d + c, x);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          const double x = dvv[std::size_t(j * dv + c)];
          if (group > 1) dvw[((s.k0 + j) * a.heads + h) * dv + c] = float(x);
          else store_from_double(buf[b_dv], p.dtype, ((s.k0 + j) * a.kv_heads + hk) * dv + c, x);
        }
      }
    });
    return {};
  }

 private:
  static Params make(const std::string& dtype, std::int64_t d, std::int64_t dv, std::int64_t stage) {
    return Params{{"stage", std::string(k_stages[std::clamp<std::int64_t>(stage, 0, 2)])},
                  {"dtype", dtype},
                  {"head_dim", d},
                  {"head_dim_v", dv},
                  {"warps", std::int64_t(attention_bwd_warps(d, dv))},
                  {"block_m", std::int64_t(attention_bwd_block_m(d, dv))},
                  {"path", std::string("mma")}};
  }
  static Params make_sm90(const std::string& dtype, std::int64_t d, std::int64_t dv) {
    Params p = make(dtype, d, dv, 1);
    p.set("path", std::string("wgmma"));
    return p;
  }
};

}  // namespace

void register_attention_bwd(Registry& r) { (void)r.add(std::make_shared<AttentionBwd>()); }

}  // namespace kiln::families
