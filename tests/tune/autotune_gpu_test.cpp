// The tuner on a real GPU: it picks a variant that matches the CPU reference, records every
// candidate, keeps broken ones (compile, launch, wrong result, invalid) as failures rather than
// dying, stores the winner per setup, stays under the time budget once compiled, and kilnd serves
// the winner to a second client over its real socket.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "cache/store.h"
#include "cache/tuning.h"
#include "client/daemon_client.h"
#include "common/half.h"
#include "jit/autotune.h"
#include "jit/autotune_mode.h"
#include "jit/builder.h"
#include "jit/device_info.h"
#include "jit/tuning_setup.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/gpu_util.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using testing::DeviceBuffer;

// A tiny family whose variants fail in every way the tuner must survive: y = 2x, except mode
// "wrong" (y = 3x), "partial" (writes half of y), "broken" (source that does not compile), and
// block 2048 (more threads than a block may have: the launch fails).
struct ProbeProblem {
  std::int64_t rows = 0, cols = 0;
};

class ProbeFamily final : public Family {
 public:
  std::string_view name() const override { return "tune_probe"; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> defs = {
        {"block", {128, 256, 2048}, {}, "threads per block"},
        {"mode", {}, {"good", "wrong", "partial", "broken"}, "what the kernel does"},
    };
    return defs;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> fields = problem_fields_of<ProbeProblem>(
        {bucketed(&ProbeProblem::rows, "rows", "rows"), key(&ProbeProblem::cols, "cols", "columns")});
    return fields;
  }
  static std::int64_t elements(const Problem& p) {
    const auto q = p.as<ProbeProblem>();
    return q.rows * q.cols;
  }
  Result<Rendered> render(const Params& p) const override {
    KILN_TRY(validate(p));
    const std::string mode = *p.get_str("mode");
    Rendered r;
    r.source = mode == "broken" ? "this is not CUDA C++;\n"
                                : "template <int MODE, int BLOCK>\n"
                                  "__global__ void tune_probe(const float* x, float* y, long long n) {\n"
                                  "  long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;\n"
                                  "  if (MODE == 2 && i >= n / 2) return;\n"
                                  "  if (i < n) y[i] = (MODE == 1 ? 3.0f : 2.0f) * x[i];\n"
                                  "}\n";
    const int m = mode == "wrong" ? 1 : mode == "partial" ? 2 : 0;
    r.name_expression = "tune_probe<" + std::to_string(m) + ", " + std::to_string(*p.get_int("block")) + ">";
    return r;
  }
  std::vector<Params> catalog() const override { return {}; }
  Status check_problem(const Params& params, const Problem& p) const override {
    if (p.dtype != DType::f32) return unsupported_dtype("tune_probe: f32 only");
    if (p.as<ProbeProblem>().rows < 1 || p.as<ProbeProblem>().cols < 1) return shape_mismatch("tune_probe: need rows, cols >= 1");
    return {};
  }
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    const auto block = *params.get_int("block");
    LaunchGeometry g;
    g.grid.x = std::uint32_t((elements(p) + block - 1) / block);
    g.block.x = std::uint32_t(block);
    return g;
  }
  Params heuristic(const Problem&) const override { return Params{{"block", 128}, {"mode", "good"}}; }
  std::vector<Params> tuning_space(const Problem&) const override {
    return {Params{{"block", 128}, {"mode", "good"}},   Params{{"block", 256}, {"mode", "good"}},
            Params{{"block", 256}, {"mode", "wrong"}},  Params{{"block", 256}, {"mode", "partial"}},
            Params{{"block", 256}, {"mode", "broken"}}, Params{{"block", 2048}, {"mode", "good"}}};
  }
  std::vector<BufferSpec> buffers(const Params&, const Problem& p) const override {
    const auto n = elements(p);
    return {{"x", BufferRole::input, DType::f32, n}, {"y", BufferRole::output, DType::f32, n}};
  }
  void pack_args(const Params&, const Problem& p, std::span<void* const> b, ArgPack& out) const override {
    out.add(b[0]);
    out.add(b[1]);
    out.add(static_cast<long long>(elements(p)));
  }
  Status cpu_reference(const Params&, const Problem& p, std::span<void* const> b) const override {
    const auto* x = static_cast<const float*>(b[0]);
    auto* y = static_cast<float*>(b[1]);
    for (std::int64_t i = 0; i < elements(p); ++i) y[i] = 2.0f * x[i];
    return {};
  }
};

