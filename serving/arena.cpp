#include "kiln/arena.h"

#include <algorithm>
#include <bit>
#include <string>

namespace kiln {

Result<ArenaAllocator> ArenaAllocator::create(std::uint64_t capacity, std::uint64_t alignment,
                                              std::int32_t max_allocations) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return invalid_argument("arena: alignment " + std::to_string(alignment) + " is not a power of two");
  if (capacity < alignment) return invalid_argument("arena: capacity " + std::to_string(capacity) + " is below the alignment");
  if (max_allocations < 1 || max_allocations > (1 << 28))
    return invalid_argument("arena: max_allocations must be in 1 .. 2^28");
  return ArenaAllocator(capacity / alignment * alignment, alignment, max_allocations);
}

ArenaAllocator::ArenaAllocator(std::uint64_t capacity, std::uint64_t alignment, std::int32_t max_allocations)
    : capacity_(capacity), align_(alignment), max_allocations_(max_allocations) {
  // Live ranges and the free ranges between them: at most 2 * max + 1.
  const std::size_t nodes = 2 * std::size_t(max_allocations) + 1;
  nodes_.resize(nodes);
  spare_.reserve(nodes);
  for (std::size_t i = nodes; i-- > 0;) spare_.push_back(std::int32_t(i));
  std::fill(std::begin(heads_), std::end(heads_), -1);
  const std::size_t slots = std::bit_ceil(2 * std::size_t(max_allocations));
  table_keys_.assign(slots, 0);
  table_vals_.assign(slots, -1);
  std::int32_t n = new_node();
  nodes_[std::size_t(n)].offset = 0;
  nodes_[std::size_t(n)].size = capacity_;
  push_free(n);
}

int ArenaAllocator::class_of(std::uint64_t size) { return 63 - std::countl_zero(size); }

std::int32_t ArenaAllocator::new_node() {
  std::int32_t n = spare_.back();
  spare_.pop_back();
  nodes_[std::size_t(n)] = Range{};
  nodes_[std::size_t(n)].used = true;
  return n;
}

void ArenaAllocator::drop_node(std::int32_t n) {
  nodes_[std::size_t(n)].used = false;
  spare_.push_back(n);
}

void ArenaAllocator::push_free(std::int32_t n) {
  Range& r = nodes_[std::size_t(n)];
  const int c = class_of(r.size);
  r.free = true;
  r.prev_free = -1;
  r.next_free = heads_[c];
  if (heads_[c] >= 0) nodes_[std::size_t(heads_[c])].prev_free = n;
  heads_[c] = n;
  nonempty_ |= std::uint64_t(1) << c;
  ++free_ranges_;
}

void ArenaAllocator::pop_free(std::int32_t n) {
  Range& r = nodes_[std::size_t(n)];
  const int c = class_of(r.size);
  if (r.prev_free >= 0) nodes_[std::size_t(r.prev_free)].next_free = r.next_free; else heads_[c] = r.next_free;
  if (r.next_free >= 0) nodes_[std::size_t(r.next_free)].prev_free = r.prev_free;
  if (heads_[c] < 0) nonempty_ &= ~(std::uint64_t(1) << c);
  r.free = false;
  r.prev_free = r.next_free = -1;
  --free_ranges_;
}

std::int32_t ArenaAllocator::find_fit(std::uint64_t size) const {
  const int c = class_of(size);
  // A few ranges of the size's own class (they may be smaller than the request).
  int scanned = 0;
  std::int32_t n = heads_[c];
  for (; n >= 0 && scanned < 8; n = nodes_[std::size_t(n)].next_free, ++scanned)
    if (nodes_[std::size_t(n)].size >= size) return n;
  // Any range of a larger class fits.
  const std::uint64_t larger = c >= 63 ? 0 : nonempty_ & (~std::uint64_t(0) << (c + 1));
  if (larger) return heads_[std::countr_zero(larger)];
  for (; n >= 0; n = nodes_[std::size_t(n)].next_free)
    if (nodes_[std::size_t(n)].size >= size) return n;
  return -1;
}

