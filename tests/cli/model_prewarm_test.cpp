// `kiln prewarm --model config.json`: the variants a model's layers use, listed (--dry-run) and
// compiled, nothing else; bad configs refused before anything is compiled; and, with a remote
// tier, a model prewarmed on four "hosts" (four cache directories, one Redis) compiled once.
#include <set>

#include "tests/cli/sandbox.h"
#include "tests/remote/redis_harness.h"

#ifndef KILN_TEST_MODELS
#error "KILN_TEST_MODELS must name tests/cli/models"
#endif

namespace kiln::testing {
namespace {

const fs::path k_models = KILN_TEST_MODELS;

std::set<std::string> specs_of(const json& plan) {
  std::set<std::string> out;
  for (const auto& v : plan.at("variants")) out.insert(v.at("spec").get<std::string>() + " @ " + v.at("arch").get<std::string>());
  return out;
}

TEST(ModelPrewarm, DryRunListsTheLayersVariantsOnce) {
  Sandbox sb;
  int rc = -1;
  json plan = sb.kiln_json({"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(), "--arch",
                            "sm_90a,sm_80", "--tokens", "1,128,4096", "--dry-run", "--json"},
                           &rc);
  ASSERT_EQ(rc, 0) << plan.dump();
  EXPECT_EQ(plan["model"], "llama");
  EXPECT_EQ(plan["dtype"], "bf16");
  EXPECT_EQ(plan["head_dim"], 64);
  EXPECT_EQ(plan["kv_heads"], 4);
  std::set<std::string> families, archs;
  for (const auto& v : plan["variants"]) {
    families.insert(v["family"].get<std::string>());
    archs.insert(v["arch"].get<std::string>());
    const std::string spec = v["spec"];
    EXPECT_NE(spec.find("dtype=bf16"), std::string::npos) << spec;
    if (v["family"] == "rope" || v["family"] == "attention") {
      EXPECT_NE(spec.find("head_dim=64"), std::string::npos) << spec;
    }
    EXPECT_FALSE(v["uses"].empty());
  }
  EXPECT_EQ(families, (std::set<std::string>{"rmsnorm", "add_rmsnorm", "rope", "attention", "act_and_mul", "gated_mlp"}));
  EXPECT_EQ(archs, (std::set<std::string>{"sm_90a", "sm_80"}));
  EXPECT_EQ(specs_of(plan).size(), plan["variants"].size()) << "each variant once";
  EXPECT_TRUE(plan["skipped"].empty()) << plan["skipped"].dump();
  // One bucket uses at most one variant of each family per arch.
  json one = sb.kiln_json({"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(), "--arch",
                           "sm_90a", "--tokens", "16", "--dry-run", "--json"});
  EXPECT_EQ(one["variants"].size(), 6u) << one.dump(2);
  EXPECT_FALSE(fs::exists(sb.cache_file())) << "a dry run opens no cache";

  // MoE: the experts' gated activation at experts_per_token routed rows, no dense MLP.
  json moe = sb.kiln_json({"prewarm", "--embedded", "--model", (k_models / "small_moe.json").string(), "--arch",
                           "sm_90a", "--tokens", "64", "--dry-run", "--json"});
  families.clear();
  for (const auto& v : moe["variants"]) families.insert(v["family"].get<std::string>());
  EXPECT_EQ(families, (std::set<std::string>{"rmsnorm", "add_rmsnorm", "rope", "attention", "act_and_mul"}));
  EXPECT_EQ(moe["dtype"], "f16");
  EXPECT_EQ(moe["experts"], 60);

  Proc text = sb.kiln({"prewarm", "--embedded", "--model", (k_models / "gemma_like.json").string(), "--arch", "sm_90a",
                       "--tokens", "16", "--dry-run"});
  ASSERT_EQ(text.rc, 0) << text.all();
  EXPECT_NE(text.out.find("gemma2 (bf16, hidden 2304, 8 heads / 4 KV heads of 256)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("act=gelu_tanh"), std::string::npos) << text.out;
}

TEST(ModelPrewarm, CompilesExactlyTheListedVariants) {
  Sandbox sb;
  const std::vector<std::string> args = {"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(),
                                         "--arch", "sm_80", "--tokens", "16,1024"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  json plan = sb.kiln_json(with({"--dry-run", "--json"}));
  int rc = -1;
  json done = sb.kiln_json(with({"--json"}), &rc);
  ASSERT_EQ(rc, 0) << done.dump(2);
  EXPECT_EQ(done["requested"], plan["variants"].size());
  EXPECT_EQ(done["compiled"], plan["variants"].size());
  json ls = sb.kiln_json({"ls", "--embedded", "--json"});
  std::set<std::string> cached;
  for (const auto& e : ls) cached.insert(e["family"].get<std::string>() + "(" + e["params"].get<std::string>() + ") @ " +
                                         e["arch"].get<std::string>());
  EXPECT_EQ(cached, specs_of(plan)) << "the cache holds the listed variants and nothing else";
  json again = sb.kiln_json(with({"--json"}));
  EXPECT_EQ(again["compiled"], 0);
  EXPECT_EQ(again["cached"], plan["variants"].size());
}

TEST(ModelPrewarm, RefusesBadInputBeforeCompiling) {
  Sandbox sb;
  const fs::path dir = sb.root() / "models";
  fs::create_directories(dir);
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {write("missing.json", R"({"num_attention_heads": 8})"), "missing field 'hidden_size'"},
      {write("neg.json", R"({"hidden_size": -4, "num_attention_heads": 8, "intermediate_size": 8})"),
       "must be a positive integer"},
      {write("gqa.json", R"({"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 3, "intermediate_size": 8})"),
       "not a multiple of num_key_value_heads"},
      {write("dtype.json", R"({"hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 8, "torch_dtype": "int8"})"),
       "torch_dtype 'int8'"},
      {write("act.json", R"({"hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 8, "hidden_act": "relu"})"),
       "hidden_act 'relu'"},
      {write("junk.json", "not json"), "not a JSON object"},
      {(dir / "absent.json").string(), "cannot read model config"},
  };
  for (const auto& [file, why] : cases) {
    Proc r = sb.kiln({"prewarm", "--embedded", "--model", file, "--arch", "sm_80"});
    EXPECT_EQ(r.rc, 2) << file << "\n" << r.all();
    EXPECT_NE(r.err.find(why), std::string::npos) << r.all();
  }
  const std::string ok = (k_models / "tiny_llama.json").string();
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--tokens", "0"}, {"--arch", "gfx90a"}, {"--family", "rmsnorm"}, {"--problems", ok}}) {
    std::vector<std::string> a = {"prewarm", "--embedded", "--model", ok};
    if (extra[0] != "--arch") a.insert(a.end(), {"--arch", "sm_80"});
    a.insert(a.end(), extra.begin(), extra.end());
    Proc r = sb.kiln(a);
    EXPECT_EQ(r.rc, 2) << r.all();
  }
  EXPECT_EQ(sb.kiln({"prewarm", "--embedded", "--arch", "sm_80", "--dry-run"}).rc, 2) << "--dry-run needs --model";
  EXPECT_FALSE(fs::exists(sb.cache_file())) << "nothing was compiled or opened";
}

