#include "kiln/radix_cache.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <string>

namespace kiln {

struct RadixCache::Node {
  NodeId id = 0;
  Node* parent = nullptr;
  std::vector<std::int32_t> key;     // token ids, a whole number of pages
  std::vector<std::int32_t> blocks;  // one per page of key
  // Children by a hash of their first page; equal hashes are told apart by comparing the page.
  std::unordered_multimap<std::uint64_t, Node*> children;
  std::int64_t lock_ref = 0;  // locks on this node and on its descendants
  std::int64_t direct = 0;    // locks taken on this node itself
  std::uint64_t last_access = 0;
};

RadixCache::RadixCache(KVCacheManager& manager)
    : manager_(manager), page_(manager.page_size()), root_(std::make_unique<Node>()) {
  nodes_[0] = root_.get();
}

RadixCache::~RadixCache() {
  for (auto& [id, n] : nodes_) {
    if (n != root_.get()) {
      (void)manager_.release(n->blocks);
      delete n;
    }
  }
}

std::uint64_t RadixCache::page_key(std::span<const std::int32_t> tokens) const {
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  for (std::int32_t i = 0; i < page_; ++i) {
    h ^= std::uint32_t(tokens[std::size_t(i)]);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
  }
  return h;
}

RadixCache::Node* RadixCache::child_for(Node* node, std::span<const std::int32_t> tokens) const {
  auto [lo, hi] = node->children.equal_range(page_key(tokens));
  for (auto it = lo; it != hi; ++it)
    if (std::equal(tokens.begin(), tokens.begin() + page_, it->second->key.begin())) return it->second;
  return nullptr;
}

RadixCache::Node* RadixCache::find_node(NodeId id) const {
  auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second;
}

void RadixCache::touch(Node* node) { node->last_access = ++clock_; }

// Splits `node` after `at` tokens (a page multiple, 0 < at < key size): a new node takes the first
// `at` tokens and becomes the parent; `node` keeps its id and the rest of its key.
RadixCache::Node* RadixCache::split(Node* node, std::int64_t at) {
  auto* mid = new Node;
  mid->id = next_id_++;
  mid->parent = node->parent;
  mid->key.assign(node->key.begin(), node->key.begin() + at);
  mid->blocks.assign(node->blocks.begin(), node->blocks.begin() + at / page_);
  mid->lock_ref = node->lock_ref;
  mid->last_access = node->last_access;
  const std::uint64_t k = page_key(node->key);
  auto [lo, hi] = node->parent->children.equal_range(k);
  for (auto it = lo; it != hi; ++it)
    if (it->second == node) {
      it->second = mid;
      break;
    }
  node->key.erase(node->key.begin(), node->key.begin() + at);
  node->blocks.erase(node->blocks.begin(), node->blocks.begin() + at / page_);
  node->parent = mid;
  mid->children.emplace(page_key(node->key), node);
  nodes_[mid->id] = mid;
  return mid;
}

RadixCache::Match RadixCache::match_prefix(std::span<const std::int32_t> tokens) {
  Match m;
  const std::int64_t n = std::int64_t(tokens.size()) / page_ * page_;
  Node* node = root_.get();
  touch(node);
  std::int64_t pos = 0;
  while (pos < n) {
    Node* child = child_for(node, tokens.subspan(std::size_t(pos)));
    if (!child) break;
    const std::int64_t limit = std::min<std::int64_t>(std::int64_t(child->key.size()), n - pos);
    std::int64_t c = page_;
    while (c < limit && child->key[std::size_t(c)] == tokens[std::size_t(pos + c)]) ++c;
    c = c / page_ * page_;
    if (c < std::int64_t(child->key.size())) child = split(child, c);
    touch(child);
    m.blocks.insert(m.blocks.end(), child->blocks.begin(), child->blocks.end());
    node = child;
    pos += c;
    if (c < limit) break;
  }
  m.num_tokens = pos;
  m.node = node->id;
  return m;
}

Result<RadixCache::InsertResult> RadixCache::insert(std::span<const std::int32_t> tokens,
                                                    std::span<const std::int32_t> blocks) {
  const std::int64_t n = std::int64_t(blocks.size()) * page_;
  if (n > std::int64_t(tokens.size()))
    return invalid_argument("radix cache: " + std::to_string(blocks.size()) + " blocks cover more than the " +
                            std::to_string(tokens.size()) + " tokens given");
  for (std::int32_t b : blocks) {
    if (b < 0 || b >= manager_.num_blocks())
      return invalid_argument("radix cache: block " + std::to_string(b) + " is outside the pool of " +
                              std::to_string(manager_.num_blocks()) + " blocks");
    if (manager_.block(b).ref_count == 0)
      return invalid_argument("radix cache: block " + std::to_string(b) + " is free (its contents are not held)");
  }
  InsertResult r;
  Node* node = root_.get();
  touch(node);
  std::int64_t pos = 0;
  while (pos < n) {
    Node* child = child_for(node, tokens.subspan(std::size_t(pos)));
    if (!child) {
      auto* leaf = new Node;
      leaf->id = next_id_++;
      leaf->parent = node;
      leaf->key.assign(tokens.begin() + pos, tokens.begin() + n);
      leaf->blocks.assign(blocks.begin() + pos / page_, blocks.end());
      Status s = manager_.retain(leaf->blocks);
      (void)s;  // checked above: every block is in the pool and held
      touch(leaf);
      node->children.emplace(page_key(leaf->key), leaf);
      nodes_[leaf->id] = leaf;
      cached_blocks_ += std::int64_t(leaf->blocks.size());
      node = leaf;
      break;
    }
    const std::int64_t limit = std::min<std::int64_t>(std::int64_t(child->key.size()), n - pos);
    std::int64_t c = page_;
    while (c < limit && child->key[std::size_t(c)] == tokens[std::size_t(pos + c)]) ++c;
    c = c / page_ * page_;
    if (c < std::int64_t(child->key.size())) child = split(child, c);
    touch(child);
    node = child;
    pos += c;
    r.cached_tokens = pos;
  }
  r.node = node->id;
  return r;
}

Status RadixCache::lock(NodeId id) {
  Node* node = find_node(id);
  if (!node) return not_found("radix cache: node " + std::to_string(id) + " does not exist (evicted?)");
  ++node->direct;
  for (Node* n = node; n != root_.get(); n = n->parent)
    if (n->lock_ref++ == 0) protected_blocks_ += std::int64_t(n->blocks.size());
  return {};
}

Status RadixCache::unlock(NodeId id) {
  Node* node = find_node(id);
  if (!node) return not_found("radix cache: node " + std::to_string(id) + " does not exist (evicted?)");
  if (node->direct == 0) return invalid_argument("radix cache: node " + std::to_string(id) + " is not locked");
  --node->direct;
  for (Node* n = node; n != root_.get(); n = n->parent)
    if (--n->lock_ref == 0) protected_blocks_ -= std::int64_t(n->blocks.size());
  return {};
}

bool RadixCache::evictable_leaf(const Node* node) const {
  return node != root_.get() && node->children.empty() && node->lock_ref == 0;
}

void RadixCache::remove_leaf(Node* node) {
  auto [lo, hi] = node->parent->children.equal_range(page_key(node->key));
  for (auto it = lo; it != hi; ++it)
    if (it->second == node) {
      node->parent->children.erase(it);
      break;
    }
  cached_blocks_ -= std::int64_t(node->blocks.size());
  nodes_.erase(node->id);
  delete node;
}

std::int64_t RadixCache::evict(std::int64_t num_blocks) {
  using Entry = std::pair<std::uint64_t, Node*>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  for (auto& [id, n] : nodes_)
    if (evictable_leaf(n)) heap.emplace(n->last_access, n);
  std::int64_t freed = 0;
  while (freed < num_blocks && !heap.empty()) {
    Node* node = heap.top().second;
    heap.pop();
    Status s = manager_.release(node->blocks);
    (void)s;  // the tree holds one external reference on each of its blocks
    for (std::int32_t b : node->blocks)
      if (manager_.block(b).ref_count == 0) ++freed;
    evicted_blocks_ += std::int64_t(node->blocks.size());
    Node* parent = node->parent;
    remove_leaf(node);
    if (evictable_leaf(parent)) heap.emplace(parent->last_access, parent);
  }
  return freed;
}

void RadixCache::clear() { (void)evict(std::numeric_limits<std::int64_t>::max()); }

RadixCache::Stats RadixCache::stats() const {
  Stats s;
  s.nodes = std::int64_t(nodes_.size()) - 1;
  s.cached_blocks = cached_blocks_;
  s.cached_tokens = cached_blocks_ * page_;
  s.protected_blocks = protected_blocks_;
  s.evictable_blocks = cached_blocks_ - protected_blocks_;
  s.evicted_blocks = evicted_blocks_;
  return s;
}

std::int64_t RadixCache::reclaimable_blocks() const {
  std::int64_t n = 0;
  for (auto& [id, node] : nodes_) {
    if (node->lock_ref > 0) continue;
    for (std::int32_t b : node->blocks) n += manager_.block(b).ref_count == manager_.external_refs(b);
  }
  return n;
}

void RadixCache::for_each_block(const std::function<void(std::int32_t)>& fn) const {
  for (auto& [id, n] : nodes_)
    for (std::int32_t b : n->blocks) fn(b);
}

Status RadixCache::check_invariants() const {
  auto fail = [](std::string m) { return internal_error("radix cache invariant: " + std::move(m)); };
  std::int64_t blocks = 0, prot = 0;
  for (auto& [id, n] : nodes_) {
    if (n->id != id) return fail("node " + std::to_string(id) + " is filed under another id");
    std::int64_t child_locks = 0;
    for (auto& [k, c] : n->children) {
      if (c->parent != n) return fail("node " + std::to_string(c->id) + " has the wrong parent");
      if (k != page_key(c->key)) return fail("node " + std::to_string(c->id) + " is filed under the wrong page key");
      if (find_node(c->id) != c) return fail("child " + std::to_string(c->id) + " is not registered");
      child_locks += c->lock_ref;
    }
    if (n == root_.get()) continue;
    if (n->key.empty() || std::int64_t(n->key.size()) != std::int64_t(n->blocks.size()) * page_)
      return fail("node " + std::to_string(id) + " has " + std::to_string(n->key.size()) + " tokens and " +
                  std::to_string(n->blocks.size()) + " blocks");
    if (n->lock_ref != n->direct + child_locks)
      return fail("node " + std::to_string(id) + " lock count " + std::to_string(n->lock_ref) + " != own " +
                  std::to_string(n->direct) + " + children " + std::to_string(child_locks));
    for (std::int32_t b : n->blocks) {
      if (b < 0 || b >= manager_.num_blocks()) return fail("node " + std::to_string(id) + " lists block " + std::to_string(b));
      if (manager_.block(b).ref_count == 0) return fail("node " + std::to_string(id) + " lists free block " + std::to_string(b));
    }
    blocks += std::int64_t(n->blocks.size());
    if (n->lock_ref > 0) prot += std::int64_t(n->blocks.size());
  }
  if (blocks != cached_blocks_ || prot != protected_blocks_)
    return fail("counters: blocks " + std::to_string(cached_blocks_) + " (counted " + std::to_string(blocks) + "), protected " +
                std::to_string(protected_blocks_) + " (" + std::to_string(prot) + ")");
  return {};
}

// --- RadixAttentionWithPagedKVCache ---

RadixAttentionWithPagedKVCache::RadixAttentionWithPagedKVCache(KVCacheManager manager)
    : manager_(std::move(manager)), tree_(std::make_unique<RadixCache>(manager_)) {}

Result<std::unique_ptr<RadixAttentionWithPagedKVCache>> RadixAttentionWithPagedKVCache::create(KVCacheConfig config) {
  config.enable_prefix_caching = false;
  KILN_ASSIGN_OR_RETURN(KVCacheManager m, KVCacheManager::create(config));
  return std::unique_ptr<RadixAttentionWithPagedKVCache>(new RadixAttentionWithPagedKVCache(std::move(m)));
}

Admission RadixAttentionWithPagedKVCache::can_allocate(std::span<const std::int32_t> prompt) {
  const std::int64_t page = manager_.page_size();
  const std::int64_t total = (std::int64_t(prompt.size()) + page - 1) / page;
  if (total > manager_.num_blocks()) return Admission::never;
  RadixCache::Match m = tree_->match_prefix(prompt.empty() ? prompt : prompt.first(prompt.size() - 1));
  // The matched path is needed, not evictable: count what eviction would free with it locked.
  (void)tree_->lock(m.node);
  const std::int64_t evictable = tree_->reclaimable_blocks();
  (void)tree_->unlock(m.node);
  const std::int64_t needed = total - std::int64_t(m.blocks.size());
  return needed <= manager_.num_free_blocks() + evictable ? Admission::now : Admission::later;
}

bool RadixAttentionWithPagedKVCache::ensure_free(std::int32_t num_blocks) {
  const std::int32_t free = manager_.num_free_blocks();
  if (free < num_blocks) (void)tree_->evict(num_blocks - free);
  return manager_.num_free_blocks() >= num_blocks;
}

Result<std::int64_t> RadixAttentionWithPagedKVCache::add_request(RequestId id, std::span<const std::int32_t> prompt,
                                                                 SlotPlan& plan) {
  if (live_.count(id)) return invalid_argument("radix attention: request " + std::to_string(id) + " is already live");
  RadixCache::Match m = tree_->match_prefix(prompt.empty() ? prompt : prompt.first(prompt.size() - 1));
  KILN_TRY(tree_->lock(m.node));
  const std::int64_t page = manager_.page_size();
  const std::int64_t needed = (std::int64_t(prompt.size()) + page - 1) / page - std::int64_t(m.blocks.size());
  if (needed <= manager_.num_blocks()) (void)ensure_free(std::int32_t(needed));
  Result<std::int64_t> cached = manager_.allocate(id, prompt, plan, {}, m.blocks);
  if (!cached.ok()) {
    (void)tree_->unlock(m.node);
    return cached.status();
  }
  live_[id] = Live{m.node, std::vector<std::int32_t>(prompt.begin(), prompt.end())};
  return cached;
}

Status RadixAttentionWithPagedKVCache::append(RequestId id, std::span<const std::int32_t> tokens, SlotPlan& plan) {
  auto it = live_.find(id);
  if (it == live_.end()) return not_found("radix attention: request " + std::to_string(id) + " is not live");
  const std::int32_t short_by = manager_.blocks_short(id, std::int64_t(tokens.size()));
  if (short_by > 0) (void)ensure_free(manager_.num_free_blocks() + short_by);
  KILN_TRY(manager_.append_slots(id, tokens, plan));
  it->second.tokens.insert(it->second.tokens.end(), tokens.begin(), tokens.end());
  return {};
}

Status RadixAttentionWithPagedKVCache::fork(RequestId parent, RequestId child) {
  auto it = live_.find(parent);
  if (it == live_.end()) return not_found("radix attention: fork: parent request " + std::to_string(parent) + " is not live");
  if (live_.count(child)) return invalid_argument("radix attention: fork: child request " + std::to_string(child) + " is already live");
  KILN_TRY(manager_.fork(parent, child));
  KILN_TRY(tree_->lock(it->second.node));
  Live copy = it->second;
  live_.emplace(child, std::move(copy));
  return {};
}

Status RadixAttentionWithPagedKVCache::finish(RequestId id, bool cache) {
  auto it = live_.find(id);
  if (it == live_.end()) return not_found("radix attention: request " + std::to_string(id) + " is not live");
  if (cache) {
    KILN_ASSIGN_OR_RETURN(std::span<const std::int32_t> table, manager_.block_table(id));
    const std::size_t full = it->second.tokens.size() / std::size_t(manager_.page_size());
    KILN_TRY(tree_->insert(it->second.tokens, table.first(full)).status());
  }
  KILN_TRY(tree_->unlock(it->second.node));
  KILN_TRY(manager_.free(id));
  live_.erase(it);
  return {};
}

}  // namespace kiln
