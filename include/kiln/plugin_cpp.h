// The C++ side of the plugin ABI: exports kiln::Family subclasses through kiln/plugin.h.
//
// A plugin written in C++ implements kiln::Family (kiln/family.h) and exports its families with
// one macro in one source file:
//
//   std::vector<kiln::plugin_bridge::FamilyExport> my_families() {
//     return {{std::make_shared<MyFamily>(), {{"my/my_kernel.cuh", my_kernel_source}}}};
//   }
//   KILN_PLUGIN("acme-norms", "1.2.0", my_families)
//
// The factory runs in the plugin's init (an exception it throws fails the init, and the plugin is
// skipped). Every exported function catches whatever the family throws and returns it as an error,
// so no exception crosses the ABI. Link the plugin with kiln's family SDK (kiln_family_sdk:
// Params, Status, the Family defaults) and build it with hidden visibility (docs/plugins.md).
// kiln registers its own built-in families through this same bridge.
#pragma once

#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kiln/family.h"
#include "kiln/plugin.h"

namespace kiln::plugin_bridge {

// One family and the template files it ships (path, source).
struct FamilyExport {
  std::shared_ptr<const Family> family;
  std::vector<std::pair<std::string, std::string>> templates;
};

namespace detail {

inline Params to_params(const kiln_params* p) {
  Params out;
  for (std::uint32_t i = 0; p && i < p->count; ++i) {
    const kiln_param& v = p->items[i];
    if (v.str) out.set(v.name, std::string(v.str));
    else out.set(v.name, v.int_value);
  }
  return out;
}

// A problem kiln passed in: a kiln::Problem by address (one layout; problem.h checks it).
inline const Problem& as_problem(const kiln_problem* p) { return *reinterpret_cast<const Problem*>(p); }
inline const kiln_problem* as_c(const Problem& p) { return reinterpret_cast<const kiln_problem*>(&p); }

// A problem a plugin wrote into a kiln_problem, copied field by field.
inline Problem to_problem(const kiln_problem* p) {
  Problem out;
  out.dtype = static_cast<DType>(p->dtype);
  out.cc = p->cc;
  out.sm_count = p->sm_count;
  out.alignment = p->alignment;
  std::memcpy(out.fields.data(), p->fields, sizeof(p->fields));
  return out;
}

inline kiln_problem to_c(const Problem& p) {
  kiln_problem out{};
  out.dtype = std::uint8_t(p.dtype);
  out.cc = p.cc;
  out.sm_count = p.sm_count;
  out.alignment = p.alignment;
  std::memcpy(out.fields, p.fields.data(), sizeof(out.fields));
  return out;
}

// Storage behind a result's `owner`: deleted by release().
struct Owned {
  virtual ~Owned() = default;
};

// Params as C lists: kiln_param names and strings point into `params`, which never changes after
// build().
struct ParamsList : Owned {
  std::vector<Params> params;
  std::vector<std::vector<kiln_param>> items;
  std::vector<kiln_params> lists;
  void build() {
    items.resize(params.size());
    lists.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      for (const auto& [name, value] : params[i].values()) {
        kiln_param p{name.c_str(), nullptr, 0};
        if (const auto* s = std::get_if<std::string>(&value)) p.str = s->c_str();
        else p.int_value = std::get<std::int64_t>(value);
        items[i].push_back(p);
      }
      lists[i] = kiln_params{items[i].data(), std::uint32_t(items[i].size())};
    }
  }
};

struct RenderedHolder : Owned {
  Rendered rendered;
  std::vector<const char*> options;
};

struct BuffersHolder : Owned {
  std::vector<BufferSpec> specs;
  std::vector<kiln_buffer_spec> items;
};

struct ProblemsHolder : Owned {
  std::vector<kiln_problem> items;
};

struct TextHolder : Owned {
  std::string text;
};

// Runs `body` (returning Status) and turns a failure or an exception into the C error convention.
template <class F>
int guarded(kiln_plugin_error* err, F&& body) noexcept {
  try {
    Status s = body();
    if (s.ok()) return KILN_OK;
    std::string m = s.message();
    if (!s.details().empty()) m += "\n" + s.details();
    return kiln_plugin_fail(err, int(s.code()), m.c_str());
  } catch (const std::exception& e) {
    return kiln_plugin_fail(err, KILN_INTERNAL, (std::string("the family threw: ") + e.what()).c_str());
  } catch (...) {
    return kiln_plugin_fail(err, KILN_INTERNAL, "the family threw a non-standard exception");
  }
}

// One exported family: the C tables (valid while this object lives) and the vtable's functions.
class ExportedFamily {
 public:
  explicit ExportedFamily(FamilyExport e) : export_(std::move(e)) {
    const Family& f = *export_.family;
    name_ = std::string(f.name());
    schema_ = f.schema();
    for (const auto& d : schema_) {
      choice_ptrs_.emplace_back();
      for (const auto& c : d.choices) choice_ptrs_.back().push_back(c.c_str());
    }
    for (std::size_t i = 0; i < schema_.size(); ++i) {
      const ParamDef& d = schema_[i];
      defs_.push_back(kiln_param_def{d.name.c_str(), d.doc.c_str(), d.ints.data(), std::uint32_t(d.ints.size()),
                                     choice_ptrs_[i].data(), std::uint32_t(choice_ptrs_[i].size())});
    }
    fields_ = f.problem_fields();
    for (const ProblemField& pf : fields_)
      field_descs_.push_back(kiln_problem_field{
          pf.name.c_str(), pf.doc.c_str(), pf.slot, std::uint8_t(pf.type),
          std::uint8_t((pf.key ? KILN_FIELD_KEY : 0u) | (pf.bucketed ? KILN_FIELD_BUCKETED : 0u)), 0});
    catalog_.params = f.catalog();
    catalog_.build();
    for (const auto& [path, source] : export_.templates)
      templates_.push_back(kiln_template_file{path.c_str(), source.c_str(), source.size()});

    desc_.struct_size = sizeof(kiln_family);
    desc_.name = name_.c_str();
    desc_.version = f.version();
    desc_.params = defs_.data();
    desc_.param_count = std::uint32_t(defs_.size());
    desc_.fields = field_descs_.data();
    desc_.field_count = std::uint32_t(field_descs_.size());
    desc_.catalog = catalog_.lists.data();
    desc_.catalog_count = std::uint32_t(catalog_.lists.size());
    desc_.templates = templates_.data();
    desc_.template_count = std::uint32_t(templates_.size());
    desc_.vtable = &vtable();
    desc_.context = this;
    desc_.flags = f.programmatic_launch() ? KILN_FAMILY_PROGRAMMATIC_LAUNCH : 0u;
  }
  ExportedFamily(const ExportedFamily&) = delete;
  ExportedFamily& operator=(const ExportedFamily&) = delete;

