#include "plugin/adapter.h"

#include <cctype>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "kiln/plugin_cpp.h"

namespace kiln::plugin {
namespace {

using plugin_bridge::detail::as_c;
using plugin_bridge::detail::to_params;
using plugin_bridge::detail::to_problem;

// Params as a C list for the length of one call; names and strings point into `params`.
class CParams {
 public:
  explicit CParams(const Params& params) {
    items_.reserve(params.values().size());
    for (const auto& [name, value] : params.values()) {
      kiln_param p{name.c_str(), nullptr, 0};
      if (const auto* s = std::get_if<std::string>(&value)) p.str = s->c_str();
      else p.int_value = std::get<std::int64_t>(value);
      items_.push_back(p);
    }
    view_ = kiln_params{items_.data(), std::uint32_t(items_.size())};
  }
  const kiln_params* get() const { return &view_; }

 private:
  std::vector<kiln_param> items_;
  kiln_params view_{};
};

bool valid_value(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.')) return false;
  return true;
}

// The descriptor's problem fields; check_descriptor has checked that each has a name.
std::vector<ProblemField> fields_of(const kiln_family& d) {
  std::vector<ProblemField> out;
  for (std::uint32_t i = 0; i < d.field_count; ++i) {
    const kiln_problem_field& f = d.fields[i];
    ProblemField pf;
    pf.name = f.name ? f.name : "";
    pf.type = static_cast<FieldType>(f.type);
    pf.slot = f.slot;
    pf.key = (f.flags & (KILN_FIELD_KEY | KILN_FIELD_BUCKETED)) != 0;
    pf.bucketed = (f.flags & KILN_FIELD_BUCKETED) != 0;
    pf.doc = f.doc ? f.doc : "";
    out.push_back(std::move(pf));
  }
  return out;
}

class PluginFamily final : public Family {
 public:
  PluginFamily(const kiln_family& d, std::shared_ptr<const PluginInfo> info, std::shared_ptr<const TemplateFiles> templates)
      : vt_(d.vtable), ctx_(d.context), name_(d.name), version_(d.version),
        programmatic_((d.flags & KILN_FAMILY_PROGRAMMATIC_LAUNCH) != 0), runs_on_(d.vtable->runs_on),
        info_(std::move(info)), templates_(std::move(templates)) {
    for (std::uint32_t i = 0; i < d.param_count; ++i) {
      const kiln_param_def& p = d.params[i];
      ParamDef def{p.name, {}, {}, p.doc ? p.doc : ""};
      for (std::uint32_t j = 0; j < p.int_count; ++j) def.ints.push_back(p.ints[j]);
      for (std::uint32_t j = 0; j < p.choice_count; ++j) def.choices.emplace_back(p.choices[j] ? p.choices[j] : "");
      schema_.push_back(std::move(def));
    }
    fields_ = fields_of(d);
  }
  ~PluginFamily() override {
    for (const auto& [canonical, handle] : bound_) vt_->unbind(ctx_, handle);
  }

  // The catalog is read after construction: each entry goes through validate(), which calls the
  // plugin.
  Status read_catalog(const kiln_family& d) {
    std::set<std::string> seen;
    for (std::uint32_t i = 0; i < d.catalog_count; ++i) {
      const kiln_params& c = d.catalog[i];
      if (c.count && !c.items) return invalid_argument("catalog entry " + std::to_string(i) + " has no items");
      for (std::uint32_t j = 0; j < c.count; ++j)
        if (!c.items[j].name) return invalid_argument("catalog entry " + std::to_string(i) + " has a nameless parameter");
      Params p = to_params(&c);
      if (p.values().size() != c.count)
        return invalid_argument("catalog entry " + std::to_string(i) + " names a parameter twice");
      Status s = validate(p);
      if (!s.ok()) return invalid_argument("catalog entry " + p.canonical() + " does not validate: " + s.message());
      if (!seen.insert(p.canonical()).second) return invalid_argument("catalog entry " + p.canonical() + " is listed twice");
      catalog_.push_back(std::move(p));
    }
    return {};
  }

