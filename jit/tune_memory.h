// Device memory for tuning: owned buffers, the bytes a BufferSpec takes, and random inputs that
// are generated on the host one block at a time.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kiln/family.h"
#include "kiln/status.h"

namespace kiln::jit {

// Device memory freed on scope exit.
class DeviceMem {
 public:
  DeviceMem() = default;
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem(DeviceMem&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = 0; }
  ~DeviceMem();
  Status alloc(std::size_t bytes);
  CUdeviceptr ptr() const { return ptr_; }
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

std::size_t buffer_bytes(const BufferSpec& b);

// `n` standard normal values stored as `t`.
std::vector<unsigned char> random_block(DType t, std::int64_t n, std::mt19937& rng);

// `n` random elements of input buffer `b`: integer buffers with an index bound (block tables,
// lengths, positions) uniform in [0, index_bound), every other buffer random_block's values.
std::vector<unsigned char> random_input(const BufferSpec& b, std::int64_t n, std::mt19937& rng);

// Fills a device buffer for input `b` with random_input values without generating all of them on
// the host: one block (up to 2^20 elements) is uploaded and then doubled in place with device copies.
Status fill_random(const DeviceMem& m, const BufferSpec& b, std::mt19937& rng);

}  // namespace kiln::jit
