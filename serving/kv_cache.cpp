#include "kiln/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "common/sha256.h"

namespace kiln {

const char* kv_dtype_name(KVDType t) {
  switch (t) {
    case KVDType::f16: return "f16";
    case KVDType::bf16: return "bf16";
    case KVDType::fp8_e4m3: return "fp8_e4m3";
    case KVDType::fp8_e5m2: return "fp8_e5m2";
  }
  return "?";
}

std::size_t kv_dtype_size(KVDType t) {
  return (t == KVDType::fp8_e4m3 || t == KVDType::fp8_e5m2) ? 1 : 2;
}

const char* admission_name(Admission a) {
  switch (a) {
    case Admission::now: return "now";
    case Admission::later: return "later";
    case Admission::never: return "never";
  }
  return "?";
}

std::uint64_t KVCacheConfig::bytes_per_block() const {
  return 2ull * std::uint64_t(num_layers) * std::uint64_t(num_kv_heads) * std::uint64_t(head_dim) *
         std::uint64_t(page_size) * kv_dtype_size(dtype);
}

Status KVCacheConfig::validate() const {
  static constexpr std::int32_t pages[] = {1, 8, 16, 32, 64, 128};
  if (std::find(std::begin(pages), std::end(pages), page_size) == std::end(pages))
    return invalid_argument("kv cache: page_size " + std::to_string(page_size) + " is not one of 1, 8, 16, 32, 64, 128");
  if (num_blocks <= 0) return invalid_argument("kv cache: num_blocks must be positive");
  if (std::int64_t(num_blocks) * page_size > (std::int64_t(1) << 40))
    return invalid_argument("kv cache: num_blocks * page_size is too large");
  if (int(dtype) > int(KVDType::fp8_e5m2)) return invalid_argument("kv cache: unknown KV dtype");
  if (num_host_blocks < 0) return invalid_argument("kv cache: num_host_blocks must not be negative");
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0)
    return invalid_argument("kv cache: num_layers, num_kv_heads and head_dim must be positive");
  if (std::int64_t(num_layers) * num_kv_heads * head_dim > (std::int64_t(1) << 32))
    return invalid_argument("kv cache: num_layers * num_kv_heads * head_dim is too large");
  return {};
}

std::int64_t kv_blocks_for_bytes(const KVCacheConfig& config, std::uint64_t bytes) {
  std::uint64_t per = config.bytes_per_block();
  return per == 0 ? 0 : std::int64_t(bytes / per);
}

BlockHash prefix_root_hash(const PrefixKey& key) {
  Sha256 h;
  h.update("kiln kv prefix v1");
  for (const std::string* s : {&key.adapter, &key.salt}) {
    std::uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = std::uint8_t(std::uint64_t(s->size()) >> (8 * i));
    h.update(len, 8);
    h.update(*s);
  }
  return h.finish();
}

BlockHash block_hash(const BlockHash& parent, std::span<const std::int32_t> tokens) {
  Sha256 h;
  h.update(parent.data(), parent.size());
  std::uint8_t buf[4 * 129];
  auto put = [&](std::size_t at, std::uint32_t v) {
    buf[at] = std::uint8_t(v);
    buf[at + 1] = std::uint8_t(v >> 8);
    buf[at + 2] = std::uint8_t(v >> 16);
    buf[at + 3] = std::uint8_t(v >> 24);
  };
  put(0, std::uint32_t(tokens.size()));
  std::size_t n = 4;
  for (std::int32_t t : tokens) {
    if (n == sizeof(buf)) {
      h.update(buf, n);
      n = 0;
    }
    put(n, std::uint32_t(t));
    n += 4;
  }
  h.update(buf, n);
  return h.finish();
}

