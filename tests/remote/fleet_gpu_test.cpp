// The fleet tier on a GPU: what one host compiled or tuned reaches another through a real
// redis-server, and the other host launches it through libkiln's typed ops, checked against the
// families' CPU references on fresh random data (outputs poisoned before every launch).
//
// A host is a kilnd process with its own socket and cache directory (a Runtime in daemon mode on
// its socket launches), or an embedded Runtime in this process with its own cache file and the
// remote tier from the environment (KILN_REMOTE, KILN_FLEET_KEY_FILE). Host B always starts with
// an empty cache. The kernels: an RMSNorm variant, and on compute capability 9.0 the FP8 GEMM's
// warp-specialized wgmma variant (sm_90a, TMA). Checked:
// * B is served what A compiled from Redis with no compile (kilnd's builder and remote counters;
//   for an embedded host, Redis's own count of SET commands: a host that compiles takes a compile
//   lock and writes back, both SETs) and launches it correctly;
// * a corrupted Redis entry is rejected by B, compiled there, and the launch is still correct;
// * a real tuning run on A (`kiln tune` through kilnd, `kiln tune` in-process, an embedded
//   KILN_AUTOTUNE=wait run) writes its winner to Redis; B, never tuning, takes that winner (the
//   same params, kept in its own tuning table, the very variant its launch loaded) and launches
//   it correctly.
// Skips without a GPU or without redis-server (KILN_REDIS_SERVER names one; scripts/gpu_run.sh
// points it at the copy scripts/stage_gpu.sh stages).
#include <gtest/gtest.h>

#include <spawn.h>
#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "cache/store.h"
#include "cache/tuning.h"
#include "common/fp8.h"
#include "families/common/gemm/gemm_util.h"
#include "families/gemm/fp8_gemm.h"
#include "families/rmsnorm/rmsnorm.h"
#include "jit/device_info.h"
#include "kiln/ops.h"
#include "kiln/runtime.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/gpu_util.h"
#include "tests/remote/redis_harness.h"

namespace kiln::testing {
namespace {

const jit::Driver* drv() { return jit::Driver::get().value(); }

// One typed op on random inputs uploaded once; run() poisons the output, launches through the
// given runtime and returns the relative L2 error against the op's CPU fallback (the family's
// reference) on the same inputs.
class Workload {
 public:
  virtual ~Workload() = default;
  virtual const Family& family() const = 0;
  // The problem the op builds, with this device's facts: what Runtime::run picks a variant for.
  virtual Problem problem() const = 0;
  virtual double run(Runtime& rt) = 0;
  // The variant an untuned host launches.
  Params heuristic() const { return family().heuristic(problem()); }
  std::string describe() const { return std::string(family().name()) + " " + heuristic().canonical(); }

 protected:
  static jit::DeviceInfo device() { return *jit::device_info(0).value(); }
  // rel_l2 over every element of `out` after the op ran (`status`).
  template <class Download>
  static double finish(const Status& status, DType t, std::int64_t n, const std::vector<unsigned char>& want,
                       Download&& download) {
    EXPECT_TRUE(status.ok()) << status.to_string();
    if (!status.ok()) return NAN;
    EXPECT_EQ(drv()->ctx_synchronize(), CUDA_SUCCESS);
    std::vector<unsigned char> got(want.size());
    download(got.data());
    std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = std::int64_t(i);
    return rel_l2(got.data(), want.data(), t, idx);
  }
};

// y = rms_norm(x, w), bf16, contiguous [rows, cols].
class RmsNormWorkload final : public Workload {
 public:
  RmsNormWorkload(std::int64_t rows, std::int64_t cols, std::mt19937& rng)
      : rows_(rows), cols_(cols), hx_(random_bytes(DType::bf16, rows * cols, rng, 2.0f)),
        hw_(random_bytes(DType::bf16, cols, rng)), want_(hx_.size()), dx_(hx_.size()), dw_(hw_.size()),
        dy_(hx_.size()) {
    dx_.upload(hx_.data());
    dw_.upload(hw_.data());
    const Status s = rms_norm(view(hx_.data(), Device::cpu()),
                              TensorView::contiguous(hw_.data(), DType::bf16, {cols_}, Device::cpu()),
                              view(want_.data(), Device::cpu()), k_eps);
    EXPECT_TRUE(s.ok()) << "the CPU reference: " << s.to_string();
  }
  const Family& family() const override { return *Registry::global().find("rmsnorm"); }
  Problem problem() const override {
    Problem p = Problem::of(DType::bf16, 16,
                            families::RmsNormProblem{.rows = rows_, .cols = cols_, .x_row_stride = cols_,
                                                     .y_row_stride = cols_, .eps = k_eps});
    jit::set_device(p, device());
    return p;
  }
  double run(Runtime& rt) override {
    dy_.poison();
    const Status s = rms_norm(view(dx_.get(), Device::cuda(0)),
                              TensorView::contiguous(dw_.get(), DType::bf16, {cols_}, Device::cuda(0)),
                              view(dy_.get(), Device::cuda(0)), k_eps, nullptr, &rt);
    return finish(s, DType::bf16, rows_ * cols_, want_, [&](void* out) { dy_.download(out); });
  }

