// The paged KV cache's host side: blocks, per-request block tables, reference counts, prefix
// caching and copy-on-write (docs/serving.md).
//
// KVCacheManager owns no device memory. It hands out block ids in [0, num_blocks) of a pool the
// caller allocates (KVCacheConfig::bytes_per_block() bytes each), and says where each new token's
// K and V go (a slot: block * page_size + offset in the block) and which blocks the kernels must
// copy before a write (copy-on-write after fork).
//
// Thread-safety: not thread-safe. A manager is meant to be owned by one scheduler thread; callers
// that share one between threads serialize every call (const ones included) themselves. Distinct
// managers share no state and may be used from different threads at once.
//
// Errors are Status codes, and a failed call changes nothing:
//   invalid_argument  a bad configuration, a request id already in use, a block id outside the pool
//                     or a block that is already free (released twice);
//   not_found         a request that was never allocated or is already freed;
//   unavailable       not enough free blocks for the call now (can_allocate says whether waiting
//                     helps);
//   shape_mismatch    a context length past its block table (validate_block_table).
//
// Swapping (num_host_blocks > 0): swap_out moves a live request's blocks to the host pool and
// returns the (device block, host block) pairs to copy; the request keeps its tokens but holds
// host blocks, takes no appends and is in no batch until swap_in brings it back into new device
// blocks with (host block, device block) pairs. The blocks one call releases may be handed out by
// the next: run each call's copies (swap_blocks) in call order on one stream, and make the stream
// that writes the cache next wait for them.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kiln/status.h"

namespace kiln {

// The element type of the cached keys and values (it only sizes the blocks here).
enum class KVDType : std::uint8_t { f16 = 0, bf16 = 1, fp8_e4m3 = 2, fp8_e5m2 = 3 };
const char* kv_dtype_name(KVDType t);
std::size_t kv_dtype_size(KVDType t);

struct KVCacheConfig {
  std::int32_t num_blocks = 0;
  std::int32_t page_size = 16;  // tokens per block: 1, 8, 16, 32, 64 or 128
  KVDType dtype = KVDType::bf16;
  std::int32_t num_layers = 1;
  std::int32_t num_kv_heads = 1;
  std::int32_t head_dim = 128;
  // Full blocks are registered under their prefix hash and reused by later requests with the same
  // prefix; freed ones stay cached until their block is needed (LRU).
  bool enable_prefix_caching = true;
  // Blocks of the host pool that swap_out moves requests into (0: no swapping; enable_swap sets
  // it later). The caller allocates it page-locked, bytes_per_block() each.
  std::int32_t num_host_blocks = 0;

  // K and V of every layer for one block: 2 * layers * kv_heads * head_dim * page_size * size.
  std::uint64_t bytes_per_block() const;
  // invalid_argument unless every field is in range.
  Status validate() const;
};

// The number of blocks of `config` (its num_blocks ignored) that fit in `bytes`.
std::int64_t kv_blocks_for_bytes(const KVCacheConfig& config, std::uint64_t bytes);

// SHA-256 of a full block's place in a sequence: chained over the parent block's hash and the
// block's token ids, the chain rooted in the request's extra keys (PrefixKey).
using BlockHash = std::array<std::uint8_t, 32>;

// Extra keys that separate otherwise equal prefixes: blocks are shared only between requests
// with the same adapter and salt.
struct PrefixKey {
  std::string adapter;
  std::string salt;
};

// The root of a hash chain: SHA-256 over a version tag and the length-prefixed extra keys.
BlockHash prefix_root_hash(const PrefixKey& key);
// The hash of a full block following `parent`: SHA-256(parent || token count || tokens, each a
// little-endian int32).
BlockHash block_hash(const BlockHash& parent, std::span<const std::int32_t> tokens);

// One block's bookkeeping, as KVCacheManager::block() shows it.
struct KVCacheBlock {
  std::int32_t id = 0;
  // Request tables holding the block plus external references (retain/release, the radix cache).
  std::int32_t ref_count = 0;
  // Registered in the prefix cache under `hash` (full blocks only).
  bool cached = false;
  BlockHash hash{};
};

// A block the kernels copy (all layers, K and V) before new tokens are written to dst.
struct BlockCopy {
  std::int32_t src = 0;
  std::int32_t dst = 0;
  bool operator==(const BlockCopy&) const = default;
};

// What allocate() and append_slots() add for the kernels: the slot of every new token (in the
// order the calls gave them; what reshape_and_cache takes) and the block copies to run first.
// Calls append to it, so one plan gathers a whole batch; clear() keeps the capacity.
struct SlotPlan {
  std::vector<std::int64_t> slot_mapping;
  std::vector<BlockCopy> copies;
  void clear() {
    slot_mapping.clear();
    copies.clear();
  }
};

// A batch's block tables in the CSR form paged attention takes: request i's blocks are
// indices[indptr[i] .. indptr[i+1]), its last block holds last_page_len[i] tokens (1..page_size)
// and its context is context_lens[i] tokens.
struct PagedBatch {
  std::vector<std::int32_t> indptr;
  std::vector<std::int32_t> indices;
  std::vector<std::int32_t> last_page_len;
  std::vector<std::int32_t> context_lens;
  void clear() {
    indptr.clear();
    indices.clear();
    last_page_len.clear();
    context_lens.clear();
  }
};

// can_allocate's answer.
enum class Admission : std::uint8_t {
  now = 0,    // enough free blocks (counting cached unreferenced ones, which are evicted LRU)
  later = 1,  // the pool is large enough, but blocks must be released first (requests finishing,
              // or the radix cache evicting)
  never = 2,  // more blocks than the whole pool
};
const char* admission_name(Admission a);

struct KVCacheStats {
  std::int32_t num_blocks = 0;
  std::int32_t free_blocks = 0;         // reference count 0, cached or not
  std::int32_t cached_free_blocks = 0;  // free but still holding a registered prefix block
  std::int32_t used_blocks = 0;         // reference count > 0
  std::int32_t cached_blocks = 0;       // registered in the prefix cache (used or free)
  std::int64_t num_requests = 0;
  std::int64_t prefix_queried_tokens = 0;  // prompt tokens allocate() looked up
  std::int64_t prefix_hit_tokens = 0;      // of those, found in the prefix cache
  std::int64_t evictions = 0;              // cached free blocks reused for other content
  std::int64_t cow_copies = 0;
};

using RequestId = std::int64_t;

class KVCacheManager {
 public:
  // invalid_argument when the configuration is not valid.
  static Result<KVCacheManager> create(const KVCacheConfig& config);

