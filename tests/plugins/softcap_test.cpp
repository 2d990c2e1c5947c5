// The example plugin (plugins/softcap) loaded from its shared library: schema and validation,
// rendering, NVRTC compiles for sm_80 and sm_90a, the CPU reference against hand-computed values,
// every error path (codes and messages cross the C ABI intact), and a rebuild with an edited
// template getting new cache keys and a recompile instead of the old kernel.
#include <gtest/gtest.h>

#include <cmath>

#include "cache/store.h"
#include "jit/builder.h"
#include "jit/nvrtc.h"
#include "kiln/half.h"
#include "tests/plugin_util.h"

namespace kiln::testing {
namespace {

class SoftcapPlugin : public ::testing::Test {
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
  static const Family& sc() { return *registry_->find("softcap"); }

  static Problem problem(DType t, std::int64_t n, double cap = 30.0) {
    return named_problem(sc(), t, 16, {{"n", double(n)}, {"cap", cap}});
  }
  static Params params(const char* dtype, std::int64_t block, std::int64_t vec) {
    return Params{{"dtype", std::string(dtype)}, {"block", block}, {"vec", vec}};
  }

  static TempDir* dir_;
  static Registry* registry_;
};
TempDir* SoftcapPlugin::dir_ = nullptr;
Registry* SoftcapPlugin::registry_ = nullptr;

TEST_F(SoftcapPlugin, SchemaAndValidation) {
  EXPECT_EQ(sc().version(), 1);
  ASSERT_EQ(sc().schema().size(), 3u);
  EXPECT_EQ(sc().schema()[0].name, "block");
  EXPECT_EQ(sc().schema()[0].ints, (std::vector<std::int64_t>{128, 256, 1024}));
  EXPECT_EQ(sc().schema()[1].choices, (std::vector<std::string>{"f32", "f16", "bf16"}));
  const auto& fields = sc().problem_fields();
  ASSERT_EQ(fields.size(), 2u);
  EXPECT_EQ(fields[0].name, "n");
  EXPECT_EQ(fields[0].slot, 0u);
  EXPECT_TRUE(fields[0].bucketed && fields[0].key);
  EXPECT_EQ(fields[0].type, FieldType::i64);
  EXPECT_EQ(fields[1].name, "cap");
  EXPECT_EQ(fields[1].slot, 1u);
  EXPECT_FALSE(fields[1].key);
  EXPECT_EQ(fields[1].type, FieldType::f64);
  EXPECT_EQ(fields[1].doc, "the soft cap: finite and positive");
  EXPECT_TRUE(sc().validate(params("bf16", 256, 8)).ok());
  // The plugin's own rule, through the C ABI with its message.
  Status wide = sc().validate(params("f32", 256, 8));
  EXPECT_EQ(wide.code(), Code::invalid_argument);
  EXPECT_EQ(wide.message(), "softcap: vec * sizeof(dtype) must be at most 16 bytes (got vec=8 for f32)");
  // Schema rules kiln enforces itself.
  EXPECT_EQ(sc().validate(params("f64", 256, 1)).code(), Code::invalid_argument);
  EXPECT_EQ(sc().validate(params("f32", 512, 1)).code(), Code::invalid_argument);
  Params extra = params("f32", 256, 1);
  extra.set("unroll", 2);
  EXPECT_EQ(sc().validate(extra).message(), "softcap: unknown parameter 'unroll'");
  EXPECT_EQ(sc().validate(Params{{"dtype", std::string("f32")}, {"vec", std::int64_t(1)}}).message(),
            "softcap: missing parameter 'block'");
  EXPECT_EQ(sc().catalog().size(), 33u);  // 3 blocks x (3 f32 + 4 f16 + 4 bf16 vector widths)
}

TEST_F(SoftcapPlugin, RendersItsTemplate) {
  auto r = sc().render(params("bf16", 256, 8));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->source, "#include \"softcap/softcap.cuh\"\n");
  EXPECT_EQ(r->name_expression, "kiln_softcap::softcap<kiln::bf16_t, 256, 8>");
  EXPECT_TRUE(r->options.empty());
  EXPECT_EQ(sc().render(params("f32", 256, 8)).status().code(), Code::invalid_argument) << "render validates first";
  ASSERT_NE(sc().template_files(), nullptr);
  EXPECT_EQ(sc().template_files()->size(), 1u);
  EXPECT_EQ(sc().template_files()->count("softcap/softcap.cuh"), 1u);
}

TEST_F(SoftcapPlugin, CompilesForSm80AndSm90a) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable: " << jit::Nvrtc::get().status().to_string();
  jit::Builder b(nullptr, registry_);
  for (const char* arch : {"sm_80", "sm_90a"})
    for (const Params& p : {params("f32", 128, 4), params("bf16", 1024, 8), params("f16", 256, 1)}) {
      auto a = b.get(KernelSpec{"softcap", p}, arch);
      ASSERT_TRUE(a.ok()) << p.canonical() << " " << arch << ": " << a.status().to_string();
      EXPECT_GT(a->entry.cubin.size(), 100u);
      EXPECT_GT(a->entry.registers, 0);
      EXPECT_NE(a->entry.lowered_name.find("softcap"), std::string::npos);
      EXPECT_NE(a->entry.key_text.find("plugin kiln-example-softcap 1.0.0\n"), std::string::npos) << a->entry.key_text;
    }
  EXPECT_EQ(b.stats().compiles, 6);
}

