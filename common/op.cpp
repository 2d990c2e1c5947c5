#include "kiln/op.h"

#include <cctype>

#include <nlohmann/json.hpp>

namespace kiln {

namespace {

bool valid_op_name(const std::string& s) {
  if (s.empty() || !std::islower(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '_'))
      return false;
  return true;
}

const char* kind_name(ScalarKind k) {
  switch (k) {
    case ScalarKind::f64: return "f64";
    case ScalarKind::i64: return "i64";
    case ScalarKind::boolean: return "bool";
    case ScalarKind::choice: return "choice";
  }
  return "?";
}

}  // namespace

std::size_t OpDecl::tensor_index(std::string_view tensor) const {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == tensor) return i;
  return tensors.size();
}

std::size_t OpDecl::input_count() const {
  std::size_t n = 0;
  while (n < tensors.size() && tensors[n].role == TensorRole::input) ++n;
  return n;
}

Status OpDecl::check() const {
  const std::string what = "op '" + name + "'";
  if (!valid_op_name(name)) return invalid_argument("bad op name '" + name + "' (want [a-z][a-z0-9_]*)");
  if (!run || !infer) return invalid_argument(what + " needs a run and an infer function");
  if (tensors.empty() || tensors.size() > 16) return invalid_argument(what + " must have 1..16 tensors");
  if (scalars.size() > 8) return invalid_argument(what + " has more than 8 scalars");
  bool outputs = false, any_output = false;
  std::vector<std::string> names;
  for (const auto& t : tensors) {
    if (!valid_op_name(t.name)) return invalid_argument(what + ": bad tensor name '" + t.name + "'");
    if (t.role == TensorRole::output) outputs = any_output = true;
    else if (outputs) return invalid_argument(what + ": input '" + t.name + "' comes after an output");
    if (t.min_rank < 1 || t.max_rank > TensorView::k_max_rank || t.min_rank > t.max_rank)
      return invalid_argument(what + ": tensor '" + t.name + "' has a bad rank range");
    names.push_back(t.name);
  }
  if (!any_output) return invalid_argument(what + " has no output");
  for (const auto& s : scalars) {
    if (!valid_op_name(s.name)) return invalid_argument(what + ": bad scalar name '" + s.name + "'");
    names.push_back(s.name);
    if (s.kind == ScalarKind::choice) {
      if (s.choices.empty()) return invalid_argument(what + ": choice '" + s.name + "' lists no values");
      if (s.has_default && (s.default_value < 0 || s.default_value >= double(s.choices.size())))
        return invalid_argument(what + ": the default of '" + s.name + "' is not one of its choices");
    } else if (!s.choices.empty()) {
      return invalid_argument(what + ": only a choice scalar lists choices ('" + s.name + "')");
    }
  }
  for (std::size_t i = 0; i < names.size(); ++i)
    for (std::size_t j = i + 1; j < names.size(); ++j)
      if (names[i] == names[j]) return invalid_argument(what + ": two arguments are named '" + names[i] + "'");
  if (!backward.empty() && !valid_op_name(backward)) return invalid_argument(what + ": bad backward op name");
  return {};
}

