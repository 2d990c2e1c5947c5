// DeviceArena: the memory pool of a serving process on one GPU (docs/serving.md). One device
// allocation is reserved when the arena is created; allocate and free then hand out and take back
// ranges of it (ArenaAllocator's bookkeeping) with no cuMemAlloc or cuMemFree until the arena goes.
//
// Frees are stream-ordered: free(ptr, stream) gives a range back while work already queued on
// `stream` may still use it. The range is reused
// - at once by an allocate on the same stream: whatever its new owner queues there runs after that
//   work;
// - by an allocate on another stream once the event recorded at the free has completed;
// - sooner when nothing else fits: the allocating stream then waits for that event
//   (cuStreamWaitEvent, oldest frees first), so the host never blocks and the GPU keeps the order.
// allocate is `unavailable` when no range fits even so.
//
// Thread-safety: every member may be called from any thread (one mutex; nothing waits while holding
// it). Streams are the caller's and must outlive their pending frees. Not for a stream that is
// being captured into a CUDA graph (allocate and free refuse one): a graph replays work the arena
// cannot see. The destructor waits for the pending frees' events, then frees the reservation; the
// caller must not destroy the arena while work that uses its memory is queued.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kiln/arena.h"
#include "kiln/status.h"
#include "kiln/runtime.h"

namespace kiln {

struct DeviceArenaStats {
  ArenaStats ranges;                    // the bookkeeping's: in_use counts pending frees too
  std::uint64_t pending_bytes = 0;      // freed, waiting for their stream's work
  std::int64_t pending_frees = 0;
  std::int64_t same_stream_reuses = 0;  // pending frees taken back at once by their own stream
  std::int64_t cross_stream_waits = 0;  // pending frees another stream waited for to fit an allocation
};

class DeviceArena {
 public:
  // Reserves `capacity` bytes (rounded down to `alignment`, a power of two) on the device of the
  // calling thread's current context (the primary context of device 0 when none is current), for
  // at most `max_allocations` live ranges. invalid_argument for unusable sizes; driver_error when
  // the reservation fails.
  static Result<std::unique_ptr<DeviceArena>> create(std::uint64_t capacity, std::uint64_t alignment = 256,
                                                     std::int32_t max_allocations = 1 << 16);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A range of at least `size` bytes (0 < size), aligned, for work on `stream` (nullptr: the legacy
  // default stream). May make `stream` wait for another stream's free (above).
  Result<void*> allocate(std::uint64_t size, Stream stream = nullptr);
  // Gives back the range allocate returned at `ptr`, in `stream`'s order. invalid_argument for a
  // pointer outside the arena; not_found for one that is not the start of a live range (never
  // allocated, or freed already).
  Status free(void* ptr, Stream stream = nullptr);

  DeviceArenaStats stats() const;
  void* base() const { return reinterpret_cast<void*>(base_); }
  std::uint64_t capacity() const { return ranges_.capacity(); }

 private:
  struct Pending {
    std::uint64_t offset, size;
    void* stream;
    void* event;
  };
  DeviceArena(ArenaAllocator ranges, std::uint64_t base, void* context);
  Status refuse_capture(Stream stream, const char* what) const;
  void release(std::size_t i);  // pending_[i] back to the bookkeeping (mutex held)
  Result<void*> event();        // a spare event, or a new one (mutex held)

  mutable std::mutex mu_;
  ArenaAllocator ranges_;
  std::uint64_t base_;
  void* context_;
  std::vector<Pending> pending_;  // oldest first
  std::vector<void*> spare_events_;
  std::vector<void*> events_;  // every event created, destroyed with the arena
  std::int64_t same_stream_reuses_ = 0, cross_stream_waits_ = 0;
};

}  // namespace kiln