std::size_t KVCacheManager::HashOfHash::operator()(const BlockHash& h) const {
  std::size_t v;
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

Result<KVCacheManager> KVCacheManager::create(const KVCacheConfig& config) {
  KILN_TRY(config.validate());
  return KVCacheManager(config);
}

KVCacheManager::KVCacheManager(const KVCacheConfig& config) : config_(config) {
  const auto n = std::size_t(config.num_blocks);
  blocks_.resize(n);
  external_refs_.assign(n, 0);
  prev_.assign(n, -1);
  next_.assign(n, -1);
  scratch_counts_.assign(n, 0);
  for (std::int32_t b = 0; b < config.num_blocks; ++b) {
    blocks_[std::size_t(b)].id = b;
    list_push_back(b);
  }
  num_free_ = config.num_blocks;
  if (config.enable_prefix_caching) index_.reserve(n);
  (void)enable_swap(config.num_host_blocks);
}

void KVCacheManager::list_remove(std::int32_t b) {
  auto i = std::size_t(b);
  if (prev_[i] >= 0) next_[std::size_t(prev_[i])] = next_[i]; else head_ = next_[i];
  if (next_[i] >= 0) prev_[std::size_t(next_[i])] = prev_[i]; else tail_ = prev_[i];
  prev_[i] = next_[i] = -1;
}

void KVCacheManager::list_push_front(std::int32_t b) {
  auto i = std::size_t(b);
  prev_[i] = -1;
  next_[i] = head_;
  if (head_ >= 0) prev_[std::size_t(head_)] = b; else tail_ = b;
  head_ = b;
}

void KVCacheManager::list_push_back(std::int32_t b) {
  auto i = std::size_t(b);
  next_[i] = -1;
  prev_[i] = tail_;
  if (tail_ >= 0) next_[std::size_t(tail_)] = b; else head_ = b;
  tail_ = b;
}

// Takes the head of the free list (callers checked num_free_ > 0); a cached block is evicted.
std::int32_t KVCacheManager::take_free_block() {
  std::int32_t b = head_;
  list_remove(b);
  --num_free_;
  KVCacheBlock& blk = blocks_[std::size_t(b)];
  if (blk.cached) {
    index_.erase(blk.hash);
    blk.cached = false;
    --num_cached_free_;
    --num_cached_;
    ++evictions_;
  }
  blk.ref_count = 1;
  return b;
}

void KVCacheManager::add_ref(std::int32_t b) {
  KVCacheBlock& blk = blocks_[std::size_t(b)];
  if (blk.ref_count == 0) {
    list_remove(b);
    --num_free_;
    if (blk.cached) --num_cached_free_;
  }
  ++blk.ref_count;
}

void KVCacheManager::drop_ref(std::int32_t b) {
  KVCacheBlock& blk = blocks_[std::size_t(b)];
  if (--blk.ref_count > 0) return;
  ++num_free_;
  if (blk.cached) {
    ++num_cached_free_;
    list_push_back(b);
  } else {
    list_push_front(b);
  }
}

void KVCacheManager::register_full_block(std::int32_t b, const BlockHash& h) {
  KVCacheBlock& blk = blocks_[std::size_t(b)];
  if (blk.cached) return;
  // Equal content computed twice: the first block stays the shared one, this one stays private.
  if (!index_.emplace(h, b).second) return;
  blk.cached = true;
  blk.hash = h;
  ++num_cached_;
}

const KVCacheManager::Request* KVCacheManager::find(RequestId r) const {
  auto it = requests_.find(r);
  return it == requests_.end() ? nullptr : &it->second;
}

std::int32_t KVCacheManager::blocks_needed_to_grow(const Request& r, std::int64_t n) const {
  if (n <= 0) return 0;
  // More tokens than any pool holds (num_blocks * page_size < 2^40): never, without overflow.
  if (n > (std::int64_t(1) << 40)) return std::int32_t(1) << 30;
  const std::int64_t page = config_.page_size;
  const std::int64_t room = r.blocks.size() * page - r.num_tokens;
  std::int64_t needed = n > room ? (n - room + page - 1) / page : 0;
  // A shared last block with room in it is copied before the first write.
  if (room > 0 && blocks_[std::size_t(r.blocks.back())].ref_count > 1) ++needed;
  return std::int32_t(std::min<std::int64_t>(needed, std::int64_t(1) << 30));
}

Admission KVCacheManager::admission(std::int32_t needed) const {
  if (needed <= num_free_) return Admission::now;
  if (needed <= config_.num_blocks) return Admission::later;
  return Admission::never;
}

Admission KVCacheManager::can_allocate(RequestId request, std::int64_t num_new_tokens) const {
  if (const Request* r = find(request)) {
    // Swapped out: its blocks come back as new ones, then it grows.
    if (r->swapped) {
      Request fresh;
      return admission(blocks_needed_to_grow(fresh, r->num_tokens + num_new_tokens));
    }
    return admission(blocks_needed_to_grow(*r, num_new_tokens));
  }
  Request empty;
  return admission(blocks_needed_to_grow(empty, num_new_tokens));
}

std::int32_t KVCacheManager::blocks_short(RequestId request, std::int64_t num_new_tokens) const {
  Request empty;
  const Request* r = find(request);
  if (r && r->swapped) return std::max(0, blocks_needed_to_grow(empty, r->num_tokens + num_new_tokens) - num_free_);
  std::int32_t needed = blocks_needed_to_grow(r ? *r : empty, num_new_tokens);
  return std::max(0, needed - num_free_);
}

Admission KVCacheManager::can_allocate(std::span<const std::int32_t> prompt, const PrefixKey& key) const {
  const std::int64_t page = config_.page_size;
  const std::int64_t total = (std::int64_t(prompt.size()) + page - 1) / page;
  std::int64_t hits = 0, hits_free = 0;
  if (config_.enable_prefix_caching && !prompt.empty()) {
    const std::int64_t max_hits = (std::int64_t(prompt.size()) - 1) / page;
    BlockHash h = prefix_root_hash(key);
    for (std::int64_t i = 0; i < max_hits; ++i) {
      h = block_hash(h, prompt.subspan(std::size_t(i * page), std::size_t(page)));
      auto it = index_.find(h);
      if (it == index_.end()) break;
      ++hits;
      if (blocks_[std::size_t(it->second)].ref_count == 0) ++hits_free;
    }
  }
  // A hit on a free cached block takes that block out of the free pool as well.
  const std::int64_t needed = total - hits + hits_free;
  if (needed <= num_free_) return Admission::now;
  return total <= config_.num_blocks ? Admission::later : Admission::never;
}

void KVCacheManager::write_tokens(Request& r, std::span<const std::int32_t> tokens, SlotPlan& plan) {
  const std::int32_t page = config_.page_size;
  const bool caching = config_.enable_prefix_caching;
  std::size_t i = 0;
  while (i < tokens.size()) {
    std::int32_t offset = std::int32_t(r.num_tokens % page);
    if (offset == 0 && std::int64_t(r.blocks.size()) * page == r.num_tokens) r.blocks.push_back(take_free_block());
    const std::int32_t b = r.blocks.back();
    const std::size_t take = std::min<std::size_t>(tokens.size() - i, std::size_t(page - offset));
    const std::int64_t base = std::int64_t(b) * page + offset;
    for (std::size_t k = 0; k < take; ++k) plan.slot_mapping.push_back(base + std::int64_t(k));
    r.num_tokens += std::int64_t(take);
    if (caching) {
      r.partial.insert(r.partial.end(), tokens.begin() + std::ptrdiff_t(i), tokens.begin() + std::ptrdiff_t(i + take));
      if (std::int32_t(r.partial.size()) == page) {
        r.last_hash = block_hash(r.last_hash, r.partial);
        register_full_block(b, r.last_hash);
        r.partial.clear();
      }
    }
    i += take;
  }
}

Result<std::int64_t> KVCacheManager::allocate(RequestId request, std::span<const std::int32_t> prompt, SlotPlan& plan,
                                              const PrefixKey& key, std::span<const std::int32_t> prefix_blocks) {
  if (requests_.count(request))
    return invalid_argument("kv cache: request " + std::to_string(request) + " is already allocated");
  const std::int64_t page = config_.page_size;
  const std::int64_t len = std::int64_t(prompt.size());
  if (std::int64_t(prefix_blocks.size()) * page > len)
    return invalid_argument("kv cache: " + std::to_string(prefix_blocks.size()) + " prefix blocks cover more than the " +
                            std::to_string(len) + "-token prompt");
  for (std::int32_t b : prefix_blocks) {
    if (b < 0 || b >= config_.num_blocks)
      return invalid_argument("kv cache: prefix block " + std::to_string(b) + " is outside the pool of " +
                              std::to_string(config_.num_blocks) + " blocks");
    if (blocks_[std::size_t(b)].ref_count == 0)
      return invalid_argument("kv cache: prefix block " + std::to_string(b) + " is free (its contents are not held)");
  }
  const std::int64_t total = (len + page - 1) / page;
  const std::int64_t given = std::int64_t(prefix_blocks.size());
  const bool caching = config_.enable_prefix_caching;
  std::int64_t hits = 0, hits_free = 0;
  BlockHash root{};
  if (caching) {
    root = prefix_root_hash(key);
    scratch_hashes_.clear();
    BlockHash h = root;
    const std::int64_t full = len / page;
    for (std::int64_t i = 0; i < full; ++i) {
      h = block_hash(h, prompt.subspan(std::size_t(i * page), std::size_t(page)));
      scratch_hashes_.push_back(h);
    }
    const std::int64_t max_hits = len > 0 ? (len - 1) / page : 0;
    for (std::int64_t i = given; i < max_hits; ++i) {
      auto it = index_.find(scratch_hashes_[std::size_t(i)]);
      if (it == index_.end()) break;
      ++hits;
      if (blocks_[std::size_t(it->second)].ref_count == 0) ++hits_free;
    }
  }
  const std::int64_t needed = total - given - hits + hits_free;
  if (needed > num_free_)
    return unavailable("kv cache: request " + std::to_string(request) + " needs " + std::to_string(needed) +
                       " free blocks, " + std::to_string(num_free_) + " are free");

  Request& r = requests_[request];
  r.blocks.reserve(std::size_t(total));
  for (std::int32_t b : prefix_blocks) {
    add_ref(b);
    r.blocks.push_back(b);
  }
  for (std::int64_t i = given; i < given + hits; ++i) {
    std::int32_t b = index_.find(scratch_hashes_[std::size_t(i)])->second;
    add_ref(b);
    r.blocks.push_back(b);
  }
  const std::int64_t cached = (given + hits) * page;
  r.num_tokens = cached;
  if (caching) {
    // Blocks given by the caller but not yet registered under their hash become shareable.
    for (std::int64_t i = 0; i < given; ++i) register_full_block(r.blocks[std::size_t(i)], scratch_hashes_[std::size_t(i)]);
    r.last_hash = cached > 0 ? scratch_hashes_[std::size_t(given + hits - 1)] : root;
  }
  queried_ += len;
  hits_ += hits * page;
  write_tokens(r, prompt.subspan(std::size_t(cached)), plan);
  return cached;
}

Status KVCacheManager::append_slots(RequestId request, std::span<const std::int32_t> tokens, SlotPlan& plan) {
  auto it = requests_.find(request);
  if (it == requests_.end())
    return not_found("kv cache: request " + std::to_string(request) + " is not allocated (never added or already freed)");
  Request& r = it->second;
  if (r.swapped)
    return invalid_argument("kv cache: request " + std::to_string(request) + " is swapped out; swap_in before appending");
  if (tokens.empty()) return {};
  const std::int32_t needed = blocks_needed_to_grow(r, std::int64_t(tokens.size()));
  if (needed > num_free_)
    return unavailable("kv cache: request " + std::to_string(request) + " needs " + std::to_string(needed) +
                       " free blocks, " + std::to_string(num_free_) + " are free");
  const std::int64_t page = config_.page_size;
  if (r.num_tokens < std::int64_t(r.blocks.size()) * page) {
    const std::int32_t last = r.blocks.back();
    if (blocks_[std::size_t(last)].ref_count > 1) {
      const std::int32_t copy = take_free_block();
      plan.copies.push_back({last, copy});
      drop_ref(last);
      r.blocks.back() = copy;
      ++cow_;
    }
  }
  write_tokens(r, tokens, plan);
  return {};
}

Status KVCacheManager::fork(RequestId parent, RequestId child) {
  auto it = requests_.find(parent);
  if (it == requests_.end())
    return not_found("kv cache: fork: parent request " + std::to_string(parent) + " is not allocated");
  if (requests_.count(child))
    return invalid_argument("kv cache: fork: child request " + std::to_string(child) + " is already allocated");
  if (it->second.swapped)
    return invalid_argument("kv cache: fork: parent request " + std::to_string(parent) + " is swapped out");
  Request copy = it->second;
  for (std::int32_t b : copy.blocks) add_ref(b);
  requests_.emplace(child, std::move(copy));
  return {};
}

Status KVCacheManager::free(RequestId request) {
  auto it = requests_.find(request);
  if (it == requests_.end())
    return not_found("kv cache: free: request " + std::to_string(request) + " is not allocated (never added or already freed)");
  const auto& blocks = it->second.blocks;
  if (it->second.swapped) {
    for (std::int32_t h : blocks) {
      host_swapped_[std::size_t(h)] = 0;
      host_free_.push_back(h);
    }
    requests_.erase(it);
    return {};
  }
  // Last blocks first: of one request's cached blocks, its prefix is evicted last.
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) drop_ref(*b);
  requests_.erase(it);
  return {};
}

