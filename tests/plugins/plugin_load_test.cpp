// The plugin loader on real shared libraries: the example plugin and a plain-C plugin load; broken
// ones (built by CMake from tests/plugins/fixtures/c_plugin.c), files that are not libraries, and
// files or directories others could write are skipped with one reason each; conflicts keep the
// first; the built-in families come through the same loader; kilnd loads plugins, serves their
// kernels (compiled in its worker processes) and survives broken ones.
#include <gtest/gtest.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>

#include "client/daemon_client.h"
#include "jit/nvrtc.h"
#include "plugin/loader.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/plugin_util.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The reason `file` was skipped when loaded alone into `r`; "" if it loaded.
std::string reason_for(Registry& r, const std::string& file) {
  plugin::Report rep = plugin::load(r, {file}, /*quiet=*/true);
  if (!rep.loaded.empty()) return "";
  EXPECT_EQ(rep.skipped.size(), 1u);
  return rep.skipped.empty() ? "(no reason)" : rep.skipped[0].reason;
}

TEST(PluginLoad, TheExamplePluginLoadsIntoARegistry) {
  TempDir dir;
  const std::string file = private_copy(example_plugin(), dir.path());
  Registry r;
  plugin::Report rep = plugin::load(r, {file}, true);
  ASSERT_EQ(rep.loaded.size(), 1u) << (rep.skipped.empty() ? "" : rep.skipped[0].reason);
  EXPECT_TRUE(rep.skipped.empty());
  const PluginInfo& info = *rep.loaded[0];
  EXPECT_EQ(info.name, "kiln-example-softcap");
  EXPECT_EQ(info.version, "1.0.0");
  EXPECT_EQ(info.path, fs::canonical(file).string());
  EXPECT_EQ(info.families, std::vector<std::string>{"softcap"});
  EXPECT_EQ(info.templates_hash.size(), 64u);
  const Family* f = r.find("softcap");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->plugin(), rep.loaded[0].get());
  ASSERT_NE(f->template_files(), nullptr);
  EXPECT_EQ(f->template_files()->count("softcap/softcap.cuh"), 1u);
}

TEST(PluginLoad, APluginWrittenInCLoads) {
  TempDir dir;
  Registry r;
  EXPECT_EQ(reason_for(r, private_copy(c_plugin("ok"), dir.path())), "");
  const Family* f = r.find("c_scale");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->plugin()->name, "c-scale");
  EXPECT_EQ(f->catalog().size(), 2u);
  // Its optional hooks are absent: kiln's defaults stand in.
  Problem p;
  p.fields[0].i = 1000;
  EXPECT_EQ(f->signature(p), "dtype=f32,align=16,n<=1024");
  ASSERT_EQ(f->problem_fields().size(), 1u);
  EXPECT_EQ(f->problem_fields()[0].doc, "elements");
  auto rendered = f->render(f->catalog()[1]);
  ASSERT_TRUE(rendered.ok()) << rendered.status().to_string();
  EXPECT_EQ(rendered->name_expression, "c_scale::scale<256>");
}

struct Broken {
  const char* kind;
  const char* reason;
};

class BrokenPlugin : public ::testing::TestWithParam<Broken> {};

