// The C ABI over the C++ client. Every entry point catches everything: no exception crosses it.
#include "kiln/kiln.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "jit/driver.h"
#include "kiln/family.h"
#include "kiln/op.h"
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

// Converts each (C tensor, name) pair into its view; the first bad one is the error.
template <std::size_t N>
kiln::Status to_views(const kiln_tensor* const (&ts)[N], const char* const (&names)[N], kiln::TensorView (&out)[N]) {
  for (std::size_t i = 0; i < N; ++i) KILN_TRY(to_view(ts[i], names[i], out[i]));
  return {};
}

// An op's tensors and scalars as views and OpValues, in declaration order.
struct OpArgs {
  kiln::TensorView views[16];
  const kiln::TensorView* ptrs[16] = {};
  kiln::OpValue values[8];
};

kiln::Status to_op_args(const kiln::OpDecl& op, const kiln_tensor* const* tensors, int32_t tensor_count,
                        const kiln_value* scalars, int32_t scalar_count, bool outputs, OpArgs& a) {
  if (tensor_count != int32_t(op.tensors.size()) || (tensor_count > 0 && !tensors))
    return kiln::invalid_argument(op.name + ": takes " + std::to_string(op.tensors.size()) + " tensors");
  if (scalar_count != int32_t(op.scalars.size()) || (scalar_count > 0 && !scalars))
    return kiln::invalid_argument(op.name + ": takes " + std::to_string(op.scalars.size()) + " scalars");
  for (int32_t i = 0; i < tensor_count; ++i) {
    if (!tensors[i] || (!outputs && op.tensors[std::size_t(i)].role == kiln::TensorRole::output)) continue;
    KILN_TRY(to_view(tensors[i], op.tensors[std::size_t(i)].name.c_str(), a.views[i]));
    a.ptrs[i] = &a.views[i];
  }
  for (int32_t i = 0; i < scalar_count; ++i) a.values[i] = {scalars[i].f64, scalars[i].i64};
  return {};
}

kiln::Runtime* runtime_of(kiln_runtime* rt) { return rt ? rt->rt.get() : nullptr; }

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

// For the C ABI's other files (kiln_kv.cpp): the calling thread's last error.
namespace kiln::c_api {
kiln_code set_last_error(const kiln::Status& s) { return finish(s); }
}  // namespace kiln::c_api

static_assert(int(kiln::Fp8Granularity::tensor) == KILN_FP8_TENSOR &&
              int(kiln::Fp8Granularity::row_1x128) == KILN_FP8_ROW_1X128 &&
              int(kiln::Fp8Granularity::tile_128) == KILN_FP8_TILE_128);
static_assert(int(kiln::GatedActivation::silu) == KILN_GATED_SILU &&
              int(kiln::GatedActivation::gelu) == KILN_GATED_GELU);

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
    kiln::TensorView v[3];
    if (auto s = to_views({x, weight, y}, {"x", "weight", "y"}, v); !s.ok()) return fail(s);
    return finish(kiln::rms_norm(v[0], v[1], v[2], eps, stream, runtime_of(rt)));
  });
}

kiln_code kiln_rms_norm_inv(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight, const kiln_tensor* y,
                            const kiln_tensor* inv_rms, double eps, void* stream) {
  if (!inv_rms) return kiln_rms_norm(rt, x, weight, y, eps, stream);
  return guarded([&] {
    kiln::TensorView v[4];
    if (auto s = to_views({x, weight, y, inv_rms}, {"x", "weight", "y", "inv_rms"}, v); !s.ok()) return fail(s);
    return finish(kiln::rms_norm(v[0], v[1], v[2], v[3], eps, stream, runtime_of(rt)));
  });
}

kiln_code kiln_add_rms_norm(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* residual,
                            const kiln_tensor* weight, const kiln_tensor* y, const kiln_tensor* residual_out,
                            double eps, void* stream) {
  return guarded([&] {
    kiln::TensorView v[5];
    if (auto s = to_views({x, residual, weight, y, residual_out}, {"x", "residual", "weight", "y", "residual_out"}, v);
        !s.ok())
      return fail(s);
    return finish(kiln::add_rms_norm(v[0], v[1], v[2], v[3], v[4], eps, stream, runtime_of(rt)));
  });
}