const Family& probe_family() {
  static const Family* f = [] {
    (void)Registry::global().add(std::make_shared<ProbeFamily>());
    return Registry::global().find("tune_probe");
  }();
  return *f;
}

const Family& family(const char* name) { return *Registry::global().find(name); }

class AutotuneGpu : public testing::GpuFixture {
 protected:
  void SetUp() override {
    GpuFixture::SetUp();
    if (IsSkipped()) return;
    store_ = cache::Store::open(dir_.path() / "k.sqlite").value();
    table_ = cache::TuningTable::open(*store_).value();
    builder_ = std::make_unique<jit::Builder>(store_.get(), &Registry::global(), jit::BuilderOptions{.use_pch = true});
  }

  // Runs `params` of `family` on fresh random inputs (outputs poisoned) and returns the largest
  // relative L2 error over the outputs against the CPU reference.
  double run_and_check(const Family& f, const Params& params, const Problem& p) {
    auto k = rt_->kernel(KernelSpec{std::string(f.name()), params});
    EXPECT_TRUE(k.ok()) << k.status().to_string();
    if (!k.ok()) return NAN;
    const auto specs = f.buffers(params, p);
    std::vector<std::unique_ptr<DeviceBuffer>> dev;
    std::vector<std::vector<unsigned char>> host, want;
    std::vector<void*> dptr, wptr;
    for (const auto& b : specs) {
      const std::size_t bytes = std::size_t(b.elements) * dtype_size(b.dtype);
      dev.push_back(std::make_unique<DeviceBuffer>(bytes));
      host.push_back(b.role == BufferRole::input ? testing::random_bytes(b.dtype, b.elements, rng_)
                                                 : std::vector<unsigned char>(bytes, 0xFF));
      want.push_back(host.back());
      if (b.role == BufferRole::input) dev.back()->upload(host.back().data());
      else dev.back()->poison();
      dptr.push_back(dev.back()->get());
      wptr.push_back(want.back().data());
    }
    Status s = rt_->launch(**k, p, dptr, nullptr);
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
    EXPECT_TRUE(f.cpu_reference(params, p, wptr).ok());
    double worst = 0;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].role != BufferRole::output) continue;
      std::vector<unsigned char> got(host[i].size());
      dev[i]->download(got.data());
      std::vector<std::int64_t> idx(std::size_t(specs[i].elements));
      for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = std::int64_t(j);
      worst = std::max(worst, testing::rel_l2(got.data(), want[i].data(), specs[i].dtype, idx));
    }
    return worst;
  }

  std::unique_ptr<cache::Store> store_;
  std::unique_ptr<cache::TuningTable> table_;
  std::unique_ptr<jit::Builder> builder_;
};