// `kiln prewarm --spec`: exactly the named variants, on the archs among --arch they run on; bad
// specs refused before anything is opened.
TEST(SpecPrewarm, CompilesExactlyTheNamedVariants) {
  Sandbox sb;
  const std::string mma = "attention(block_n=64,dtype=bf16,head_dim=64,head_dim_v=64,overlap=0,path=mma,persistent=0,"
                          "pingpong=0,warps=4)";
  const std::string wgmma = "attention(block_n=64,dtype=bf16,head_dim=64,head_dim_v=64,overlap=1,path=wgmma,"
                            "persistent=1,pingpong=1,warps=12)";
  for (const auto& [spec, why] : std::vector<std::pair<std::string, std::string>>{
           {"attention(block_n=64", "bad spec"},
           {"nosuch(a=1)", "unknown kernel family"},
           {"attention(block_n=64,dtype=bf16)", "missing parameter"},
           {wgmma, "runs on none of the architectures"}}) {
    Proc r = sb.kiln({"prewarm", "--embedded", "--arch", "sm_80", "--spec", spec});
    EXPECT_EQ(r.rc, 2) << spec << "\n" << r.all();
    EXPECT_NE(r.err.find(why), std::string::npos) << r.all();
  }
  EXPECT_EQ(sb.kiln({"prewarm", "--embedded", "--spec", mma}).rc, 2) << "--spec needs --arch";
  EXPECT_EQ(sb.kiln({"prewarm", "--embedded", "--arch", "sm_80", "--spec", mma, "--family", "rmsnorm"}).rc, 2);
  EXPECT_FALSE(fs::exists(sb.cache_file())) << "nothing was compiled or opened";

  int rc = -1;
  json done = sb.kiln_json({"prewarm", "--embedded", "--arch", "sm_80,sm_90a", "--spec", mma, "--spec", wgmma, "--json"},
                           &rc);
  ASSERT_EQ(rc, 0) << done.dump(2);
  EXPECT_EQ(done["compiled"], 3) << "the mma variant for both archs, the wgmma one for sm_90a only";
  std::set<std::string> cached;
  for (const auto& e : sb.kiln_json({"ls", "--embedded", "--json"}))
    cached.insert(e["family"].get<std::string>() + "(" + e["params"].get<std::string>() + ") @ " +
                  e["arch"].get<std::string>());
  EXPECT_EQ(cached, (std::set<std::string>{mma + " @ sm_80", mma + " @ sm_90a", wgmma + " @ sm_90a"}));
}

// Four hosts (four cache directories) with one Redis prewarm the same model one after another:
// the first compiles every variant, the other three compile none.
TEST(ModelPrewarm, FourHostsCompileEachKernelOnce) {
  KILN_REQUIRE_REDIS();
  TempDir tmp;
  auto redis = RedisServer::start(tmp.path());
  ASSERT_TRUE(redis);
  const fs::path key = write_secret(tmp.path() / "fleet.key", "four hosts, one fleet key, 32 bytes+\n");
  const std::vector<std::string> args = {"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(),
                                         "--arch", "sm_90a", "--tokens", "16", "--json"};
  std::int64_t compiled_total = 0, remote_total = 0, variants = 0;
  for (int host = 0; host < 4; ++host) {
    Sandbox sb;
    sb.set_env("KILN_REMOTE", redis->url());
    sb.set_env("KILN_FLEET_KEY_FILE", key.string());
    int rc = -1;
    json r = sb.kiln_json(args, &rc);
    ASSERT_EQ(rc, 0) << r.dump(2);
    variants = r["requested"];
    compiled_total += r["compiled"].get<std::int64_t>();
    remote_total += r["remote"].get<std::int64_t>();
    if (host == 0) EXPECT_EQ(r["compiled"], variants);
    else EXPECT_EQ(r["remote"], variants) << "host " << host << ": " << r.dump(2);
  }
  EXPECT_EQ(compiled_total, variants) << "each kernel compiled once across the fleet";
  EXPECT_EQ(remote_total, 3 * variants);
}

}  // namespace
}  // namespace kiln::testing