std::size_t ArenaAllocator::slot_of(std::uint64_t offset) const {
  std::uint64_t h = (offset / align_) * 0x9e3779b97f4a7c15ull;
  return std::size_t(h >> 17) & (table_keys_.size() - 1);
}

void ArenaAllocator::table_put(std::uint64_t offset, std::int32_t n) {
  std::size_t i = slot_of(offset);
  while (table_vals_[i] >= 0) i = (i + 1) & (table_keys_.size() - 1);
  table_keys_[i] = offset;
  table_vals_[i] = n;
}

std::int32_t ArenaAllocator::table_get(std::uint64_t offset) const {
  for (std::size_t i = slot_of(offset); table_vals_[i] >= 0; i = (i + 1) & (table_keys_.size() - 1))
    if (table_keys_[i] == offset) return table_vals_[i];
  return -1;
}

void ArenaAllocator::table_erase(std::uint64_t offset) {
  const std::size_t mask = table_keys_.size() - 1;
  std::size_t i = slot_of(offset);
  while (table_keys_[i] != offset || table_vals_[i] < 0) i = (i + 1) & mask;
  // Backward shift: move later entries of the run into the hole when their home allows it.
  for (std::size_t j = (i + 1) & mask; table_vals_[j] >= 0; j = (j + 1) & mask) {
    const std::size_t home = slot_of(table_keys_[j]);
    const bool movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
    if (movable) {
      table_keys_[i] = table_keys_[j];
      table_vals_[i] = table_vals_[j];
      i = j;
    }
  }
  table_vals_[i] = -1;
}

Result<std::uint64_t> ArenaAllocator::allocate(std::uint64_t size) {
  if (size == 0) return invalid_argument("arena: allocation of 0 bytes");
  if (size > capacity_) {
    ++failed_;
    return unavailable("arena: " + std::to_string(size) + " bytes exceed the arena's " + std::to_string(capacity_));
  }
  size = (size + align_ - 1) / align_ * align_;
  if (live_ >= max_allocations_) {
    ++failed_;
    return unavailable("arena: " + std::to_string(max_allocations_) + " ranges are live, the most it tracks");
  }
  const std::int32_t n = find_fit(size);
  if (n < 0) {
    ++failed_;
    return unavailable("arena: no free range of " + std::to_string(size) + " bytes (" + std::to_string(capacity_ - in_use_) +
                       " free in " + std::to_string(free_ranges_) + " ranges)");
  }
  pop_free(n);
  if (nodes_[std::size_t(n)].size > size) {
    // The rest stays free, after the new range.
    const std::int32_t rest = new_node();
    Range& r = nodes_[std::size_t(n)];
    Range& t = nodes_[std::size_t(rest)];
    t.offset = r.offset + size;
    t.size = r.size - size;
    t.prev = n;
    t.next = r.next;
    if (r.next >= 0) nodes_[std::size_t(r.next)].prev = rest;
    r.next = rest;
    r.size = size;
    push_free(rest);
  }
  const std::uint64_t offset = nodes_[std::size_t(n)].offset;
  table_put(offset, n);
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  ++live_;
  return offset;
}

Status ArenaAllocator::free(std::uint64_t offset) {
  std::int32_t n = table_get(offset);
  if (n < 0) return not_found("arena: no live range starts at offset " + std::to_string(offset) + " (never allocated, or freed already)");
  table_erase(offset);
  in_use_ -= nodes_[std::size_t(n)].size;
  --live_;
  // Merge with a free neighbour on either side.
  std::int32_t next = nodes_[std::size_t(n)].next;
  if (next >= 0 && nodes_[std::size_t(next)].free) {
    pop_free(next);
    Range& r = nodes_[std::size_t(n)];
    r.size += nodes_[std::size_t(next)].size;
    r.next = nodes_[std::size_t(next)].next;
    if (r.next >= 0) nodes_[std::size_t(r.next)].prev = n;
    drop_node(next);
  }
  std::int32_t prev = nodes_[std::size_t(n)].prev;
  if (prev >= 0 && nodes_[std::size_t(prev)].free) {
    pop_free(prev);
    Range& p = nodes_[std::size_t(prev)];
    p.size += nodes_[std::size_t(n)].size;
    p.next = nodes_[std::size_t(n)].next;
    if (p.next >= 0) nodes_[std::size_t(p.next)].prev = prev;
    drop_node(n);
    n = prev;
  }
  push_free(n);
  return {};
}