TEST_P(BrokenPlugin, IsSkippedWithItsReason) {
  TempDir dir;
  Registry r;
  // "builtin_name" provides a family named like a built-in: the registry holds the built-ins.
  plugin::Report builtins;
  ASSERT_TRUE(plugin::register_plugin(r, plugin::builtin_descriptor(), plugin::k_builtin_path, builtins).ok());
  const std::size_t before = r.all().size();
  const std::string reason = reason_for(r, private_copy(c_plugin(GetParam().kind), dir.path()));
  EXPECT_TRUE(contains(reason, GetParam().reason)) << reason;
  EXPECT_EQ(r.all().size(), before) << "a skipped plugin registered a family";
  EXPECT_NE(r.find("rmsnorm"), nullptr);
  EXPECT_EQ(r.find("rmsnorm")->plugin()->name, "builtin") << "the first provider of a name is kept";
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, BrokenPlugin,
    ::testing::Values(Broken{"wrong_version", "built for plugin ABI version 100; this kiln loads version 3"},
                      Broken{"failing_init", "its init failed (code 10): c-scale: no license file at /etc/c-scale.lic"},
                      Broken{"empty_name", "family #0 is invalid: its name is missing"},
                      Broken{"bad_schema", "parameter 'block' must list either integers or string choices"},
                      Broken{"builtin_name", "conflict: family 'rmsnorm' is already provided by plugin 'builtin'"},
                      Broken{"no_entry", "missing symbol kiln_plugin_entry"},
                      Broken{"shadow_template", "template 'common/dtype.cuh' would shadow kiln's own template"},
                      Broken{"missing_function", "its vtable lacks pack_args"}),
    [](const auto& info) { return std::string(info.param.kind); });