Status KVCacheManager::enable_swap(std::int32_t n) {
  if (n < 0) return invalid_argument("kv cache: enable_swap: the host pool size must not be negative");
  for (const auto& [id, r] : requests_)
    if (r.swapped)
      return invalid_argument("kv cache: enable_swap: request " + std::to_string(id) +
                              " is swapped out; the host pool can change only with none");
  host_swapped_.assign(std::size_t(n), 0);
  host_free_.resize(std::size_t(n));
  // Block 0 on top of the stack: the lowest ids are handed out first.
  for (std::int32_t h = 0; h < n; ++h) host_free_[std::size_t(h)] = n - 1 - h;
  config_.num_host_blocks = n;
  return {};
}

bool KVCacheManager::is_swapped(RequestId request) const {
  const Request* r = find(request);
  return r && r->swapped;
}

Status KVCacheManager::swap_out(RequestId request, std::vector<BlockCopy>& copies) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return not_found("kv cache: swap_out: request " + std::to_string(request) + " is not allocated");
  Request& r = it->second;
  if (host_swapped_.empty()) return invalid_argument("kv cache: swap_out: no host pool (num_host_blocks is 0)");
  if (r.swapped) return invalid_argument("kv cache: swap_out: request " + std::to_string(request) + " is already swapped out");
  if (r.blocks.size() > host_free_.size())
    return unavailable("kv cache: swap_out: request " + std::to_string(request) + " needs " +
                       std::to_string(r.blocks.size()) + " host blocks, " + std::to_string(host_free_.size()) +
                       " are free");
  copies.reserve(copies.size() + r.blocks.size());
  for (std::int32_t& b : r.blocks) {
    const std::int32_t h = host_free_.back();
    host_free_.pop_back();
    host_swapped_[std::size_t(h)] = 1;
    copies.push_back({b, h});
  }
  // Last blocks first, as free does: of its cached blocks, the prefix is evicted last.
  for (std::size_t i = r.blocks.size(); i-- > 0;) drop_ref(r.blocks[i]);
  for (std::size_t i = 0; i < r.blocks.size(); ++i) r.blocks[i] = copies[copies.size() - r.blocks.size() + i].dst;
  r.swapped = true;
  return {};
}

