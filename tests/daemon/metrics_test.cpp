// Metrics: the Prometheus text rendered from a stats reply, kilnd's `metrics` request and its
// HTTP listener, with a remote tier that cannot be reached (its errors are counted, no launch
// waits on it).
#include <arpa/inet.h>
#include <netinet/in.h>

#include <regex>

#include "daemon/metrics.h"
#include "daemon/metrics_http.h"
#include "tests/daemon/kilnd_harness.h"
#include "tests/remote/redis_harness.h"

namespace kiln::testing {
namespace {

// The value of the first sample line that starts with `series` (name and labels), or -1.
double sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

TEST(Metrics, RendersAStatsReply) {
  nlohmann::json stats = {
      {"builder",
       {{"requests", 5}, {"cache_hits", 2}, {"cache_misses", 3}, {"remote_hits", 1}, {"remote_misses", 2},
        {"compiles", 2}, {"compile_failures", 0}, {"coalesced", 0}, {"store_failures", 0},
        {"compile_seconds",
         {{"buckets", {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}}, {"counts", {0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0}},
          {"sum", 0.5}}}}},
      {"daemon",
       {{"compiles_queued", 4}, {"tuning_runs", 7},
        {"remote", {{"up", false}, {"rejected", 3}, {"timeouts", 2}, {"errors", 1}, {"skipped", 9}}}}},
      {"cache", {{"entries", 10}, {"evictions", 6}}}};
  const std::string text = daemon::render_metrics(stats);
  EXPECT_EQ(sample(text, "kiln_cache_hits_total{tier=\"local\"}"), 2);
  EXPECT_EQ(sample(text, "kiln_cache_hits_total{tier=\"remote\"}"), 1);
  EXPECT_EQ(sample(text, "kiln_cache_misses_total{tier=\"remote\"}"), 2);
  EXPECT_EQ(sample(text, "kiln_compile_seconds_bucket{le=\"0.05\"}"), 0);
  EXPECT_EQ(sample(text, "kiln_compile_seconds_bucket{le=\"0.1\"}"), 1);
  EXPECT_EQ(sample(text, "kiln_compile_seconds_bucket{le=\"0.5\"}"), 2) << "buckets are cumulative";
  EXPECT_EQ(sample(text, "kiln_compile_seconds_bucket{le=\"+Inf\"}"), 2);
  EXPECT_EQ(sample(text, "kiln_compile_seconds_count"), 2);
  EXPECT_EQ(sample(text, "kiln_compile_seconds_sum"), 0.5);
  EXPECT_EQ(sample(text, "kiln_compile_queue_depth"), 4);
  EXPECT_EQ(sample(text, "kiln_tuning_runs_total"), 7);
  EXPECT_EQ(sample(text, "kiln_cache_evictions_total"), 6);
  EXPECT_EQ(sample(text, "kiln_remote_up"), 0);
  EXPECT_EQ(sample(text, "kiln_remote_rejected_total"), 3);
  EXPECT_EQ(sample(text, "kiln_remote_errors_total{kind=\"timeout\"}"), 2);
  EXPECT_EQ(sample(text, "kiln_remote_skipped_total"), 9);
  EXPECT_NE(text.find("# TYPE kiln_compile_seconds histogram"), std::string::npos);
  // Every line is a comment or a sample "name{labels} value".
  const std::regex line_re(R"((# (HELP|TYPE) [a-z_]+ .+)|([a-z_]+(\{[a-z_]+="[^"]*"\})? -?[0-9.e+]+))");
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) EXPECT_TRUE(std::regex_match(line, line_re)) << line;

  const std::string cache_only = daemon::render_metrics({{"cache", {{"entries", 1}}}});
  EXPECT_EQ(sample(cache_only, "kiln_cache_entries"), 1);
  EXPECT_EQ(cache_only.find("kiln_compiles_total"), std::string::npos) << "no builder, no builder series";
  EXPECT_EQ(cache_only.find("kiln_remote"), std::string::npos);
}

