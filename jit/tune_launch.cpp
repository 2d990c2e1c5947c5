#include "jit/tune_launch.h"

#include <span>

#include "jit/driver.h"

namespace kiln::jit {

LoadedCandidate::~LoadedCandidate() {
  if (module) Driver::get().value()->module_unload(module);
}

Result<std::unique_ptr<LoadedCandidate>> load_candidate(const Artifact& artifact) {
  KILN_ASSIGN_OR_RETURN(const Driver* d, Driver::get());
  auto l = std::make_unique<LoadedCandidate>();
  KILN_TRY(d->check(d->module_load_data(&l->module, artifact.entry.cubin.data()), "cuModuleLoadData"));
  KILN_TRY(d->check(d->module_get_function(&l->function, l->module, artifact.entry.lowered_name.c_str()),
                    "cuModuleGetFunction"));
  KILN_TRY(allow_dynamic_smem(l->function));
  return l;
}

Status launch_candidate(const Family& f, const Params& params, const Problem& p, CUfunction fn,
                        const std::vector<void*>& bufs) {
  const Driver* d = Driver::get().value();
  const LaunchGeometry g = f.geometry(params, p);
  ArgPack args;
  f.pack_args(params, p, std::span<void* const>(bufs.data(), bufs.size()), args);
  if (args.overflow()) return internal_error("kernel arguments exceed the argument block");
  KILN_TRY(encode_tensor_maps(args));
  return d->check(d->launch_kernel(fn, g.grid.x, g.grid.y, g.grid.z, g.block.x, g.block.y, g.block.z, g.shared_bytes,
                                   nullptr, args.pointers(), nullptr),
                  "cuLaunchKernel");
}

}  // namespace kiln::jit