Result<Admission> KVCacheManager::can_swap_in(RequestId request) const {
  const Request* r = find(request);
  if (!r) return not_found("kv cache: can_swap_in: request " + std::to_string(request) + " is not allocated");
  if (!r->swapped) return invalid_argument("kv cache: can_swap_in: request " + std::to_string(request) + " is not swapped out");
  return admission(std::int32_t(r->blocks.size()));
}

Status KVCacheManager::swap_in(RequestId request, std::vector<BlockCopy>& copies) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return not_found("kv cache: swap_in: request " + std::to_string(request) + " is not allocated");
  Request& r = it->second;
  if (!r.swapped) return invalid_argument("kv cache: swap_in: request " + std::to_string(request) + " is not swapped out");
  if (std::int64_t(r.blocks.size()) > num_free_)
    return unavailable("kv cache: swap_in: request " + std::to_string(request) + " needs " +
                       std::to_string(r.blocks.size()) + " free blocks, " + std::to_string(num_free_) + " are free");
  copies.reserve(copies.size() + r.blocks.size());
  for (std::int32_t& h : r.blocks) {
    const std::int32_t b = take_free_block();
    copies.push_back({h, b});
    host_swapped_[std::size_t(h)] = 0;
    host_free_.push_back(h);
    h = b;
  }
  r.swapped = false;
  return {};
}

