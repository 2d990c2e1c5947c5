// get / prewarm / list / stats against a real kilnd that compiles with NVRTC into a real SQLite
// cache in a temp directory.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <thread>

#include "common/sha256.h"
#include "tests/daemon/kilnd_harness.h"

namespace kiln::testing {
namespace {

KernelSpec spec_of(const std::string& text) {
  auto s = KernelSpec::parse(text);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : KernelSpec{};
}

TEST(KilndGet, CompilesOnceThenServesFromCache) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  const KernelSpec spec = spec_of("rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)");

  auto first = (*c)->get_kernel(spec, "sm_90a");
  ASSERT_TRUE(first.ok()) << first.status().to_string() << "\n" << k->log();
  const cache::Entry& e = first->entry;
  EXPECT_EQ(first->source, jit::ArtifactSource::compiled);
  ASSERT_FALSE(e.cubin.empty());
  EXPECT_EQ(e.cubin.compare(0, 4, "\x7f" "ELF"), 0) << "a cubin is an ELF image";
  EXPECT_EQ(static_cast<std::int64_t>(e.cubin.size()), e.size);
  EXPECT_EQ(sha256_hex(e.cubin), e.checksum);
  EXPECT_EQ(e.key.size(), 64u);
  EXPECT_EQ(e.family, "rmsnorm");
  EXPECT_EQ(e.params, "block=256,bulk=0,dtype=f32,row=0,vec=4");
  EXPECT_EQ(e.arch, "sm_90a");
  EXPECT_FALSE(e.lowered_name.empty());
  EXPECT_GT(e.compile_ms, 0);

  auto second = (*c)->get_kernel(spec, "sm_90a");
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(second->source, jit::ArtifactSource::cache);
  EXPECT_EQ(second->entry.key, e.key);
  EXPECT_EQ(second->entry.cubin, e.cubin);

  auto s = stats_of(env.socket());
  EXPECT_EQ(s["builder"]["compiles"], 1);
  EXPECT_EQ(s["builder"]["cache_hits"], 1);
  EXPECT_EQ(s["builder"]["requests"], 2);
  EXPECT_EQ(s["cache"]["entries"], 1);
  EXPECT_EQ(s["daemon"]["pch"], true);
  EXPECT_EQ(s["daemon"]["jobs"], 2);
  EXPECT_NE(k->log().find("compiled rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4) @ sm_90a in"), std::string::npos);

  // The cache outlives the daemon: a new one on the same file serves the kernel without compiling.
  ASSERT_TRUE((*c)->shutdown().ok());
  ASSERT_TRUE(k->wait_exit());
  auto k2 = env.start();
  ASSERT_TRUE(k2);
  auto c2 = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c2.ok());
  auto third = (*c2)->get_kernel(spec, "sm_90a");
  ASSERT_TRUE(third.ok()) << third.status().to_string();
  EXPECT_EQ(third->source, jit::ArtifactSource::cache);
  EXPECT_EQ(third->entry.checksum, e.checksum);
  EXPECT_EQ(stats_of(env.socket())["builder"]["compiles"], 0);

  // list sees it, filtered or not; a filter that matches nothing gives an empty list.
  auto all = (*c2)->list({});
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].key, e.key);
  EXPECT_TRUE((*all)[0].cubin.empty());
  EXPECT_EQ((*all)[0].size, e.size);
  auto none = (*c2)->list({"rmsnorm", "sm_80"});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto some = (*c2)->list({"rmsnorm", "sm_90a"});
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(some->size(), 1u);
}

TEST(KilndGet, ConcurrentRequestsForOneKeyCompileOnce) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2"});
  ASSERT_TRUE(k);
  const KernelSpec spec = spec_of("rmsnorm(block=128,bulk=0,dtype=bf16,row=0,vec=8)");
  constexpr int n = 6;
  std::vector<std::unique_ptr<client::DaemonClient>> clients;
  for (int i = 0; i < n; ++i) {
    auto c = client::DaemonClient::connect(env.socket());
    ASSERT_TRUE(c.ok());
    clients.push_back(std::move(c).value());
  }
  std::latch go(n);
  std::vector<Result<jit::Artifact>> results(n, Result<jit::Artifact>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      go.arrive_and_wait();
      results[i] = clients[i]->get_kernel(spec, "sm_90a");
    });
  for (auto& t : threads) t.join();

  std::string checksum;
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    if (checksum.empty()) checksum = r->entry.checksum;
    EXPECT_EQ(r->entry.checksum, checksum);
  }
  auto s = stats_of(env.socket());
  EXPECT_EQ(s["builder"]["compiles"], 1) << s.dump();
  EXPECT_EQ(s["builder"]["requests"], n);
  EXPECT_EQ(s["builder"]["coalesced"].get<int>() + s["builder"]["cache_hits"].get<int>(), n - 1) << s.dump();
}

