#include "client/workspace.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "jit/driver.h"

namespace kiln::client {

namespace {

struct Workspace {
  CUdeviceptr ptr = 0;
  std::int64_t elements = 0;
};

std::mutex g_mu;
std::map<std::pair<CUcontext, Stream>, Workspace> g_workspaces;

}  // namespace

Result<void*> stream_workspace(int ordinal, Stream stream, std::int64_t elements) {
  KILN_ASSIGN_OR_RETURN(CUcontext ctx, jit::current_context(ordinal));
  std::lock_guard lock(g_mu);
  Workspace& ws = g_workspaces[{ctx, stream}];
  if (ws.elements >= elements) return reinterpret_cast<void*>(ws.ptr);
  KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
  // At least doubling, so a slowly growing batch reallocates only logarithmically often.
  const std::int64_t grown = std::max(elements, 2 * ws.elements);
  if (ws.ptr) {
    KILN_TRY(d->check(d->stream_synchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize"));
    KILN_TRY(d->check(d->mem_free(ws.ptr), "cuMemFree"));
    ws = Workspace{};
  }
  KILN_TRY(d->check(d->mem_alloc(&ws.ptr, std::size_t(grown) * sizeof(float)), "cuMemAlloc"));
  ws.elements = grown;
  return reinterpret_cast<void*>(ws.ptr);
}

}  // namespace kiln::client