kiln_code kiln_act_and_mul(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* out, int32_t activation,
                           void* stream) {
  return guarded([&] {
    if (activation < KILN_SILU || activation > KILN_GELU_TANH)
      return fail(kiln::invalid_argument("act_and_mul: activation must be silu (0), gelu (1) or gelu_tanh (2)"));
    kiln::TensorView v[2];
    if (auto s = to_views({x, out}, {"x", "out"}, v); !s.ok()) return fail(s);
    return finish(kiln::act_and_mul(v[0], v[1], static_cast<kiln::Activation>(activation), stream, runtime_of(rt)));
  });
}

kiln_code kiln_quantize_fp8(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* q, const kiln_tensor* scale,
                            int32_t granularity, int32_t transpose, void* stream) {
  return guarded([&] {
    if (granularity < KILN_FP8_TENSOR || granularity > KILN_FP8_TILE_128)
      return fail(kiln::invalid_argument("quantize_fp8: granularity must be tensor (0), row_1x128 (1) or tile_128 (2)"));
    kiln::TensorView v[3];
    if (auto s = to_views({x, q, scale}, {"x", "q", "scale"}, v); !s.ok()) return fail(s);
    return finish(kiln::quantize_fp8(v[0], v[1], v[2], static_cast<kiln::Fp8Granularity>(granularity), transpose != 0,
                                     stream, runtime_of(rt)));
  });
}

kiln_code kiln_fp8_gemm(kiln_runtime* rt, const kiln_tensor* a, const kiln_tensor* b, const kiln_tensor* a_scale,
                        const kiln_tensor* b_scale, const kiln_tensor* out, void* stream) {
  return guarded([&] {
    if (!a_scale) return fail(kiln::invalid_argument("fp8_gemm: a is pre-quantized (u8 e4m3 codes) and needs a_scale"));
    if (!b_scale) return fail(kiln::invalid_argument("fp8_gemm: b is pre-quantized (u8 e4m3 codes) and needs b_scale"));
    kiln::TensorView v[5];
    if (auto s = to_views({a, b, a_scale, b_scale, out}, {"a", "b", "a_scale", "b_scale", "out"}, v); !s.ok())
      return fail(s);
    return finish(kiln::fp8_gemm(v[0], v[1], v[2], v[3], v[4], stream, runtime_of(rt)));
  });
}

kiln_code kiln_fused_gated_mlp(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* gate_weight,
                               const kiln_tensor* up_weight, const kiln_tensor* out, int32_t activation, void* stream) {
  return guarded([&] {
    if (activation != KILN_GATED_SILU && activation != KILN_GATED_GELU)
      return fail(kiln::invalid_argument("fused_gated_mlp: activation must be silu (0) or gelu (1)"));
    kiln::TensorView v[4];
    if (auto s = to_views({x, gate_weight, up_weight, out}, {"x", "gate_weight", "up_weight", "out"}, v); !s.ok())
      return fail(s);
    return finish(kiln::fused_gated_mlp(v[0], v[1], v[2], v[3], static_cast<kiln::GatedActivation>(activation), stream,
                                        runtime_of(rt)));
  });
}

kiln_code kiln_apply_rope_qk(kiln_runtime* rt, const kiln_tensor* q, const kiln_tensor* k, const kiln_tensor* cos,
                             const kiln_tensor* sin, const kiln_tensor* position_ids, const kiln_tensor* q_out,
                             const kiln_tensor* k_out, int32_t layout, void* stream) {
  return guarded([&] {
    if (layout != KILN_ROPE_NEOX && layout != KILN_ROPE_GPTJ)
      return fail(kiln::invalid_argument("apply_rope_qk: layout must be neox (0) or gptj (1)"));
    kiln::TensorView v[7];
    if (auto s = to_views({q, k, cos, sin, position_ids, q_out, k_out},
                          {"q", "k", "cos", "sin", "position_ids", "q_out", "k_out"}, v);
        !s.ok())
      return fail(s);
    return finish(kiln::apply_rope_qk(v[0], v[1], v[2], v[3], v[4], v[5], v[6], static_cast<kiln::RopeLayout>(layout),
                                      stream, runtime_of(rt)));
  });
}