 private:
  static constexpr double k_eps = 1e-6;
  TensorView view(void* p, Device d) const { return TensorView::contiguous(p, DType::bf16, {rows_, cols_}, d); }
  std::int64_t rows_, cols_;
  std::vector<unsigned char> hx_, hw_, want_;
  DeviceBuffer dx_, dw_, dy_;
};

// out = fp8_gemm(a, b) with per-tensor scales, bf16 out; b is the K-major view of an [N, K]
// tensor. M and N are not multiples of any tile, K not of 128.
class Fp8GemmWorkload final : public Workload {
 public:
  Fp8GemmWorkload(std::int64_t m, std::int64_t n, std::int64_t k, std::mt19937& rng)
      : m_(m), n_(n), k_(k), ha_(e4m3(m * k, rng)), hb_(e4m3(n * k, rng)), want_(std::size_t(m * n) * 2),
        da_(ha_.size()), db_(hb_.size()), dsa_(4), dsb_(4), dout_(want_.size()) {
    std::uniform_real_distribution<float> scale(0.25f, 2.0f);
    sa_ = scale(rng) / 64.0f;
    sb_ = scale(rng) / 64.0f;
    da_.upload(ha_.data());
    db_.upload(hb_.data());
    dsa_.upload(&sa_);
    dsb_.upload(&sb_);
    const Status s = call(ha_.data(), hb_.data(), &sa_, &sb_, want_.data(), Device::cpu(), nullptr);
    EXPECT_TRUE(s.ok()) << "the CPU reference: " << s.to_string();
  }
  const Family& family() const override { return *Registry::global().find("fp8_gemm"); }
  Problem problem() const override {
    Problem p = Problem::of(DType::bf16, 16,
                            families::gemm::GemmProblem{.m = m_, .n = n_, .k = k_, .mode = families::k_fp8_per_tensor});
    jit::set_device(p, device());
    return p;
  }
  double run(Runtime& rt) override {
    dout_.poison();
    const Status s = call(da_.get(), db_.get(), dsa_.get(), dsb_.get(), dout_.get(), Device::cuda(0), &rt);
    return finish(s, DType::bf16, m_ * n_, want_, [&](void* out) { dout_.download(out); });
  }