Status KVCacheManager::retain(std::span<const std::int32_t> blocks) {
  for (std::int32_t b : blocks) {
    if (b < 0 || b >= config_.num_blocks)
      return invalid_argument("kv cache: retain: block " + std::to_string(b) + " is outside the pool of " +
                              std::to_string(config_.num_blocks) + " blocks");
    if (blocks_[std::size_t(b)].ref_count == 0)
      return invalid_argument("kv cache: retain: block " + std::to_string(b) + " is free");
  }
  for (std::int32_t b : blocks) {
    add_ref(b);
    ++external_refs_[std::size_t(b)];
  }
  return {};
}

Status KVCacheManager::release(std::span<const std::int32_t> blocks) {
  Status bad;
  std::size_t counted = 0;
  for (; counted < blocks.size(); ++counted) {
    std::int32_t b = blocks[counted];
    if (b < 0 || b >= config_.num_blocks) {
      bad = invalid_argument("kv cache: release: block " + std::to_string(b) + " is outside the pool of " +
                             std::to_string(config_.num_blocks) + " blocks");
      break;
    }
    if (++scratch_counts_[std::size_t(b)] > external_refs_[std::size_t(b)]) {
      bad = invalid_argument("kv cache: release: block " + std::to_string(b) +
                             (blocks_[std::size_t(b)].ref_count == 0 ? " is already free (released twice)"
                                                                     : " has no external reference left to release"));
      ++counted;
      break;
    }
  }
  for (std::size_t i = 0; i < counted; ++i) {
    std::int32_t b = blocks[i];
    if (b >= 0 && b < config_.num_blocks) scratch_counts_[std::size_t(b)] = 0;
  }
  if (!bad.ok()) return bad;
  for (std::int32_t b : blocks) {
    --external_refs_[std::size_t(b)];
    drop_ref(b);
  }
  return {};
}

