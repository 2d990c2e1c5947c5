// `kiln tune --shape` on a GPU: the device facts that rmsnorm and the GEMM families keep as problem
// dims (`sms`, `cc`) come from the tuning device unless the shape names them, so the candidates and
// the stored timings belong to this GPU and not to a default one.
#include <nlohmann/json.hpp>

#include "jit/device_info.h"
#include "tests/gpu_util.h"
#include "tests/tune/tune_cli_util.h"

namespace kiln::testing {
namespace {

// The tuned problem's dims ("rows=64,cols=1024,...") of `kiln --embedded tune ... --json`.
std::string tuned_problem(const Proc& p) {
  auto j = nlohmann::json::parse(p.out, nullptr, false);
  if (j.is_discarded() || !j.contains("records") || j["records"].size() != 1) return "(no record) " + p.all();
  return j["records"][0].value("problem", std::string());
}

TEST_F(TuneCli, ShapesTakeTheTuningDevicesFacts) {
  KILN_REQUIRE_GPU();
  const auto dev = jit::device_info(0);
  ASSERT_TRUE(dev.ok());
  const int sms = (*dev)->sm_count, cc = (*dev)->compute_capability;
  const std::string facts = "sms=" + std::to_string(sms) + ",cc=" + std::to_string(cc);

  Proc p = kiln({"--embedded", "tune", "--family", "rmsnorm", "--dtype", "bf16", "--shape", "rows=64,cols=1024", "--json"});
  ASSERT_EQ(p.rc, 0) << p.all();
  EXPECT_EQ(tuned_problem(p), "rows=64,cols=1024,x_row_stride=1024,y_row_stride=1024," + facts);

  // What the shape names is kept.
  p = kiln({"--embedded", "tune", "--family", "rmsnorm", "--dtype", "bf16", "--shape", "rows=64,cols=1024,cc=0", "--json"});
  ASSERT_EQ(p.rc, 0) << p.all();
  EXPECT_EQ(tuned_problem(p), "rows=64,cols=1024,x_row_stride=1024,y_row_stride=1024,sms=" + std::to_string(sms) + ",cc=0");
}

}  // namespace
}  // namespace kiln::testing