 private:
  static std::vector<unsigned char> e4m3(std::int64_t n, std::mt19937& rng) {
    std::normal_distribution<float> d(0.0f, 2.0f);
    std::vector<unsigned char> out(static_cast<std::size_t>(n));
    for (auto& v : out) v = float_to_e4m3(d(rng));
    return out;
  }
  Status call(void* a, void* b, void* sa, void* sb, void* out, Device d, Runtime* rt) const {
    TensorView bv = TensorView::contiguous(b, DType::u8, {n_, k_}, d);
    std::swap(bv.shape[0], bv.shape[1]);
    std::swap(bv.strides[0], bv.strides[1]);
    return fp8_gemm(TensorView::contiguous(a, DType::u8, {m_, k_}, d), bv,
                    TensorView::contiguous(sa, DType::f32, {1}, d), TensorView::contiguous(sb, DType::f32, {1}, d),
                    TensorView::contiguous(out, DType::bf16, {m_, n_}, d), nullptr, rt);
  }
  std::int64_t m_, n_, k_;
  std::vector<unsigned char> ha_, hb_, want_;
  float sa_ = 1, sb_ = 1;
  DeviceBuffer da_, db_, dsa_, dsb_, dout_;
};

// Launches every workload through `rt` and checks each against its reference.
void expect_correct(std::vector<std::unique_ptr<Workload>>& work, Runtime& rt, const char* host, unsigned seed) {
  for (auto& w : work)
    EXPECT_LT(w->run(rt), tolerance(DType::bf16)) << host << ", " << w->describe() << ", seed " << seed;
}

// True when `rt` loaded exactly this variant already: kernel() answers from its table, nothing is
// resolved or loaded. (When it did not, this resolves the variant: call it last.)
bool loaded(Runtime& rt, const Family& f, const Params& p) {
  const RuntimeCounters before = rt.counters();
  auto k = rt.kernel(KernelSpec{std::string(f.name()), p});
  const RuntimeCounters after = rt.counters();
  return k.ok() && after.table_hits == before.table_hits + 1 && after.module_loads == before.module_loads;
}

// Copies the prewarmed catalog cache (KILN_GPU_TEST_CACHE, set by scripts/gpu_run.sh) to `file`,
// so that a tuning host compiles only the candidates the catalogs lack. Hosts whose compiles are
// the point of a test start empty instead.
void seed_from_gpu_test_cache(const fs::path& file) {
  const char* seed = std::getenv("KILN_GPU_TEST_CACHE");
  if (!seed || !*seed) return;
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  fs::copy_file(seed, file, fs::copy_options::overwrite_existing, ec);
  EXPECT_FALSE(ec) << "copying KILN_GPU_TEST_CACHE " << seed << ": " << ec.message();
}

// A kilnd host: its own socket and cache directory, the remote tier on the command line, and a
// Runtime in daemon mode on its socket (no tuning from the client: Autotune::off).
struct KilndHost {
  DaemonEnv env;
  std::unique_ptr<Kilnd> kilnd;
  std::shared_ptr<Runtime> rt;

  KilndHost(const std::string& url, const fs::path& key, bool seed = false) {
    if (seed) seed_from_gpu_test_cache(env.cache_dir() / "kernels.sqlite");
    kilnd = env.start({"--jobs", "8", "--remote", url, "--fleet-key-file", key.string()});
    if (!kilnd) return;
    RuntimeOptions o;
    o.mode = ResolverMode::daemon;
    o.autotune = Autotune::off;
    o.socket_path = env.socket().string();
    o.cache_file = (env.root() / "client.sqlite").string();  // unused in daemon mode
    rt = Runtime::create(o).value();
  }
  bool ok() const { return kilnd && rt; }
  nlohmann::json stats() { return stats_of(env.socket()); }
  std::int64_t remote(const char* counter) { return stats()["daemon"]["remote"].value(counter, std::int64_t{-1}); }
  std::int64_t builder(const char* counter) { return stats()["builder"].value(counter, std::int64_t{-1}); }
  std::int64_t daemon(const char* counter) { return stats()["daemon"].value(counter, std::int64_t{-1}); }
  // Every write-back queued so far has been sent, and at least n records were stored.
  bool written(std::int64_t n) {
    return eventually([&] { return remote("writes") >= n && remote("pending_writes") == 0; });
  }
};

// An embedded host: a Runtime in this process on its own cache file; the remote tier comes from
// the environment, which the fixture sets.
struct EmbeddedHost {
  TempDir dir;
  std::shared_ptr<Runtime> rt;