kiln_code kiln_rms_norm_rope(kiln_runtime* rt, const kiln_tensor* x, const kiln_tensor* weight,
                             const kiln_tensor* cos, const kiln_tensor* sin, const kiln_tensor* out, double eps,
                             int64_t num_heads, void* stream) {
  return guarded([&] {
    kiln::TensorView v[5];
    if (auto s = to_views({x, weight, cos, sin, out}, {"x", "weight", "cos", "sin", "out"}, v); !s.ok()) return fail(s);
    return finish(kiln::rms_norm_rope(v[0], v[1], v[2], v[3], v[4], eps, num_heads, stream, runtime_of(rt)));
  });
}

kiln_code kiln_rms_norm_backward(kiln_runtime* rt, const kiln_tensor* dy, const kiln_tensor* x,
                                 const kiln_tensor* weight, const kiln_tensor* inv_rms, const kiln_tensor* dx,
                                 const kiln_tensor* dw, const kiln_tensor* workspace, void* stream) {
  return guarded([&] {
    kiln::TensorView v[6], ws;
    if (auto s = to_views({dy, x, weight, inv_rms, dx, dw}, {"dy", "x", "weight", "inv_rms", "dx", "dw"}, v); !s.ok())
      return fail(s);
    if (workspace)
      if (auto s = to_view(workspace, "workspace", ws); !s.ok()) return fail(s);
    return finish(kiln::rms_norm_backward(v[0], v[1], v[2], v[3], v[4], v[5], stream, runtime_of(rt),
                                          workspace ? &ws : nullptr));
  });
}

kiln_code kiln_rms_norm_backward_workspace_elements(const kiln_tensor* x, int64_t* out) {
  return guarded([&] {
    if (!out) return fail(kiln::invalid_argument("out is NULL"));
    kiln::TensorView xv;
    if (auto s = to_view(x, "x", xv); !s.ok()) return fail(s);
    auto n = kiln::rms_norm_backward_workspace_elements(xv);
    if (!n.ok()) return fail(n.status());
    *out = *n;
    return finish({});
  });
}

kiln_code kiln_runtime_get_counters(kiln_runtime* rt, kiln_runtime_counters* out) {
  return guarded([&] {
    if (!out) return fail(kiln::invalid_argument("out is NULL"));
    kiln::Runtime* r = runtime_of(rt);
    if (!r) {
      auto shared = kiln::Runtime::shared();
      if (!shared.ok()) return fail(shared.status());
      r = *shared;
    }
    const kiln::RuntimeCounters c = r->counters();
    *out = {c.table_hits, c.from_daemon, c.from_embedded, c.module_loads};
    return finish({});
  });
}

kiln_code kiln_pointer_device(const void* ptr, int32_t* kind, int32_t* index) {
  return guarded([&] {
    if (!kind || !index) return fail(kiln::invalid_argument("kind or index is NULL"));
    *kind = KILN_CPU;
    *index = 0;
    auto d = kiln::jit::Driver::get();
    if (!d.ok() || !ptr) return finish({});
    unsigned int mem_type = 0;
    int ordinal = -1;
    CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    void* values[2] = {&mem_type, &ordinal};
    // An error here means memory the driver does not know: host memory.
    if ((*d)->pointer_get_attributes(2, attrs, values, reinterpret_cast<CUdeviceptr>(ptr)) == CUDA_SUCCESS &&
        (mem_type == CU_MEMORYTYPE_DEVICE || mem_type == CU_MEMORYTYPE_UNIFIED) && ordinal >= 0) {
      *kind = KILN_CUDA;
      *index = ordinal;
    }
    return finish({});
  });
}