std::string OpDecl::describe() const {
  nlohmann::json j;
  j["name"] = name;
  j["doc"] = doc;
  j["backward"] = backward;
  j["cpu"] = cpu;
  j["tensors"] = nlohmann::json::array();
  for (const auto& t : tensors) {
    nlohmann::json d = nlohmann::json::array();
    for (int i = 0; i < 6; ++i)
      if (t.dtypes & (1u << i)) d.push_back(dtype_name(static_cast<DType>(i)));
    j["tensors"].push_back({{"name", t.name},
                            {"output", t.role == TensorRole::output},
                            {"optional", t.optional},
                            {"dtypes", d},
                            {"min_rank", t.min_rank},
                            {"max_rank", t.max_rank},
                            {"shape", t.shape},
                            {"grad_of", t.grad_of},
                            {"strided_rows", t.strided_rows}});
  }
  j["scalars"] = nlohmann::json::array();
  for (const auto& s : scalars) {
    nlohmann::json d = {{"name", s.name}, {"kind", kind_name(s.kind)}, {"doc", s.doc}, {"choices", s.choices}};
    if (s.has_default) {
      if (s.kind == ScalarKind::f64) d["default"] = s.default_value;
      else if (s.kind == ScalarKind::boolean) d["default"] = s.default_value != 0;
      else if (s.kind == ScalarKind::choice) d["default"] = s.choices[std::size_t(s.default_value)];
      else d["default"] = std::int64_t(s.default_value);
    }
    j["scalars"].push_back(std::move(d));
  }
  return j.dump();
}

Status check_op_call(const OpDecl& op, const OpCall& call, bool outputs) {
  if (call.tensors.size() != op.tensors.size())
    return invalid_argument(op.name + ": takes " + std::to_string(op.tensors.size()) + " tensors, got " +
                            std::to_string(call.tensors.size()));
  if (call.scalars.size() != op.scalars.size())
    return invalid_argument(op.name + ": takes " + std::to_string(op.scalars.size()) + " scalars, got " +
                            std::to_string(call.scalars.size()));
  for (std::size_t i = 0; i < op.tensors.size(); ++i) {
    const OpTensor& d = op.tensors[i];
    if (!outputs && d.role == TensorRole::output) continue;
    const TensorView* t = call.tensors[i];
    if (!t) {
      if (d.optional) continue;
      return invalid_argument(op.name + ": " + d.name + " is required");
    }
    if (t->rank < d.min_rank || t->rank > d.max_rank)
      return shape_mismatch(op.name + ": " + d.name + " must have rank " +
                            (d.min_rank == d.max_rank ? std::to_string(d.min_rank)
                                                      : std::to_string(d.min_rank) + ".." + std::to_string(d.max_rank)) +
                            " (" + d.shape + "), got " + std::to_string(t->rank));
    if (!(d.dtypes & dtype_bit(t->dtype))) {
      std::string allowed;
      for (int k = 0; k < 6; ++k)
        if (d.dtypes & (1u << k)) allowed += std::string(allowed.empty() ? "" : ", ") + dtype_name(static_cast<DType>(k));
      return unsupported_dtype(op.name + ": " + d.name + " must be " + allowed + " (got " + dtype_name(t->dtype) + ")");
    }
  }
  for (std::size_t i = 0; i < op.scalars.size(); ++i) {
    const OpScalar& d = op.scalars[i];
    const std::int64_t v = call.scalars[i].i64;
    if (d.kind == ScalarKind::choice && (v < 0 || v >= std::int64_t(d.choices.size())))
      return invalid_argument(op.name + ": " + d.name + " must be 0.." + std::to_string(d.choices.size() - 1) +
                              " (got " + std::to_string(v) + ")");
    if (d.kind == ScalarKind::boolean && v != 0 && v != 1)
      return invalid_argument(op.name + ": " + d.name + " must be 0 or 1");
  }
  return {};
}

OutputShape shape_like(const TensorView& like, DType dtype, std::int64_t last) {
  OutputShape o;
  o.dtype = dtype;
  o.rank = like.rank;
  for (int i = 0; i < like.rank; ++i) o.shape[i] = like.shape[i];
  if (last >= 0 && like.rank > 0) o.shape[like.rank - 1] = last;
  return o;
}

OutputShape rows_of(const TensorView& like, DType dtype) {
  OutputShape o;
  o.dtype = dtype;
  if (like.rank <= 1) {
    o.rank = 1;
    o.shape[0] = 1;
    return o;
  }
  o.rank = like.rank - 1;
  for (int i = 0; i + 1 < like.rank; ++i) o.shape[i] = like.shape[i];
  return o;
}

}  // namespace kiln