  explicit EmbeddedHost(Autotune autotune, bool seed = false) {
    if (seed) seed_from_gpu_test_cache(file());
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.autotune = autotune;
    o.cache_file = file().string();
    rt = Runtime::create(o).value();
  }
  fs::path file() const { return dir.path() / "kernels.sqlite"; }
  // The rows of this host's tuning table.
  std::vector<cache::TuningRecord> tuned() const {
    auto store = cache::Store::open(file());
    EXPECT_TRUE(store.ok()) << store.status().to_string();
    if (!store.ok()) return {};
    auto table = cache::TuningTable::open(**store);
    EXPECT_TRUE(table.ok()) << table.status().to_string();
    if (!table.ok()) return {};
    auto rows = (*table)->list();
    EXPECT_TRUE(rows.ok()) << rows.status().to_string();
    return rows.ok() ? *rows : std::vector<cache::TuningRecord>{};
  }
};

struct CliRun {
  int rc = -1;
  std::string out, err;
  std::string all() const { return "exit " + std::to_string(rc) + "\n--- stdout\n" + out + "--- stderr\n" + err; }
};

// Runs the kiln CLI with this process's environment plus `env` (posix_spawn: this process has
// CUDA's and the remote tier's threads, so no fork-then-setenv).
CliRun run_kiln(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                const fs::path& dir) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (const auto eq = kv.find('='); eq != std::string::npos) vars[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) vars[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings = {KILN_CLI_PATH};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  const fs::path out = dir / "kiln.out", err = dir / "kiln.err";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, KILN_CLI_PATH, &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  CliRun r;
  if (rc != 0) {
    r.err = std::string("cannot start ") + KILN_CLI_PATH + ": " + std::strerror(rc);
    return r;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = Kilnd::read_file(out);
  r.err = Kilnd::read_file(err);
  return r;
}

// The winner of the one record in `kiln tune --json` output; "" (with a failure) otherwise.
std::string winner_of(const CliRun& run, const std::string& via_prefix) {
  auto j = nlohmann::json::parse(run.out, nullptr, false);
  if (j.is_discarded() || !j.contains("records") || j["records"].size() != 1) {
    ADD_FAILURE() << "no tuning record in the output:\n" << run.all();
    return "";
  }
  EXPECT_EQ(j.value("via", std::string()).rfind(via_prefix, 0), 0u) << run.all();
  return j["records"][0].value("winner", std::string());
}

class FleetGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    KILN_REQUIRE_GPU();
    KILN_REQUIRE_REDIS();
    dev_ = *jit::device_info(0).value();
    redis = RedisServer::start(tmp.path());
    ASSERT_TRUE(redis);
    key = write_secret(tmp.path() / "fleet.key", "fleet gpu test key: 0123456789abcdef\n");
    // Embedded hosts and in-process `kiln tune` take the remote tier from the environment.
    env_.push_back(std::make_unique<ScopedEnv>("KILN_REMOTE", redis->url()));
    env_.push_back(std::make_unique<ScopedEnv>("KILN_FLEET_KEY_FILE", key.string()));
    seed_ = fresh_seed();
    rng_.seed(seed_);
    std::printf("device: %s (%s, %d SMs); seed %u\n", dev_.name.c_str(), dev_.arch.c_str(), dev_.sm_count, seed_);
  }

  // The RMSNorm workload, and on compute capability 9.0 the FP8 GEMM, whose variant there must be
  // the wgmma one.
  std::vector<std::unique_ptr<Workload>> workloads() {
    std::vector<std::unique_ptr<Workload>> w;
    w.push_back(std::make_unique<RmsNormWorkload>(77, 4096, rng_));
    if (dev_.compute_capability == 90) {
      w.push_back(std::make_unique<Fp8GemmWorkload>(200, 328, 528, rng_));
      EXPECT_EQ(w.back()->heuristic().get_str("path").value_or(""), "wgmma") << w.back()->describe();
    } else {
      std::printf("compute capability %d: no sm_90a wgmma kernel on this GPU, RMSNorm only\n",
                  dev_.compute_capability);
    }
    return w;
  }

  std::vector<std::string> keys(const std::string& pattern) {
    std::vector<std::string> out;
    auto r = redis->command({"KEYS", pattern});
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (r.ok())
      for (const auto& e : r->elements) out.push_back(e.text);
    return out;
  }

  // How many SET commands Redis has run since its statistics were last reset (CONFIG RESETSTAT).
  std::int64_t set_commands() {
    auto r = redis->command({"INFO", "commandstats"});
    EXPECT_TRUE(r.ok() && r->type == remote::Reply::Type::bulk);
    if (!r.ok()) return -1;
    const std::string tag = "cmdstat_set:calls=";
    const auto at = r->text.find(tag);
    return at == std::string::npos ? 0 : std::stoll(r->text.substr(at + tag.size()));
  }

