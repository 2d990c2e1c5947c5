// Scratch device memory for ops that need a workspace the caller did not pass (partial sums of a
// two-stage reduction, say): one f32 buffer per (CUDA context, stream), grown on demand and never
// freed. Calls on one stream share it safely because the stream orders them; growing it waits for
// the stream first. Thread-safe. Not usable during CUDA graph capture (it may call cuMemAlloc).
#pragma once

#include <cstdint>

#include "kiln/runtime.h"
#include "kiln/status.h"

namespace kiln::client {

// At least `elements` f32 values on the current context of device `ordinal`, for `stream`.
Result<void*> stream_workspace(int ordinal, Stream stream, std::int64_t elements);

}  // namespace kiln::client
