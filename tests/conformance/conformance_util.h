// What the conformance tests run over: every family in the process-wide registry (built-in, from
// KILN_PLUGIN_PATH, plus the example plugin and the C fixture plugin), and the element types each
// supports.
#pragma once

#include <string>
#include <vector>

#include "kiln/family.h"
#include "tests/plugin_util.h"

namespace kiln::testing {

inline std::vector<std::string> conformance_families() {
  register_test_plugins();
  std::vector<std::string> out;
  for (const Family* f : Registry::global().all()) out.emplace_back(f->name());
  return out;
}

// The dtypes a family's "dtype" parameter allows.
inline std::vector<DType> family_dtypes(const Family& f) {
  for (const ParamDef& d : f.schema())
    if (d.name == "dtype") {
      std::vector<DType> out;
      for (const auto& c : d.choices)
        if (auto t = parse_dtype(c)) out.push_back(*t);
      return out;
    }
  // No dtype parameter (fp8_gemm names its output type otherwise): every float type, and the
  // family's benchmark_problems returns none for the ones it does not take.
  return {DType::f32, DType::f16, DType::bf16};
}

}  // namespace kiln::testing