  // Flips one byte inside the cubin of every kernel record in Redis; how many there were.
  std::size_t corrupt_kernel_records() {
    std::size_t n = 0;
    for (const auto& name : keys("kiln:v1:k/*")) {
      auto value = redis->command({"GET", name});
      EXPECT_TRUE(value.ok() && value->type == remote::Reply::Type::bulk) << name;
      if (!value.ok() || value->type != remote::Reply::Type::bulk) continue;
      std::string bad = value->text;
      bad[bad.size() - 100] = char(bad[bad.size() - 100] ^ 0x01);  // before the 32-byte tag: the cubin
      EXPECT_TRUE(redis->command({"SET", name, bad}).ok());
      ++n;
    }
    return n;
  }

  // The shape the tuning tests tune and launch.
  static constexpr std::int64_t k_tune_rows = 512, k_tune_cols = 4096;
  static std::vector<std::string> tune_args() {
    return {"tune", "--family", "rmsnorm", "--dtype", "bf16", "--shape",
            "rows=" + std::to_string(k_tune_rows) + ",cols=" + std::to_string(k_tune_cols), "--json"};
  }

  // Host B's side of every tuning test: `rt` (fresh, never tuning) launches the tuned shape
  // correctly with A's winner, the very variant it loaded.
  void expect_launches_winner(Runtime& rt, const std::string& winner) {
    RmsNormWorkload w(k_tune_rows, k_tune_cols, rng_);
    EXPECT_LT(w.run(rt), tolerance(DType::bf16)) << w.describe() << ", seed " << seed_;
    EXPECT_EQ(rt.counters().tuned_choices, 1) << "B launched a tuned winner, not the heuristic's pick";
    auto params = Params::parse(winner);
    ASSERT_TRUE(params.ok()) << winner;
    EXPECT_TRUE(loaded(rt, w.family(), *params)) << "B's launch loaded " << winner;
  }

