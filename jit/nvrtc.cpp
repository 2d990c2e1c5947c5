#include "jit/nvrtc.h"

#include <dlfcn.h>
#include <nvrtc.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <regex>
#include <string>

#include "jit/templates.h"

namespace kiln::jit {

struct Nvrtc::Api {
  void* lib = nullptr;
  decltype(&::nvrtcVersion) version;
  decltype(&::nvrtcGetErrorString) error_string;
  decltype(&::nvrtcCreateProgram) create;
  decltype(&::nvrtcDestroyProgram) destroy;
  decltype(&::nvrtcAddNameExpression) add_name;
  decltype(&::nvrtcCompileProgram) compile;
  decltype(&::nvrtcGetProgramLogSize) log_size;
  decltype(&::nvrtcGetProgramLog) log;
  decltype(&::nvrtcGetCUBINSize) cubin_size;
  decltype(&::nvrtcGetCUBIN) cubin;
  decltype(&::nvrtcGetLoweredName) lowered_name;
};

namespace {

const char* const k_candidates[] = {
    "libnvrtc.so.13",
    "libnvrtc.so",
    "/usr/local/cuda/lib64/libnvrtc.so.13",
    "/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.13",
    "/usr/local/cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.13",
    "/usr/local/cuda/lib64/libnvrtc.so",
};

template <class F>
bool load_symbol(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

int parse_int(const std::string& log, const std::regex& re) {
  std::smatch m;
  if (std::regex_search(log, m, re)) return std::stoi(m[1].str());
  return -1;
}

namespace fs = std::filesystem;

// NVRTC's automatic PCH (-pch) writes an 8 MB header image into /tmp/__nvrtc_auto_pch_<pid>_<n>
// and never removes it: every compiling process (kiln prewarm, kiln tune, each of kilnd's
// compile workers, every test) left one behind, and a day of them filled a 252 GB disk. kiln
// points -pch-dir at a directory of its own instead, one per process, removed when the process
// exits normally; directories of processes that died without cleaning up are removed by the next
// process that creates one.
constexpr const char* k_pch_prefix = "kiln-pch-";

fs::path temp_root() {
  const char* t = std::getenv("TMPDIR");
  return fs::path(t && *t ? t : "/tmp");
}

// Removes kiln-pch-<pid>-* directories whose process is gone.
void remove_stale_pch_dirs(const fs::path& root) {
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(k_pch_prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + std::char_traits<char>::length(k_pch_prefix), nullptr, 10);
    if (pid <= 0 || (::kill(pid_t(pid), 0) != 0 && errno == ESRCH)) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
    }
  }
}

struct PchDir {
  std::mutex mu;
  pid_t owner = 0;
  std::string path;
  ~PchDir() {
    // Only the process that made it removes it (a forked child inherits this object).
    if (owner == ::getpid() && !path.empty()) {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  }
};

PchDir& pch_state() {
  static PchDir d;
  return d;
}

// This process's PCH directory, created on first use; empty when it cannot be made (then NVRTC
// compiles without PCH).
std::string pch_dir() {
  PchDir& d = pch_state();
  std::lock_guard lock(d.mu);
  if (d.owner == ::getpid()) return d.path;
  const fs::path root = temp_root();
  remove_stale_pch_dirs(root);
  std::string tmpl = (root / (std::string(k_pch_prefix) + std::to_string(::getpid()) + "-XXXXXX")).string();
  d.owner = ::getpid();
  d.path = ::mkdtemp(tmpl.data()) ? tmpl : std::string();
  return d.path;
}

}  // namespace

void remove_dead_pch_dirs() { remove_stale_pch_dirs(temp_root()); }

const std::vector<std::string>& Nvrtc::base_options() {
  static const std::vector<std::string> opts = {"-std=c++17", "-default-device", "-Xptxas=-v"};
  return opts;
}

Result<Nvrtc*> Nvrtc::get() {
  static std::once_flag once;
  static Nvrtc* instance = nullptr;
  static Status failure;
  std::call_once(once, [] {
    std::vector<std::string> tried;
    void* lib = nullptr;
    if (const char* p = std::getenv("KILN_NVRTC_PATH"); p && *p) {
      lib = dlopen(p, RTLD_NOW | RTLD_LOCAL);
      tried.push_back(std::string(p) + " (KILN_NVRTC_PATH): " + (lib ? "ok" : dlerror()));
    }
    for (const char* c : k_candidates) {
      if (lib) break;
      lib = dlopen(c, RTLD_NOW | RTLD_LOCAL);
      if (!lib) tried.push_back(std::string(c) + ": " + dlerror());
    }
    if (!lib) {
      std::string details;
      for (auto& t : tried) details += "  tried " + t + "\n";
      failure = unavailable(
          "NVRTC (libnvrtc.so.13) could not be loaded; install the CUDA toolkit's NVRTC or set "
          "KILN_NVRTC_PATH to the library file (or add its folder to LD_LIBRARY_PATH)",
          details);
      return;
    }
    auto* api = new Api;
    api->lib = lib;
    bool ok = load_symbol(lib, "nvrtcVersion", api->version) && load_symbol(lib, "nvrtcGetErrorString", api->error_string) &&
              load_symbol(lib, "nvrtcCreateProgram", api->create) && load_symbol(lib, "nvrtcDestroyProgram", api->destroy) &&
              load_symbol(lib, "nvrtcAddNameExpression", api->add_name) &&
              load_symbol(lib, "nvrtcCompileProgram", api->compile) &&
              load_symbol(lib, "nvrtcGetProgramLogSize", api->log_size) && load_symbol(lib, "nvrtcGetProgramLog", api->log) &&
              load_symbol(lib, "nvrtcGetCUBINSize", api->cubin_size) && load_symbol(lib, "nvrtcGetCUBIN", api->cubin) &&
              load_symbol(lib, "nvrtcGetLoweredName", api->lowered_name);
    if (!ok) {
      failure = unavailable("the loaded NVRTC lacks a required symbol (need CUDA 12 or newer)", dlerror() ? dlerror() : "");
      delete api;
      return;
    }
    auto* n = new Nvrtc;
    n->api_ = api;
    api->version(&n->major_, &n->minor_);
    instance = n;
  });
  if (!instance) return failure;
  return instance;
}

std::string Nvrtc::version() const { return std::to_string(major_) + "." + std::to_string(minor_); }

Result<CompileOutput> Nvrtc::compile(const CompileRequest& req) const {
  const TemplateSet& templates = req.templates ? *req.templates : TemplateSet::active();
  KILN_ASSIGN_OR_RETURN(auto closure, templates.closure(req.source, req.overlay));
  std::vector<const char*> header_src, header_names;
  for (const auto& h : closure.headers) {
    header_names.push_back(h.c_str());
    header_src.push_back(templates.find(h, req.overlay)->c_str());
  }

  CompileOutput out;
  out.options = base_options();
  out.options.push_back("-arch=" + req.arch);
  for (const auto& o : req.options) out.options.push_back(o);
  if (req.use_pch) {
    if (const std::string dir = pch_dir(); !dir.empty()) {
      out.options.push_back("-pch");
      out.options.push_back("-pch-dir=" + dir);
    }
  }
  std::vector<const char*> opts;
  for (const auto& o : out.options) opts.push_back(o.c_str());

  auto t0 = std::chrono::steady_clock::now();
  nvrtcProgram prog = nullptr;
  nvrtcResult rc = api_->create(&prog, req.source.c_str(), "kiln_kernel.cu", int(header_src.size()),
                                header_src.data(), header_names.data());
  if (rc != NVRTC_SUCCESS) return Status(Code::internal, std::string("nvrtcCreateProgram: ") + api_->error_string(rc));
  struct Guard {
    const Api* api;
    nvrtcProgram* p;
    ~Guard() { api->destroy(p); }
  } guard{api_, &prog};

  rc = api_->add_name(prog, req.name_expression.c_str());
  if (rc != NVRTC_SUCCESS)
    return Status(Code::internal, std::string("nvrtcAddNameExpression: ") + api_->error_string(rc));
  nvrtcResult compile_rc = api_->compile(prog, int(opts.size()), opts.data());
  std::size_t log_size = 0;
  api_->log_size(prog, &log_size);
  out.log.resize(log_size);
  if (log_size > 0) {
    api_->log(prog, out.log.data());
    while (!out.log.empty() && out.log.back() == '\0') out.log.pop_back();
  }
  if (compile_rc != NVRTC_SUCCESS) {
    std::string details = "options:";
    for (const auto& o : out.options) details += " " + o;
    details += "\nname expression: " + req.name_expression + "\nlog:\n" + out.log;
    return Status(Code::compile_error, std::string("NVRTC failed to compile ") + req.name_expression + ": " +
                                           api_->error_string(compile_rc),
                  details);
  }
  std::size_t cubin_size = 0;
  api_->cubin_size(prog, &cubin_size);
  out.cubin.resize(cubin_size);
  api_->cubin(prog, out.cubin.data());
  const char* lowered = nullptr;
  rc = api_->lowered_name(prog, req.name_expression.c_str(), &lowered);
  if (rc != NVRTC_SUCCESS || !lowered)
    return Status(Code::internal, "NVRTC gave no lowered name for " + req.name_expression);
  out.lowered_name = lowered;
  out.compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  static const std::regex k_regs("Used ([0-9]+) registers");
  static const std::regex k_smem("([0-9]+) bytes smem");
  static const std::regex k_spill("([0-9]+) bytes spill stores");
  out.registers = parse_int(out.log, k_regs);
  out.shared_bytes = parse_int(out.log, k_smem);
  if (out.shared_bytes < 0 && out.registers >= 0) out.shared_bytes = 0;  // ptxas omits smem when zero
  out.spill_bytes = parse_int(out.log, k_spill);
  return out;
}

}  // namespace kiln::jit