Result<std::span<const std::int32_t>> KVCacheManager::block_table(RequestId request) const {
  const Request* r = find(request);
  if (!r) return not_found("kv cache: request " + std::to_string(request) + " is not allocated");
  return std::span<const std::int32_t>(r->blocks);
}

Result<std::int64_t> KVCacheManager::num_tokens(RequestId request) const {
  const Request* r = find(request);
  if (!r) return not_found("kv cache: request " + std::to_string(request) + " is not allocated");
  return r->num_tokens;
}

Status KVCacheManager::build_batch(std::span<const RequestId> requests, PagedBatch& out) const {
  out.clear();
  out.indptr.push_back(0);
  for (RequestId id : requests) {
    const Request* r = find(id);
    if (!r) return not_found("kv cache: build_batch: request " + std::to_string(id) + " is not allocated");
    if (r->swapped) return invalid_argument("kv cache: build_batch: request " + std::to_string(id) + " is swapped out");
    out.indices.insert(out.indices.end(), r->blocks.begin(), r->blocks.end());
    out.indptr.push_back(std::int32_t(out.indices.size()));
    const std::int64_t page = config_.page_size;
    out.last_page_len.push_back(r->num_tokens == 0 ? 0 : std::int32_t((r->num_tokens - 1) % page + 1));
    out.context_lens.push_back(std::int32_t(r->num_tokens));
  }
  return {};
}

