// docs/reliability.md, item 14, second half: a cache on a file system that has become read-only.
// Needs CAP_SYS_ADMIN for a private mount namespace and a tmpfs (root in the CI container has it);
// skips with the reason otherwise. File modes cannot stand in: root ignores them.
#include <gtest/gtest.h>

#include <sched.h>
#include <sys/mount.h>

#include "common/sha256.h"
#include "tests/reliability/rel_util.h"

namespace kiln::testing {
namespace {

TEST(ReadOnly, CacheOnAReadOnlyFileSystemServesHitsAndCompilesWithoutStoring) {
  // A mount namespace of this test process (and the kilnd it starts): nothing leaks to the host.
  if (::unshare(CLONE_NEWNS) != 0) GTEST_SKIP() << "no private mount namespace: " << std::strerror(errno);
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    GTEST_SKIP() << "cannot make mounts private: " << std::strerror(errno);
  DaemonEnv env;
  const fs::path mnt = env.root() / "mnt";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=32m,mode=0700") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(errno);
  const fs::path cache_dir = mnt / "cache";
  auto opts = [&](std::vector<std::string> args) {
    auto o = env.options(std::move(args));
    o.cache_dir = cache_dir;
    return o;
  };
  const auto pool = spec_pool(5);
  std::map<std::string, std::string> sums;
  {
    auto k = Kilnd::spawn(opts({"--jobs", "2"}));
    ASSERT_TRUE(k->wait_ready()) << k->log();
    auto c = client::DaemonClient::connect(env.socket());
    for (int i = 0; i < 2; ++i) {
      auto r = (*c)->get_kernel(pool[i], "sm_90a");
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      sums[pool[i].canonical()] = r->entry.checksum;
    }
    ASSERT_TRUE((*c)->shutdown().ok());
    ASSERT_EQ(k->wait_exit(), 0);
  }
  ASSERT_EQ(::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr), 0) << std::strerror(errno);

  auto k = Kilnd::spawn(opts({"--jobs", "2"}));
  ASSERT_TRUE(k->wait_ready()) << "kilnd does not start on a read-only cache:\n" << k->log();
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 5; ++i) {
    auto r = (*c)->get_kernel(pool[i], "sm_90a");
    ASSERT_TRUE(r.ok()) << pool[i].canonical() << ": " << r.status().to_string() << "\n" << k->log();
    EXPECT_EQ(r->source, i < 2 ? jit::ArtifactSource::cache : jit::ArtifactSource::compiled) << i;
    EXPECT_EQ(sha256_hex(r->entry.cubin), r->entry.checksum);
    if (i < 2) {
      EXPECT_EQ(r->entry.checksum, sums[pool[i].canonical()]);
    }
  }
  auto st = stats_of(env.socket());
  EXPECT_EQ(st["builder"]["compiles"], 3) << st.dump();
  EXPECT_EQ(st["builder"]["store_failures"], 3) << st.dump();
  const std::string log = k->log();
  std::size_t lines = 0;
  for (std::size_t p = 0; (p = log.find("could not store", p)) != std::string::npos; ++p) ++lines;
  EXPECT_EQ(lines, 1u) << log;
  ASSERT_TRUE((*c)->shutdown().ok());
  EXPECT_EQ(k->wait_exit(), 0) << k->log();

  ASSERT_EQ(::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT, nullptr), 0) << std::strerror(errno);
  expect_cache_sound(cache_dir / "kernels.sqlite", "after the read-only period");
  RawDb db(cache_dir / "kernels.sqlite");
  EXPECT_EQ(db.keys().size(), 2u);
  ::umount2(mnt.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace kiln::testing
