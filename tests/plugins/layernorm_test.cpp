// The example plugin (plugins/layernorm) loaded from its shared library: schema and validation,
// rendering, NVRTC compiles for sm_80 and sm_90a, the CPU reference against hand-computed rows,
// every error path (codes and messages cross the C ABI intact), and a rebuild with an edited
// template getting new cache keys and a recompile instead of the old kernel.
#include <gtest/gtest.h>

#include <cmath>

#include "cache/store.h"
#include "common/half.h"
#include "jit/builder.h"
#include "jit/nvrtc.h"
#include "tests/plugin_util.h"

namespace kiln::testing {
namespace {

class LayerNormPlugin : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    registry_ = new Registry;
    auto rep = plugin::load(*registry_, {private_copy(example_plugin(), dir_->path())});
    ASSERT_EQ(rep.loaded.size(), 1u) << (rep.skipped.empty() ? "" : rep.skipped[0].reason);
  }
  static void TearDownTestSuite() {
    delete registry_;
    delete dir_;
  }
  static const Family& ln() { return *registry_->find("layernorm"); }

  static Problem problem(DType t, std::int64_t rows, std::int64_t cols, double eps = 1e-5) {
    Problem p;
    p.dtype = t;
    p.dims[0] = rows;
    p.dims[1] = cols;
    p.scalars[0] = eps;
    return p;
  }
  static Params params(const char* dtype, std::int64_t block, std::int64_t vec) {
    return Params{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}};
  }

  static TempDir* dir_;
  static Registry* registry_;
};
TempDir* LayerNormPlugin::dir_ = nullptr;
Registry* LayerNormPlugin::registry_ = nullptr;

TEST_F(LayerNormPlugin, SchemaAndValidation) {
  EXPECT_EQ(ln().version(), 1);
  ASSERT_EQ(ln().schema().size(), 3u);
  EXPECT_EQ(ln().schema()[0].name, "block");
  EXPECT_EQ(ln().schema()[0].ints, (std::vector<std::int64_t>{128, 256, 1024}));
  EXPECT_EQ(ln().schema()[1].choices, (std::vector<std::string>{"f32", "f16", "bf16"}));
  EXPECT_EQ(ln().problem_dims(), (std::vector<std::string>{"rows", "cols"}));
  EXPECT_EQ(ln().problem_scalars(), std::vector<std::string>{"eps"});
  EXPECT_TRUE(ln().validate(params("bf16", 256, 8)).ok());
  // The plugin's own rule, through the C ABI with its message.
  Status wide = ln().validate(params("f32", 256, 8));
  EXPECT_EQ(wide.code(), Code::invalid_argument);
  EXPECT_EQ(wide.message(), "layernorm: vec * sizeof(dtype) must be at most 16 bytes (got vec=8 for f32)");
  // Schema rules kiln enforces itself.
  EXPECT_EQ(ln().validate(params("f64", 256, 1)).code(), Code::invalid_argument);
  EXPECT_EQ(ln().validate(params("f32", 512, 1)).code(), Code::invalid_argument);
  Params extra = params("f32", 256, 1);
  extra.set("unroll", 2);
  EXPECT_EQ(ln().validate(extra).message(), "layernorm: unknown parameter 'unroll'");
  EXPECT_EQ(ln().validate(Params{{"dtype", std::string("f32")}, {"vec", std::int64_t(1)}}).message(),
            "layernorm: missing parameter 'block'");
  EXPECT_EQ(ln().catalog().size(), 33u);  // 3 blocks x (3 f32 + 4 f16 + 4 bf16 vector widths)
}

TEST_F(LayerNormPlugin, RendersItsTemplate) {
  auto r = ln().render(params("bf16", 256, 8));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, "#include \"layernorm/layernorm_fwd.cuh\"\n");
  EXPECT_EQ(r->name_expression, "kiln_layernorm::layernorm_fwd<kiln::bf16_t, 256, 8>");
  EXPECT_TRUE(r->options.empty());
  EXPECT_EQ(ln().render(params("f32", 256, 8)).status().code(), Code::invalid_argument) << "render validates first";
}

