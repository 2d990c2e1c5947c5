// Scratch device memory for ops that need a workspace the caller did not pass (partial sums of a
// two-stage reduction, say).
//
// Outside CUDA graph capture: one f32 buffer per (CUDA context, stream), grown on demand (growing
// waits for the stream, then frees the old buffer). Calls on one stream share it safely because the
// stream orders them.
//
// While the stream is being captured into a CUDA graph: memory of the device's stream-ordered pool
// allocated on the stream (cuMemAllocAsync, a graph allocation node) and freed on it once the op
// has enqueued its launches (cuMemFreeAsync when the handle goes, a free node). The graph owns
// that memory, so every replay has its own valid scratch, and no later eager call can take it away
// (the per-stream buffer is never captured). Thread-safe.
#pragma once

#include <cstdint>

#include "kiln/runtime.h"
#include "kiln/status.h"

namespace kiln::client {

class StreamWorkspace {
 public:
  // At least `elements` f32 values on the current context of device `ordinal`, for the work the
  // caller enqueues next on `stream`. Keep the handle until the last launch that uses it is
  // enqueued: when captured, its destructor enqueues the free.
  static Result<StreamWorkspace> get(int ordinal, Stream stream, std::int64_t elements);

  StreamWorkspace() = default;
  StreamWorkspace(StreamWorkspace&& o) noexcept { *this = std::move(o); }
  StreamWorkspace& operator=(StreamWorkspace&& o) noexcept;
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;
  ~StreamWorkspace();

  void* data() const { return data_; }
  // Whether the memory is a captured graph's (freed on the stream by the destructor).
  bool graph_owned() const { return graph_owned_; }

 private:
  void* data_ = nullptr;
  Stream stream_ = nullptr;
  bool graph_owned_ = false;
};

}  // namespace kiln::client
