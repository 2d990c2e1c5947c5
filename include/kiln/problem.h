// A family's problem: a typed struct the family declares, carried in a fixed-size block.
//
// Each family declares its problem as a plain struct of std::int64_t and double members and lists
// its fields once, naming each, saying whether it is a key (it may pick a different variant: the
// heuristic, the launch geometry and the tuning signature read it) or a per-call value (a stride,
// a scale: only checks, arguments, buffer sizes and the CPU reference read it), and which key the
// tuning signature buckets to powers of two:
//
//   struct RopeProblem {
//     std::int64_t tokens = 0, heads = 0, q_stride = 0;
//     double theta = 0;
//   };
//   const std::vector<ProblemField>& problem_fields() const override {
//     static const auto fields = problem_fields_of<RopeProblem>({
//         bucketed(&RopeProblem::tokens, "tokens", "tokens to rotate"),
//         key(&RopeProblem::heads, "heads", "heads per token"),
//         value(&RopeProblem::q_stride, "q_stride", "elements between two tokens of q"),
//         value(&RopeProblem::theta, "theta", "rotary base")});
//     return fields;
//   }
//
// and reads a Problem as that struct (problem.as<RopeProblem>()) or builds one from it
// (Problem::of(dtype, alignment, RopeProblem{...})). Every 8-byte word of the struct is a declared
// field, so nothing a family reads can be left out of the field list by mistake. The Problem is the
// plugin ABI's kiln_problem, so it crosses the ABI by address.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kiln/plugin.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln {

enum class FieldType : std::uint8_t { i64 = KILN_FIELD_I64, f64 = KILN_FIELD_F64 };

// One named field of a problem: which slot of Problem::fields holds it and how it is read.
struct ProblemField {
  std::string name;
  FieldType type = FieldType::i64;
  std::uint32_t slot = 0;
  bool key = false;       // may pick a different variant; part of the tuning signature
  bool bucketed = false;  // the key that signatures round up to a power of two
  std::string doc;
  // The member's value in a default-constructed problem struct: what a problem built from named
  // sizes (`kiln tune --shape`) holds where a value field is not named.
  std::int64_t default_i = 0;
  double default_f = 0;
};

// A problem instance: the family's fields, the element type, the smallest byte alignment among
// the buffers' base addresses and row strides, and the device it runs on. Plain data, so the
// launch path never allocates.
//
// The device facts are not the caller's to give: the runtime fills them from its device-attribute
// cache (jit/device_info.h) for the device of the current context before it asks the family
// anything, and the tuner for the device it times on. 0 means unknown (a CPU test, `kiln tune`
// with no device): families then choose as for their reference device.
struct Problem {
  static constexpr int k_max_fields = KILN_PLUGIN_MAX_FIELDS;
  DType dtype = DType::f32;
  std::uint8_t cc = 0;         // compute capability, major * 10 + minor
  std::uint16_t sm_count = 0;  // multiprocessors
  std::uint32_t alignment = 16;
  std::array<kiln_problem_value, k_max_fields> fields{};

  // The family's typed problem: the first sizeof(P) bytes of fields.
  template <class P>
  P as() const {
    check_struct<P>();
    P out;
    std::memcpy(static_cast<void*>(&out), fields.data(), sizeof(P));
    return out;
  }
  template <class P>
  void set(const P& typed) {
    check_struct<P>();
    std::memcpy(fields.data(), static_cast<const void*>(&typed), sizeof(P));
  }
  template <class P>
  static Problem of(DType dtype, std::uint32_t alignment, const P& typed) {
    Problem p;
    p.dtype = dtype;
    p.alignment = alignment;
    p.set(typed);
    return p;
  }

  template <class P>
  static constexpr void check_struct() {
    static_assert(std::is_trivially_copyable_v<P> && std::is_standard_layout_v<P>,
                  "a problem struct is plain data");
    static_assert(sizeof(P) % 8 == 0 && alignof(P) == 8 && sizeof(P) <= sizeof(kiln_problem_value) * k_max_fields,
                  "a problem struct holds at most KILN_PLUGIN_MAX_FIELDS std::int64_t or double members");
  }
};
// The plugin ABI's kiln_problem has this layout: the launch path hands a Problem to a plugin by
// address, without a copy (kiln/plugin_cpp.h, plugin/adapter.cpp).
static_assert(std::is_standard_layout_v<Problem> && sizeof(Problem) == sizeof(kiln_problem) &&
              offsetof(Problem, dtype) == offsetof(kiln_problem, dtype) &&
              offsetof(Problem, cc) == offsetof(kiln_problem, cc) &&
              offsetof(Problem, sm_count) == offsetof(kiln_problem, sm_count) &&
              offsetof(Problem, alignment) == offsetof(kiln_problem, alignment) &&
              offsetof(Problem, fields) == offsetof(kiln_problem, fields) && sizeof(DType) == 1);

namespace detail {
template <class P, class T>
ProblemField make_field(T P::*member, std::string name, bool key, bool bucketed, std::string doc) {
  static_assert(std::is_same_v<T, std::int64_t> || std::is_same_v<T, double>,
                "problem fields are std::int64_t or double");
  const P probe{};
  const auto offset = std::size_t(reinterpret_cast<const char*>(&(probe.*member)) -
                                  reinterpret_cast<const char*>(&probe));
  ProblemField f;
  f.name = std::move(name);
  f.type = std::is_same_v<T, double> ? FieldType::f64 : FieldType::i64;
  f.slot = std::uint32_t(offset / 8);
  f.key = key;
  f.bucketed = bucketed;
  f.doc = std::move(doc);
  if constexpr (std::is_same_v<T, double>) f.default_f = probe.*member;
  else f.default_i = probe.*member;
  return f;
}
}  // namespace detail

// A key field: it may pick a different variant, and the tuning signature holds its exact value.
template <class P, class T>
ProblemField key(T P::*member, std::string name, std::string doc) {
  return detail::make_field(member, std::move(name), true, false, std::move(doc));
}
// The key the tuning signature rounds up to a power of two (at most one per problem; i64).
template <class P>
ProblemField bucketed(std::int64_t P::*member, std::string name, std::string doc) {
  return detail::make_field(member, std::move(name), true, true, std::move(doc));
}
// A per-call value that never picks a different variant (a stride, a scale, an epsilon).
template <class P, class T>
ProblemField value(T P::*member, std::string name, std::string doc) {
  return detail::make_field(member, std::move(name), false, false, std::move(doc));
}

// Checks a field list: names [a-z][a-z0-9_]* and unique, slots 0..n-1 each named once, at most
// k_max_fields, at most one bucketed field and it an i64 key. invalid_argument naming the fault.
Status check_problem_fields(const std::vector<ProblemField>& fields);

// The field list of struct P; a list that does not name every word of P exactly once is a bug in
// the family, reported by throwing when the family first asks for its fields.
template <class P>
std::vector<ProblemField> problem_fields_of(std::vector<ProblemField> fields) {
  Problem::check_struct<P>();
  if (fields.size() * 8 != sizeof(P))
    throw std::logic_error("a problem's field list must name every member of its struct");
  if (Status s = check_problem_fields(fields); !s.ok()) throw std::logic_error(s.message());
  return fields;
}

// A field's value as a double (f64 fields) or an integer (i64 fields), for printing.
std::string field_value_text(const ProblemField& f, const Problem& p);

}  // namespace kiln