TEST_F(LayerNormPlugin, CompilesForSm80AndSm90a) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable: " << jit::Nvrtc::get().status().to_string();
  jit::Builder b(nullptr, registry_);
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const Params& p : {params("f32", 128, 4), params("bf16", 1024, 8), params("f16", 256, 1)}) {
      auto a = b.get(KernelSpec{"layernorm", p}, arch);
      ASSERT_TRUE(a.ok()) << p.canonical() << " " << arch << ": " << a.status().to_string();
      EXPECT_GT(a->entry.cubin.size(), 100u);
      EXPECT_GT(a->entry.registers, 0);
      EXPECT_NE(a->entry.lowered_name.find("layernorm_fwd"), std::string::npos);
      EXPECT_NE(a->entry.key_text.find("plugin kiln-example-layernorm 1.0.0\n"), std::string::npos) << a->entry.key_text;
    }
  EXPECT_EQ(b.stats().compiles, 6);
}

// Two rows by hand: mean, biased variance, rstd = 1/sqrt(var + eps) with eps = 0.
//   row 0: x = [1, 2, 3, 4]: mean 2.5, var 1.25, normalized [-1.3416408, -0.4472136, 0.4472136, 1.3416408]
//   row 1: x = [0, 0, 0, 4]: mean 1, var 3, normalized [-0.5773503 (x3), 1.7320508]
//   gamma = [1, 2, 0.5, -1], beta = [0, 1, -1, 0.25]
TEST_F(LayerNormPlugin, CpuReferenceMatchesHandComputedRows) {
  std::vector<float> x = {1, 2, 3, 4, 0, 0, 0, 4}, gamma = {1, 2, 0.5f, -1}, beta = {0, 1, -1, 0.25f}, y(8, NAN);
  void* bufs[4] = {x.data(), gamma.data(), beta.data(), y.data()};
  const Problem p = problem(DType::f32, 2, 4, 0.0);
  Status s = ln().cpu_reference(ln().heuristic(p), p, bufs);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const double want[8] = {-1.3416407865, 0.1055728090, -0.7763932023, -1.0916407865,
                          -0.5773502692, -0.1547005384, -1.2886751346, -1.4820508076};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(y[i], want[i], 1e-6) << i;

  // The same rows in bf16: inputs are exact in bf16, the outputs rounded to it.
  std::vector<std::uint16_t> xb(8), gb(4), bb(4), yb(8, 0xffff);
  for (int i = 0; i < 8; ++i) store_from_double(xb.data(), DType::bf16, i, x[i]);
  for (int i = 0; i < 4; ++i) store_from_double(gb.data(), DType::bf16, i, gamma[i]);
  for (int i = 0; i < 4; ++i) store_from_double(bb.data(), DType::bf16, i, beta[i]);
  void* bbufs[4] = {xb.data(), gb.data(), bb.data(), yb.data()};
  const Problem pb = problem(DType::bf16, 2, 4, 0.0);
  ASSERT_TRUE(ln().cpu_reference(ln().heuristic(pb), pb, bbufs).ok());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(load_as_double(yb.data(), DType::bf16, i), want[i], 1e-2) << i;
}

TEST_F(LayerNormPlugin, HeuristicPicksTheWidestAccessAndABlockPerRowLength) {
  Problem p = problem(DType::bf16, 4096, 4096);
  EXPECT_EQ(ln().heuristic(p), params("bf16", 128, 8));
  p.dims[1] = 16384;  // 2048 packs of 8
  EXPECT_EQ(ln().heuristic(p), params("bf16", 256, 8));
  p.dims[1] = 65536;
  EXPECT_EQ(ln().heuristic(p), params("bf16", 1024, 8));
  p.dims[1] = 1023;  // odd rows: one element per access
  EXPECT_EQ(ln().heuristic(p), params("bf16", 128, 1));
  p = problem(DType::f32, 8, 4096);
  p.alignment = 8;
  EXPECT_EQ(ln().heuristic(p), params("f32", 256, 2));  // 8-byte aligned: 2048 packs of 2
  for (const Problem& b : ln().benchmark_problems(DType::f16)) {
    const Params h = ln().heuristic(b);
    EXPECT_TRUE(ln().check_problem(h, b).ok()) << h.canonical();
  }
}