// By hand, cap = 2: y = 2 tanh(x / 2).
//   x = 0 -> 0;  1 -> 2 tanh(0.5) = 0.9242343145;  -2 -> 2 tanh(-1) = -1.5231883119;
//   6 -> 2 tanh(3) = 1.9901095073;  100 -> 2 (saturated);  -0.25 -> 2 tanh(-0.125) = -0.2487060035
TEST_F(SoftcapPlugin, CpuReferenceMatchesHandComputedValues) {
  std::vector<float> x = {0, 1, -2, 6, 100, -0.25f}, y(6, NAN);
  void* bufs[2] = {x.data(), y.data()};
  const Problem p = problem(DType::f32, 6, 2.0);
  Status s = sc().cpu_reference(sc().heuristic(p), p, bufs);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const double want[6] = {0.0, 0.9242343145, -1.5231883119, 1.9901095073, 2.0, -0.2487060035};
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(y[i], want[i], 1e-6) << i;

  // The same values in bf16: inputs are exact in bf16, the outputs rounded to it.
  std::vector<std::uint16_t> xb(6), yb(6, 0xffff);
  for (int i = 0; i < 6; ++i) store_from_double(xb.data(), DType::bf16, i, x[i]);
  void* bbufs[2] = {xb.data(), yb.data()};
  const Problem pb = problem(DType::bf16, 6, 2.0);
  ASSERT_TRUE(sc().cpu_reference(sc().heuristic(pb), pb, bbufs).ok());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(load_as_double(yb.data(), DType::bf16, i), want[i], 1e-2) << i;
  EXPECT_EQ(yb[4], float_to_bf16(2.0f));
}

TEST_F(SoftcapPlugin, HeuristicPicksTheWidestAccessAndABlockPerSize) {
  Problem p = problem(DType::bf16, 65536 * 8);
  EXPECT_EQ(sc().heuristic(p), params("bf16", 128, 8));
  p.fields[0].i = 65536 * 8 + 8;  // one pack more
  EXPECT_EQ(sc().heuristic(p), params("bf16", 256, 8));
  p.fields[0].i = 1000003;  // an odd length keeps the widest access: the tail goes one element at a time
  EXPECT_EQ(sc().heuristic(p), params("bf16", 256, 8));
  p = problem(DType::f32, 4096);
  p.alignment = 8;
  EXPECT_EQ(sc().heuristic(p), params("f32", 128, 2));  // 8-byte aligned
  p.alignment = 2;
  EXPECT_EQ(sc().heuristic(p), params("f32", 128, 1));
  for (const Problem& b : sc().benchmark_problems(DType::f16)) {
    const Params h = sc().heuristic(b);
    EXPECT_TRUE(sc().check_problem(h, b).ok()) << h.canonical();
  }
}