const char* kiln_runtime_resolver_name(kiln_runtime* rt) {
  if (rt) return kiln_runtime_resolver(rt);
  thread_local std::string name;
  auto shared = kiln::Runtime::shared();
  name = shared.ok() ? (*shared)->resolver() : std::string();
  return name.c_str();
}

kiln_code kiln_op_count(int32_t* out) {
  return guarded([&] {
    if (!out) return fail(kiln::invalid_argument("out is NULL"));
    *out = int32_t(kiln::Registry::global().ops().size());
    return finish({});
  });
}

kiln_code kiln_op_at(int32_t index, const kiln_op** out) {
  return guarded([&] {
    if (!out) return fail(kiln::invalid_argument("out is NULL"));
    const auto ops = kiln::Registry::global().ops();
    if (index < 0 || std::size_t(index) >= ops.size())
      return fail(kiln::not_found("no op at index " + std::to_string(index)));
    *out = reinterpret_cast<const kiln_op*>(ops[std::size_t(index)]);
    return finish({});
  });
}

kiln_code kiln_op_find(const char* name, const kiln_op** out) {
  return guarded([&] {
    if (!name || !out) return fail(kiln::invalid_argument("name or out is NULL"));
    const kiln::OpDecl* op = kiln::Registry::global().find_op(name);
    if (!op) return fail(kiln::not_found(std::string("no op named '") + name + "'"));
    *out = reinterpret_cast<const kiln_op*>(op);
    return finish({});
  });
}

const char* kiln_op_describe(const kiln_op* op) {
  if (!op) return nullptr;
  // Built once per op and kept: declarations never change after registration.
  static std::mutex mu;
  static std::map<const kiln_op*, std::string> described;
  std::lock_guard lock(mu);
  auto it = described.find(op);
  if (it == described.end())
    it = described.emplace(op, reinterpret_cast<const kiln::OpDecl*>(op)->describe()).first;
  return it->second.c_str();
}

kiln_code kiln_op_call(kiln_runtime* rt, const kiln_op* op, const kiln_tensor* const* tensors, int32_t tensor_count,
                       const kiln_value* scalars, int32_t scalar_count, void* stream) {
  return guarded([&] {
    if (!op) return fail(kiln::invalid_argument("op is NULL"));
    const auto& decl = *reinterpret_cast<const kiln::OpDecl*>(op);
    OpArgs a;
    if (auto s = to_op_args(decl, tensors, tensor_count, scalars, scalar_count, true, a); !s.ok()) return fail(s);
    kiln::OpCall call{{a.ptrs, std::size_t(tensor_count)}, {a.values, std::size_t(scalar_count)}, stream,
                      runtime_of(rt)};
    if (auto s = kiln::check_op_call(decl, call); !s.ok()) return fail(s);
    return finish(decl.run(call));
  });
}

kiln_code kiln_op_infer(const kiln_op* op, const kiln_tensor* const* tensors, int32_t tensor_count,
                        const kiln_value* scalars, int32_t scalar_count, kiln_shape* outputs, int32_t output_count) {
  return guarded([&] {
    if (!op || !outputs) return fail(kiln::invalid_argument("op or outputs is NULL"));
    const auto& decl = *reinterpret_cast<const kiln::OpDecl*>(op);
    const std::size_t n_out = decl.tensors.size() - decl.input_count();
    if (output_count != int32_t(n_out))
      return fail(kiln::invalid_argument(decl.name + ": has " + std::to_string(n_out) + " outputs"));
    OpArgs a;
    if (auto s = to_op_args(decl, tensors, tensor_count, scalars, scalar_count, false, a); !s.ok()) return fail(s);
    kiln::OpCall call{{a.ptrs, std::size_t(tensor_count)}, {a.values, std::size_t(scalar_count)}, nullptr, nullptr};
    if (auto s = kiln::check_op_call(decl, call, false); !s.ok()) return fail(s);
    kiln::OutputShape shapes[16];
    if (auto s = decl.infer(call, {shapes, n_out}); !s.ok()) return fail(s);
    for (std::size_t i = 0; i < n_out; ++i) {
      outputs[i].dtype = int32_t(shapes[i].dtype);
      outputs[i].rank = shapes[i].rank;
      for (int d = 0; d < 8; ++d) outputs[i].shape[d] = d < shapes[i].rank ? shapes[i].shape[d] : 0;
    }
    return finish({});
  });
}