TEST_F(LayerNormPlugin, ErrorPathsKeepTheirCodesAcrossTheAbi) {
  const Params v = params("bf16", 256, 8);
  EXPECT_EQ(ln().check_problem(v, problem(DType::f16, 4, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(ln().check_problem(v, problem(DType::bf16, 4, 0)).code(), Code::shape_mismatch);
  EXPECT_EQ(ln().check_problem(v, problem(DType::bf16, 4, 64, NAN)).code(), Code::invalid_argument);
  EXPECT_EQ(ln().check_problem(v, problem(DType::bf16, 4, 60)).message(),
            "layernorm: vec=8 needs buffers aligned to vec elements and a row length divisible by vec");
  Problem misaligned = problem(DType::bf16, 4, 64);
  misaligned.alignment = 4;
  EXPECT_EQ(ln().check_problem(v, misaligned).code(), Code::invalid_argument);
  EXPECT_TRUE(ln().check_problem(v, problem(DType::bf16, 4, 64)).ok());
  // An invalid variant is refused before the plugin sees it.
  EXPECT_EQ(ln().check_problem(params("f32", 256, 8), problem(DType::f32, 4, 64)).code(), Code::invalid_argument);
  float a[4] = {};
  void* three[3] = {a, a, a};
  Status s = ln().cpu_reference(v, problem(DType::bf16, 1, 4), three);
  EXPECT_EQ(s.code(), Code::invalid_argument);
  EXPECT_EQ(s.message(), "layernorm: the reference takes buffers x, gamma, beta and y");
}

TEST_F(LayerNormPlugin, ArgumentsAndGeometry) {
  const Problem p = problem(DType::bf16, 7, 512);
  const Params v = params("bf16", 256, 8);
  int x, g, b, y;
  void* bufs[4] = {&x, &g, &b, &y};
  ArgPack args;
  ln().pack_bound(ln().bind(v), v, p, bufs, args);
  ASSERT_FALSE(args.overflow());
  ASSERT_EQ(args.count(), 7u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &x);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[3]), &y);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[4]), 7);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[5]), 512);
  EXPECT_FLOAT_EQ(*static_cast<float*>(args.pointers()[6]), 1e-5f);
  const LaunchGeometry geo = ln().geometry(v, p);
  EXPECT_EQ(geo.grid.x, 7u);
  EXPECT_EQ(geo.block.x, 256u);
  EXPECT_EQ(geo.shared_bytes, 0u);
  const auto bs = ln().buffers(v, p);
  ASSERT_EQ(bs.size(), 4u);
  EXPECT_EQ(bs[1].name, "gamma");
  EXPECT_EQ(bs[1].elements, 512);
  EXPECT_EQ(bs[3].role, BufferRole::output);
  EXPECT_EQ(bs[3].elements, 7 * 512);
  auto shaped = ln().problem_from_shape(DType::f16, {{"rows", 3}, {"cols", 768}});
  ASSERT_TRUE(shaped.ok());
  EXPECT_EQ(shaped->dims[1], 768);
  EXPECT_DOUBLE_EQ(shaped->scalars[0], 1e-5);
  EXPECT_EQ(ln().problem_from_shape(DType::f16, {{"tokens", 3}}).status().code(), Code::invalid_argument);
}

// The plugin rebuilt with one line added to its template (same name, same version): its kernels
// get new keys, so a cache filled by the old build serves it nothing; the old build still hits.
TEST_F(LayerNormPlugin, AnEditedTemplateGetsNewKeysAndARecompile) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable";
  TempDir dir;
  Registry changed;
  auto rep = plugin::load(changed, {private_copy(example_plugin_changed(), dir.path())});
  ASSERT_EQ(rep.loaded.size(), 1u) << (rep.skipped.empty() ? "" : rep.skipped[0].reason);
  const PluginInfo& old_info = *ln().plugin();
  const PluginInfo& new_info = *changed.find("layernorm")->plugin();
  EXPECT_EQ(new_info.name, old_info.name);
  EXPECT_EQ(new_info.version, old_info.version);
  EXPECT_NE(new_info.templates_hash, old_info.templates_hash);

  auto store = cache::Store::open(dir.path() / "k.sqlite").value();
  const KernelSpec spec{"layernorm", params("f32", 128, 4)};
  jit::Builder before(store.get(), registry_);
  auto a = before.get(spec, "sm_80");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->source, jit::ArtifactSource::compiled);
  jit::Builder again(store.get(), registry_);
  auto hit = again.get(spec, "sm_80");
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->source, jit::ArtifactSource::cache) << "the same build is served from the cache";

  jit::Builder after(store.get(), &changed);
  auto b = after.get(spec, "sm_80");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->source, jit::ArtifactSource::compiled) << "the rebuilt plugin must not get the old kernel";
  EXPECT_NE(b->entry.key, a->entry.key);
  EXPECT_NE(b->entry.key_text.find("plugin_templates " + new_info.templates_hash), std::string::npos);
  EXPECT_EQ(after.stats().compiles, 1);
}

}  // namespace
}  // namespace kiln::testing