TEST(Metrics, ListenAddresses) {
  std::string host;
  unsigned short port = 0;
  EXPECT_TRUE(daemon::parse_listen_address("127.0.0.1:9464", host, port).ok());
  EXPECT_EQ(port, 9464);
  EXPECT_TRUE(daemon::parse_listen_address("[::1]:0", host, port).ok());
  EXPECT_EQ(host, "::1");
  for (const char* bad : {"9464", ":9464", "localhost:9464", "127.0.0.1:", "127.0.0.1:70000", "1.2.3.4:x"})
    EXPECT_EQ(daemon::parse_listen_address(bad, host, port).code(), Code::invalid_argument) << bad;
}

// One HTTP/1.1 request on a fresh TCP connection; the whole response.
std::string http(const std::string& address, const std::string& request) {
  const auto colon = address.rfind(':');
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(std::uint16_t(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return "";
  }
  (void)!::write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) break;
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, std::size_t(n));
  }
  ::close(fd);
  return out;
}

TEST(Metrics, KilndServesThemOnTheSocketAndOverHttp) {
  DaemonEnv env;
  TempDir tmp;
  const fs::path key = write_secret(tmp.path() / "fleet.key", "metrics test fleet key 0123456789\n");
  // Nothing listens on the remote's port: its failures show in the counters, the kernel compiles.
  const std::string remote = "redis://127.0.0.1:" + std::to_string(RedisServer::free_port());
  auto k = env.start({"--jobs", "2", "--metrics-listen", "127.0.0.1:0", "--remote", remote, "--fleet-key-file",
                      key.string()});
  ASSERT_TRUE(k);
  auto c = client::DaemonClient::connect(env.socket());
  ASSERT_TRUE(c.ok());
  auto spec = KernelSpec::parse("rmsnorm(block=128,bulk=0,dtype=f16,row=0,vec=8)");
  auto r = (*c)->get_kernel(*spec, "sm_80");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE((*c)->get_kernel(*spec, "sm_80").ok());

  auto text = (*c)->metrics();
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_EQ(sample(*text, "kiln_build_requests_total"), 2);
  EXPECT_EQ(sample(*text, "kiln_compiles_total"), 1);
  EXPECT_EQ(sample(*text, "kiln_cache_hits_total{tier=\"local\"}"), 1);
  EXPECT_EQ(sample(*text, "kiln_cache_misses_total{tier=\"local\"}"), 1);
  EXPECT_EQ(sample(*text, "kiln_cache_misses_total{tier=\"remote\"}"), 1);
  EXPECT_EQ(sample(*text, "kiln_compile_seconds_count"), 1);
  EXPECT_GT(sample(*text, "kiln_compile_seconds_sum"), 0);
  EXPECT_EQ(sample(*text, "kiln_compile_queue_depth"), 0);
  EXPECT_EQ(sample(*text, "kiln_remote_up"), 0);
  // The lookup's refused connection, and maybe the write-back's probe after the back-off.
  EXPECT_GE(sample(*text, "kiln_remote_errors_total{kind=\"connection\"}"), 1);
  EXPECT_EQ(sample(*text, "kiln_cache_entries"), 1);

  const std::string address = stats_of(env.socket())["daemon"].value("metrics_listen", std::string());
  ASSERT_FALSE(address.empty()) << k->log();
  const std::string ok = http(address, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << ok;
  EXPECT_NE(ok.find("\nkiln_compiles_total 1\n"), std::string::npos) << ok;
  EXPECT_EQ(http(address, "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(http(address, "POST /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0), 0u);
  const std::string head = http(address, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(head.substr(head.find("\r\n\r\n") + 4), "") << "no body for HEAD";
  EXPECT_EQ(http(address, std::string(9000, 'x')).rfind("HTTP/1.1 400", 0), 0u) << "an oversized request";

  k->signal(SIGTERM);
  EXPECT_EQ(k->wait_exit(20s), 0) << k->log();
}

TEST(Metrics, KilndRefusesABadListenAddress) {
  DaemonEnv env;
  auto k = Kilnd::spawn(env.options({"--metrics-listen", "localhost:9464"}));
  EXPECT_EQ(k->wait_exit(10s), 1);
  EXPECT_NE(k->log().find("bad metrics address"), std::string::npos) << k->log();
}

}  // namespace
}  // namespace kiln::testing