  const KVCacheConfig& config() const { return config_; }
  std::int32_t page_size() const { return config_.page_size; }
  std::int32_t num_blocks() const { return config_.num_blocks; }

  // Whether `num_new_tokens` more tokens fit for `request`: growth of a live request (counting
  // the room in its last block and a copy-on-write of a shared last block), or a new request of
  // that many tokens when `request` is not live.
  Admission can_allocate(RequestId request, std::int64_t num_new_tokens) const;
  // Whether a new request with this prompt fits, counting its prefix-cache hits.
  Admission can_allocate(std::span<const std::int32_t> prompt, const PrefixKey& key = {}) const;
  // The blocks short of admitting that request now (0 when can_allocate says now).
  std::int32_t blocks_short(RequestId request, std::int64_t num_new_tokens) const;

  // Starts `request` with its prompt. Its first prefix_blocks.size() blocks are those given (full
  // blocks already holding prompt[0 .. n * page_size), typically a radix cache match; each gains a
  // reference); then, with prefix caching, the longest run of cached full blocks continuing the
  // prompt, leaving at least the prompt's last token to compute; then new blocks. Adds the slots
  // of the tokens not cached to `plan` and returns how many leading tokens were cached.
  Result<std::int64_t> allocate(RequestId request, std::span<const std::int32_t> prompt, SlotPlan& plan,
                                const PrefixKey& key = {}, std::span<const std::int32_t> prefix_blocks = {});
  // Grows `request` by these tokens: adds their slots to `plan`, taking new blocks as the last
  // fills, and a copy (added to plan.copies) when the last block is shared and partly filled.
  Status append_slots(RequestId request, std::span<const std::int32_t> tokens, SlotPlan& plan);
  // Starts `child` as a copy of `parent` (beam search, parallel sampling): the same blocks, each
  // gaining a reference. Nothing is copied now; the first append to a shared, partly filled last
  // block copies it (append_slots' plan.copies).
  Status fork(RequestId parent, RequestId child);
  // Ends `request`: its blocks lose a reference; blocks left unreferenced become free (registered
  // ones stay cached until evicted).
  Status free(RequestId request);

  // Swapping. swap_out: invalid_argument without a host pool or for a request already swapped
  // out, unavailable when the host pool has too few free blocks. The request's device blocks lose
  // its reference (blocks shared with other requests or cached stay theirs); each gets a host
  // block of its own, and `copies` gains (device, host) pairs in table order.
  Status swap_out(RequestId request, std::vector<BlockCopy>& copies);
  // Into fresh device blocks (unavailable when too few are free now; can_swap_in says whether
  // waiting helps), `copies` gaining (host, device) pairs; the host blocks become free. The
  // blocks are not registered in the prefix cache again; appends go on hashing where they were.
  Status swap_in(RequestId request, std::vector<BlockCopy>& copies);
  // now / later / never for swap_in (never: more blocks than the device pool). not_found and
  // invalid_argument (not swapped out) as swap_in.
  Result<Admission> can_swap_in(RequestId request) const;
  bool is_swapped(RequestId request) const;
  // Sets the host pool's size: invalid_argument while a request is swapped out, or for n < 0.
  Status enable_swap(std::int32_t num_host_blocks);
  std::int32_t num_host_blocks() const { return std::int32_t(host_swapped_.size()); }
  std::int32_t num_free_host_blocks() const { return std::int32_t(host_free_.size()); }

