// ArenaAllocator: the bookkeeping of one reserved memory range (a device arena for activations,
// workspaces and KV pools, docs/serving.md): ranges are handed out as offsets into it and given
// back by offset, with no system allocation after construction.
//
// Free ranges sit in segregated lists by size class (powers of two, one bit per non-empty class),
// neighbours are merged on free, and the allocation table is an open-addressing hash of offsets, all
// preallocated for `max_allocations` live ranges. Allocation is good-fit: a short scan of the size's
// own class, then the first range of the next non-empty larger class, then the rest of its own
// class; O(1) apart from those scans. The class owns no memory: a device arena maps offsets to
// base + offset.
//
// Thread-safety: not thread-safe; serialize calls (e.g. under the arena's mutex or on the one
// stream-ordering thread).
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/status.h"

namespace kiln {

struct ArenaStats {
  std::uint64_t capacity = 0;
  std::uint64_t in_use = 0;         // bytes handed out (sizes rounded up to the alignment)
  std::uint64_t free = 0;           // capacity - in_use
  std::uint64_t largest_free = 0;   // the largest single range allocate could return
  std::int64_t allocations = 0;     // live ranges
  std::int64_t free_ranges = 0;
  std::int64_t peak_in_use = 0;
  std::int64_t failed = 0;          // allocate calls that found no room
};

class ArenaAllocator {
 public:
  // capacity: bytes in the range; alignment: a power of two every offset and size is rounded to;
  // max_allocations: live ranges at most. invalid_argument when they are not usable.
  static Result<ArenaAllocator> create(std::uint64_t capacity, std::uint64_t alignment = 256,
                                       std::int32_t max_allocations = 1 << 16);

  // The offset of a new range of at least `size` bytes (0 < size). unavailable when no free range
  // is large enough or max_allocations ranges are live; invalid_argument for size 0.
  Result<std::uint64_t> allocate(std::uint64_t size);
  // Gives back the range starting at `offset`. not_found when no live range starts there (never
  // allocated, or freed already).
  Status free(std::uint64_t offset);
  // The rounded size of the live range at `offset`; not_found as free.
  Result<std::uint64_t> size_of(std::uint64_t offset) const;

  ArenaStats stats() const;
  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t alignment() const { return align_; }
  // Ranges tile [0, capacity) in address order, no two free ranges touch, the lists and the table
  // hold exactly the free and live ranges, the counters add up. internal_error otherwise.
  Status check_invariants() const;

 private:
  struct Range {
    std::uint64_t offset = 0, size = 0;
    std::int32_t prev = -1, next = -1;            // address order
    std::int32_t prev_free = -1, next_free = -1;  // its size class's list, when free
    bool free = false;
    bool used = false;  // the node slot holds a range
  };
  ArenaAllocator(std::uint64_t capacity, std::uint64_t alignment, std::int32_t max_allocations);
  static int class_of(std::uint64_t size);
  std::int32_t new_node();
  void drop_node(std::int32_t n);
  void push_free(std::int32_t n);
  void pop_free(std::int32_t n);
  std::int32_t find_fit(std::uint64_t size) const;
  void table_put(std::uint64_t offset, std::int32_t n);
  std::int32_t table_get(std::uint64_t offset) const;
  void table_erase(std::uint64_t offset);
  std::size_t slot_of(std::uint64_t offset) const;

  std::uint64_t capacity_, align_;
  std::int32_t max_allocations_;
  std::vector<Range> nodes_;
  std::vector<std::int32_t> spare_;  // unused node slots
  std::int32_t heads_[64];
  std::uint64_t nonempty_ = 0;       // bit c: class c's list is not empty
  // Live ranges by offset: linear probing, deletion by backward shift (no tombstones).
  std::vector<std::uint64_t> table_keys_;
  std::vector<std::int32_t> table_vals_;  // -1: empty
  std::uint64_t in_use_ = 0, peak_ = 0;
  std::int64_t live_ = 0, free_ranges_ = 0, failed_ = 0;
};

}  // namespace kiln