  std::string_view name() const override { return name_; }
  int version() const override { return version_; }
  const std::vector<ParamDef>& schema() const override { return schema_; }
  const std::vector<ProblemField>& problem_fields() const override { return fields_; }
  std::vector<Params> catalog() const override { return catalog_; }
  bool programmatic_launch() const override { return programmatic_; }
  const PluginInfo* plugin() const override { return info_.get(); }
  const TemplateFiles* template_files() const override { return templates_.get(); }

  // A plugin that fails to answer is logged and taken to mean "runs": the variant is then
  // compiled, and a compile that cannot work reports why.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    if (!runs_on_) return true;
    CParams c(params);
    const kiln_arch a{std::uint32_t(arch.capability), std::uint32_t(static_cast<unsigned char>(arch.suffix))};
    std::int32_t runs = 1;
    Error err;
    Status s = check(runs_on_(ctx_, c.get(), &a, &runs, &err.e), err, "runs_on");
    if (!s.ok()) return report(s, true);
    return runs != 0;
  }

  // kiln enforces the schema itself, whatever the plugin's validate says.
  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    CParams c(params);
    Error err;
    return check(vt_->validate(ctx_, c.get(), &err.e), err, "validate");
  }

  Result<Rendered> render(const Params& params) const override {
    KILN_TRY(validate(params));
    CParams c(params);
    Error err;
    kiln_rendered r{};
    KILN_TRY(check(vt_->render(ctx_, c.get(), &r, &err.e), err, "render"));
    Rendered out;
    if (r.source) out.source = r.source;
    if (r.name_expression) out.name_expression = r.name_expression;
    for (std::uint32_t i = 0; i < r.option_count && r.options; ++i)
      if (r.options[i]) out.options.emplace_back(r.options[i]);
    vt_->release(ctx_, r.owner);
    if (out.source.empty() || out.name_expression.empty())
      return internal_error(name_ + ": the plugin rendered no source or no name expression for " + params.canonical());
    for (const auto& o : out.options)
      for (const char* banned : {"-arch", "--gpu-architecture", "-I", "--include-path", "-include", "--pre-include"})
        if (o.rfind(banned, 0) == 0)
          return internal_error(name_ + ": the plugin's NVRTC option '" + o + "' is not allowed (kiln sets the arch; "
                                "templates come from the plugin, not from paths)");
    return out;
  }

  Status check_problem(const Params& params, const Problem& problem) const override {
    KILN_ASSIGN_OR_RETURN(const void* v, bound(params));
    Error err;
    return check(vt_->check_problem(ctx_, v, as_c(problem), &err.e), err, "check_problem");
  }

  LaunchGeometry geometry(const Params& params, const Problem& problem) const override {
    LaunchGeometry g;
    auto v = bound(params);
    if (!v.ok()) return failed_geometry(v.status());
    Error err;
    kiln_geometry out{};
    Status s = check(vt_->geometry(ctx_, *v, as_c(problem), &out, &err.e), err, "geometry");
    if (!s.ok()) return failed_geometry(s);
    g.grid = {out.grid[0], out.grid[1], out.grid[2]};
    g.block = {out.block[0], out.block[1], out.block[2]};
    g.shared_bytes = out.shared_bytes;
    return g;
  }

  std::vector<BufferSpec> buffers(const Params& params, const Problem& problem) const override {
    auto v = bound(params);
    if (!v.ok()) return report(v.status(), std::vector<BufferSpec>{});
    Error err;
    kiln_buffer_list list{};
    Status s = check(vt_->buffers(ctx_, *v, as_c(problem), &list, &err.e), err, "buffers");
    if (!s.ok()) return report(s, std::vector<BufferSpec>{});
    std::vector<BufferSpec> out;
    for (std::uint32_t i = 0; i < list.count && list.items; ++i) {
      const kiln_buffer_spec& b = list.items[i];
      out.push_back(BufferSpec{b.name ? b.name : "", b.role == KILN_BUFFER_OUTPUT ? BufferRole::output : BufferRole::input,
                               static_cast<DType>(b.dtype), b.elements, b.index_bound});
    }
    vt_->release(ctx_, list.owner);
    return out;
  }

