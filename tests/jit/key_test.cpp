#include "jit/key.h"

#include <gtest/gtest.h>

#include "jit/builder.h"
#include "jit/templates.h"
#include "kiln/family.h"
#include "tests/test_util.h"

namespace kiln::jit {
namespace {

KeyInputs base() {
  KeyInputs in;
  in.family = "rmsnorm";
  in.family_version = 1;
  in.params = "block=256,bulk=0,dtype=bf16,row=0,vec=8";
  in.plugin = "builtin 0.1.0";
  in.plugin_templates = std::string(64, 'c');
  in.arch = "sm_90a";
  in.nvrtc_version = "13.0";
  in.template_hash = std::string(64, 'a');
  in.options = {"-std=c++17", "-default-device"};
  return in;
}

TEST(Key, SameInputsSameKey) {
  EXPECT_EQ(make_key(base()).hex, make_key(base()).hex);
  EXPECT_EQ(make_key(base()).hex.size(), 64u);
}

TEST(Key, EveryPartChangesTheKey) {
  const std::string k0 = make_key(base()).hex;
  auto changed = [&](auto mutate) {
    KeyInputs in = base();
    mutate(in);
    return make_key(in).hex != k0;
  };
  EXPECT_TRUE(changed([](KeyInputs& i) { i.family = "rmsnorm2"; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.family_version = 2; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.plugin = "builtin 0.1.1"; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.plugin = "acme 0.1.0"; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.plugin_templates[7] = 'd'; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.params = "block=128,bulk=0,dtype=bf16,row=0,vec=8"; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.arch = "sm_90"; }));  // sm_90a is not sm_90
  EXPECT_TRUE(changed([](KeyInputs& i) { i.nvrtc_version = "13.1"; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.template_hash[5] = 'b'; }));
  EXPECT_TRUE(changed([](KeyInputs& i) { i.options.push_back("--use_fast_math"); }));
}

TEST(Key, OptionOrderDuplicatesAndPchDoNotChangeTheKey) {
  const std::string k0 = make_key(base()).hex;
  KeyInputs in = base();
  in.options = {"-default-device", "-std=c++17", "-pch", "-default-device", "-Xptxas=-v"};
  EXPECT_EQ(make_key(in).hex, k0);
}

TEST(Key, TextExplainsTheKeyWithoutPaths) {
  Key k = make_key(base());
  EXPECT_NE(k.text.find("family rmsnorm"), std::string::npos);
  EXPECT_NE(k.text.find("arch sm_90a"), std::string::npos);
  EXPECT_NE(k.text.find("nvrtc 13.0"), std::string::npos);
  EXPECT_EQ(k.text.find('/'), std::string::npos);
}

TEST(TemplateClosure, FollowsIncludesAndHashesBytes) {
  TemplateSet set = TemplateSet::embedded();
  auto c = set.closure("#include \"rmsnorm/rmsnorm_fwd.cuh\"\n");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  std::vector<std::string> want = {"common/dtype.cuh", "common/ptx.cuh", "common/reduce.cuh", "rmsnorm/rmsnorm_fwd.cuh"};
  EXPECT_EQ(c->headers, want);
  EXPECT_FALSE(set.closure("#include \"nope/missing.cuh\"\n").ok());
}

// A family's own headers (a plugin's templates) are found after kiln's and take part in the hash.
TEST(TemplateClosure, OverlayHeadersAddToTheSetAndAreHashed) {
  TemplateSet set = TemplateSet::embedded();
  const std::string src = "#include \"mine/k.cuh\"\n";
  TemplateSet::Overlay overlay = {{"mine/k.cuh", "#include \"common/dtype.cuh\"\n"}};
  auto a = set.closure(src, &overlay);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->headers, (std::vector<std::string>{"common/dtype.cuh", "mine/k.cuh"}));
  overlay["mine/k.cuh"] += "// edited\n";
  auto b = set.closure(src, &overlay);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->hash, b->hash);
  EXPECT_FALSE(set.closure(src).ok()) << "without the overlay the header does not exist";
  ASSERT_NE(set.find("mine/k.cuh", &overlay), nullptr);
  EXPECT_EQ(set.find("mine/k.cuh"), nullptr);
  TemplateSet::Overlay shadow = {{"common/dtype.cuh", "// not kiln's\n"}};
  EXPECT_EQ(set.find("common/dtype.cuh", &shadow), set.find("common/dtype.cuh")) << "kiln's own header wins";
}

// The builder's key over real templates: a byte changed in an included header changes it; a byte
// changed in a header nobody includes does not.
TEST(BuilderKey, ChangesWithTemplateBytesOptionsAndArchOnly) {
  testing::TempDir dir;
  auto write_tree = [&](const std::string& reduce_suffix, const std::string& unrelated) {
    const TemplateSet embedded = TemplateSet::embedded();
    for (const auto& [path, body] : embedded.files()) {
      auto p = dir.path() / path;
      std::filesystem::create_directories(p.parent_path());
      std::string text = body;
      if (path == "common/reduce.cuh") text += reduce_suffix;
      FILE* f = fopen(p.c_str(), "w");
      fwrite(text.data(), 1, text.size(), f);
      fclose(f);
    }
    auto p = dir.path() / "unrelated" / "x.cuh";
    std::filesystem::create_directories(p.parent_path());
    FILE* f = fopen(p.c_str(), "w");
    fputs(unrelated.c_str(), f);
    fclose(f);
    return TemplateSet::from_directory(dir.path().string()).value();
  };
  KernelSpec spec{"rmsnorm", Params{{"dtype", std::string("bf16")}, {"block", std::int64_t(256)}, {"vec", std::int64_t(8)}, {"bulk", std::int64_t(0)}, {"row", std::int64_t(0)}}};
  auto key_with = [&](const TemplateSet& set, const std::string& arch) {
    BuilderOptions o;
    o.templates = &set;
    Builder b(nullptr, &Registry::global(), o);
    auto k = b.key_text(spec, arch);
    EXPECT_TRUE(k.ok()) << k.status().to_string();
    return k.ok() ? k->substr(0, 64) : std::string();
  };
  TemplateSet t0 = write_tree("", "a");
  const std::string k0 = key_with(t0, "sm_90a");
  EXPECT_EQ(key_with(TemplateSet::embedded(), "sm_90a"), k0);  // same bytes from disk or embedded
  TemplateSet t1 = write_tree("", "b");
  EXPECT_EQ(key_with(t1, "sm_90a"), k0);  // a file outside the closure
  TemplateSet t2 = write_tree(" ", "a");
  EXPECT_NE(key_with(t2, "sm_90a"), k0);  // one byte in an included header
  EXPECT_NE(key_with(t0, "sm_90"), k0);
  EXPECT_NE(key_with(t0, "sm_80"), k0);
  KernelSpec other = spec;
  other.params.set("block", std::int64_t(128));
  BuilderOptions o;
  o.templates = &t0;
  Builder b(nullptr, &Registry::global(), o);
  EXPECT_NE(b.key_text(other, "sm_90a")->substr(0, 64), k0);
}

}  // namespace
}  // namespace kiln::jit