TEST(KilndGet, BadRequestsFailBeforeAnyCompile) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());

  struct Case {
    std::string spec, arch;
    Code code;
  };
  for (const Case& t : {Case{"rmsnorm(block=257,bulk=0,dtype=f32,row=0,vec=4)", "sm_90a", Code::invalid_argument},
                        Case{"rmsnorm(block=256,bulk=0,dtype=f64,row=0,vec=4)", "sm_90a", Code::invalid_argument},
                        Case{"rmsnorm(block=256,dtype=f32)", "sm_90a", Code::invalid_argument},
                        Case{"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4,extra=1)", "sm_90a", Code::invalid_argument},
                        Case{"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "sm_9x", Code::invalid_argument},
                        Case{"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "", Code::invalid_argument},
                        Case{"rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)", "compute_90", Code::invalid_argument},
                        Case{"nosuchfamily(a=1)", "sm_90a", Code::not_found}}) {
    // Raw frames, so that specs the client library could not even build still reach the daemon.
    RawConn raw(env.socket());
    ASSERT_TRUE(raw.ok());
    nlohmann::json req{{"op", "get"}, {"spec", t.spec}, {"arch", t.arch}};
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(req.dump())));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << t.spec;
    EXPECT_EQ((*reply)["ok"], false) << t.spec;
    EXPECT_EQ(error_code_of(*reply), code_name(t.code)) << t.spec << " @ " << t.arch << ": " << reply->dump();
    EXPECT_FALSE((*reply)["error"].value("message", "").empty());
  }
  // Malformed spec text and missing fields.
  for (const char* body : {R"J({"op":"get","spec":"rmsnorm(block=256","arch":"sm_90a"})J",
                           R"J({"op":"get","spec":"rmsnorm(block=25 6,dtype=f32,vec=4)","arch":"sm_90a"})J",
                           R"J({"op":"get","arch":"sm_90a"})J", R"J({"op":"get","spec":"rmsnorm"})J",
                           R"J({"op":"get","spec":42,"arch":"sm_90a"})J"}) {
    RawConn raw(env.socket());
    ASSERT_TRUE(raw.send_bytes(RawConn::frame(body)));
    auto reply = raw.read_reply();
    ASSERT_TRUE(reply) << body;
    EXPECT_EQ(error_code_of(*reply), "invalid_argument") << body << ": " << reply->dump();
  }
  // The client library reports the daemon's code.
  auto r = (*c)->get_kernel(spec_of("rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)"), "sm_91x");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::invalid_argument);

  auto s = stats_of(env.socket());
  EXPECT_EQ(s["builder"]["requests"], 0) << s.dump();
  EXPECT_EQ(s["builder"]["compiles"], 0);
  EXPECT_EQ(s["cache"]["entries"], 0);
  EXPECT_GE(s["daemon"]["errors"].get<int>(), 14);
}

TEST(KilndPrewarm, ValidatesBeforeCompiling) {
  DaemonEnv env;
  auto k = env.start();
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->prewarm({"sm_90a", "sm_nope"}, {"rmsnorm"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::invalid_argument);
  r = (*c)->prewarm({"sm_90a"}, {"nosuchfamily"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::not_found);
  r = (*c)->prewarm({}, {"rmsnorm"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::invalid_argument);
  EXPECT_EQ(stats_of(env.socket())["builder"]["requests"], 0);
}

TEST(KilndPrewarm, CompilesTheCatalogThenFindsItCached) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "2"});
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  const Family* rms = Registry::global().find("rmsnorm");
  ASSERT_NE(rms, nullptr);
  const auto catalog = static_cast<std::int64_t>(rms->catalog().size());

  // One variant compiled before, so the prewarm sees a mix of cached and new.
  ASSERT_TRUE((*c)->get_kernel(spec_of("rmsnorm(block=256,bulk=0,dtype=f32,row=0,vec=4)"), "sm_90a").ok());
  auto r = (*c)->prewarm({"sm_90a"}, {"rmsnorm"});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->requested, catalog);
  EXPECT_EQ(r->failed, 0) << (r->errors.empty() ? "" : r->errors.front());
  EXPECT_EQ(r->cached, 1);
  EXPECT_EQ(r->compiled, catalog - 1);
  auto again = (*c)->prewarm({"sm_90a"}, {"rmsnorm"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->compiled, 0);
  EXPECT_EQ(again->cached, catalog);
  auto listed = (*c)->list({"rmsnorm", "sm_90a"});
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(static_cast<std::int64_t>(listed->size()), catalog);
}

TEST(KilndPrewarm, PingAnswersWhileCompiling) {
  DaemonEnv env;
  auto k = env.start({"--jobs", "1", "--no-pch"});
  ASSERT_TRUE(k);
  EXPECT_EQ(stats_of(env.socket())["daemon"]["pch"], false);
  std::atomic<bool> done{false};
  Result<client::PrewarmResult> result = internal_error("not run");
  std::thread prewarm([&] {
    auto c = client::DaemonClient::connect(env.socket());
    if (c.ok()) result = (*c)->prewarm({"sm_80"}, {"rmsnorm"});
    done = true;
  });
  // Wait until the compile pool is busy, then time a ping.
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline &&
         stats_of(env.socket())["daemon"].value("compiles_running", 0) == 0)
    std::this_thread::sleep_for(5ms);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE((*c)->ping().ok());
  auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 200.0) << "ping waited on a compile";
  EXPECT_FALSE(done.load()) << "prewarm finished before the ping; the test proved nothing";
  // Stop while the prewarm runs: queued variants are answered shutting_down, the running compile
  // finishes, the daemon exits 0. The prewarm reply arrives either way.
  ASSERT_TRUE((*c)->shutdown().ok());
  prewarm.join();
  auto code = k->wait_exit(30s);
  ASSERT_TRUE(code);
  EXPECT_EQ(*code, 0) << k->log();
  ASSERT_TRUE(result.ok()) << result.status().to_string();
  EXPECT_GE(result->compiled, 1);
  EXPECT_GE(result->failed, 1);
  ASSERT_FALSE(result->errors.empty());
  EXPECT_NE(result->errors.front().find("shutting_down"), std::string::npos) << result->errors.front();
  EXPECT_EQ(result->compiled + result->cached + result->failed, result->requested);
}

}  // namespace
}  // namespace kiln::testing