KVCacheStats KVCacheManager::stats() const {
  KVCacheStats s;
  s.num_blocks = config_.num_blocks;
  s.free_blocks = num_free_;
  s.cached_free_blocks = num_cached_free_;
  s.used_blocks = config_.num_blocks - num_free_;
  s.cached_blocks = num_cached_;
  s.num_requests = std::int64_t(requests_.size());
  s.prefix_queried_tokens = queried_;
  s.prefix_hit_tokens = hits_;
  s.evictions = evictions_;
  s.cow_copies = cow_;
  return s;
}

void KVCacheManager::reset_prefix_cache() {
  for (std::int32_t b = head_; b >= 0;) {
    std::int32_t nb = next_[std::size_t(b)];
    KVCacheBlock& blk = blocks_[std::size_t(b)];
    if (blk.cached) {
      index_.erase(blk.hash);
      blk.cached = false;
      --num_cached_free_;
      --num_cached_;
      list_remove(b);
      list_push_front(b);
    }
    b = nb;
  }
}

Status KVCacheManager::check_invariants() const {
  auto fail = [](std::string m) { return internal_error("kv cache invariant: " + std::move(m)); };
  std::vector<std::int32_t> refs(blocks_.size(), 0), host_refs(host_swapped_.size(), 0);
  for (const auto& [id, r] : requests_) {
    const std::int64_t page = config_.page_size;
    if (std::int64_t(r.blocks.size()) != (r.num_tokens + page - 1) / page)
      return fail("request " + std::to_string(id) + " has " + std::to_string(r.blocks.size()) + " blocks for " +
                  std::to_string(r.num_tokens) + " tokens");
    if (r.swapped) {
      for (std::int32_t h : r.blocks) {
        if (h < 0 || h >= num_host_blocks()) return fail("swapped request " + std::to_string(id) + " holds host block " + std::to_string(h) + " outside the host pool");
        if (++host_refs[std::size_t(h)] > 1 || !host_swapped_[std::size_t(h)]) return fail("host block " + std::to_string(h) + " is held twice or not marked");
      }
    } else {
      for (std::int32_t b : r.blocks) {
        if (b < 0 || b >= config_.num_blocks) return fail("request " + std::to_string(id) + " holds block " + std::to_string(b) + " outside the pool");
        ++refs[std::size_t(b)];
      }
    }
    if (config_.enable_prefix_caching && std::int64_t(r.partial.size()) != r.num_tokens % page)
      return fail("request " + std::to_string(id) + " keeps " + std::to_string(r.partial.size()) + " partial tokens");
  }
  std::int32_t free_count = 0, cached_free = 0, cached = 0;
  for (std::size_t b = 0; b < blocks_.size(); ++b) {
    const KVCacheBlock& blk = blocks_[b];
    if (blk.id != std::int32_t(b)) return fail("block " + std::to_string(b) + " has id " + std::to_string(blk.id));
    if (external_refs_[b] < 0) return fail("block " + std::to_string(b) + " has negative external references");
    if (blk.ref_count != refs[b] + external_refs_[b])
      return fail("block " + std::to_string(b) + " has reference count " + std::to_string(blk.ref_count) + ", tables hold " +
                  std::to_string(refs[b]) + " and external references " + std::to_string(external_refs_[b]));
    if (blk.ref_count == 0) {
      ++free_count;
      if (blk.cached) ++cached_free;
    }
    if (blk.cached) {
      ++cached;
      auto it = index_.find(blk.hash);
      if (it == index_.end() || it->second != std::int32_t(b)) return fail("cached block " + std::to_string(b) + " is not indexed under its hash");
    }
  }
  if (std::int64_t(index_.size()) != cached) return fail("the prefix index has " + std::to_string(index_.size()) + " entries for " + std::to_string(cached) + " cached blocks");
  if (free_count != num_free_ || cached_free != num_cached_free_ || cached != num_cached_)
    return fail("counters: free " + std::to_string(num_free_) + " (counted " + std::to_string(free_count) + "), cached free " +
                std::to_string(num_cached_free_) + " (" + std::to_string(cached_free) + "), cached " + std::to_string(num_cached_) +
                " (" + std::to_string(cached) + ")");
  // The free list: exactly the unreferenced blocks, uncached ones before cached ones.
  std::int32_t listed = 0, prev = -1;
  bool seen_cached = false;
  for (std::int32_t b = head_; b >= 0; b = next_[std::size_t(b)]) {
    if (++listed > config_.num_blocks) return fail("the free list has a cycle");
    if (prev_[std::size_t(b)] != prev) return fail("free list back link of block " + std::to_string(b));
    const KVCacheBlock& blk = blocks_[std::size_t(b)];
    if (blk.ref_count != 0) return fail("block " + std::to_string(b) + " is on the free list with references");
    if (blk.cached) seen_cached = true;
    else if (seen_cached) return fail("uncached free block " + std::to_string(b) + " behind cached ones");
    prev = b;
  }
  if (prev != tail_) return fail("the free list's tail");
  // The host pool: every block either on the free stack once or held by one swapped request.
  std::int64_t held = 0;
  for (std::size_t h = 0; h < host_swapped_.size(); ++h) {
    if (host_swapped_[h] && !host_refs[h]) return fail("host block " + std::to_string(h) + " is marked but no request holds it");
    held += host_refs[h];
  }
  std::vector<char> on_stack(host_swapped_.size(), 0);
  for (std::int32_t h : host_free_) {
    if (h < 0 || std::size_t(h) >= host_swapped_.size() || on_stack[std::size_t(h)]++ || host_swapped_[std::size_t(h)])
      return fail("the host free stack holds block " + std::to_string(h) + " twice, out of range or in use");
  }
  if (held + std::int64_t(host_free_.size()) != std::int64_t(host_swapped_.size()))
    return fail("host pool: " + std::to_string(held) + " held and " + std::to_string(host_free_.size()) + " free of " + std::to_string(host_swapped_.size()));
  if (listed != num_free_) return fail("the free list holds " + std::to_string(listed) + " blocks, " + std::to_string(num_free_) + " are free");
  return {};
}

Status KVCacheManager::validate_block_table(std::span<const std::int32_t> table, std::int64_t context_len,
                                            std::int32_t num_blocks, std::int32_t page_size) {
  if (context_len < 0) return shape_mismatch("block table: negative context length " + std::to_string(context_len));
  if (page_size <= 0) return invalid_argument("block table: page size must be positive");
  const std::int64_t needed = (context_len + page_size - 1) / page_size;
  if (needed > std::int64_t(table.size()))
    return shape_mismatch("block table: context length " + std::to_string(context_len) + " needs " + std::to_string(needed) +
                          " blocks of " + std::to_string(page_size) + ", the table has " + std::to_string(table.size()));
  for (std::int64_t i = 0; i < needed; ++i) {
    std::int32_t b = table[std::size_t(i)];
    if (b < 0 || b >= num_blocks)
      return invalid_argument("block table: entry " + std::to_string(i) + " is block " + std::to_string(b) +
                              ", outside the pool of " + std::to_string(num_blocks) + " blocks");
  }
  return {};
}

}  // namespace kiln