  const kiln_family& descriptor() const { return desc_; }

 private:
  static const Family& fam(void* ctx) { return *static_cast<ExportedFamily*>(ctx)->export_.family; }
  static const Params& variant(const void* v) { return *static_cast<const Params*>(v); }

  static int validate(void* ctx, const kiln_params* params, kiln_plugin_error* err) {
    return guarded(err, [&] { return fam(ctx).validate(to_params(params)); });
  }
  static int render(void* ctx, const kiln_params* params, kiln_rendered* out, kiln_plugin_error* err) {
    return guarded(err, [&]() -> Status {
      auto h = std::make_unique<RenderedHolder>();
      KILN_ASSIGN_OR_RETURN(h->rendered, fam(ctx).render(to_params(params)));
      for (const auto& o : h->rendered.options) h->options.push_back(o.c_str());
      *out = kiln_rendered{h->rendered.source.c_str(), h->rendered.name_expression.c_str(), h->options.data(),
                           std::uint32_t(h->options.size()), nullptr};
      out->owner = static_cast<Owned*>(h.release());
      return {};
    });
  }
  static int bind(void* ctx, const kiln_params* params, void** variant_out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      *variant_out = new Params(to_params(params));
      return Status();
    });
  }
  static void unbind(void*, void* v) { delete static_cast<Params*>(v); }
  static int check_problem(void* ctx, const void* v, const kiln_problem* p, kiln_plugin_error* err) {
    return guarded(err, [&] { return fam(ctx).check_problem(variant(v), as_problem(p)); });
  }
  static int geometry(void* ctx, const void* v, const kiln_problem* p, kiln_geometry* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      const LaunchGeometry g = fam(ctx).geometry(variant(v), as_problem(p));
      *out = kiln_geometry{{g.grid.x, g.grid.y, g.grid.z}, {g.block.x, g.block.y, g.block.z}, g.shared_bytes};
      return Status();
    });
  }
  static int buffers(void* ctx, const void* v, const kiln_problem* p, kiln_buffer_list* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      auto h = std::make_unique<BuffersHolder>();
      h->specs = fam(ctx).buffers(variant(v), as_problem(p));
      for (const auto& b : h->specs)
        h->items.push_back(
            kiln_buffer_spec{b.name.c_str(), std::int32_t(b.role), std::int32_t(b.dtype), b.elements, b.index_bound});
      *out = kiln_buffer_list{h->items.data(), std::uint32_t(h->items.size()), nullptr};
      out->owner = static_cast<Owned*>(h.release());
      return Status();
    });
  }
  static int pack_args(void* ctx, const void* v, const kiln_problem* p, void* const* buffers, std::uint32_t n,
                       kiln_arg_pack* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      fam(ctx).pack_args(variant(v), as_problem(p), std::span<void* const>(buffers, n), ArgPack::over(out));
      return Status();
    });
  }
  static int cpu_reference(void* ctx, const void* v, const kiln_problem* p, void* const* buffers, std::uint32_t n,
                           kiln_plugin_error* err) {
    return guarded(err, [&] { return fam(ctx).cpu_reference(variant(v), as_problem(p), std::span<void* const>(buffers, n)); });
  }
  static int params_list(std::vector<Params> params, kiln_params_list* out) {
    auto h = std::make_unique<ParamsList>();
    h->params = std::move(params);
    h->build();
    *out = kiln_params_list{h->lists.data(), std::uint32_t(h->lists.size()), nullptr};
    out->owner = static_cast<Owned*>(h.release());
    return KILN_OK;
  }
  static int heuristic(void* ctx, const kiln_problem* p, kiln_params_list* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      params_list({fam(ctx).heuristic(as_problem(p))}, out);
      return Status();
    });
  }
  static int tuning_space(void* ctx, const kiln_problem* p, kiln_params_list* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      params_list(fam(ctx).tuning_space(as_problem(p)), out);
      return Status();
    });
  }
  static int signature(void* ctx, const kiln_problem* p, kiln_text* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      auto h = std::make_unique<TextHolder>();
      h->text = fam(ctx).signature(as_problem(p));
      *out = kiln_text{h->text.c_str(), nullptr};
      out->owner = static_cast<Owned*>(h.release());
      return Status();
    });
  }
  static int tuning_problem(void* ctx, const kiln_problem* p, kiln_problem* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      *out = to_c(fam(ctx).tuning_problem(as_problem(p)));
      return Status();
    });
  }
  static int problem_from_shape(void* ctx, std::int32_t dtype, const kiln_params* shape, kiln_problem* out,
                                kiln_plugin_error* err) {
    return guarded(err, [&]() -> Status {
      std::vector<std::pair<std::string, std::int64_t>> named;
      for (std::uint32_t i = 0; shape && i < shape->count; ++i)
        named.emplace_back(shape->items[i].name, shape->items[i].int_value);
      KILN_ASSIGN_OR_RETURN(Problem p, fam(ctx).problem_from_shape(static_cast<DType>(dtype), named));
      *out = to_c(p);
      return {};
    });
  }
  static int benchmark_problems(void* ctx, std::int32_t dtype, kiln_problem_list* out, kiln_plugin_error* err) {
    return guarded(err, [&] {
      auto h = std::make_unique<ProblemsHolder>();
      for (const Problem& p : fam(ctx).benchmark_problems(static_cast<DType>(dtype))) h->items.push_back(to_c(p));
      *out = kiln_problem_list{h->items.data(), std::uint32_t(h->items.size()), nullptr};
      out->owner = static_cast<Owned*>(h.release());
      return Status();
    });
  }
  static void release(void*, void* owner) { delete static_cast<Owned*>(owner); }
  static int runs_on(void* ctx, const kiln_params* params, const kiln_arch* arch, std::int32_t* runs,
                     kiln_plugin_error* err) {
    return guarded(err, [&] {
      *runs = fam(ctx).runs_on(to_params(params), GpuArch{int(arch->capability), char(arch->suffix)}) ? 1 : 0;
      return Status();
    });
  }

  static const kiln_family_vtable& vtable() {
    static const kiln_family_vtable vt = {
        sizeof(kiln_family_vtable), validate,     render,        bind,           unbind,
        check_problem,              geometry,     buffers,       pack_args,      cpu_reference,
        heuristic,                  tuning_space, signature,     tuning_problem, problem_from_shape,
        benchmark_problems,         release,      runs_on};
    return vt;
  }

  FamilyExport export_;
  std::string name_;
  std::vector<ParamDef> schema_;
  std::vector<std::vector<const char*>> choice_ptrs_;
  std::vector<kiln_param_def> defs_;
  std::vector<ProblemField> fields_;
  std::vector<kiln_problem_field> field_descs_;
  ParamsList catalog_;
  std::vector<kiln_template_file> templates_;
  kiln_family desc_{};
};

}  // namespace detail

