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

// Whether `stream` is being captured; an unknown answer (no cuStreamIsCapturing) is no.
Result<bool> capturing(const jit::Driver& d, Stream stream) {
  if (!d.stream_is_capturing) return false;
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  KILN_TRY(d.check(d.stream_is_capturing(static_cast<CUstream>(stream), &st), "cuStreamIsCapturing"));
  return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

}  // namespace

Result<StreamWorkspace> StreamWorkspace::get(int ordinal, Stream stream, std::int64_t elements) {
  StreamWorkspace out;
  out.stream_ = stream;
  if (elements <= 0) return out;
  KILN_ASSIGN_OR_RETURN(CUcontext ctx, jit::current_context(ordinal));
  KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
  KILN_ASSIGN_OR_RETURN(const bool captured, capturing(*d, stream));
  const std::size_t bytes = std::size_t(elements) * sizeof(float);
  if (captured) {
    if (!d->mem_alloc_async || !d->mem_free_async)
      return unavailable("a workspace inside CUDA graph capture needs cuMemAllocAsync (CUDA 11.2 or later)");
    CUdeviceptr p = 0;
    KILN_TRY(d->check(d->mem_alloc_async(&p, bytes, static_cast<CUstream>(stream)), "cuMemAllocAsync"));
    out.data_ = reinterpret_cast<void*>(p);
    out.graph_owned_ = true;
    return out;
  }
  std::lock_guard lock(g_mu);
  Workspace& ws = g_workspaces[{ctx, stream}];
  if (ws.elements < elements) {
    // At least doubling, so a slowly growing batch reallocates only logarithmically often.
    const std::int64_t grown = std::max(elements, 2 * ws.elements);
    if (ws.ptr) {
      KILN_TRY(d->check(d->stream_synchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize"));
      KILN_TRY(d->check(d->mem_free(ws.ptr), "cuMemFree"));
      ws = Workspace{};
    }
    KILN_TRY(d->check(d->mem_alloc(&ws.ptr, std::size_t(grown) * sizeof(float)), "cuMemAlloc"));
    ws.elements = grown;
  }
  out.data_ = reinterpret_cast<void*>(ws.ptr);
  return out;
}

StreamWorkspace& StreamWorkspace::operator=(StreamWorkspace&& o) noexcept {
  if (this != &o) {
    this->~StreamWorkspace();
    data_ = std::exchange(o.data_, nullptr);
    stream_ = o.stream_;
    graph_owned_ = std::exchange(o.graph_owned_, false);
  }
  return *this;
}

StreamWorkspace::~StreamWorkspace() {
  if (!graph_owned_ || !data_) return;
  // A failure here also fails the capture, which reports it when it ends.
  if (auto d = jit::Driver::get(); d.ok())
    (void)(*d)->mem_free_async(reinterpret_cast<CUdeviceptr>(data_), static_cast<CUstream>(stream_));
  data_ = nullptr;
  graph_owned_ = false;
}

}  // namespace kiln::client