  TempDir tmp;
  std::unique_ptr<RedisServer> redis;
  fs::path key;
  jit::DeviceInfo dev_;
  std::vector<std::unique_ptr<ScopedEnv>> env_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(FleetGpu, HostsLaunchWhatHostACompiledFromRedisWithoutCompiling) {
  KilndHost a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  auto work = workloads();
  const auto n = std::int64_t(work.size());
  expect_correct(work, *a.rt, "host A", seed_);
  EXPECT_EQ(a.builder("compiles"), n) << a.kilnd->log();
  ASSERT_TRUE(a.written(n)) << a.stats().dump();
  ASSERT_EQ(keys("kiln:v1:k/*").size(), std::size_t(n));

  // Host B, a second kilnd: every kernel from Redis, none compiled, each launched correctly.
  expect_correct(work, *b.rt, "host B", seed_);
  EXPECT_EQ(b.builder("compiles"), 0) << b.kilnd->log();
  EXPECT_EQ(b.builder("remote_hits"), n);
  EXPECT_EQ(b.remote("hits"), n);
  EXPECT_EQ(b.remote("rejected"), 0);
  EXPECT_EQ(b.remote("writes"), 0) << "nothing compiled, nothing written back";
  EXPECT_EQ(b.rt->counters().from_daemon, n);
  for (auto& w : work) EXPECT_TRUE(loaded(*b.rt, w->family(), w->heuristic())) << w->describe();

  // Host C, embedded in this process: the same from Redis. A host that compiles takes a compile
  // lock and writes the kernel back, both SET commands; C sends none.
  ASSERT_TRUE(redis->command({"CONFIG", "RESETSTAT"}).ok());
  EmbeddedHost c(Autotune::off);
  expect_correct(work, *c.rt, "host C", seed_);
  EXPECT_EQ(c.rt->counters().from_embedded, n);
  EXPECT_EQ(set_commands(), 0) << "host C compiled something";
  for (auto& w : work) EXPECT_TRUE(loaded(*c.rt, w->family(), w->heuristic())) << w->describe();
}

TEST_F(FleetGpu, ACorruptedEntryIsRejectedCompiledLocallyAndLaunchedCorrectly) {
  KilndHost a(redis->url(), key), b(redis->url(), key);
  ASSERT_TRUE(a.ok() && b.ok());
  auto work = workloads();
  const auto n = std::int64_t(work.size());
  expect_correct(work, *a.rt, "host A", seed_);
  ASSERT_TRUE(a.written(n)) << a.stats().dump();
  ASSERT_EQ(corrupt_kernel_records(), std::size_t(n));

  expect_correct(work, *b.rt, "host B", seed_);
  EXPECT_EQ(b.remote("rejected"), n);
  EXPECT_EQ(b.builder("remote_hits"), 0);
  EXPECT_EQ(b.builder("compiles"), n);
  EXPECT_NE(b.kilnd->log().find("rejected the entry"), std::string::npos) << b.kilnd->log();
  for (auto& w : work) EXPECT_TRUE(loaded(*b.rt, w->family(), w->heuristic())) << w->describe();
}

// `kiln tune` through host A's kilnd; host B is embedded.
TEST_F(FleetGpu, AWinnerTunedThroughKilndIsTakenByAnEmbeddedHost) {
  KilndHost a(redis->url(), key, /*seed=*/true);
  ASSERT_TRUE(a.ok());
  // The CLI uses a daemon only when it serves the cache file the CLI would use itself.
  const CliRun tune = run_kiln(
      tune_args(), {{"KILN_SOCKET", a.env.socket().string()}, {"KILN_CACHE_DIR", a.env.cache_dir().string()}},
      tmp.path());
  ASSERT_EQ(tune.rc, 0) << tune.all();
  const std::string winner = winner_of(tune, "kilnd at ");
  ASSERT_FALSE(winner.empty()) << tune.all();
  EXPECT_EQ(a.daemon("tuning_runs"), 1);
  ASSERT_TRUE(eventually([&] { return keys("kiln:v1:t/*").size() == 1 && a.remote("pending_writes") == 0; }))
      << a.stats().dump();

  EmbeddedHost b(Autotune::off);
  expect_launches_winner(*b.rt, winner);
  const auto rows = b.tuned();
  ASSERT_EQ(rows.size(), 1u) << "the winner from Redis is kept in B's tuning table";
  EXPECT_EQ(rows[0].winner, winner);
}

// `kiln tune` in-process on host A with the remote tier in its environment; host B is a kilnd.
TEST_F(FleetGpu, AWinnerTunedInProcessIsTakenByAKilndHost) {
  TempDir a_dir;
  seed_from_gpu_test_cache(a_dir.path() / "kernels.sqlite");
  std::vector<std::string> args = {"--embedded"};
  for (auto& s : tune_args()) args.push_back(s);
  const CliRun tune = run_kiln(
      args, {{"KILN_CACHE_DIR", a_dir.path().string()}, {"KILN_SOCKET", (a_dir.path() / "none.sock").string()}},
      tmp.path());
  ASSERT_EQ(tune.rc, 0) << tune.all();
  const std::string winner = winner_of(tune, "in-process on ");
  ASSERT_FALSE(winner.empty()) << tune.all();
  EXPECT_NE(tune.out.find("remote tier"), std::string::npos) << tune.all();
  // The command sent its write-backs before it exited.
  EXPECT_EQ(keys("kiln:v1:t/*").size(), 1u);

  KilndHost b(redis->url(), key);
  ASSERT_TRUE(b.ok());
  expect_launches_winner(*b.rt, winner);
  EXPECT_EQ(b.daemon("tuning_runs"), 0) << "B did not tune";
  EXPECT_EQ(b.daemon("tuning_remote_hits"), 1);
}

// An embedded host tuning before its first launch (KILN_AUTOTUNE=wait) shares the winner; host B is
// embedded too.
TEST_F(FleetGpu, AnEmbeddedWaitTuningRunIsSharedWithTheFleet) {
  std::string winner;
  {
    EmbeddedHost a(Autotune::wait, /*seed=*/true);
    RmsNormWorkload w(k_tune_rows, k_tune_cols, rng_);
    EXPECT_LT(w.run(*a.rt), tolerance(DType::bf16)) << "host A, seed " << seed_;
    EXPECT_EQ(a.rt->counters().tuned_choices, 1) << "A tuned before its first launch";
    const auto rows = a.tuned();
    ASSERT_EQ(rows.size(), 1u);
    winner = rows[0].winner;
    ASSERT_FALSE(winner.empty());
    // Dropping the runtime sends its queued write-backs.
  }
  EXPECT_EQ(keys("kiln:v1:t/*").size(), 1u);

  EmbeddedHost b(Autotune::off);
  expect_launches_winner(*b.rt, winner);
  const auto rows = b.tuned();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].winner, winner);
}

}  // namespace
}  // namespace kiln::testing
