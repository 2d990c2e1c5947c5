// A family that does nothing, for tests that need a Family object but not its kernels: every
// method has a trivial answer (an empty schema, catalog and field list, no buffers, success), and
// the test overrides what it is about.
#pragma once

#include <string>

#include "kiln/family.h"

namespace kiln::testing {

class StubFamily : public Family {
 public:
  explicit StubFamily(std::string name) : name_(std::move(name)) {}
  std::string_view name() const override { return name_; }
  int version() const override { return 1; }
  const std::vector<ParamDef>& schema() const override {
    static const std::vector<ParamDef> none;
    return none;
  }
  const std::vector<ProblemField>& problem_fields() const override {
    static const std::vector<ProblemField> none;
    return none;
  }
  Result<Rendered> render(const Params&) const override { return Rendered{}; }
  std::vector<Params> catalog() const override { return {}; }
  Status check_problem(const Params&, const Problem&) const override { return {}; }
  LaunchGeometry geometry(const Params&, const Problem&) const override { return {}; }
  Params heuristic(const Problem&) const override { return {}; }
  std::vector<Params> tuning_space(const Problem&) const override { return {}; }
  std::vector<BufferSpec> buffers(const Params&, const Problem&) const override { return {}; }
  void pack_args(const Params&, const Problem&, std::span<void* const>, ArgPack&) const override {}
  Status cpu_reference(const Params&, const Problem&, std::span<void* const>) const override { return {}; }

 private:
  std::string name_;
};

}  // namespace kiln::testing
