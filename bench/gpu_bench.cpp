// GPU benchmark for the foundation: copy bandwidth, RMSNorm bandwidth over LLM shapes, host cost of
// an op call against a bare cuLaunchKernel, compile and warm-hit latencies, daemon round trips.
//
//   kiln_bench_gpu [--json FILE] [--kilnd PATH] [--quick]
//
// Every timed shape is first checked against the CPU reference on fresh random data; timings are
// medians of CUDA-event intervals after warm-up, with inputs rotated so that small shapes do not
// run out of L2.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/store.h"
#include "client/daemon_client.h"
#include "common/half.h"
#include "families/rmsnorm/rmsnorm.h"
#include "jit/builder.h"
#include "jit/driver.h"
#include "jit/nvrtc.h"
#include "kiln/runtime.h"

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;
const jit::Driver* drv = nullptr;

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s\n", drv->check(rc, what).to_string().c_str());
    std::exit(1);
  }
}
void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * double(v.size())))];
}
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Median milliseconds of `fn(i)` timed with events, after `warmup` untimed calls.
template <class F>
double time_events(F&& fn, int warmup, int iters) {
  CUevent a, b;
  check(drv->event_create(&a, CU_EVENT_DEFAULT), "cuEventCreate");
  check(drv->event_create(&b, CU_EVENT_DEFAULT), "cuEventCreate");
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    check(drv->event_record(a, nullptr), "cuEventRecord");
    fn(i);
    check(drv->event_record(b, nullptr), "cuEventRecord");
    check(drv->event_synchronize(b), "cuEventSynchronize");
    float ms = 0;
    check(drv->event_elapsed_time(&ms, a, b), "cuEventElapsedTime");
    t.push_back(ms);
  }
  drv->event_destroy(a);
  drv->event_destroy(b);
  return median(t);
}

struct Buf {
  CUdeviceptr p = 0;
  explicit Buf(std::size_t n) { check(drv->mem_alloc(&p, n), "cuMemAlloc"); }
  ~Buf() { drv->mem_free(p); }
  void* get() const { return reinterpret_cast<void*>(p); }
};