  void pack_args(const Params& params, const Problem& problem, std::span<void* const> buffers,
                 ArgPack& out) const override {
    pack_bound(nullptr, params, problem, buffers, out);
  }

  // The launch path: one call into the plugin with the handle bound when the kernel was loaded.
  void pack_bound(const void* handle, const Params& params, const Problem& problem, std::span<void* const> buffers,
                  ArgPack& out) const override {
    if (!handle) {
      auto v = bound(params);
      if (!v.ok()) {
        out.raw()->overflow = 1;
        report(v.status(), 0);
        return;
      }
      handle = *v;
    }
    Error err;
    const int rc = vt_->pack_args(ctx_, handle, as_c(problem), buffers.data(), std::uint32_t(buffers.size()), out.raw(), &err.e);
    if (rc != KILN_OK) {
      out.raw()->overflow = 1;  // the launch is refused
      report(check(rc, err, "pack_args"), 0);
    }
  }

  Status cpu_reference(const Params& params, const Problem& problem, std::span<void* const> buffers) const override {
    KILN_ASSIGN_OR_RETURN(const void* v, bound(params));
    Error err;
    return check(vt_->cpu_reference(ctx_, v, as_c(problem), buffers.data(), std::uint32_t(buffers.size()), &err.e), err,
                 "cpu_reference");
  }

  Params heuristic(const Problem& problem) const override {
    auto list = params_list(vt_->heuristic, problem, "heuristic");
    if (list.size() != 1) return report(internal_error(name_ + ": heuristic must give exactly one variant"), Params{});
    return list[0];
  }

  std::vector<Params> tuning_space(const Problem& problem) const override {
    return params_list(vt_->tuning_space, problem, "tuning_space");
  }

  const void* bind(const Params& params) const override {
    auto v = bound(params);
    return v.ok() ? *v : nullptr;
  }

  std::string signature(const Problem& problem) const override {
    if (!vt_->signature) return Family::signature(problem);
    Error err;
    kiln_text t{};
    Status s = check(vt_->signature(ctx_, as_c(problem), &t, &err.e), err, "signature");
    if (!s.ok()) return report(s, Family::signature(problem));
    std::string out = t.text ? t.text : "";
    vt_->release(ctx_, t.owner);
    return out;
  }