// A plugin that calls itself "builtin" is a conflict too, and so is one whose descriptor is too
// small for this ABI: checked on the real C fixture's descriptor, altered.
TEST(PluginLoad, ANamesakeOfTheBuiltInPluginOrATruncatedDescriptorIsRefused) {
  TempDir dir;
  void* lib = ::dlopen(private_copy(c_plugin("ok"), dir.path()).c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  auto entry = reinterpret_cast<kiln_plugin_entry_fn>(::dlsym(lib, KILN_PLUGIN_ENTRY_SYMBOL));
  ASSERT_NE(entry, nullptr);
  Registry r;
  plugin::Report rep;
  ASSERT_TRUE(plugin::register_plugin(r, plugin::builtin_descriptor(), plugin::k_builtin_path, rep).ok());
  kiln_plugin namesake = *entry();
  namesake.name = "builtin";
  EXPECT_EQ(plugin::register_plugin(r, &namesake, "/x/libnamesake.so", rep).message(),
            "conflict: a plugin named 'builtin' is already loaded from (built in); the first is kept");
  kiln_plugin small = *entry();
  small.struct_size = 8;
  EXPECT_NE(plugin::register_plugin(r, &small, "/x/libsmall.so", rep).message().find("struct_size 8 is below"),
            std::string::npos);
  EXPECT_EQ(r.find("c_scale"), nullptr);
  ASSERT_EQ(rep.skipped.size(), 2u);
  EXPECT_EQ(rep.skipped[0].path, "/x/libnamesake.so");
}

// kiln_family.flags: the programmatic-launch flag is honoured; a descriptor shorter than this API
// version's kiln_family is refused. A plugin built against a newer header of the same version
// (fields appended, a larger struct_size) lays its array out with its own stride: both entries
// register, and entries of different sizes cannot be strided over.
TEST(PluginLoad, FamilyFlagsAndTheDescriptorArraysStride) {
  TempDir dir;
  void* lib = ::dlopen(private_copy(c_plugin("ok"), dir.path()).c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  const kiln_plugin& good = *reinterpret_cast<kiln_plugin_entry_fn>(::dlsym(lib, KILN_PLUGIN_ENTRY_SYMBOL))();
  auto programmatic = [&](std::uint32_t struct_size, std::uint32_t flags) -> std::optional<bool> {
    kiln_family f = good.families[0];
    f.struct_size = struct_size;
    f.flags = flags;
    kiln_plugin p = good;
    p.families = &f;
    p.family_count = 1;
    Registry r;
    plugin::Report rep;
    if (!plugin::register_plugin(r, &p, "/x/lib.so", rep).ok()) return std::nullopt;
    return r.find("c_scale")->programmatic_launch();
  };
  EXPECT_EQ(programmatic(sizeof(kiln_family), 0), false);
  EXPECT_EQ(programmatic(sizeof(kiln_family), KILN_FAMILY_PROGRAMMATIC_LAUNCH), true);
  EXPECT_EQ(programmatic(std::uint32_t(KILN_FAMILY_MIN_STRUCT_SIZE) - 8, 0), std::nullopt) << "truncated";

  constexpr std::size_t newer = sizeof(kiln_family) + 16;
  alignas(kiln_family) unsigned char array[2 * newer] = {};
  kiln_family first = good.families[0], second = good.families[0];
  first.struct_size = second.struct_size = std::uint32_t(newer);
  second.name = "c_scale_newer_two";
  second.flags = KILN_FAMILY_PROGRAMMATIC_LAUNCH;
  std::memcpy(array, &first, sizeof(kiln_family));
  std::memcpy(array + newer, &second, sizeof(kiln_family));
  kiln_plugin p = good;
  p.families = reinterpret_cast<const kiln_family*>(array);
  p.family_count = 2;
  Registry r;
  plugin::Report rep;
  Status s = plugin::register_plugin(r, &p, "/x/newer.so", rep);
  EXPECT_TRUE(s.ok()) << s.to_string();
  ASSERT_NE(r.find("c_scale_newer_two"), nullptr);
  EXPECT_TRUE(r.find("c_scale_newer_two")->programmatic_launch());
  EXPECT_FALSE(r.find("c_scale")->programmatic_launch());
  second.struct_size = sizeof(kiln_family);
  std::memcpy(array + newer, &second, sizeof(kiln_family));
  Registry r2;
  EXPECT_NE(plugin::register_plugin(r2, &p, "/x/mixed.so", rep).message().find("family #1 has struct_size"),
            std::string::npos);
}

// kiln_family_vtable.runs_on was appended to the vtable: a vtable built against the header before
// it (struct_size up to the field) still registers, its variants on every arch; one that covers the
// kiln_family_vtable.runs_on: a family that has one gets its catalog filtered per arch, with the
// arch taken apart ("sm_90a" -> {90, 'a'}); a runs_on that fails counts as "runs"; a vtable shorter
// than this API version's is refused.
TEST(PluginLoad, RunsOnFiltersTheCatalogPerArch) {
  TempDir dir;
  void* lib = ::dlopen(private_copy(c_plugin("ok"), dir.path()).c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  const kiln_plugin& good = *reinterpret_cast<kiln_plugin_entry_fn>(::dlsym(lib, KILN_PLUGIN_ENTRY_SYMBOL))();
  using RunsOn = decltype(kiln_family_vtable::runs_on);
  // block=256 runs on sm_90a only.
  const RunsOn block_256_on_sm90a = [](void*, const kiln_params* params, const kiln_arch* arch, std::int32_t* runs,
                                       kiln_plugin_error*) -> int {
    std::int64_t block = 0;
    for (std::uint32_t i = 0; i < params->count; ++i)
      if (std::strcmp(params->items[i].name, "block") == 0) block = params->items[i].int_value;
    *runs = block != 256 || (arch->capability == 90 && arch->suffix == 'a');
    return KILN_OK;
  };
  const RunsOn failing = [](void*, const kiln_params*, const kiln_arch*, std::int32_t*, kiln_plugin_error* err) {
    return kiln_plugin_fail(err, KILN_INTERNAL, "c_scale: runs_on failed");
  };
  using Sizes = std::vector<std::size_t>;  // catalog sizes for sm_80, sm_90, sm_90a
  auto sizes = [&](std::size_t vtable_size, RunsOn runs_on) -> std::optional<Sizes> {
    kiln_family_vtable vt = *good.families[0].vtable;
    vt.struct_size = std::uint32_t(vtable_size);
    vt.runs_on = runs_on;
    kiln_family f = good.families[0];
    f.vtable = &vt;
    kiln_plugin p = good;
    p.families = &f;
    p.family_count = 1;
    Registry r;
    plugin::Report rep;
    if (!plugin::register_plugin(r, &p, "/x/lib.so", rep).ok()) return std::nullopt;
    Sizes out;
    for (const char* arch : {"sm_80", "sm_90", "sm_90a"}) out.push_back(catalog_for(*r.find("c_scale"), arch)->size());
    return out;
  };
  EXPECT_EQ(sizes(sizeof(kiln_family_vtable), block_256_on_sm90a), (Sizes{1, 1, 2}));
  EXPECT_EQ(sizes(sizeof(kiln_family_vtable), nullptr), (Sizes{2, 2, 2}));
  EXPECT_EQ(sizes(sizeof(kiln_family_vtable), failing), (Sizes{2, 2, 2}));
  EXPECT_EQ(sizes(KILN_FAMILY_VTABLE_MIN_STRUCT_SIZE - 8, nullptr), std::nullopt) << "truncated";
}

// Descriptor checks on the C fixture's descriptor with one thing wrong at a time: template paths
// and text, a catalog entry the schema rejects, bad problem fields, two families with one name.
TEST(PluginLoad, DescriptorsWithBadTemplatesOrCatalogsAreRefused) {
  TempDir dir;
  void* lib = ::dlopen(private_copy(c_plugin("ok"), dir.path()).c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  const kiln_plugin& good = *reinterpret_cast<kiln_plugin_entry_fn>(::dlsym(lib, KILN_PLUGIN_ENTRY_SYMBOL))();
  auto refusal = [&](const kiln_family* families, std::uint32_t count) {
    kiln_plugin p = good;
    p.families = families;
    p.family_count = count;
    Registry r;
    plugin::Report rep;
    Status s = plugin::register_plugin(r, &p, "/x/lib.so", rep);
    EXPECT_EQ(r.all().empty(), !s.ok()) << "all families or none";
    return s.message();
  };
  const kiln_family base = good.families[0];
  EXPECT_EQ(refusal(&base, 1), "") << "the unaltered descriptor registers";

  for (const char* path : {"../etc/passwd.cuh", "/abs.cuh", "a//b.cuh", "a/./b.cuh", "sp ace.cuh"}) {
    const kiln_template_file t{path, "x", 1};
    kiln_family f = base;
    f.templates = &t;
    EXPECT_TRUE(contains(refusal(&f, 1), "is not a relative path")) << path;
  }
  const char bad_utf8[] = "// \xff\xfe\n";
  const kiln_template_file binary{"c_scale/scale.cuh", bad_utf8, sizeof bad_utf8 - 1};
  kiln_family f = base;
  f.templates = &binary;
  EXPECT_EQ(refusal(&f, 1), "template 'c_scale/scale.cuh' is not UTF-8 text");
  const kiln_template_file other{"c_scale/scale.cuh", "// another body\n", 16};
  kiln_family two[2] = {base, base};
  two[1].name = "c_scale_two";
  two[1].templates = &other;
  EXPECT_EQ(refusal(two, 2), "two families ship different templates at 'c_scale/scale.cuh'");
  two[1] = base;
  EXPECT_EQ(refusal(two, 2), "it provides family 'c_scale' twice");

  const kiln_param wrong_block[] = {{"block", nullptr, 96}, {"dtype", "f32", 0}};
  const kiln_params catalog{wrong_block, 2};
  f = base;
  f.catalog = &catalog;
  f.catalog_count = 1;
  EXPECT_TRUE(contains(refusal(&f, 1), "catalog entry block=96,dtype=f32 does not validate: c_scale: parameter "
                                       "'block' must be one of {128, 256}"))
      << refusal(&f, 1);
  auto with_fields = [&](std::vector<kiln_problem_field> fields) {
    kiln_family g = base;
    g.fields = fields.data();
    g.field_count = std::uint32_t(fields.size());
    return refusal(&g, 1);
  };
  const std::uint8_t key = KILN_FIELD_KEY, bucket = KILN_FIELD_KEY | KILN_FIELD_BUCKETED;
  EXPECT_EQ(with_fields({{"n", "", 0, KILN_FIELD_I64, bucket, 0}, {"cap", nullptr, 1, KILN_FIELD_F64, 0, 0}}), "");
  EXPECT_TRUE(contains(with_fields({{"n", "", 1, KILN_FIELD_I64, key, 0}}), "each named once"));
  EXPECT_TRUE(contains(with_fields({{"n", "", 0, KILN_FIELD_I64, key, 0}, {"n", "", 1, KILN_FIELD_I64, key, 0}}),
                       "declared twice"));
  EXPECT_TRUE(contains(with_fields({{"n", "", 0, KILN_FIELD_F64, bucket, 0}}), "must be an i64 key"));
  EXPECT_TRUE(contains(with_fields({{"n", "", 0, 7, key, 0}}), "unknown type"));
  EXPECT_TRUE(contains(with_fields({{"n", "", 0, KILN_FIELD_I64, 8, 0}}), "unknown flags"));
  EXPECT_TRUE(contains(with_fields({{nullptr, "", 0, KILN_FIELD_I64, key, 0}}), "has no name"));
  EXPECT_TRUE(contains(with_fields({{"N", "", 0, KILN_FIELD_I64, key, 0}}), "is not [a-z]"));
  f = base;
  f.field_count = KILN_PLUGIN_MAX_FIELDS + 1;
  EXPECT_TRUE(contains(refusal(&f, 1), "more than " + std::to_string(KILN_PLUGIN_MAX_FIELDS) + " problem fields"));
  f = base;
  f.catalog_count = 0;
  EXPECT_TRUE(contains(refusal(&f, 1), "an empty catalog"));
}

TEST(PluginLoad, FilesThatAreNotPluginsAreSkipped) {
  TempDir dir;
  Registry r;
  const auto text = dir.path() / "libnotes.so";
  std::ofstream(text) << "not an ELF file\n";
  ::chmod(text.c_str(), 0644);
  EXPECT_TRUE(contains(reason_for(r, text.string()), "not a loadable shared library")) << reason_for(r, text.string());
  EXPECT_EQ(reason_for(r, (dir.path() / "missing.so").string()), "no such file or directory");
  // A real shared library that is no plugin (the math library) has no entry point.
  const std::string libm = "/lib/x86_64-linux-gnu/libm.so.6";
  if (fs::exists(libm)) {
    EXPECT_EQ(reason_for(r, libm), "missing symbol kiln_plugin_entry (not a kiln plugin?)");
  }
  EXPECT_TRUE(r.all().empty());
}

TEST(PluginLoad, FilesAndDirectoriesOthersCanWriteAreSkipped) {
  TempDir dir;
  Registry r;
  const std::string file = private_copy(c_plugin("ok"), dir.path());
  ::chmod(file.c_str(), 0775);
  EXPECT_EQ(reason_for(r, file), "the file is writable by group or others (mode 0775)");
  ::chmod(file.c_str(), 0757);
  EXPECT_EQ(reason_for(r, file), "the file is writable by group or others (mode 0757)");
  ::chmod(file.c_str(), 0755);

  const fs::path open_dir = dir.path() / "open";
  fs::create_directory(open_dir);
  const std::string inside = private_copy(c_plugin("ok"), open_dir);
  ::chmod(open_dir.c_str(), 0777);
  EXPECT_EQ(reason_for(r, inside), "its directory is writable by group or others (mode 0777)");
  EXPECT_EQ(reason_for(r, open_dir.string()), "the directory is writable by group or others (mode 0777)");
  EXPECT_TRUE(r.all().empty());
  ::chmod(open_dir.c_str(), 0700);
  EXPECT_EQ(reason_for(r, inside), "") << "the same file loads once nobody else can write it";
}

TEST(PluginLoad, FilesOwnedBySomeoneElseAreSkipped) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  TempDir dir;
  Registry r;
  const std::string file = private_copy(c_plugin("ok"), dir.path());
  ASSERT_EQ(::chown(file.c_str(), 4242, 4242), 0);
  EXPECT_TRUE(contains(reason_for(r, file), "the file is owned by uid 4242, neither this user")) << reason_for(r, file);
  EXPECT_TRUE(r.all().empty());
}

TEST(PluginLoad, TwoPluginsOfOneNameKeepTheFirst) {
  TempDir dir;
  Registry r;
  const std::string a = private_copy(example_plugin(), dir.path(), "liba.so");
  const std::string b = private_copy(example_plugin(), dir.path(), "libb.so");
  plugin::Report rep = plugin::load(r, {a, b, a}, true);
  ASSERT_EQ(rep.loaded.size(), 1u);
  EXPECT_EQ(rep.loaded[0]->path, fs::canonical(a).string());
  ASSERT_EQ(rep.skipped.size(), 2u);
  EXPECT_EQ(rep.skipped[0].path, fs::canonical(b).string());
  EXPECT_TRUE(contains(rep.skipped[0].reason, "conflict: a plugin named 'kiln-example-softcap' is already loaded from " +
                                                  fs::canonical(a).string()))
      << rep.skipped[0].reason;
  EXPECT_TRUE(contains(rep.skipped[1].reason, "the same file is already listed")) << rep.skipped[1].reason;
  EXPECT_EQ(r.find("softcap")->plugin()->path, fs::canonical(a).string());
}

TEST(PluginLoad, ADirectoryContributesItsSharedLibrariesInNameOrder) {
  TempDir dir;
  Registry r;
  private_copy(example_plugin(), dir.path(), "libz_softcap.so");
  private_copy(c_plugin("ok"), dir.path(), "liba_scale.so");
  std::ofstream(dir.path() / "README") << "not a plugin, not a .so: ignored\n";
  plugin::Report rep = plugin::load(r, {dir.path().string()}, true);
  ASSERT_EQ(rep.loaded.size(), 2u);
  EXPECT_TRUE(rep.skipped.empty()) << rep.skipped[0].path << ": " << rep.skipped[0].reason;
  EXPECT_EQ(rep.loaded[0]->name, "c-scale");
  EXPECT_EQ(rep.loaded[1]->name, "kiln-example-softcap");
}

TEST(PluginLoad, SearchPathComesFromTheEnvironment) {
  {
    ScopedEnv p("KILN_PLUGIN_PATH", "/opt/a.so::/opt/dir");
    EXPECT_EQ(plugin::search_path(), (std::vector<std::string>{"/opt/a.so", "/opt/dir"}));
  }
  {
    ScopedEnv p("KILN_PLUGIN_PATH", "");
    EXPECT_TRUE(plugin::search_path().empty()) << "an empty KILN_PLUGIN_PATH turns plugins off";
  }
  ScopedEnv xdg("XDG_DATA_HOME", "/data");
  ::unsetenv("KILN_PLUGIN_PATH");
  EXPECT_EQ(plugin::search_path(), std::vector<std::string>{"/data/kiln/plugins"});
  ScopedEnv rel("XDG_DATA_HOME", "relative");
  ScopedEnv home("HOME", "/home/u");
  EXPECT_EQ(plugin::default_dir(), "/home/u/.local/share/kiln/plugins");
}

TEST(PluginLoad, BuiltInFamiliesComeThroughTheLoader) {
  const plugin::Report& rep = plugin::process_report();
  ASSERT_FALSE(rep.loaded.empty());
  EXPECT_EQ(rep.loaded[0]->name, "builtin");
  EXPECT_EQ(rep.loaded[0]->path, plugin::k_builtin_path);
  EXPECT_EQ(rep.loaded[0]->version, KILN_VERSION);
  // Every family the built-in plugin lists is registered from it, and nothing else came from it.
  const PluginInfo& builtin = *rep.loaded[0];
  ASSERT_FALSE(builtin.families.empty());
  EXPECT_NE(Registry::global().find("rmsnorm"), nullptr);
  std::size_t from_builtin = 0;
  for (const Family* f : Registry::global().all()) {
    ASSERT_NE(f->plugin(), nullptr) << f->name();
    if (f->plugin()->name != "builtin") continue;
    ++from_builtin;
    EXPECT_NE(std::find(builtin.families.begin(), builtin.families.end(), f->name()), builtin.families.end())
        << f->name();
    EXPECT_NE(f->bind(f->catalog()[0]), nullptr) << f->name() << ": the launch path binds a handle";
  }
  EXPECT_EQ(from_builtin, builtin.families.size());
}

// kilnd with a plugin directory holding the example and a broken plugin: it starts, logs the
// skipped one, and compiles the example's kernels in its worker processes (which get the
// plugin's templates with each request).
TEST(PluginLoad, KilndServesPluginKernelsAndSurvivesBrokenPlugins) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable";
  DaemonEnv env;
  const fs::path plugins = env.root() / "plugins";
  fs::create_directory(plugins);
  ::chmod(plugins.c_str(), 0755);
  private_copy(example_plugin(), plugins);
  private_copy(c_plugin("wrong_version"), plugins);
  auto o = env.options({"--jobs", "1"});
  o.env["KILN_PLUGIN_PATH"] = plugins.string();
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto spec = KernelSpec::parse("softcap(block=256,dtype=bf16,vec=8)");
  ASSERT_TRUE(spec.ok());
  auto art = (*c)->get_kernel(*spec, "sm_90a");
  ASSERT_TRUE(art.ok()) << art.status().to_string() << "\n" << k->log();
  EXPECT_GT(art->entry.cubin.size(), 100u);
  EXPECT_TRUE(contains(art->entry.key_text, "plugin kiln-example-softcap 1.0.0")) << art->entry.key_text;
  EXPECT_TRUE(contains(k->log(), "libc_wrong_version.so skipped: built for plugin ABI version 100")) << k->log();
  EXPECT_TRUE(k->running());

  // The runtime launches a kilnd kernel only when kilnd has this process's build of the family.
  TempDir mine;
  Registry same, edited;
  ASSERT_EQ(plugin::load(same, {private_copy(example_plugin(), mine.path(), "a.so")}).loaded.size(), 1u);
  ASSERT_EQ(plugin::load(edited, {private_copy(example_plugin_changed(), mine.path(), "b.so")}).loaded.size(), 1u);
  EXPECT_TRUE(client::same_family_build(*same.find("softcap"), art->entry).ok());
  Status other = client::same_family_build(*edited.find("softcap"), art->entry);
  EXPECT_EQ(other.code(), Code::unavailable);
  EXPECT_TRUE(contains(other.message(), "kilnd serves another build of family 'softcap' (plugin "
                                        "kiln-example-softcap 1.0.0, plugin_templates ")) << other.message();
  EXPECT_FALSE(client::same_family_build(*Registry::global().find("rmsnorm"), art->entry).ok());
}

// A kilnd without the plugin answers not_found for its family (the runtime then compiles in
// process rather than failing the call); kiln's own families it serves as always.
TEST(PluginLoad, KilndWithoutThePluginDoesNotKnowItsFamily) {
  if (!jit::Nvrtc::get().ok()) GTEST_SKIP() << "NVRTC unavailable";
  DaemonEnv env;
  auto o = env.options({"--jobs", "1"});
  o.env["KILN_PLUGIN_PATH"] = "";
  auto k = Kilnd::spawn(o);
  ASSERT_TRUE(k->wait_ready()) << k->log();
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto art = (*c)->get_kernel(*KernelSpec::parse("softcap(block=256,dtype=bf16,vec=8)"), "sm_90a");
  ASSERT_FALSE(art.ok());
  EXPECT_EQ(art.status().code(), Code::not_found) << art.status().to_string();
}

}  // namespace
}  // namespace kiln::testing