Result<std::uint64_t> ArenaAllocator::size_of(std::uint64_t offset) const {
  std::int32_t n = table_get(offset);
  if (n < 0) return not_found("arena: no live range starts at offset " + std::to_string(offset));
  return nodes_[std::size_t(n)].size;
}

ArenaStats ArenaAllocator::stats() const {
  ArenaStats s;
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.free = capacity_ - in_use_;
  s.allocations = live_;
  s.free_ranges = free_ranges_;
  s.peak_in_use = std::int64_t(peak_);
  s.failed = failed_;
  if (nonempty_) {
    const int c = 63 - std::countl_zero(nonempty_);
    for (std::int32_t n = heads_[c]; n >= 0; n = nodes_[std::size_t(n)].next_free)
      s.largest_free = std::max(s.largest_free, nodes_[std::size_t(n)].size);
  }
  return s;
}

Status ArenaAllocator::check_invariants() const {
  auto fail = [](std::string m) { return internal_error("arena invariant: " + std::move(m)); };
  // The range holding offset 0: the one with no predecessor.
  std::int32_t first = -1;
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].used && nodes_[i].prev < 0) {
      if (first >= 0) return fail("two ranges without a predecessor");
      first = std::int32_t(i);
    }
  if (first < 0) return fail("no first range");
  std::uint64_t at = 0, used = 0;
  std::int64_t live = 0, free_count = 0, count = 0;
  bool prev_free = false;
  for (std::int32_t n = first, p = -1; n >= 0; p = n, n = nodes_[std::size_t(n)].next) {
    const Range& r = nodes_[std::size_t(n)];
    if (++count > std::int64_t(nodes_.size())) return fail("a cycle in address order");
    if (!r.used || r.prev != p) return fail("address links at offset " + std::to_string(r.offset));
    if (r.offset != at || r.size == 0 || r.size % align_ != 0) return fail("range at " + std::to_string(r.offset) + " does not tile");
    if (r.free) {
      if (prev_free) return fail("two free ranges touch at " + std::to_string(r.offset));
      ++free_count;
    } else {
      if (table_get(r.offset) != n) return fail("live range at " + std::to_string(r.offset) + " is not in the table");
      used += r.size;
      ++live;
    }
    prev_free = r.free;
    at += r.size;
  }
  if (at != capacity_) return fail("ranges end at " + std::to_string(at) + ", capacity " + std::to_string(capacity_));
  if (used != in_use_ || live != live_ || free_count != free_ranges_) return fail("counters");
  std::int64_t listed = 0;
  for (int c = 0; c < 64; ++c) {
    if (bool(nonempty_ >> c & 1) != (heads_[c] >= 0)) return fail("class bitmap at " + std::to_string(c));
    for (std::int32_t n = heads_[c], p = -1; n >= 0; p = n, n = nodes_[std::size_t(n)].next_free) {
      const Range& r = nodes_[std::size_t(n)];
      if (!r.free || class_of(r.size) != c || r.prev_free != p) return fail("free list of class " + std::to_string(c));
      if (++listed > free_ranges_) return fail("free lists hold more ranges than are free");
    }
  }
  if (listed != free_ranges_) return fail("free lists miss ranges");
  std::int64_t in_table = 0;
  for (std::int32_t v : table_vals_) in_table += v >= 0;
  if (in_table != live_) return fail("the table holds " + std::to_string(in_table) + " ranges, " + std::to_string(live_) + " live");
  return {};
}

}  // namespace kiln