TEST_F(SoftcapPlugin, ErrorPathsKeepTheirCodesAcrossTheAbi) {
  const Params v = params("bf16", 256, 8);
  EXPECT_EQ(sc().check_problem(v, problem(DType::f16, 64)).code(), Code::unsupported_dtype);
  EXPECT_EQ(sc().check_problem(v, problem(DType::f16, 64)).message(), "softcap: kernel is for bf16, tensors are f16");
  EXPECT_EQ(sc().check_problem(v, problem(DType::bf16, -1)).code(), Code::shape_mismatch);
  for (double cap : {0.0, -1.0, double(NAN), double(INFINITY)})
    EXPECT_EQ(sc().check_problem(v, problem(DType::bf16, 64, cap)).message(),
              "softcap: cap must be finite and positive")
        << cap;
  Problem misaligned = problem(DType::bf16, 64);
  misaligned.alignment = 4;
  EXPECT_EQ(sc().check_problem(v, misaligned).message(), "softcap: vec=8 needs buffers aligned to vec elements");
  EXPECT_TRUE(sc().check_problem(v, problem(DType::bf16, 61)).ok()) << "any n: the tail is handled";
  EXPECT_TRUE(sc().check_problem(v, problem(DType::bf16, 0)).ok());
  // An invalid variant is refused before the plugin sees it.
  EXPECT_EQ(sc().check_problem(params("f32", 256, 8), problem(DType::f32, 64)).code(), Code::invalid_argument);
  float a[4] = {};
  void* one[1] = {a};
  Status s = sc().cpu_reference(v, problem(DType::bf16, 4), one);
  EXPECT_EQ(s.code(), Code::invalid_argument);
  EXPECT_EQ(s.message(), "softcap: the reference takes buffers x and y");
}

TEST_F(SoftcapPlugin, ArgumentsAndGeometry) {
  const Problem p = problem(DType::bf16, 7 * 256 * 8 + 5, 50.0);
  const Params v = params("bf16", 256, 8);
  int x, y;
  void* bufs[2] = {&x, &y};
  ArgPack args;
  sc().pack_bound(sc().bind(v), v, p, bufs, args);
  ASSERT_FALSE(args.overflow());
  ASSERT_EQ(args.count(), 4u);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[0]), &x);
  EXPECT_EQ(*static_cast<void**>(args.pointers()[1]), &y);
  EXPECT_EQ(*static_cast<long long*>(args.pointers()[2]), 7 * 256 * 8 + 5);
  EXPECT_FLOAT_EQ(*static_cast<float*>(args.pointers()[3]), 50.f);
  LaunchGeometry geo = sc().geometry(v, p);
  EXPECT_EQ(geo.grid.x, 7u) << "one pack per thread; the 5 left over go to the first threads";
  EXPECT_EQ(geo.block.x, 256u);
  EXPECT_EQ(geo.shared_bytes, 0u);
  EXPECT_EQ(sc().geometry(v, problem(DType::bf16, 3)).grid.x, 1u);
  EXPECT_EQ(sc().geometry(params("f32", 128, 1), problem(DType::f32, std::int64_t(1) << 40)).grid.x, 1u << 20)
      << "the grid strides over what a capped grid does not cover";
  const auto bs = sc().buffers(v, p);
  ASSERT_EQ(bs.size(), 2u);
  EXPECT_EQ(bs[0].name, "x");
  EXPECT_EQ(bs[0].elements, p.fields[0].i);
  EXPECT_EQ(bs[1].role, BufferRole::output);
  EXPECT_EQ(bs[1].elements, p.fields[0].i);
  auto shaped = sc().problem_from_shape(DType::f16, {{"n", 768}});
  ASSERT_TRUE(shaped.ok());
  EXPECT_EQ(shaped->fields[0].i, 768);
  EXPECT_DOUBLE_EQ(shaped->fields[1].f, 30.0);
  EXPECT_EQ(sc().problem_from_shape(DType::f16, {{"tokens", 3}}).status().code(), Code::invalid_argument);
}

// The plugin rebuilt with one line added to its template (same name, same version): its kernels
// get new keys, so a cache filled by the old build serves it nothing; the old build still hits.
TEST_F(SoftcapPlugin, AnEditedTemplateGetsNewKeysAndARecompile) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable";
  TempDir dir;
  Registry changed;
  auto rep = plugin::load(changed, {private_copy(example_plugin_changed(), dir.path())});
  ASSERT_EQ(rep.loaded.size(), 1u) << (rep.skipped.empty() ? "" : rep.skipped[0].reason);
  const PluginInfo& old_info = *sc().plugin();
  const PluginInfo& new_info = *changed.find("softcap")->plugin();
  EXPECT_EQ(new_info.name, old_info.name);
  EXPECT_EQ(new_info.version, old_info.version);
  EXPECT_NE(new_info.templates_hash, old_info.templates_hash);

  auto store = cache::Store::open(dir.path() / "k.sqlite").value();
  const KernelSpec spec{"softcap", params("f32", 128, 4)};
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
