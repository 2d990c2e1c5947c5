// `kiln tune --shape` on a GPU: the device facts a problem carries (SM count, compute capability)
// come from the tuning device, so the candidates and the stored timings belong to this GPU and not
// to a default one; a shape cannot name them.
#include <nlohmann/json.hpp>

#include "jit/device_info.h"
#include "tests/gpu_util.h"
#include "tests/tune/tune_cli_util.h"

namespace kiln::testing {
namespace {

// The tuned problem ("rows=64,cols=1024,...") of `kiln --embedded tune ... --json`.
std::string tuned_problem(const Proc& p) {
  auto j = nlohmann::json::parse(p.out, nullptr, false);
  if (j.is_discarded() || !j.contains("records") || j["records"].size() != 1) return "(no record) " + p.all();
  return j["records"][0].value("problem", std::string());
}

TEST_F(TuneCli, ShapesTakeTheTuningDevicesFacts) {
  KILN_REQUIRE_GPU();
  const auto dev = jit::device_info(0);
  ASSERT_TRUE(dev.ok());
  const std::string facts =
      "sm_count=" + std::to_string((*dev)->sm_count) + ",cc=" + std::to_string((*dev)->compute_capability);

  Proc p = kiln({"--embedded", "tune", "--family", "rmsnorm", "--dtype", "bf16", "--shape", "rows=64,cols=1024", "--json"});
  ASSERT_EQ(p.rc, 0) << p.all();
  const std::string problem = tuned_problem(p);
  EXPECT_EQ(problem.rfind("rows=64,cols=1024,x_row_stride=1024,y_row_stride=1024,", 0), 0u) << problem;
  EXPECT_NE(problem.find(facts), std::string::npos) << problem;

  // The device facts are not fields: naming one is an error before anything is tuned.
  p = kiln({"--embedded", "tune", "--family", "rmsnorm", "--dtype", "bf16", "--shape", "rows=64,cols=1024,cc=0", "--json"});
  EXPECT_NE(p.rc, 0) << p.all();
  EXPECT_NE(p.all().find("no field named 'cc'"), std::string::npos) << p.all();
}

}  // namespace
}  // namespace kiln::testing
