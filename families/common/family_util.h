// Small helpers every built-in family uses when validating and rendering.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "kiln/spec.h"
#include "kiln/status.h"
#include "kiln/types.h"

namespace kiln::families {

// The device type of a dtype parameter value ("f32", "f16", "bf16"), as families/common/dtype.cuh
// names it.
inline const char* device_type(const std::string& dtype) {
  if (dtype == "f16") return "kiln::f16_t";
  if (dtype == "bf16") return "kiln::bf16_t";
  return "float";
}

// invalid_argument unless params' `vec` elements of `dtype` fit one access of at most 16 bytes.
inline Status check_access_width(std::string_view family, const Params& params) {
  const auto vec = *params.get_int("vec");
  const auto dtype = *params.get_str("dtype");
  if (vec * std::int64_t(dtype_size(*parse_dtype(dtype))) > 16)
    return invalid_argument(std::string(family) + ": vec * sizeof(dtype) must be at most 16 bytes (got vec=" +
                            std::to_string(vec) + " for " + dtype + ")");
  return {};
}

// Packs per thread that a row kernel holds in `cache_regs` 32-bit registers (a pack narrower than
// a register still takes one).
inline std::int64_t register_cache_packs(std::int64_t cache_regs, std::int64_t pack_bytes) {
  return cache_regs / std::max<std::int64_t>(1, pack_bytes / 4);
}

// The row kernels' shared-memory cache (rmsnorm, add_rmsnorm): of a row's `packs`, those past the
// register cache (block threads x `cached_per_thread`) that fit in `max_bytes`; the kernel reads
// any rest twice.
inline std::int64_t smem_cache_packs(std::int64_t packs, std::int64_t block, std::int64_t cached_per_thread,
                                     std::int64_t pack_bytes, std::int64_t max_bytes) {
  return std::clamp<std::int64_t>(packs - block * cached_per_thread, 0, max_bytes / pack_bytes);
}

}  // namespace kiln::families
