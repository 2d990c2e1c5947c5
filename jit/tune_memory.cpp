#include "jit/tune_memory.h"

#include <algorithm>

#include "common/half.h"
#include "jit/driver.h"

namespace kiln::jit {

DeviceMem::~DeviceMem() {
  if (ptr_) Driver::get().value()->mem_free(ptr_);
}

Status DeviceMem::alloc(std::size_t bytes) {
  const Driver* d = Driver::get().value();
  bytes_ = bytes;
  return d->check(d->mem_alloc(&ptr_, bytes ? bytes : 1), "cuMemAlloc");
}

std::size_t buffer_bytes(const BufferSpec& b) { return std::size_t(std::max<std::int64_t>(b.elements, 0)) * dtype_size(b.dtype); }

std::vector<unsigned char> random_block(DType t, std::int64_t n, std::mt19937& rng) {
  std::vector<unsigned char> v(std::size_t(n) * dtype_size(t));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(v.data(), t, i, dist(rng));
  return v;
}

std::vector<unsigned char> random_input(const BufferSpec& b, std::int64_t n, std::mt19937& rng) {
  if ((b.dtype != DType::i32 && b.dtype != DType::i64) || b.index_bound <= 0) return random_block(b.dtype, n, rng);
  std::vector<unsigned char> v(std::size_t(n) * dtype_size(b.dtype));
  std::uniform_int_distribution<std::int64_t> dist(0, b.index_bound - 1);
  for (std::int64_t i = 0; i < n; ++i) store_from_double(v.data(), b.dtype, i, double(dist(rng)));
  return v;
}

Status fill_random(const DeviceMem& m, const BufferSpec& b, std::mt19937& rng) {
  const Driver* d = Driver::get().value();
  const std::size_t esize = dtype_size(b.dtype);
  const std::size_t n = m.bytes() / esize;
  if (n == 0) return {};
  const std::size_t block = std::min<std::size_t>(n, std::size_t(1) << 20);
  auto host = random_input(b, std::int64_t(block), rng);
  KILN_TRY(d->check(d->memcpy_htod(m.ptr(), host.data(), host.size()), "cuMemcpyHtoD"));
  std::size_t done = block * esize;
  while (done < m.bytes()) {
    const std::size_t chunk = std::min(done, m.bytes() - done);
    KILN_TRY(d->check(d->memcpy_dtod(m.ptr() + done, m.ptr(), chunk), "cuMemcpyDtoD"));
    done += chunk;
  }
  return {};
}

}  // namespace kiln::jit