TEST_F(AutotuneGpu, PicksAVariantThatMatchesTheReferenceAndStoresIt) {
  struct Case {
    const char* family;
    std::vector<std::pair<std::string, std::int64_t>> shape;
  };
  for (const Case& c : {Case{"rmsnorm", {{"rows", 512}, {"cols", 4096}}}, Case{"rmsnorm", {{"rows", 3}, {"cols", 5120}}},
                        Case{"act_and_mul", {{"rows", 16}, {"d", 14336}}}}) {
    SCOPED_TRACE(std::string(c.family) + " seed " + std::to_string(seed_));
    const Family& f = family(c.family);
    const Problem p = f.problem_from_shape(DType::bf16, c.shape).value();
    jit::Tuner tuner(builder_.get(), table_.get());
    auto rec = tuner.tune(f, p);
    ASSERT_TRUE(rec.ok()) << rec.status().to_string();
    ASSERT_FALSE(rec->winner.empty());
    // The tuner times the problem as it runs on its device (device 0 here).
    Problem on_device = p;
    jit::set_device(on_device, *jit::device_info(0).value());
    const Problem tp = f.tuning_problem(on_device);
    // One vector: begin() and end() of two calls' temporaries would be two different ranges.
    const std::vector<Params> space = f.tuning_space(tp);
    EXPECT_EQ(rec->candidates.size(), space.size() + (std::count(space.begin(), space.end(), f.heuristic(tp)) ? 0 : 1));
    int ok = 0;
    for (const auto& cand : rec->candidates) {
      EXPECT_EQ(cand.status, cache::CandidateStatus::ok) << cand.params << ": " << cand.error;
      if (cand.status != cache::CandidateStatus::ok) continue;
      ++ok;
      EXPECT_GT(cand.median_ms, 0);
      // Hopeless candidates (over twice the best time) stop after three timed launches.
      EXPECT_GE(cand.launches, cand.params == rec->winner ? 5 : 3) << cand.params;
      // The winner is the fastest, or within the tie band of it.
      EXPECT_GE(cand.median_ms, rec->winner_ms / 1.03 - 0.0005 - 1e-9) << cand.params << " beats " << rec->winner;
    }
    EXPECT_GT(ok, 1);
    EXPECT_EQ(rec->heuristic, f.heuristic(tp).canonical());
    EXPECT_GT(rec->heuristic_ms, 0);
    std::printf("%s %s: winner %s %.2f us, heuristic %s %.2f us, compile %.0f ms, measure %.0f ms\n", c.family,
                rec->signature.c_str(), rec->winner.c_str(), rec->winner_ms * 1e3, rec->heuristic.c_str(),
                rec->heuristic_ms * 1e3, rec->compile_ms, rec->measure_ms);

    // Stored for this GPU's setup, and the winner computes the right thing on the real problem.
    const jit::DeviceInfo& dev = *jit::device_info(0).value();
    auto setup = jit::tuning_setup(f, p, dev.arch, dev.name, dev.driver_version).value();
    auto found = table_->lookup(std::string(f.name()), f.signature(p), setup);
    ASSERT_TRUE(found.ok() && found->has_value());
    EXPECT_EQ((*found)->winner, rec->winner);
    const Params winner = Params::parse(rec->winner).value();
    ASSERT_TRUE(f.check_problem(winner, p).ok());
    EXPECT_LE(run_and_check(f, winner, p), testing::tolerance(DType::bf16));
  }
}

TEST_F(AutotuneGpu, OneProblemTunesUnderTwoSecondsOnceCompiled) {
  const Family& f = family("rmsnorm");
  const Problem p = f.problem_from_shape(DType::bf16, {{"rows", 4096}, {"cols", 8192}}).value();
  jit::Tuner tuner(builder_.get(), table_.get());
  auto first = tuner.tune(f, p);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  const auto t0 = Clock::now();
  auto second = tuner.tune(f, p);
  const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  std::printf("first tune: compile %.0f ms, measure %.0f ms; cached: compile %.0f ms, measure %.0f ms, wall %.0f ms\n",
              first->compile_ms, first->measure_ms, second->compile_ms, second->measure_ms, wall_ms);
  EXPECT_LT(wall_ms, 2000);
}

TEST_F(AutotuneGpu, BrokenCandidatesAreRecordedNotFatal) {
  const Family& f = probe_family();
  const Problem p = Problem::of(DType::f32, 16, ProbeProblem{.rows = 1000, .cols = 333});
  jit::TuneOptions o;
  o.candidates = f.tuning_space(p);
  o.candidates.push_back(Params{{"block", 999}, {"mode", "good"}});  // not in the schema
  jit::Tuner tuner(builder_.get(), table_.get());
  auto rec = tuner.tune(f, p, o);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string();
  std::map<std::string, cache::CandidateStatus> status;
  for (const auto& c : rec->candidates) status[c.params] = c.status;
  using S = cache::CandidateStatus;
  EXPECT_EQ(status["block=128,mode=good"], S::ok);
  EXPECT_EQ(status["block=256,mode=good"], S::ok);
  EXPECT_EQ(status["block=256,mode=wrong"], S::wrong_result);
  EXPECT_EQ(status["block=256,mode=partial"], S::wrong_result);
  EXPECT_EQ(status["block=256,mode=broken"], S::compile_failed);
  EXPECT_EQ(status["block=2048,mode=good"], S::launch_failed);
  EXPECT_EQ(status["block=999,mode=good"], S::invalid);
  EXPECT_TRUE(rec->winner == "block=128,mode=good" || rec->winner == "block=256,mode=good") << rec->winner;
  for (const auto& c : rec->candidates) {
    if (c.status != S::ok) {
      EXPECT_FALSE(c.error.empty()) << c.params;
    }
  }
  // The context survived: the winner still runs and is right.
  EXPECT_LE(run_and_check(f, Params::parse(rec->winner).value(), p), 1e-6);
}

