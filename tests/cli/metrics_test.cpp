// `kiln metrics`: the daemon's counters when it runs, the cache file's without it.
#include "tests/cli/sandbox.h"

namespace kiln::testing {
namespace {

TEST(CliMetrics, FromTheCacheFileAndFromTheDaemon) {
  Sandbox sb;
  Proc none = sb.kiln({"metrics", "--embedded"});
  ASSERT_EQ(none.rc, 0) << none.all();
  EXPECT_NE(none.out.find("\nkiln_cache_entries 0\n"), std::string::npos) << none.out;
  EXPECT_EQ(none.out.find("kiln_compiles_total"), std::string::npos) << "no daemon, no builder counters";

  ASSERT_EQ(sb.kiln({"prewarm", "--embedded", "--arch", "sm_80", "--family", "rmsnorm_bwd_reduce"}).rc, 0);
  Proc file = sb.kiln({"metrics", "--embedded"});
  ASSERT_EQ(file.rc, 0) << file.all();
  EXPECT_EQ(file.out.find("\nkiln_cache_entries 0\n"), std::string::npos) << file.out;

  Proc start = sb.kiln({"daemon", "start"});
  ASSERT_EQ(start.rc, 0) << start.all();
  Proc d = sb.kiln({"metrics"});
  EXPECT_EQ(d.rc, 0) << d.all();
  EXPECT_NE(d.out.find("# TYPE kiln_compile_seconds histogram"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("kiln_daemon_uptime_seconds"), std::string::npos) << d.out;
  sb.stop_daemon();
}

}  // namespace
}  // namespace kiln::testing