std::vector<unsigned char> random_bf16(std::int64_t n, std::mt19937& rng) {
  std::vector<unsigned char> v(n * 2);
  std::normal_distribution<float> d(0, 1);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(v.data(), DType::bf16, i, d(rng));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, kilnd;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--kilnd" && i + 1 < argc) kilnd = argv[++i];
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: kiln_bench_gpu [--json FILE] [--kilnd PATH] [--quick]\n");
      return 2;
    }
  }
  auto d = jit::Driver::get();
  if (!d.ok()) {
    std::fprintf(stderr, "kiln_bench_gpu: %s\n", d.status().to_string().c_str());
    return 1;
  }
  drv = *d;
  auto ctx = jit::current_context();
  check(ctx.status(), "context");
  CUdevice dev;
  check(drv->ctx_get_device(&dev), "cuCtxGetDevice");
  char name[256] = {};
  check(drv->device_get_name(name, sizeof name, dev), "cuDeviceGetName");
  int drv_version = 0;
  drv->driver_get_version(&drv_version);
  nlohmann::json out;
  out["device"] = name;
  out["driver_version"] = drv_version;
  std::printf("device: %s (driver %d)\n", name, drv_version);

  char cache_tmpl[] = "/tmp/kiln-bench-XXXXXX";
  const std::string cache_dir = mkdtemp(cache_tmpl);
  const std::string cache_file = cache_dir + "/k.sqlite";

  // --- compile latencies -------------------------------------------------------------------
  {
    jit::Builder cold(nullptr, &Registry::global());
    auto t0 = Clock::now();
    auto a = cold.get(KernelSpec::parse("rmsnorm(block=256,dtype=bf16,vec=8)").value(), "sm_90a");
    check(a.status(), "cold compile");
    double first_ms = ms_since(t0);
    std::vector<double> plain, pch;
    jit::Builder nopch(nullptr, &Registry::global());
    jit::BuilderOptions po;
    po.use_pch = true;
    jit::Builder withpch(nullptr, &Registry::global(), po);
    (void)withpch.get(KernelSpec::parse("rmsnorm(block=64,dtype=f32,vec=1)").value(), "sm_90a");  // creates the PCH
    for (const char* s : {"rmsnorm(block=128,dtype=bf16,vec=8)", "rmsnorm(block=512,dtype=f16,vec=4)",
                          "rmsnorm(block=1024,dtype=f32,vec=4)", "rmsnorm(block=64,dtype=bf16,vec=2)",
                          "rmsnorm(block=256,dtype=f16,vec=8)"}) {
      auto spec = KernelSpec::parse(s).value();
      t0 = Clock::now();
      check(nopch.get(spec, "sm_90a").status(), "compile");
      plain.push_back(ms_since(t0));
      t0 = Clock::now();
      check(withpch.get(spec, "sm_80").status(), "compile");
      pch.push_back(ms_since(t0));
    }
    out["compile_ms"] = {{"first_in_process", first_ms}, {"warm_process_median", median(plain)},
                         {"pch_warm_median", median(pch)}};
    std::printf("compile: first in process %.1f ms, later (no pch) median %.1f ms, with -pch warm median %.1f ms\n",
                first_ms, median(plain), median(pch));
  }

  // --- warm hit: fresh runtime + fresh store connection, cubin in SQLite ---------------------
  {
    RuntimeOptions o;
    o.mode = ResolverMode::embedded;
    o.cache_file = cache_file;
    auto warmer = Runtime::create(o).value();
    auto spec = KernelSpec::parse("rmsnorm(block=256,dtype=bf16,vec=8)").value();
    check(warmer->kernel(spec).status(), "warm the cache");
    std::vector<double> hit_ms, lookup_ms;
    for (int i = 0; i < 20; ++i) {
      auto t0 = Clock::now();
      auto rt = Runtime::create(o).value();
      check(rt->kernel(spec).status(), "warm hit");
      hit_ms.push_back(ms_since(t0));
      t0 = Clock::now();
      auto st = cache::Store::open(cache_file).value();
      jit::Builder b(st.get(), &Registry::global());
      check(b.get(spec, "sm_90a").status(), "lookup");
      lookup_ms.push_back(ms_since(t0));
    }
    out["warm_hit_ms"] = {{"open_lookup_verify_load_median", median(hit_ms)},
                          {"open_lookup_verify_median", median(lookup_ms)}};
    std::printf("warm hit (new runtime: open cache, lookup, verify, cuModuleLoadData): median %.3f ms; "
                "without module load %.3f ms\n",
                median(hit_ms), median(lookup_ms));
  }

  // --- copy bandwidth --------------------------------------------------------------------------
  double copy_gbs = 0;
  {
    const std::size_t n = std::size_t(1) << 30;
    Buf a(n), b(n);
    check(drv->memset_d8(a.p, 1, n), "memset");
    double ms = time_events([&](int) { check(drv->memcpy_dtod(b.p, a.p, n), "cuMemcpyDtoD"); }, 3, quick ? 5 : 20);
    copy_gbs = 2.0 * double(n) / (ms * 1e-3) / 1e9;
    out["copy_gbs"] = copy_gbs;
    std::printf("device-to-device copy 1 GiB: %.1f GB/s (read + write)\n", copy_gbs);
  }

  // --- RMSNorm bandwidth ------------------------------------------------------------------------
  RuntimeOptions o;
  o.mode = ResolverMode::embedded;
  o.cache_file = cache_file;
  auto rt = Runtime::create(o).value();
  std::mt19937 rng(std::random_device{}());
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (std::int64_t tokens : {1, 16, 512, 4096, 32768})
    for (std::int64_t hidden : {2048, 4096, 8192, 16384}) shapes.emplace_back(tokens, hidden);
  shapes.emplace_back(1, 65536);
  shapes.emplace_back(4096, 65536);
  if (quick) shapes = {{32768, 4096}, {1, 4096}};
  std::printf("\n%8s %7s %10s %10s %9s %9s %8s\n", "tokens", "hidden", "median_us", "GB/s", "%copy", "rel_err", "variant");
  nlohmann::json rows = nlohmann::json::array();
  for (auto [tokens, hidden] : shapes) {
    const std::int64_t elems = tokens * hidden;
    const std::size_t bytes = std::size_t(elems) * 2;
    // Enough input sets that one pass over all of them exceeds the 50-60 MB L2.
    const int sets = int(std::clamp<std::size_t>((256u << 20) / (2 * bytes + 1), 1, 64));
    std::vector<std::unique_ptr<Buf>> xs, ys;
    auto hx = random_bf16(elems, rng);
    auto hw = random_bf16(hidden, rng);
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<Buf>(bytes));
      ys.push_back(std::make_unique<Buf>(bytes));
      check(drv->memcpy_htod(xs.back()->p, hx.data(), bytes), "upload");
      check(drv->memset_d8(ys.back()->p, 0xFF, bytes), "poison");
    }
    Buf w(hidden * 2);
    check(drv->memcpy_htod(w.p, hw.data(), hidden * 2), "upload");
    auto view = [&](const Buf& b, std::initializer_list<std::int64_t> shape) {
      return TensorView::contiguous(b.get(), DType::bf16, shape, Device::cuda(0));
    };
    auto call = [&](int i) {
      const int s = i % sets;
      check(rms_norm(view(*xs[s], {tokens, hidden}), view(w, {hidden}), view(*ys[s], {tokens, hidden}), 1e-6, nullptr,
                     rt.get()),
            "rms_norm");
    };
    call(0);
    check(drv->ctx_synchronize(), "sync");
    // Correctness on up to 64 rows of set 0 before any timing.
    const std::int64_t check_rows = std::min<std::int64_t>(tokens, 64);
    std::vector<unsigned char> got(check_rows * hidden * 2), want(check_rows * hidden * 2);
    check(drv->memcpy_dtoh(got.data(), ys[0]->p, got.size()), "download");
    Problem p;
    p.dtype = DType::bf16;
    p.dims = {check_rows, hidden, hidden, hidden};
    p.scalars[0] = 1e-6;
    void* refb[3] = {hx.data(), hw.data(), want.data()};
    const Family& f = *Registry::global().find("rmsnorm");
    check(f.cpu_reference(f.heuristic(p), p, refb), "reference");
    double num = 0, den = 0;
    for (std::int64_t i = 0; i < check_rows * hidden; ++i) {
      double g = load_as_double(got.data(), DType::bf16, i), r = load_as_double(want.data(), DType::bf16, i);
      num += (g - r) * (g - r);
      den += r * r;
    }
    const double err = std::isnan(num) ? NAN : std::sqrt(num / den);
    if (!(err < 1e-2)) {
      std::fprintf(stderr, "rmsnorm %lldx%lld: relative error %.3g against the CPU reference\n", (long long)tokens,
                   (long long)hidden, err);
      return 1;
    }
    const double ms = time_events(call, 10, quick ? 20 : 100);
    const double gbs = double(2 * bytes + hidden * 2) / (ms * 1e-3) / 1e9;
    Problem hp = p;
    hp.dims = {tokens, hidden, hidden, hidden};
    const auto choice = families::rmsnorm_heuristic(hp);
    char variant[64];
    std::snprintf(variant, sizeof variant, "b%d v%d", choice.block, choice.vec);
    std::printf("%8lld %7lld %10.2f %10.1f %8.1f%% %9.2e %8s\n", (long long)tokens, (long long)hidden, ms * 1e3, gbs,
                100 * gbs / copy_gbs, err, variant);
    rows.push_back({{"tokens", tokens}, {"hidden", hidden}, {"median_us", ms * 1e3}, {"gbs", gbs},
                    {"fraction_of_copy", gbs / copy_gbs}, {"rel_err", err}, {"block", choice.block}, {"vec", choice.vec}});
  }
  out["rmsnorm_bf16"] = rows;

  // --- host cost of an op call versus a bare cuLaunchKernel ------------------------------------
  {
    const std::int64_t hidden = 4096;
    Buf x(hidden * 2), y(hidden * 2), w(hidden * 2);
    auto hx = random_bf16(hidden, rng);
    check(drv->memcpy_htod(x.p, hx.data(), hidden * 2), "upload");
    check(drv->memcpy_htod(w.p, hx.data(), hidden * 2), "upload");
    auto xv = TensorView::contiguous(x.get(), DType::bf16, {1, hidden}, Device::cuda(0));
    auto wv = TensorView::contiguous(w.get(), DType::bf16, {hidden}, Device::cuda(0));
    auto yv = TensorView::contiguous(y.get(), DType::bf16, {1, hidden}, Device::cuda(0));
    check(rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()), "op");
    Problem p;
    p.dtype = DType::bf16;
    p.dims = {1, hidden, hidden, hidden};
    p.scalars[0] = 1e-6;
    const Family& f = *Registry::global().find("rmsnorm");
    const Params params = f.heuristic(p);
    const Kernel* k = rt->kernel(KernelSpec{"rmsnorm", params}).value();
    void* bufs[3] = {x.get(), w.get(), y.get()};
    ArgPack args;
    f.pack_args(params, p, bufs, args);
    const LaunchGeometry g = f.geometry(params, p);
    const int n = quick ? 2000 : 20000;
    auto host_us = [&](auto&& fn) {
      std::vector<double> reps;
      for (int r = 0; r < 5; ++r) {
        check(drv->ctx_synchronize(), "sync");
        auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) fn();
        reps.push_back(ms_since(t0) * 1e3 / n);
        check(drv->ctx_synchronize(), "sync");
      }
      return median(reps);
    };
    const double bare = host_us([&] {
      drv->launch_kernel(static_cast<CUfunction>(k->function), g.grid.x, 1, 1, g.block.x, 1, 1, 0, nullptr,
                         args.pointers(), nullptr);
    });
    const double op = host_us([&] { (void)rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()); });
    const double gpu_us = 1e3 * time_events([&](int) { (void)rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()); }, 50, 200);
    out["host_us"] = {{"bare_cuLaunchKernel", bare}, {"op_call", op}, {"ratio", op / bare}, {"gpu_us_1x4096", gpu_us}};
    std::printf("\nhost cost per call, 1x4096 bf16: bare cuLaunchKernel %.2f us, kiln::rms_norm %.2f us (%.2fx); "
                "event-timed %.2f us\n",
                bare, op, op / bare, gpu_us);
  }

  // --- daemon round trips -----------------------------------------------------------------------
  if (!kilnd.empty()) {
    const std::string sock = cache_dir + "/run/kilnd.sock";
    pid_t pid = fork();
    if (pid == 0) {
      setenv("KILN_SOCKET", sock.c_str(), 1);
      setenv("KILN_CACHE_DIR", (cache_dir + "/daemon-cache").c_str(), 1);
      // The daemon's log goes to a file: an orphaned daemon must not hold our stdout open.
      const std::string log = cache_dir + "/kilnd.log";
      if (FILE* f = std::fopen(log.c_str(), "w")) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      execl(kilnd.c_str(), "kilnd", nullptr);
      _exit(127);
    }
    std::unique_ptr<client::DaemonClient> c;
    for (int i = 0; i < 100 && !c; ++i) {
      auto r = client::DaemonClient::connect(sock);
      if (r.ok()) c = std::move(r).value();
      else std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!c) {
      std::fprintf(stderr, "kilnd did not start\n");
      kill(pid, SIGKILL);
      return 1;
    }
    auto spec = KernelSpec::parse("rmsnorm(block=256,dtype=bf16,vec=8)").value();
    auto t0 = Clock::now();
    check(c->get_kernel(spec, "sm_90a").status(), "daemon cold get");
    const double cold = ms_since(t0);
    t0 = Clock::now();
    check(c->get_kernel(KernelSpec::parse("rmsnorm(block=128,dtype=f16,vec=8)").value(), "sm_90a").status(), "daemon");
    const double second = ms_since(t0);
    std::vector<double> rt_us;
    for (int i = 0; i < 1000; ++i) {
      t0 = Clock::now();
      check(c->get_kernel(spec, "sm_90a").status(), "daemon warm get");
      rt_us.push_back(ms_since(t0) * 1e3);
    }
    out["daemon"] = {{"cold_get_ms", cold}, {"second_compile_get_ms", second},
                     {"warm_get_p50_us", percentile(rt_us, 0.5)}, {"warm_get_p99_us", percentile(rt_us, 0.99)}};
    std::printf("daemon: first get (compile) %.1f ms, second variant (PCH warm) %.1f ms, cached get p50 %.0f us "
                "p99 %.0f us\n",
                cold, second, percentile(rt_us, 0.5), percentile(rt_us, 0.99));
    if (!c->shutdown().ok()) kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
  }

  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  std::error_code ec;
  std::filesystem::remove_all(cache_dir, ec);
  return 0;
}