// A plugin descriptor over C++ families made by `factory` in init. Keep it alive (a static) for as
// long as the descriptor may be used.
class ExportedPlugin {
 public:
  using Factory = std::function<std::vector<FamilyExport>()>;
  ExportedPlugin(std::string name, std::string version, Factory factory)
      : name_(std::move(name)), version_(std::move(version)), factory_(std::move(factory)) {
    desc_.api_version = KILN_PLUGIN_API_VERSION;
    desc_.struct_size = sizeof(kiln_plugin);
    desc_.name = name_.c_str();
    desc_.version = version_.c_str();
    desc_.context = this;
    desc_.init = &init;
    desc_.shutdown = &shutdown;
  }
  ExportedPlugin(const ExportedPlugin&) = delete;
  ExportedPlugin& operator=(const ExportedPlugin&) = delete;

  const kiln_plugin* descriptor() const { return &desc_; }

 private:
  // A process may register one plugin into several registries (kiln's tests do): init and
  // shutdown are counted, and the families live from the first init to the last shutdown.
  static int init(void* ctx, const kiln_host*, kiln_plugin_error* err) {
    auto* self = static_cast<ExportedPlugin*>(ctx);
    std::lock_guard lock(self->mu_);
    return detail::guarded(err, [&] {
      if (self->inits_ == 0) {
        std::vector<std::unique_ptr<detail::ExportedFamily>> families;
        for (auto& e : self->factory_()) {
          if (!e.family) return internal_error("the plugin's factory returned a null family");
          families.push_back(std::make_unique<detail::ExportedFamily>(std::move(e)));
        }
        self->families_ = std::move(families);
        self->descs_.clear();
        for (const auto& f : self->families_) self->descs_.push_back(f->descriptor());
        self->desc_.families = self->descs_.data();
        self->desc_.family_count = std::uint32_t(self->descs_.size());
      }
      ++self->inits_;
      return Status();
    });
  }
  static void shutdown(void* ctx) {
    auto* self = static_cast<ExportedPlugin*>(ctx);
    std::lock_guard lock(self->mu_);
    if (self->inits_ == 0 || --self->inits_ > 0) return;
    self->desc_.families = nullptr;
    self->desc_.family_count = 0;
    self->descs_.clear();
    self->families_.clear();
  }

  std::mutex mu_;
  int inits_ = 0;
  std::string name_, version_;
  Factory factory_;
  std::vector<std::unique_ptr<detail::ExportedFamily>> families_;
  std::vector<kiln_family> descs_;
  kiln_plugin desc_{};
};

}  // namespace kiln::plugin_bridge

// Defines the plugin's entry point: NAME and VERSION are strings, FACTORY a function returning
// std::vector<kiln::plugin_bridge::FamilyExport>.
#define KILN_PLUGIN(NAME, VERSION, FACTORY)                                                            \
  extern "C" __attribute__((visibility("default"))) const kiln_plugin* kiln_plugin_entry(void) {       \
    static ::kiln::plugin_bridge::ExportedPlugin kiln_exported_plugin((NAME), (VERSION), (FACTORY)); \
    return kiln_exported_plugin.descriptor();                                                         \
  }
