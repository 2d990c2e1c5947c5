// Op declarations: what one typed op takes, returns and runs, written once per op in its family's
// folder (families/<name>/ops.cpp) and registered with the family (kiln::Registry::add_op).
//
// Everything outside the family is driven by the declaration: the generic C ABI entry
// (kiln_op_call, kiln_op_infer, kiln_op_describe in kiln/kiln.h), the Python functions of
// kiln.ops, the fast path of kiln._fast and the torch custom ops of kiln.torch with their fake
// (shape) functions and autograd. Adding an op touches nothing outside its family's folder.
//
// Conventions the bindings rely on:
//  - tensors are listed inputs first, then outputs; Python takes inputs positionally, scalars
//    after them, and outputs as keyword arguments (allocated through `infer` when not given);
//  - a backward op marks each gradient tensor with `grad_of`: an input that is the gradient of a
//    forward output, an output that is the gradient of a forward input. Its other inputs are the
//    forward's tensors of the same name (inputs, or outputs it saves) and its scalars the
//    forward's of the same name. That is all kiln.torch needs to register the autograd formula.
//
// Declarations are written with designated initializers ({.name = "x", .shape = "[..., cols]"}),
// leaving out members whose defaults fit; GCC's -Wextra then warns (-Wmissing-field-initializers),
// so kiln builds its families with -Wno-missing-field-initializers.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln {

class Runtime;

enum class TensorRole : std::uint8_t { input, output };

// The dtype set of an op tensor: a bit per kiln::DType.
constexpr std::uint32_t dtype_bit(DType d) { return 1u << static_cast<unsigned>(d); }
inline constexpr std::uint32_t k_float_dtypes = dtype_bit(DType::f32) | dtype_bit(DType::f16) | dtype_bit(DType::bf16);
inline constexpr std::uint32_t k_half_dtypes = dtype_bit(DType::f16) | dtype_bit(DType::bf16);

struct OpTensor {
  std::string name;
  TensorRole role = TensorRole::input;
  // May be absent (a null tensor): an optional input, or an output the caller may skip.
  bool optional = false;
  // dtype_bit()s of the dtypes the op accepts (the op's own checks tell which combinations).
  std::uint32_t dtypes = k_float_dtypes;
  int min_rank = 1, max_rank = TensorView::k_max_rank;
  // The shape in terms of named sizes, for documentation and error messages: "[..., hidden]".
  std::string shape;
  // In a backward op: the forward tensor this one is the gradient of ("" for none).
  std::string grad_of;
  // The op takes this tensor's rows at any row stride: the last dimension contiguous, the leading
  // ones collapsing into one row index (a slice of a wider tensor). Bindings pass such views as
  // they are; a tensor without the mark is made contiguous first.
  bool strided_rows = false;
};

enum class ScalarKind : std::uint8_t { f64, i64, boolean, choice };

struct OpScalar {
  std::string name;
  ScalarKind kind = ScalarKind::f64;
  // The value Python and torch use when the caller gives none; absent: the scalar is required.
  bool has_default = false;
  double default_value = 0;
  // ScalarKind::choice: the names callers pass; the op receives the index. The one place an
  // op's enum values are written down (the C++ enum of kiln/ops.h has the same order).
  std::vector<std::string> choices;
  std::string doc;
};

// One scalar as passed: f64 for ScalarKind::f64, i64 for the others.
struct OpValue {
  double f64 = 0;
  std::int64_t i64 = 0;
};

// An op's arguments, in declaration order. An absent tensor is null.
struct OpCall {
  std::span<const TensorView* const> tensors;
  std::span<const OpValue> scalars;
  void* stream = nullptr;  // a CUstream (kiln::Stream)
  Runtime* runtime = nullptr;

  const TensorView& tensor(std::size_t i) const { return *tensors[i]; }
  const TensorView* optional(std::size_t i) const { return tensors[i]; }
  double f64(std::size_t i) const { return scalars[i].f64; }
  std::int64_t i64(std::size_t i) const { return scalars[i].i64; }
};

// The shape and dtype of one output, as `infer` computes it.
struct OutputShape {
  DType dtype = DType::f32;
  int rank = 0;
  std::int64_t shape[TensorView::k_max_rank] = {};
};

struct OpDecl {
  std::string name;
  std::string doc;
  std::vector<OpTensor> tensors;
  std::vector<OpScalar> scalars;
  // The op that computes this op's gradients ("" for none); see the conventions above.
  std::string backward;
  // True when host tensors run a CPU fallback.
  bool cpu = true;
  // Validates the call and runs it: the op's typed C++ function.
  std::function<Status(const OpCall&)> run;
  // The shapes and dtypes of every output (in declaration order) from the inputs' shapes, dtypes
  // and the scalars; output tensors in the call are null and input data pointers may be null
  // (torch's fake tensors). Errors as run's for the same inputs.
  std::function<Status(const OpCall&, std::span<OutputShape>)> infer;

  std::size_t tensor_index(std::string_view tensor) const;  // tensors.size() when absent
  std::size_t input_count() const;
  // The declaration as JSON (name, doc, tensors, scalars, backward, cpu): what the bindings read.
  std::string describe() const;
  // Checks the declaration itself: names, inputs before outputs, choice defaults in range, a
  // run and an infer function.
  Status check() const;
};

// The checks every op call gets before its own: the right number of tensors and scalars, every
// required tensor present, ranks and dtypes within the declaration (shape_mismatch,
// unsupported_dtype, invalid_argument). `outputs` false: output tensors are not looked at (infer).
Status check_op_call(const OpDecl& op, const OpCall& call, bool outputs = true);

// An output of dtype `dtype` shaped like `like`, with its last dimension replaced by `last` when
// last >= 0.
OutputShape shape_like(const TensorView& like, DType dtype, std::int64_t last = -1);
// The leading dimensions of `like` (all but the last), and dtype: per-row outputs.
OutputShape rows_of(const TensorView& like, DType dtype);

}  // namespace kiln