  // External references (the radix cache's): each listed block gains / loses one. invalid_argument
  // for a block outside the pool, a free block (retain) or one with no external reference left
  // (release); nothing changes then.
  Status retain(std::span<const std::int32_t> blocks);
  Status release(std::span<const std::int32_t> blocks);

  bool contains(RequestId request) const { return requests_.count(request) != 0; }
  // not_found for an unknown request. The span is valid until the next call that changes the
  // manager. A swapped-out request's table holds host pool blocks.
  Result<std::span<const std::int32_t>> block_table(RequestId request) const;
  Result<std::int64_t> num_tokens(RequestId request) const;
  // The CSR block tables of `requests`, in that order (appended to `out`, which is cleared first).
  Status build_batch(std::span<const RequestId> requests, PagedBatch& out) const;

  // Bookkeeping of block `id` (0 <= id < num_blocks, unchecked).
  const KVCacheBlock& block(std::int32_t id) const { return blocks_[std::size_t(id)]; }
  std::int32_t external_refs(std::int32_t id) const { return external_refs_[std::size_t(id)]; }
  KVCacheStats stats() const;
  std::int32_t num_free_blocks() const { return num_free_; }
  // Drops every cached free block from the prefix cache (e.g. after new weights).
  void reset_prefix_cache();

  // Every internal invariant: each reference count equals the request tables and external
  // references holding the block, the free list holds exactly the unreferenced blocks, the prefix
  // index matches the blocks' registrations. internal_error naming the first violation.
  Status check_invariants() const;

  // invalid_argument for an entry outside [0, num_blocks); shape_mismatch when context_len needs
  // more blocks than the table has or is negative. What a paged kernel checks before launch.
  static Status validate_block_table(std::span<const std::int32_t> table, std::int64_t context_len,
                                     std::int32_t num_blocks, std::int32_t page_size);

 private:
  struct Request {
    std::vector<std::int32_t> blocks;
    std::int64_t num_tokens = 0;
    // Prefix caching: tokens of the partly filled last block, and the hash of the last full block
    // (the chain root before the first).
    std::vector<std::int32_t> partial;
    BlockHash last_hash{};
    // Swapped out: `blocks` are host pool blocks.
    bool swapped = false;
  };
  struct HashOfHash {
    std::size_t operator()(const BlockHash& h) const;
  };

  explicit KVCacheManager(const KVCacheConfig& config);
  // Free list (doubly linked by block id): uncached blocks at the head, cached ones behind them
  // in release order, so allocation takes empty blocks first and then evicts the least recently
  // released cached block.
  void list_remove(std::int32_t b);
  void list_push_front(std::int32_t b);
  void list_push_back(std::int32_t b);
  std::int32_t take_free_block();
  void add_ref(std::int32_t b);
  void drop_ref(std::int32_t b);
  void register_full_block(std::int32_t b, const BlockHash& h);
  const Request* find(RequestId r) const;
  std::int32_t blocks_needed_to_grow(const Request& r, std::int64_t n) const;
  Admission admission(std::int32_t needed) const;
  // Writes `tokens` into r's blocks from its current length; blocks must already be available.
  void write_tokens(Request& r, std::span<const std::int32_t> tokens, SlotPlan& plan);

  KVCacheConfig config_;
  std::vector<KVCacheBlock> blocks_;
  std::vector<std::int32_t> external_refs_;
  std::vector<std::int32_t> prev_, next_;
  std::int32_t head_ = -1, tail_ = -1;
  std::int32_t num_free_ = 0, num_cached_free_ = 0, num_cached_ = 0;
  std::unordered_map<BlockHash, std::int32_t, HashOfHash> index_;
  std::unordered_map<RequestId, Request> requests_;
  std::vector<BlockHash> scratch_hashes_;
  mutable std::vector<std::int32_t> scratch_counts_;
  std::int64_t queried_ = 0, hits_ = 0, evictions_ = 0, cow_ = 0;
  // The host pool: free blocks (a stack) and, per block, whether a swapped request holds it.
  std::vector<std::int32_t> host_free_;
  std::vector<char> host_swapped_;
};

}  // namespace kiln