TEST_F(AutotuneGpu, EmbeddedWaitModeTunesOnTheFirstCall) {
  RuntimeOptions o;
  o.mode = ResolverMode::embedded;
  o.cache_file = (dir_.path() / "k.sqlite").string();
  o.autotune = Autotune::wait;
  auto rt = Runtime::create(o).value();
  const Family& f = family("act_and_mul");
  const Problem p = f.problem_from_shape(DType::bf16, {{"rows", 100}, {"d", 4096}}).value();
  const auto specs = f.buffers(f.heuristic(p), p);
  DeviceBuffer x(std::size_t(specs[0].elements) * 2), out(std::size_t(specs[1].elements) * 2);
  auto hx = testing::random_bytes(DType::bf16, specs[0].elements, rng_);
  x.upload(hx.data());
  out.poison();
  void* bufs[2] = {x.get(), out.get()};
  Status s = rt->run(f, p, bufs, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(rt->counters().tuned_choices, 1);
  auto listed = table_->list({"act_and_mul", ""});
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);
  std::vector<unsigned char> got(std::size_t(specs[1].elements) * 2), want(got.size(), 0xFF);
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  out.download(got.data());
  void* ref[2] = {hx.data(), want.data()};
  ASSERT_TRUE(f.cpu_reference(f.heuristic(p), p, ref).ok());
  std::vector<std::int64_t> idx(std::size_t(specs[1].elements));
  for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = std::int64_t(j);
  EXPECT_LE(testing::rel_l2(got.data(), want.data(), DType::bf16, idx), testing::tolerance(DType::bf16));
}

TEST_F(AutotuneGpu, KilndServesTheTunedWinnerToASecondClient) {
  testing::DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  const Family& f = family("rmsnorm");
  const Problem p = f.problem_from_shape(DType::bf16, {{"rows", 4096}, {"cols", 5120}}).value();

  // Client one tunes through the daemon.
  auto one = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(one.ok());
  auto rec = (*one)->tune(f, p, 0);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string() << "\n" << k->log();
  ASSERT_FALSE(rec->winner.empty()) << k->log();

  // Client two, a Runtime in daemon mode, resolves the same signature (another row count of the
  // bucket) and runs the winner.
  const jit::DeviceInfo& dev = *jit::device_info(0).value();
  auto two = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(two.ok());
  const Problem member = f.problem_from_shape(DType::bf16, {{"rows", 3001}, {"cols", 5120}}).value();
  auto r = (*two)->resolve(f, member, {dev.arch, dev.name, dev.driver_version, dev.pci_bus_id},
                           jit::AutotuneMode::off);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->tuned);
  EXPECT_EQ(r->params.canonical(), rec->winner);

  RuntimeOptions o;
  o.mode = ResolverMode::daemon;
  o.socket_path = env.socket().string();
  o.autotune = Autotune::off;
  auto rt = Runtime::create(o).value();
  const auto specs = f.buffers(f.heuristic(member), member);
  DeviceBuffer x(std::size_t(specs[0].elements) * 2), w(std::size_t(specs[1].elements) * 2),
      y(std::size_t(specs[2].elements) * 2);
  auto hx = testing::random_bytes(DType::bf16, specs[0].elements, rng_);
  auto hw = testing::random_bytes(DType::bf16, specs[1].elements, rng_);
  x.upload(hx.data());
  w.upload(hw.data());
  y.poison();
  void* bufs[3] = {x.get(), w.get(), y.get()};
  Status s = rt->run(f, member, bufs, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(rt->counters().tuned_choices, 1);
  EXPECT_EQ(rt->resolver(), "daemon");
  ASSERT_EQ(jit::Driver::get().value()->ctx_synchronize(), CUDA_SUCCESS);
  std::vector<unsigned char> got(std::size_t(specs[2].elements) * 2), want(got.size(), 0xFF);
  y.download(got.data());
  void* ref[3] = {hx.data(), hw.data(), want.data()};
  ASSERT_TRUE(f.cpu_reference(f.heuristic(member), member, ref).ok());
  std::vector<std::int64_t> idx(std::size_t(specs[2].elements));
  for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = std::int64_t(j);
  EXPECT_LE(testing::rel_l2(got.data(), want.data(), DType::bf16, idx), testing::tolerance(DType::bf16));
}

}  // namespace
}  // namespace kiln
