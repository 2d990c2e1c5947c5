// `kiln tune`, `kiln ls --tuned` and `kiln prewarm --problems` as processes: argument errors are
// exit 2 with a message before anything runs, and `ls --tuned` shows a table the test filled.
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "cache/tuning.h"
#include "kiln/family.h"
#include "tests/test_util.h"
#include "tests/tune/tune_cli_util.h"

namespace kiln::testing {
namespace {

TEST_F(TuneCli, ArgumentErrorsAreUsageErrors) {
  expect_usage_error({"tune", "--family", "rmsnorm"}, "give --shape SIZES or --all");
  expect_usage_error({"tune", "--family", "rmsnorm", "--all", "--shape", "rows=1,cols=8"}, "not both");
  expect_usage_error({"tune", "--shape", "rows=1,cols=8"}, "--family is required");
  expect_usage_error({"tune", "--family", "nope", "--shape", "rows=1"}, "unknown family 'nope'");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows=4096,cols=x"}, "not a non-negative integer");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows4096"}, "expected name=size pairs");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows=1,cols=8,foo=2"}, "no field named 'foo'");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows=1"}, "'cols' is missing");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows=4,cols=0"}, "cols > 0");
  expect_usage_error({"tune", "--family", "rmsnorm", "--dtype", "i32", "--shape", "rows=1,cols=8"}, "bad dtype 'i32'");
  expect_usage_error({"tune", "--family", "rmsnorm", "--shape", "rows=1,cols=8", "--device", "-1"}, "--device");
}

// In-process tuning uses the environment's remote tier (a GPU run is in tests/remote/
// fleet_gpu_test.cpp); a wrong setting stops it before anything is opened, tuned or compiled.
TEST_F(TuneCli, ABadRemoteSettingStopsInProcessTuning) {
  const fs::path key = dir_.path() / "fleet.key";
  std::ofstream(key) << "fleet test key: 0123456789abcdef\n";
  fs::permissions(key, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  ScopedEnv remote("KILN_REMOTE", "redis://127.0.0.1:1");
  ScopedEnv key_file("KILN_FLEET_KEY_FILE", key.string());
  const std::vector<std::string> tune = {"--embedded", "tune", "--family", "rmsnorm", "--shape", "rows=64,cols=1024"};
  expect_usage_error(tune, "must be 0600");
  ScopedEnv bad_url("KILN_REMOTE", "http://127.0.0.1:1");
  fs::permissions(key, fs::perms::owner_read | fs::perms::owner_write);
  expect_usage_error(tune, "the scheme must be redis://");
}

TEST_F(TuneCli, PrewarmProblemsFileErrorsNameTheLine) {
  expect_usage_error({"prewarm"}, "--arch");
  expect_usage_error({"prewarm", "--problems", (dir_.path() / "missing.txt").string()}, "cannot read problems file");
  const auto bad = write_file("bad.txt", "# tuned on boot\nrmsnorm bf16 rows=4096,cols=4096\n\nrmsnorm bf16 rows=1\n");
  expect_usage_error({"prewarm", "--problems", bad.string()}, "bad.txt:4: rmsnorm: the shape must name every key field");
  const auto words = write_file("words.txt", "rmsnorm bf16\n");
  expect_usage_error({"prewarm", "--problems", words.string()}, "words.txt:1: expected 'FAMILY DTYPE name=size,...'");
  const auto empty = write_file("empty.txt", "# nothing\n\n");
  expect_usage_error({"prewarm", "--problems", empty.string()}, "lists no problems");
  // A bad problems file is refused before the catalog compile starts.
  expect_usage_error({"prewarm", "--arch", "sm_90a", "--problems", (dir_.path() / "missing.txt").string()},
                     "cannot read problems file");
}

TEST_F(TuneCli, LsTunedShowsTheTable) {
  Proc empty = kiln({"ls", "--tuned"});
  EXPECT_EQ(empty.rc, 0) << empty.all();
  EXPECT_NE(empty.err.find("no tuned problems"), std::string::npos) << empty.all();
  {
    auto store = cache::Store::open(cache_dir() / "kernels.sqlite").value();
    auto table = cache::TuningTable::open(*store).value();
    const Family& f = *Registry::global().find("rmsnorm");
    const Problem p = f.problem_from_shape(DType::bf16, {{"rows", 4096}, {"cols", 5120}}).value();
    cache::TuningRecord r;
    r.family = "rmsnorm";
    r.signature = f.signature(p);
    r.setup = {"sm_90a", "NVIDIA H100 80GB HBM3", "580.65.06 cuda 13000", "0123456789abcdef"};
    r.winner = "block=512,bulk=0,dtype=bf16,row=0,vec=4";
    r.winner_ms = 0.0321;
    r.heuristic = "block=128,bulk=0,dtype=bf16,row=0,vec=4";
    r.heuristic_ms = 0.0345;
    r.problem = "rows=4096,cols=5120,x_row_stride=5120,y_row_stride=5120";
    r.candidates = {{r.winner, cache::CandidateStatus::ok, 0.0321, 0.01, 20, ""},
                    {r.heuristic, cache::CandidateStatus::ok, 0.0345, 0.01, 20, ""},
                    {"block=64,bulk=0,dtype=bf16,row=0,vec=1", cache::CandidateStatus::compile_failed, -1, 0, 0, "nvrtc said no"}};
    ASSERT_TRUE(table->put(r).ok());
    cache::TuningRecord a = r;
    a.family = "act_and_mul";
    a.signature = "dtype=bf16,align=16,rows<=16,d=4096,x_row_stride=8192,out_row_stride=4096,activation=0";
    a.setup.arch = "sm_80";
    a.winner = a.candidates[0].params = "act=silu,block=256,bulk=0,dtype=bf16,row=0,vec=8";
    ASSERT_TRUE(table->put(a).ok());
  }
  Proc text = kiln({"ls", "--tuned"});
  ASSERT_EQ(text.rc, 0) << text.all();
  for (const char* want : {"rmsnorm", "rows<=4096,cols=5120", "block=512,bulk=0,dtype=bf16,row=0,vec=4", "32.10", "34.50",
                           "NVIDIA H100 80GB HBM3", "580.65.06 cuda 13000", "0123456789ab", "act_and_mul",
                           "2 tuned problems"})
    EXPECT_NE(text.out.find(want), std::string::npos) << want << "\n" << text.all();

  Proc filtered = kiln({"ls", "--tuned", "--family", "act_and_mul"});
  ASSERT_EQ(filtered.rc, 0) << filtered.all();
  EXPECT_EQ(filtered.out.find("block=512,bulk=0,dtype=bf16,row=0,vec=4"), std::string::npos) << filtered.all();
  EXPECT_NE(filtered.out.find("1 tuned problem"), std::string::npos) << filtered.all();

  Proc js = kiln({"ls", "--tuned", "--json", "--arch", "sm_90a"});
  ASSERT_EQ(js.rc, 0) << js.all();
  auto j = nlohmann::json::parse(js.out, nullptr, false);
  ASSERT_TRUE(j.is_array()) << js.all();
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["winner"], "block=512,bulk=0,dtype=bf16,row=0,vec=4");
  EXPECT_EQ(j[0]["device_name"], "NVIDIA H100 80GB HBM3");
  ASSERT_EQ(j[0]["candidates"].size(), 3u);
  EXPECT_EQ(j[0]["candidates"][2]["status"], "compile_failed");
  EXPECT_EQ(j[0]["candidates"][2]["error"], "nvrtc said no");
}

}  // namespace
}  // namespace kiln::testing