  Problem tuning_problem(const Problem& problem) const override {
    if (!vt_->tuning_problem) return Family::tuning_problem(problem);
    Error err;
    kiln_problem out{};
    Status s = check(vt_->tuning_problem(ctx_, as_c(problem), &out, &err.e), err, "tuning_problem");
    if (!s.ok()) return report(s, Family::tuning_problem(problem));
    return to_problem(&out);
  }

  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    if (!vt_->problem_from_shape) return Family::problem_from_shape(dtype, shape);
    std::vector<kiln_param> items;
    for (const auto& [n, v] : shape) items.push_back(kiln_param{n.c_str(), nullptr, v});
    const kiln_params c{items.data(), std::uint32_t(items.size())};
    Error err;
    kiln_problem out{};
    KILN_TRY(check(vt_->problem_from_shape(ctx_, std::int32_t(dtype), &c, &out, &err.e), err, "problem_from_shape"));
    return to_problem(&out);
  }

  std::vector<Problem> benchmark_problems(DType dtype) const override {
    if (!vt_->benchmark_problems) return {};
    Error err;
    kiln_problem_list list{};
    Status s = check(vt_->benchmark_problems(ctx_, std::int32_t(dtype), &list, &err.e), err, "benchmark_problems");
    if (!s.ok()) return report(s, std::vector<Problem>{});
    std::vector<Problem> out;
    for (std::uint32_t i = 0; i < list.count && list.items; ++i) out.push_back(to_problem(&list.items[i]));
    vt_->release(ctx_, list.owner);
    return out;
  }

 private:
  // Caller-supplied error storage; only the first byte is cleared (a plugin that fails without a
  // message then reads as empty, not as stack garbage).
  struct Error {
    Error() { e.message[0] = '\0'; }
    kiln_plugin_error e;
  };

  Status check(int rc, const Error& err, const char* what) const {
    if (rc == KILN_OK) return {};
    const Code code = rc > 0 && rc <= int(Code::internal) ? Code(rc) : Code::internal;
    std::string m(err.e.message, strnlen(err.e.message, sizeof(err.e.message)));
    if (m.empty()) m = name_ + ": the plugin's " + what + " failed (code " + std::to_string(rc) + ")";
    return Status(code, m);
  }

  // Methods without a Status in Family's signature log the plugin's error and return `fallback`.
  template <class T>
  T report(const Status& s, T fallback) const {
    std::fprintf(stderr, "kiln: family %s (plugin %s): %s\n", name_.c_str(), info_ ? info_->name.c_str() : "-",
                 s.to_string().c_str());
    return fallback;
  }

  LaunchGeometry failed_geometry(const Status& s) const {
    LaunchGeometry g;
    g.grid.x = 0;  // the driver refuses an empty grid: the launch fails instead of running garbage
    return report(s, g);
  }

  std::vector<Params> params_list(int (*fn)(void*, const kiln_problem*, kiln_params_list*, kiln_plugin_error*),
                                  const Problem& problem, const char* what) const {
    Error err;
    kiln_params_list list{};
    Status s = check(fn(ctx_, as_c(problem), &list, &err.e), err, what);
    if (!s.ok()) return report(s, std::vector<Params>{});
    std::vector<Params> out;
    for (std::uint32_t i = 0; i < list.count && list.items; ++i) out.push_back(to_params(&list.items[i]));
    vt_->release(ctx_, list.owner);
    return out;
  }

  // The plugin's handle for params, bound on first use and kept while the family lives (variants
  // are enumerated by the schema, so the map stays small).
  Result<const void*> bound(const Params& params) const {
    std::string key = params.canonical();
    {
      std::lock_guard lock(mu_);
      if (auto it = bound_.find(key); it != bound_.end()) return static_cast<const void*>(it->second);
    }
    KILN_TRY(validate(params));
    CParams c(params);
    Error err;
    void* handle = nullptr;
    KILN_TRY(check(vt_->bind(ctx_, c.get(), &handle, &err.e), err, "bind"));
    std::lock_guard lock(mu_);
    auto [it, inserted] = bound_.emplace(std::move(key), handle);
    if (!inserted) vt_->unbind(ctx_, handle);
    return static_cast<const void*>(it->second);
  }

  const kiln_family_vtable* vt_;
  void* ctx_;
  std::string name_;
  int version_;
  bool programmatic_;
  decltype(kiln_family_vtable::runs_on) runs_on_;
  std::shared_ptr<const PluginInfo> info_;
  std::shared_ptr<const TemplateFiles> templates_;
  std::vector<ParamDef> schema_;
  std::vector<ProblemField> fields_;
  std::vector<Params> catalog_;
  mutable std::mutex mu_;
  mutable std::map<std::string, void*> bound_;
};

