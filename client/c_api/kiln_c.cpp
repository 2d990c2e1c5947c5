// The C ABI over the C++ client. Every entry point catches everything: no exception crosses it.
#include "kiln/kiln.h"

#include <memory>
#include <string>

#include "kiln/ops.h"

struct kiln_runtime {
  std::shared_ptr<kiln::Runtime> rt;
  std::string resolver;
};

namespace {

thread_local std::string g_last_error;

kiln_code fail(const kiln::Status& s) {
  g_last_error = s.to_string();
  return static_cast<kiln_code>(s.code());
}

kiln_code finish(const kiln::Status& s) {
  if (s.ok()) {
    g_last_error.clear();
    return KILN_OK;
  }
  return fail(s);
}

kiln::Status to_view(const kiln_tensor* t, const char* name, kiln::TensorView& out) {
  if (!t) return kiln::invalid_argument(std::string(name) + " is NULL");
  if (t->rank < 1 || t->rank > kiln::TensorView::k_max_rank || !t->shape)
    return kiln::shape_mismatch(std::string(name) + ": rank must be 1..8 with a shape array");
  if (t->dtype < 0 || t->dtype > KILN_I64) return kiln::unsupported_dtype(std::string(name) + ": unknown dtype code");
  if (t->device_kind != KILN_CPU && t->device_kind != KILN_CUDA)
    return kiln::device_error(std::string(name) + ": unknown device kind");
  out = kiln::TensorView{};
  out.data = t->data;
  out.dtype = static_cast<kiln::DType>(t->dtype);
  out.rank = t->rank;
  out.device = {static_cast<kiln::DeviceKind>(t->device_kind), t->device_index};
  std::int64_t stride = 1;
  for (int d = t->rank - 1; d >= 0; --d) {
    out.shape[d] = t->shape[d];
    out.strides[d] = t->strides ? t->strides[d] : stride;
    stride *= t->shape[d];
  }
  return {};
}

template <class F>
kiln_code guarded(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return fail(kiln::internal_error(std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return fail(kiln::internal_error("unexpected exception"));
  }
}

}  // namespace

extern "C" {

int kiln_abi_version(void) { return KILN_ABI_VERSION; }

const char* kiln_last_error(void) { return g_last_error.c_str(); }

const char* kiln_code_name(kiln_code code) { return kiln::code_name(static_cast<kiln::Code>(code)); }

kiln_code kiln_runtime_create(const char* mode, kiln_runtime** out) {
  return guarded([&] {
    if (!out) return fail(kiln::invalid_argument("out is NULL"));
    kiln::RuntimeOptions o;
    std::string m = mode ? mode : "auto";
    if (m == "embedded") o.mode = kiln::ResolverMode::embedded;
    else if (m == "daemon") o.mode = kiln::ResolverMode::daemon;
    else if (m != "auto") return fail(kiln::invalid_argument("mode must be auto, embedded or daemon"));
    auto rt = kiln::Runtime::create(o);
    if (!rt.ok()) return fail(rt.status());
    *out = new kiln_runtime{std::move(rt).value(), {}};
    return finish({});
  });
}

void kiln_runtime_destroy(kiln_runtime* rt) { delete rt; }

const char* kiln_runtime_resolver(kiln_runtime* rt) {
  if (!rt) return "";
  rt->resolver = rt->rt->resolver();
  return rt->resolver.c_str();
}

kiln_code kiln_rms_norm(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight, const kiln_tensor* y,
                        double eps, void* stream) {
  return guarded([&] {
    kiln::TensorView xv, wv, yv;
    kiln::Status s = to_view(x, "x", xv);
    if (s.ok()) s = to_view(weight, "weight", wv);
    if (s.ok()) s = to_view(y, "y", yv);
    if (!s.ok()) return fail(s);
    return finish(kiln::rms_norm(xv, wv, yv, eps, stream, rt ? rt->rt.get() : nullptr));
  });
}

}  // extern "C"
