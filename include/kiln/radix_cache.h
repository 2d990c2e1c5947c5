// RadixCache: a token-level radix tree over a KVCacheManager's blocks, in SGLang's RadixAttention
// design (docs/serving.md). Each edge holds a run of token ids and the blocks caching their K and
// V; a lookup finds the longest cached prefix of a prompt, running requests lock the path they
// use, and unlocked leaves are evicted least recently used first, their blocks going back to the
// manager.
//
// The tree holds one external reference (KVCacheManager::retain) on every block it lists. With a
// page size above 1 it caches whole pages only: matches and splits fall on page boundaries.
//
// RadixAttentionWithPagedKVCache puts the two together behind the request life cycle a scheduler
// drives (add a request with its prompt, grow it, fork it, finish it), evicting from the tree when
// the manager runs short of blocks.
//
// Thread-safety: as KVCacheManager: not thread-safe; one owner, or calls serialized by the caller
// together with the manager's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "kiln/kv_cache.h"

namespace kiln {

class RadixCache {
 public:
  // A node handle: 0 is the root; ids are never reused. A node evicted or split away is gone
  // (not_found); a split keeps the id on the lower part, so a handle keeps naming the path's end.
  using NodeId = std::int64_t;

  struct Match {
    std::vector<std::int32_t> blocks;  // the cached prefix's blocks, in order
    std::int64_t num_tokens = 0;       // blocks.size() * page_size
    NodeId node = 0;                   // the node where the match ends (lock it while in use)
  };
  struct InsertResult {
    NodeId node = 0;                 // the node ending the inserted prefix
    std::int64_t cached_tokens = 0;  // leading tokens that were already in the tree (its blocks kept)
  };
  struct Stats {
    std::int64_t nodes = 0;              // besides the root
    std::int64_t cached_tokens = 0;
    std::int64_t cached_blocks = 0;
    std::int64_t evictable_blocks = 0;   // in unlocked nodes
    std::int64_t protected_blocks = 0;   // in locked nodes
    std::int64_t evicted_blocks = 0;     // over the cache's life
  };

  // The manager must outlive the cache; the cache's references are released by clear() or the
  // destructor.
  explicit RadixCache(KVCacheManager& manager);
  ~RadixCache();
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  std::int32_t page_size() const { return page_; }

  // The longest cached prefix of `tokens` (whole pages), splitting a node where the match ends
  // inside it. Marks the path used now (LRU).
  Match match_prefix(std::span<const std::int32_t> tokens);
  // Caches tokens[0 .. n) with n = blocks.size() * page_size rounded down to what `tokens` holds:
  // blocks[i] holds tokens [i * page, (i + 1) * page). Pages already in the tree keep the tree's
  // blocks (the caller's duplicates stay the caller's); new ones are retained from the manager.
  // invalid_argument when blocks cover more tokens than given, or a block is outside the pool or
  // free.
  Result<InsertResult> insert(std::span<const std::int32_t> tokens, std::span<const std::int32_t> blocks);
  // Lock: the node and its ancestors are not evicted until as many unlock calls. not_found for an
  // unknown node; invalid_argument for unlocking a node that is not locked.
  Status lock(NodeId node);
  Status unlock(NodeId node);
  // Evicts unlocked leaves, least recently used first, until `num_blocks` blocks have been freed in
  // the manager or nothing evictable is left; returns the blocks freed (blocks still held by a
  // request lose the tree's reference but are not freed, and do not count).
  std::int64_t evict(std::int64_t num_blocks);
  // Drops every unlocked node.
  void clear();

  Stats stats() const;
  // The blocks evict() could free now: listed in unlocked nodes and referenced by the tree alone
  // (a block a request also holds loses the tree's reference but stays in use). O(nodes).
  std::int64_t reclaimable_blocks() const;
  // Blocks the tree lists, each once per node listing it (what the tree holds references on).
  void for_each_block(const std::function<void(std::int32_t)>& fn) const;
  // Structure, lock counts and counters; internal_error naming the first violation.
  Status check_invariants() const;

 private:
  struct Node;
  Node* find_node(NodeId id) const;
  Node* split(Node* node, std::int64_t at);
  void touch(Node* node);
  std::uint64_t page_key(std::span<const std::int32_t> tokens) const;
  Node* child_for(Node* node, std::span<const std::int32_t> tokens) const;
  void remove_leaf(Node* node);
  bool evictable_leaf(const Node* node) const;

  KVCacheManager& manager_;
  std::int32_t page_;
  std::unique_ptr<Node> root_;
  std::unordered_map<NodeId, Node*> nodes_;
  NodeId next_id_ = 1;
  std::uint64_t clock_ = 0;
  std::int64_t cached_blocks_ = 0, protected_blocks_ = 0, evicted_blocks_ = 0;
};

// The manager and a radix cache behind a scheduler's request life cycle (SGLang's flow):
// add_request matches the prompt in the tree, locks the match and allocates the rest (evicting
// from the tree when the manager is short of blocks); append grows a request; finish caches its
// full pages in the tree, unlocks and frees it.
class RadixAttentionWithPagedKVCache {
 public:
  // The manager's own prefix index is not used (the tree replaces it): config.enable_prefix_caching
  // is ignored and set false.
  static Result<std::unique_ptr<RadixAttentionWithPagedKVCache>> create(KVCacheConfig config);

  KVCacheManager& manager() { return manager_; }
  const KVCacheManager& manager() const { return manager_; }
  RadixCache& tree() { return *tree_; }

  // now when the request fits after evicting unlocked tree nodes; later when it would fit once
  // running requests finish; never when it exceeds the pool.
  Admission can_allocate(std::span<const std::int32_t> prompt);
  // Returns the number of leading prompt tokens served from the tree (their slots are not in the
  // plan). At least the prompt's last token is always computed.
  Result<std::int64_t> add_request(RequestId id, std::span<const std::int32_t> prompt, SlotPlan& plan);
  Status append(RequestId id, std::span<const std::int32_t> tokens, SlotPlan& plan);
  // The child shares the parent's blocks and its tree lock; its tokens are the parent's so far.
  Status fork(RequestId parent, RequestId child);
  // Caches the request's full pages (its tokens: prompt and generated ones) and frees it; with
  // cache=false nothing is added to the tree.
  Status finish(RequestId id, bool cache = true);
  // Makes `num_blocks` blocks free if the tree can give them; returns whether they are.
  bool ensure_free(std::int32_t num_blocks);

 private:
  struct Live {
    RadixCache::NodeId node = 0;
    std::vector<std::int32_t> tokens;
  };
  explicit RadixAttentionWithPagedKVCache(KVCacheManager manager);

  KVCacheManager manager_;
  std::unique_ptr<RadixCache> tree_;
  std::unordered_map<RequestId, Live> live_;
};

}  // namespace kiln