// The descriptor's static data, before anything of it is copied.
Status check_descriptor(const kiln_family& d) {
  if (d.struct_size < KILN_FAMILY_MIN_STRUCT_SIZE)
    return invalid_argument("its kiln_family struct_size " + std::to_string(d.struct_size) + " is below this ABI's " +
                            std::to_string(KILN_FAMILY_MIN_STRUCT_SIZE));
  if (!d.name || !valid_identifier(d.name)) return invalid_argument("its name is missing or not [a-z][a-z0-9_]*");
  const std::string name = d.name;
  auto bad = [&](const std::string& why) { return invalid_argument("family '" + name + "': " + why); };
  if (d.version < 0) return bad("negative version");
  const kiln_family_vtable* vt = d.vtable;
  if (!vt) return bad("no vtable");
  if (vt->struct_size < KILN_FAMILY_VTABLE_MIN_STRUCT_SIZE)
    return bad("its vtable struct_size " + std::to_string(vt->struct_size) + " is below this ABI's " +
               std::to_string(KILN_FAMILY_VTABLE_MIN_STRUCT_SIZE));
  std::string missing;
  const std::pair<const char*, bool> required[] = {
      {"validate", vt->validate != nullptr},     {"render", vt->render != nullptr},
      {"bind", vt->bind != nullptr},             {"unbind", vt->unbind != nullptr},
      {"check_problem", vt->check_problem != nullptr}, {"geometry", vt->geometry != nullptr},
      {"buffers", vt->buffers != nullptr},       {"pack_args", vt->pack_args != nullptr},
      {"cpu_reference", vt->cpu_reference != nullptr}, {"heuristic", vt->heuristic != nullptr},
      {"tuning_space", vt->tuning_space != nullptr},   {"release", vt->release != nullptr}};
  for (const auto& [fn, present] : required)
    if (!present) missing += (missing.empty() ? "" : ", ") + std::string(fn);
  if (!missing.empty()) return bad("its vtable lacks " + missing);

  if (d.param_count > 64 || (d.param_count && !d.params)) return bad("bad parameter list");
  std::set<std::string> names;
  for (std::uint32_t i = 0; i < d.param_count; ++i) {
    const kiln_param_def& p = d.params[i];
    if (!p.name || !valid_identifier(p.name)) return bad("parameter " + std::to_string(i) + " has no valid name");
    const std::string pn = p.name;
    if (!names.insert(pn).second) return bad("parameter '" + pn + "' is declared twice");
    if ((p.int_count > 0) == (p.choice_count > 0))
      return bad("parameter '" + pn + "' must list either integers or string choices");
    if ((p.int_count && !p.ints) || (p.choice_count && !p.choices)) return bad("parameter '" + pn + "' has a null list");
    std::set<std::int64_t> ints(p.ints, p.ints + p.int_count);
    if (ints.size() != p.int_count) return bad("parameter '" + pn + "' lists a value twice");
    std::set<std::string> choices;
    for (std::uint32_t j = 0; j < p.choice_count; ++j) {
      if (!p.choices[j] || !valid_value(p.choices[j]))
        return bad("parameter '" + pn + "' has a choice that is not [A-Za-z0-9_.]+");
      if (!choices.insert(p.choices[j]).second) return bad("parameter '" + pn + "' lists a value twice");
    }
  }
  if (d.field_count > KILN_PLUGIN_MAX_FIELDS) return bad("more than " + std::to_string(KILN_PLUGIN_MAX_FIELDS) + " problem fields");
  if (d.field_count && !d.fields) return bad("null problem field list");
  for (std::uint32_t i = 0; i < d.field_count; ++i) {
    const kiln_problem_field& f = d.fields[i];
    if (!f.name) return bad("problem field " + std::to_string(i) + " has no name");
    if (f.type != KILN_FIELD_I64 && f.type != KILN_FIELD_F64)
      return bad("problem field '" + std::string(f.name) + "' has an unknown type");
    if (f.flags & ~(KILN_FIELD_KEY | KILN_FIELD_BUCKETED))
      return bad("problem field '" + std::string(f.name) + "' has unknown flags");
  }
  if (Status s = check_problem_fields(fields_of(d)); !s.ok()) return bad(s.message());
  if (d.catalog_count == 0 || !d.catalog) return bad("an empty catalog (kiln prewarm and the conformance test need one)");
  return {};
}

}  // namespace

bool valid_identifier(std::string_view s) {
  if (s.empty() || s.size() > 64 || !(s[0] >= 'a' && s[0] <= 'z')) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

Result<std::shared_ptr<const Family>> adapt_family(const kiln_family& desc, std::shared_ptr<const PluginInfo> info,
                                                   std::shared_ptr<const TemplateFiles> templates) {
  KILN_TRY(check_descriptor(desc));
  auto family = std::make_shared<PluginFamily>(desc, std::move(info), std::move(templates));
  Status s = family->read_catalog(desc);
  if (!s.ok()) return invalid_argument("family '" + std::string(desc.name) + "': " + s.message());
  return std::shared_ptr<const Family>(std::move(family));
}

}  // namespace kiln::plugin