const char* kiln_family_describe(const char* family) {
  static std::mutex mu;
  static std::map<const kiln::Family*, std::string> described;
  const kiln::Family* f = family ? kiln::Registry::global().find(family) : nullptr;
  if (!f) {
    fail(kiln::not_found(std::string("no kernel family named '") + (family ? family : "(null)") + "'"));
    return nullptr;
  }
  std::lock_guard lock(mu);
  auto it = described.find(f);
  if (it == described.end()) it = described.emplace(f, kiln::describe_family(*f)).first;
  return it->second.c_str();
}

kiln_code kiln_launch(kiln_runtime* rt, const char* family, int32_t dtype, const kiln_value* fields,
                      int32_t field_count, uint32_t alignment, void* const* buffers, int32_t buffer_count,
                      void* stream) {
  return guarded([&] {
    if (!family) return fail(kiln::invalid_argument("family is NULL"));
    const kiln::Family* f = kiln::Registry::global().find(family);
    if (!f) return fail(kiln::not_found(std::string("no kernel family named '") + family + "'"));
    if (dtype < 0 || dtype > KILN_I64) return fail(kiln::unsupported_dtype("unknown dtype code"));
    const auto& decl = f->problem_fields();
    if (field_count != int32_t(decl.size()) || (field_count && !fields))
      return fail(kiln::invalid_argument(std::string("kiln_launch: ") + family + " takes " +
                                         std::to_string(decl.size()) + " problem fields"));
    if (buffer_count < 0 || buffer_count > int32_t(kiln::ArgPack::k_max_args) || (buffer_count && !buffers))
      return fail(kiln::invalid_argument("kiln_launch: bad buffer list"));
    kiln::Problem p;
    p.dtype = static_cast<kiln::DType>(dtype);
    std::uint64_t bits = alignment ? std::min<std::uint32_t>(alignment, 16) : 16;
    for (int32_t i = 0; i < buffer_count; ++i) {
      if (!buffers[i]) return fail(kiln::invalid_argument("kiln_launch: buffer " + std::to_string(i) + " is NULL"));
      bits |= reinterpret_cast<std::uintptr_t>(buffers[i]);
    }
    p.alignment = std::uint32_t(bits & (~bits + 1));
    for (const kiln::ProblemField& pf : decl) {
      if (pf.type == kiln::FieldType::i64) p.fields[pf.slot].i = fields[pf.slot].i64;
      else p.fields[pf.slot].f = fields[pf.slot].f64;
    }
    // The buffer count must match the family's own list for this problem.
    const auto specs = f->buffers(f->heuristic(p), p);
    if (std::size_t(buffer_count) != specs.size())
      return fail(kiln::invalid_argument(std::string("kiln_launch: ") + family + " takes " +
                                         std::to_string(specs.size()) + " buffers for this problem"));
    for (int32_t i = 0; i < buffer_count; ++i) {
      int32_t kind = KILN_CPU, index = 0;
      if (kiln_pointer_device(buffers[i], &kind, &index) != KILN_OK || kind != KILN_CUDA)
        return fail(kiln::device_error("kiln_launch: buffer " + std::to_string(i) + " (" + specs[std::size_t(i)].name +
                                       ") is not CUDA memory"));
    }
    kiln::Runtime* runtime = runtime_of(rt);
    if (!runtime) {
      auto r = kiln::Runtime::shared();
      if (!r.ok()) return fail(r.status());
      runtime = *r;
    }
    return finish(runtime->run(*f, p, {buffers, std::size_t(buffer_count)}, stream));
  });
}

}  // extern "C"
