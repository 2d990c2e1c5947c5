// GPU benchmark for the foundation: copy bandwidth, RMSNorm bandwidth over LLM shapes, host cost of
// an op call against a bare cuLaunchKernel, compile and warm-hit latencies, daemon round trips.
//
//   kiln_bench_gpu [--json FILE] [--kilnd PATH] [--quick] [--only SECTION[,SECTION...]]
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
#include <filesystem>
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
#include "jit/device_info.h"
#include "jit/driver.h"
#include "jit/nvrtc.h"
#include "bench/gpu_harness.h"
#include "kiln/ops.h"

namespace {

using namespace kiln;
using namespace kiln::bench;
using Clock = std::chrono::steady_clock;
const jit::Driver* drv = nullptr;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, kilnd, only;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--kilnd" && i + 1 < argc) kilnd = argv[++i];
    else if (a == "--quick") quick = true;
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: kiln_bench_gpu [--json FILE] [--kilnd PATH] [--quick] [--only SECTION]\n");
      return 2;
    }
  }
  auto d = jit::Driver::get();
  if (!d.ok()) {
    std::fprintf(stderr, "kiln_bench_gpu: %s\n", d.status().to_string().c_str());
    return 1;
  }
  drv = *d;
  check(jit::current_context().status(), "context");
  CUdevice dev;
  check(drv->ctx_get_device(&dev), "cuCtxGetDevice");
  auto info = jit::device_info(int(dev));
  check(info.status(), "device");
  const char* name = (*info)->name.c_str();
  const std::string arch = (*info)->arch;
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
    auto a = cold.get(KernelSpec::parse("rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)").value(), arch);
    check(a.status(), "cold compile");
    double first_ms = ms_since(t0);
    std::vector<double> plain, pch;
    jit::Builder nopch(nullptr, &Registry::global());
    jit::BuilderOptions po;
    po.use_pch = true;
    jit::Builder withpch(nullptr, &Registry::global(), po);
    (void)withpch.get(KernelSpec::parse("rmsnorm(block=64,bulk=0,dtype=f32,row=0,vec=1)").value(), arch);  // creates the PCH
    for (const char* s : {"rmsnorm(block=128,bulk=0,dtype=bf16,row=0,vec=8)", "rmsnorm(block=512,bulk=0,dtype=f16,row=0,vec=4)",
                          "rmsnorm(block=1024,bulk=0,dtype=f32,row=0,vec=4)", "rmsnorm(block=64,bulk=0,dtype=bf16,row=0,vec=2)",
                          "rmsnorm(block=256,bulk=0,dtype=f16,row=0,vec=8)"}) {
      auto spec = KernelSpec::parse(s).value();
      t0 = Clock::now();
      check(nopch.get(spec, arch).status(), "compile");
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
    auto spec = KernelSpec::parse("rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)").value();
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
      check(b.get(spec, arch).status(), "lookup");
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
    DeviceBuffer a(n), b(n);
    check(drv->memset_d8(a.ptr, 1, n), "memset");
    double ms = time_events([&](int) { check(drv->memcpy_dtod(b.ptr, a.ptr, n), "cuMemcpyDtoD"); }, 3, quick ? 5 : 20);
    copy_gbs = 2.0 * double(n) / (ms * 1e-3) / 1e9;
    out["copy_gbs"] = copy_gbs;
    std::printf("device-to-device copy 1 GiB: %.1f GB/s (read + write)\n", copy_gbs);
    // The same copy at the sizes of one 4096-token tensor and below: what the memory system gives
    // a single short launch (the ramp and tail that every kernel of that size pays as well).
    nlohmann::json sizes = nlohmann::json::object();
    std::printf("copy of n bytes (read n + write n), %% of the 1 GiB figure:");
    for (std::size_t mb : {4, 16, 32, 64, 128, 256}) {
      const std::size_t bytes = mb << 20;
      double t = time_events([&](int i) {
        const std::size_t off = std::size_t(i % 2) * (n / 2);  // two source/destination pairs
        check(drv->memcpy_dtod_async(b.ptr + off, a.ptr + off, bytes, nullptr), "cuMemcpyDtoDAsync");
      }, 3, quick ? 10 : 30);
      const double gbs = 2.0 * double(bytes) / (t * 1e-3) / 1e9;
      sizes[std::to_string(mb) + "MiB"] = gbs;
      std::printf(" %zu MiB %.1f%%", mb, 100 * gbs / copy_gbs);
    }
    std::printf("\n");
    out["copy_gbs_by_size"] = sizes;
  }

  // A prewarmed cache (KILN_GPU_TEST_CACHE, the file the GPU tests start from) spares the sections
  // below compiling their variants on the device; the compile and warm-hit figures above ran
  // without it.
  if (const char* seed = std::getenv("KILN_GPU_TEST_CACHE"); seed && *seed) {
    std::error_code ec;
    std::filesystem::copy_file(seed, cache_file, std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) std::printf("KILN_GPU_TEST_CACHE %s not copied (%s): compiling on demand\n", seed, ec.message().c_str());
  }
  RuntimeOptions o;
  o.mode = ResolverMode::embedded;
  o.cache_file = cache_file;
  auto rt = Runtime::create(o).value();
  std::mt19937 rng(std::random_device{}());

  // --- host cost of an op call versus a bare cuLaunchKernel ------------------------------------
  {
    const std::int64_t hidden = 4096;
    DeviceBuffer x(hidden * 2), y(hidden * 2), w(hidden * 2);
    auto hx = random_values(DType::bf16, hidden, rng);
    x.upload(hx.data());
    w.upload(hx.data());
    auto xv = TensorView::contiguous(x.get(), DType::bf16, {1, hidden}, Device::cuda(0));
    auto wv = TensorView::contiguous(w.get(), DType::bf16, {hidden}, Device::cuda(0));
    auto yv = TensorView::contiguous(y.get(), DType::bf16, {1, hidden}, Device::cuda(0));
    check(rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()), "op");
    const Problem p = Problem::of(DType::bf16, 16,
                                  families::RmsNormProblem{
                                      .rows = 1, .cols = hidden, .x_row_stride = hidden, .y_row_stride = hidden, .eps = 1e-6});
    const Family& f = *Registry::global().find("rmsnorm");
    const Params params = f.heuristic(p);
    const Kernel* k = rt->kernel(KernelSpec{"rmsnorm", params}).value();
    void* bufs[3] = {x.get(), w.get(), y.get()};
    ArgPack args;
    f.pack_args(params, p, bufs, args);
    const LaunchGeometry g = f.geometry(params, p);
    const int n = quick ? 2000 : 20000;
    // Host figures drift within a run (CPU clocks, the driver's queues): measured one after the
    // other, a bare launch once came out dearer than Runtime::run, which makes one. So every
    // figure is taken in rounds, interleaved, each round measuring all of them in turn; a figure
    // is the median of its rounds, and the ratio the median of the rounds' own ratios (paired).
    const std::vector<std::function<void()>> calls = {
        [&] {  // bare cuLaunchKernel of the op's kernel
          drv->launch_kernel(static_cast<CUfunction>(k->function), g.grid.x, 1, 1, g.block.x, 1, 1, 0, nullptr,
                             args.pointers(), nullptr);
        },
        [&] { (void)rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()); },
        // Where the difference goes: the runtime's launch path alone (no validation), and the
        // pointer checks the op makes (one cuPointerGetAttributes per tensor).
        [&] { (void)rt->run(f, p, bufs, nullptr); },
        [&] {
          CUcontext c;
          drv->ctx_get_current(&c);
        },
        [&] {
          for (void* b : bufs) {
            unsigned mem_type = 0;
            int ordinal = -1;
            CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
            void* values[2] = {&mem_type, &ordinal};
            drv->pointer_get_attributes(2, attrs, values, reinterpret_cast<CUdeviceptr>(b));
          }
        }};
    constexpr int k_rounds = 10;
    std::vector<std::vector<double>> rounds(calls.size());
    std::vector<double> ratios;
    for (int r = 0; r < k_rounds; ++r) {
      for (std::size_t c = 0; c < calls.size(); ++c) rounds[c].push_back(host_us_per_call(calls[c], n / k_rounds));
      ratios.push_back(rounds[1].back() / rounds[0].back());
    }
    const double bare = median(rounds[0]), op = median(rounds[1]), run_only = median(rounds[2]),
                 ctx_query = median(rounds[3]), ptr_checks = median(rounds[4]), ratio = median(ratios);
    // An empty kernel, compiled and loaded here: the floor for GPU time and for launch cost.
    jit::CompileRequest req{"extern \"C\" __global__ void kiln_empty() {}\n", "kiln_empty", {}, arch, false, nullptr};
    auto empty = jit::Nvrtc::get().value()->compile(req);
    check(empty.status(), "empty kernel");
    CUmodule mod;
    CUfunction empty_fn;
    check(drv->module_load_data(&mod, empty->cubin.data()), "cuModuleLoadData");
    check(drv->module_get_function(&empty_fn, mod, empty->lowered_name.c_str()), "cuModuleGetFunction");
    auto launch_empty = [&] { drv->launch_kernel(empty_fn, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr); };
    const double empty_host = host_us_per_call(launch_empty, n);
    const double empty_gpu = 1e3 * time_events([&](int) { launch_empty(); }, 50, 200);
    const double gpu_us = 1e3 * time_events([&](int) { (void)rms_norm(xv, wv, yv, 1e-6, nullptr, rt.get()); }, 50, 200);
    out["host_us"] = {{"bare_cuLaunchKernel_same_kernel", bare}, {"op_call", op}, {"ratio", ratio},
                      {"empty_kernel_launch", empty_host}, {"runtime_run_only", run_only},
                      {"three_pointer_checks", ptr_checks}, {"cuCtxGetCurrent", ctx_query}};
    out["gpu_us"] = {{"empty_kernel", empty_gpu}, {"rmsnorm_1x4096", gpu_us}};
    std::printf("\nhost cost per call (handle cached), 1x4096 bf16: bare cuLaunchKernel %.2f us, kiln::rms_norm %.2f us "
                "(%.2fx); empty-kernel launch %.2f us\n",
                bare, op, ratio, empty_host);
    std::printf("  of which: Runtime::run alone %.2f us; three cuPointerGetAttributes %.2f us; cuCtxGetCurrent %.2f us\n",
                run_only, ptr_checks, ctx_query);
    std::printf("GPU time (events, median): empty kernel %.2f us, rms_norm 1x4096 %.2f us (%.2fx)\n", empty_gpu, gpu_us,
                gpu_us / empty_gpu);
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
    auto spec = KernelSpec::parse("rmsnorm(block=256,bulk=0,dtype=bf16,row=0,vec=8)").value();
    auto t0 = Clock::now();
    check(c->get_kernel(spec, arch).status(), "daemon cold get");
    const double cold = ms_since(t0);
    t0 = Clock::now();
    check(c->get_kernel(KernelSpec::parse("rmsnorm(block=128,bulk=0,dtype=f16,row=0,vec=8)").value(), arch).status(), "daemon");
    const double second = ms_since(t0);
    std::vector<double> rt_us;
    for (int i = 0; i < 1000; ++i) {
      t0 = Clock::now();
      check(c->get_kernel(spec, arch).status(), "daemon warm get");
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

  Context ctx;
  ctx.driver = drv;
  ctx.runtime = rt.get();
  ctx.rng.seed(std::random_device{}());
  ctx.quick = quick;
  ctx.copy_gbs = copy_gbs;
  ctx.out = &out;
  const int sections_rc = run_sections(ctx, only);

  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  std::error_code ec;
  std::filesystem::remove_all(cache_dir, ec);
  return sections_rc;
}
