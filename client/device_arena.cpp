#include "kiln/device_arena.h"

#include <string>
#include <utility>

#include "jit/driver.h"

namespace kiln {
namespace {

CUstream as_stream(void* s) { return static_cast<CUstream>(s); }
CUevent as_event(void* e) { return static_cast<CUevent>(e); }

}  // namespace

Result<std::unique_ptr<DeviceArena>> DeviceArena::create(std::uint64_t capacity, std::uint64_t alignment,
                                                         std::int32_t max_allocations) {
  KILN_ASSIGN_OR_RETURN(ArenaAllocator ranges, ArenaAllocator::create(capacity, alignment, max_allocations));
  KILN_ASSIGN_OR_RETURN(const jit::Driver* d, jit::Driver::get());
  KILN_ASSIGN_OR_RETURN(CUcontext ctx, jit::current_context());
  CUdeviceptr base = 0;
  KILN_TRY(d->check(d->mem_alloc(&base, ranges.capacity()), "cuMemAlloc (the arena's reservation)"));
  return std::unique_ptr<DeviceArena>(new DeviceArena(std::move(ranges), std::uint64_t(base), ctx));
}

DeviceArena::DeviceArena(ArenaAllocator ranges, std::uint64_t base, void* context)
    : ranges_(std::move(ranges)), base_(base), context_(context) {}

DeviceArena::~DeviceArena() {
  const jit::Driver* d = jit::Driver::get().value();
  CUcontext current = nullptr;
  d->ctx_get_current(&current);
  if (current != static_cast<CUcontext>(context_)) d->ctx_set_current(static_cast<CUcontext>(context_));
  for (const Pending& p : pending_) d->event_synchronize(as_event(p.event));
  for (void* e : events_) d->event_destroy(as_event(e));
  d->mem_free(CUdeviceptr(base_));
  if (current && current != static_cast<CUcontext>(context_)) d->ctx_set_current(current);
}

Status DeviceArena::refuse_capture(Stream stream, const char* what) const {
  const jit::Driver* d = jit::Driver::get().value();
  if (!d->stream_is_capturing) return {};
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  KILN_TRY(d->check(d->stream_is_capturing(as_stream(stream), &status), "cuStreamIsCapturing"));
  if (status != CU_STREAM_CAPTURE_STATUS_NONE)
    return invalid_argument(std::string("device arena: ") + what +
                            " on a stream that is being captured into a CUDA graph (the graph's replays would "
                            "reuse memory the arena hands out again)");
  return {};
}

void DeviceArena::release(std::size_t i) {
  (void)ranges_.free(pending_[i].offset);
  spare_events_.push_back(pending_[i].event);
  pending_.erase(pending_.begin() + std::ptrdiff_t(i));
}

Result<void*> DeviceArena::event() {
  if (!spare_events_.empty()) {
    void* e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  const jit::Driver* d = jit::Driver::get().value();
  CUevent e = nullptr;
  KILN_TRY(d->check(d->event_create(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate"));
  events_.push_back(e);
  return static_cast<void*>(e);
}

Result<void*> DeviceArena::allocate(std::uint64_t size, Stream stream) {
  if (size == 0) return invalid_argument("device arena: allocate needs a size above 0");
  KILN_TRY(refuse_capture(stream, "allocate"));
  const jit::Driver* d = jit::Driver::get().value();
  std::lock_guard lock(mu_);
  // Frees of this stream come back at once; those of others whose work has finished.
  for (std::size_t i = pending_.size(); i-- > 0;) {
    if (pending_[i].stream == stream) {
      ++same_stream_reuses_;
      release(i);
      continue;
    }
    const CUresult q = d->event_query(as_event(pending_[i].event));
    if (q == CUDA_SUCCESS) release(i);
    else if (q != CUDA_ERROR_NOT_READY) return d->check(q, "cuEventQuery (a pending free)");
  }
  auto off = ranges_.allocate(size);
  // Nothing fits: take other streams' pending frees, oldest first, each after this stream waits for
  // the work queued before it.
  while (!off.ok() && off.status().code() == Code::unavailable && !pending_.empty()) {
    KILN_TRY(d->check(d->stream_wait_event(as_stream(stream), as_event(pending_.front().event), 0),
                      "cuStreamWaitEvent (reusing another stream's free)"));
    ++cross_stream_waits_;
    release(0);
    off = ranges_.allocate(size);
  }
  if (!off.ok()) {
    const ArenaStats s = ranges_.stats();
    return Status{off.status().code(),
                  "device arena: no free range of " + std::to_string(size) + " bytes (" + std::to_string(s.in_use) +
                      " of " + std::to_string(s.capacity) + " in use, the largest free range " +
                      std::to_string(s.largest_free) + ", " + std::to_string(s.allocations) + " live ranges)"};
  }
  return reinterpret_cast<void*>(base_ + *off);
}

Status DeviceArena::free(void* ptr, Stream stream) {
  const auto p = std::uint64_t(reinterpret_cast<std::uintptr_t>(ptr));
  if (p < base_ || p >= base_ + ranges_.capacity())
    return invalid_argument("device arena: free of a pointer outside the arena");
  KILN_TRY(refuse_capture(stream, "free"));
  const jit::Driver* d = jit::Driver::get().value();
  std::lock_guard lock(mu_);
  const std::uint64_t offset = p - base_;
  for (const Pending& q : pending_)
    if (q.offset == offset) return not_found("device arena: free of a range freed already");
  auto size = ranges_.size_of(offset);
  if (!size.ok()) return not_found("device arena: free of a pointer that is not the start of a live range");
  KILN_ASSIGN_OR_RETURN(void* e, event());
  if (Status s = d->check(d->event_record(as_event(e), as_stream(stream)), "cuEventRecord (a free)"); !s.ok()) {
    spare_events_.push_back(e);
    return s;
  }
  pending_.push_back({offset, *size, stream, e});
  return {};
}

DeviceArenaStats DeviceArena::stats() const {
  std::lock_guard lock(mu_);
  DeviceArenaStats s;
  s.ranges = ranges_.stats();
  for (const Pending& p : pending_) s.pending_bytes += p.size;
  s.pending_frees = std::int64_t(pending_.size());
  s.same_stream_reuses = same_stream_reuses_;
  s.cross_stream_waits = cross_stream_waits_;
  return s;
}

}  // namespace kiln
