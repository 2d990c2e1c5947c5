// One tuning candidate on the GPU: its module loaded into the current context, and one launch of
// its kernel on a problem's buffers (on the default stream, not synchronized).
#pragma once

#include <cuda.h>

#include <memory>
#include <vector>

#include "jit/builder.h"
#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

// A loaded candidate; its module is unloaded on scope exit.
struct LoadedCandidate {
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  ~LoadedCandidate();
};

// Loads the artifact's cubin, finds its kernel and lets it take the device's dynamic shared memory.
Result<std::unique_ptr<LoadedCandidate>> load_candidate(const Artifact& artifact);

Status launch_candidate(const Family& f, const Params& params, const Problem& p, CUfunction fn,
                        const std::vector<void*>& bufs);

}  // namespace kiln::jit
