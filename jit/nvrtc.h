// NVRTC, opened with dlopen so that binaries start where it is missing.
//
// Search order: $KILN_NVRTC_PATH (a file), then libnvrtc.so.13 / libnvrtc.so on the loader path,
// then the usual CUDA locations. A missing library is Code::unavailable with a message naming what
// was tried and how to point kiln at it.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "kiln/status.h"

namespace kiln::jit {

class TemplateSet;

struct CompileRequest {
  std::string source;
  std::string name_expression;
  std::vector<std::string> options;  // family options; -arch is added from `arch`
  std::string arch;                  // exact, e.g. sm_90a
  bool use_pch = false;              // NVRTC's automatic precompiled headers (-pch)
  const TemplateSet* templates = nullptr;  // null: TemplateSet::active()
  // Headers `templates` lacks that the source needs (a plugin's own); not owned.
  const std::map<std::string, std::string>* overlay = nullptr;
};

struct CompileOutput {
  std::string cubin;
  std::string lowered_name;
  std::string log;
  std::vector<std::string> options;  // exactly what NVRTC got
  double compile_ms = 0;
  int registers = -1;
  int shared_bytes = -1;
  int spill_bytes = -1;
};

class Nvrtc {
 public:
  // The loaded library, or why it could not be loaded. Thread-safe; loads once.
  static Result<Nvrtc*> get();

  // "13.0"
  std::string version() const;
  // Compiles to a cubin for req.arch with the active template set as in-memory headers. A rejected
  // program is Code::compile_error whose details hold the log and the options.
  Result<CompileOutput> compile(const CompileRequest& req) const;

  // The options that always go to NVRTC (besides -arch and the family's).
  static const std::vector<std::string>& base_options();

 private:
  Nvrtc() = default;
  struct Api;
  Api* api_ = nullptr;
  int major_ = 0, minor_ = 0;
};

// Removes the precompiled-header directories (kiln-pch-<pid>-*, under $TMPDIR or /tmp) of
// processes that are gone. Each compiling process removes its own at exit; kilnd calls this after
// reaping a compile worker it had to kill.
void remove_dead_pch_dirs();

}  // namespace kiln::jit
