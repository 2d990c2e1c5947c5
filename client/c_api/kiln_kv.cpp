// The C ABI of the paged KV cache's host bookkeeping (kiln.h, version 6) over kiln/kv_cache.h and
// kiln/radix_cache.h, and the paged decode's host plans (version 7). Every entry point catches everything: no exception crosses it.
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "families/paged_attention/ops.h"
#include "kiln/kiln.h"
#include "kiln/kv_cache.h"
#include "kiln/radix_cache.h"

namespace kiln::c_api {
kiln_code set_last_error(const kiln::Status& s);
}

struct kiln_kv_manager {
  std::optional<kiln::KVCacheManager> m;
};
struct kiln_kv_plan {
  kiln::SlotPlan plan;
};
struct kiln_radix {
  std::unique_ptr<kiln::RadixCache> tree;
};

namespace {

using kiln::c_api::set_last_error;

static_assert(sizeof(kiln::BlockCopy) == 2 * sizeof(int32_t), "copies are read as (src, dst) int32 pairs");
static_assert(int(kiln::KVDType::fp8_e5m2) == KILN_KV_FP8_E5M2 && int(kiln::Admission::never) == KILN_KV_NEVER);

template <class F>
kiln_code guarded(F&& f) {
  try {
    return set_last_error(f());
  } catch (const std::exception& e) {
    return set_last_error(kiln::internal_error(std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return set_last_error(kiln::internal_error("unexpected exception"));
  }
}

kiln::Status need(const void* p, const char* name) {
  return p ? kiln::Status{} : kiln::invalid_argument(std::string(name) + " is NULL");
}

// A (pointer, count) pair from C as a span; NULL is fine only with count 0.
template <class T>
kiln::Status span_of(const T* p, int64_t n, const char* name, std::span<const T>& out) {
  if (n < 0) return kiln::invalid_argument(std::string(name) + ": negative count");
  if (n > 0 && !p) return kiln::invalid_argument(std::string(name) + " is NULL");
  out = n > 0 ? std::span<const T>(p, std::size_t(n)) : std::span<const T>();
  return {};
}

kiln::PrefixKey key_of(const char* adapter, const char* salt) {
  return kiln::PrefixKey{adapter ? adapter : "", salt ? salt : ""};
}

}  // namespace

extern "C" {

kiln_code kiln_kv_manager_create(const kiln_kv_config* config, kiln_kv_manager** out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(config, "config"));
    KILN_TRY(need(out, "out"));
    if (config->dtype < 0 || config->dtype > KILN_KV_FP8_E5M2) return kiln::invalid_argument("kv cache: unknown KV dtype");
    kiln::KVCacheConfig c;
    c.num_blocks = config->num_blocks;
    c.page_size = config->page_size;
    c.dtype = kiln::KVDType(config->dtype);
    c.num_layers = config->num_layers;
    c.num_kv_heads = config->num_kv_heads;
    c.head_dim = config->head_dim;
    c.enable_prefix_caching = config->enable_prefix_caching != 0;
    KILN_ASSIGN_OR_RETURN(kiln::KVCacheManager m, kiln::KVCacheManager::create(c));
    auto h = std::make_unique<kiln_kv_manager>();
    h->m.emplace(std::move(m));
    *out = h.release();
    return {};
  });
}

void kiln_kv_manager_destroy(kiln_kv_manager* m) { delete m; }

kiln_code kiln_kv_plan_create(kiln_kv_plan** out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(out, "out"));
    *out = new kiln_kv_plan;
    return {};
  });
}

void kiln_kv_plan_destroy(kiln_kv_plan* plan) { delete plan; }

void kiln_kv_plan_clear(kiln_kv_plan* plan) {
  if (plan) plan->plan.clear();
}

kiln_code kiln_kv_plan_get(const kiln_kv_plan* plan, const int64_t** slots, int64_t* num_slots, const int32_t** copies,
                           int64_t* num_copies) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(plan, "plan"));
    if (slots) *slots = plan->plan.slot_mapping.data();
    if (num_slots) *num_slots = int64_t(plan->plan.slot_mapping.size());
    if (copies) *copies = reinterpret_cast<const int32_t*>(plan->plan.copies.data());
    if (num_copies) *num_copies = int64_t(plan->plan.copies.size());
    return {};
  });
}

kiln_code kiln_kv_can_allocate(kiln_kv_manager* m, int64_t request, int64_t num_new_tokens, int32_t* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(out, "out"));
    if (num_new_tokens < 0) return kiln::invalid_argument("kv cache: negative token count");
    *out = int32_t(m->m->can_allocate(request, num_new_tokens));
    return {};
  });
}

kiln_code kiln_kv_can_allocate_prompt(kiln_kv_manager* m, const int32_t* tokens, int64_t num_tokens, const char* adapter,
                                      const char* salt, int32_t* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(out, "out"));
    std::span<const int32_t> t;
    KILN_TRY(span_of(tokens, num_tokens, "tokens", t));
    *out = int32_t(m->m->can_allocate(t, key_of(adapter, salt)));
    return {};
  });
}

kiln_code kiln_kv_allocate(kiln_kv_manager* m, int64_t request, const int32_t* tokens, int64_t num_tokens,
                           const char* adapter, const char* salt, const int32_t* prefix_blocks,
                           int64_t num_prefix_blocks, kiln_kv_plan* plan, int64_t* num_cached) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(plan, "plan"));
    std::span<const int32_t> t, p;
    KILN_TRY(span_of(tokens, num_tokens, "tokens", t));
    KILN_TRY(span_of(prefix_blocks, num_prefix_blocks, "prefix_blocks", p));
    KILN_ASSIGN_OR_RETURN(int64_t cached, m->m->allocate(request, t, plan->plan, key_of(adapter, salt), p));
    if (num_cached) *num_cached = cached;
    return {};
  });
}

kiln_code kiln_kv_append_slots(kiln_kv_manager* m, int64_t request, const int32_t* tokens, int64_t num_tokens,
                               kiln_kv_plan* plan) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(plan, "plan"));
    std::span<const int32_t> t;
    KILN_TRY(span_of(tokens, num_tokens, "tokens", t));
    return m->m->append_slots(request, t, plan->plan);
  });
}

kiln_code kiln_kv_fork(kiln_kv_manager* m, int64_t parent, int64_t child) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    return m->m->fork(parent, child);
  });
}

kiln_code kiln_kv_free(kiln_kv_manager* m, int64_t request) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    return m->m->free(request);
  });
}

kiln_code kiln_kv_retain(kiln_kv_manager* m, const int32_t* blocks, int64_t num_blocks) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    std::span<const int32_t> b;
    KILN_TRY(span_of(blocks, num_blocks, "blocks", b));
    return m->m->retain(b);
  });
}

kiln_code kiln_kv_release(kiln_kv_manager* m, const int32_t* blocks, int64_t num_blocks) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    std::span<const int32_t> b;
    KILN_TRY(span_of(blocks, num_blocks, "blocks", b));
    return m->m->release(b);
  });
}

kiln_code kiln_kv_block_table(kiln_kv_manager* m, int64_t request, const int32_t** blocks, int64_t* num_blocks,
                              int64_t* num_tokens) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_ASSIGN_OR_RETURN(std::span<const int32_t> table, m->m->block_table(request));
    if (blocks) *blocks = table.data();
    if (num_blocks) *num_blocks = int64_t(table.size());
    if (num_tokens) *num_tokens = *m->m->num_tokens(request);
    return {};
  });
}

kiln_code kiln_kv_block_info(kiln_kv_manager* m, int32_t block, int32_t* ref_count, int32_t* external_refs,
                             int32_t* cached) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    if (block < 0 || block >= m->m->num_blocks())
      return kiln::invalid_argument("kv cache: block " + std::to_string(block) + " is outside the pool of " +
                                    std::to_string(m->m->num_blocks()) + " blocks");
    const kiln::KVCacheBlock& b = m->m->block(block);
    if (ref_count) *ref_count = b.ref_count;
    if (external_refs) *external_refs = m->m->external_refs(block);
    if (cached) *cached = b.cached ? 1 : 0;
    return {};
  });
}

kiln_code kiln_kv_get_stats(kiln_kv_manager* m, kiln_kv_stats* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(out, "out"));
    const kiln::KVCacheStats s = m->m->stats();
    *out = kiln_kv_stats{s.num_blocks,  s.free_blocks,           s.cached_free_blocks, s.used_blocks,
                         s.cached_blocks, s.num_requests,        s.prefix_queried_tokens, s.prefix_hit_tokens,
                         s.evictions,   s.cow_copies,            m->m->config().bytes_per_block()};
    return {};
  });
}

kiln_code kiln_kv_check(kiln_kv_manager* m) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    return m->m->check_invariants();
  });
}

kiln_code kiln_kv_enable_swap(kiln_kv_manager* m, int32_t num_host_blocks) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    return m->m->enable_swap(num_host_blocks);
  });
}

namespace {

kiln::Status swap_pairs(kiln_kv_manager* m, int64_t request, int32_t* pairs, int64_t capacity, int64_t* num_pairs,
                        bool out) {
  KILN_TRY(need(m, "manager"));
  KILN_TRY(need(num_pairs, "num_pairs"));
  KILN_ASSIGN_OR_RETURN(std::span<const int32_t> table, m->m->block_table(request));
  if (capacity < int64_t(table.size()))
    return kiln::invalid_argument("kv cache: " + std::string(out ? "swap_out" : "swap_in") + ": room for " +
                                  std::to_string(capacity) + " pairs, the request has " +
                                  std::to_string(table.size()) + " blocks");
  if (!table.empty()) KILN_TRY(need(pairs, "pairs"));
  std::vector<kiln::BlockCopy> copies;
  KILN_TRY(out ? m->m->swap_out(request, copies) : m->m->swap_in(request, copies));
  for (std::size_t i = 0; i < copies.size(); ++i) {
    pairs[2 * i] = copies[i].src;
    pairs[2 * i + 1] = copies[i].dst;
  }
  *num_pairs = int64_t(copies.size());
  return {};
}

}  // namespace

kiln_code kiln_kv_swap_out(kiln_kv_manager* m, int64_t request, int32_t* pairs, int64_t capacity, int64_t* num_pairs) {
  return guarded([&]() { return swap_pairs(m, request, pairs, capacity, num_pairs, true); });
}

kiln_code kiln_kv_swap_in(kiln_kv_manager* m, int64_t request, int32_t* pairs, int64_t capacity, int64_t* num_pairs) {
  return guarded([&]() { return swap_pairs(m, request, pairs, capacity, num_pairs, false); });
}

kiln_code kiln_kv_can_swap_in(kiln_kv_manager* m, int64_t request, int32_t* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(out, "out"));
    KILN_ASSIGN_OR_RETURN(kiln::Admission a, m->m->can_swap_in(request));
    *out = int32_t(a);
    return {};
  });
}

kiln_code kiln_kv_swap_state(kiln_kv_manager* m, int64_t request, int32_t* swapped, int32_t* host_blocks,
                             int32_t* free_host_blocks) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    if (swapped) *swapped = m->m->is_swapped(request) ? 1 : 0;
    if (host_blocks) *host_blocks = m->m->num_host_blocks();
    if (free_host_blocks) *free_host_blocks = m->m->num_free_host_blocks();
    return {};
  });
}

kiln_code kiln_kv_validate_block_table(const int32_t* table, int64_t table_len, int64_t context_len, int32_t num_blocks,
                                       int32_t page_size) {
  return guarded([&]() -> kiln::Status {
    std::span<const int32_t> t;
    KILN_TRY(span_of(table, table_len, "table", t));
    return kiln::KVCacheManager::validate_block_table(t, context_len, num_blocks, page_size);
  });
}

kiln_code kiln_paged_decode_plan(const int32_t* seq_lens, int64_t batch, const int32_t* cu_seqlens_q,
                                 const int32_t* block_tables, int64_t max_blocks, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t page_size, int64_t num_blocks, int64_t sm_count,
                                 kiln_paged_decode_plan_t* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(out, "out"));
    if (batch < 0 || max_blocks < 0) return kiln::shape_mismatch("kiln_paged_decode_plan: negative batch or max_blocks");
    std::span<const int32_t> lens, cu, tables;
    KILN_TRY(span_of(seq_lens, batch, "seq_lens", lens));
    if (cu_seqlens_q) cu = std::span<const int32_t>(cu_seqlens_q, std::size_t(batch + 1));
    if (block_tables) tables = std::span<const int32_t>(block_tables, std::size_t(batch * max_blocks));
    const kiln::PagedDecodeShape shape{.heads = heads,
                                       .kv_heads = kv_heads,
                                       .head_dim = head_dim,
                                       .page_size = page_size,
                                       .num_blocks = num_blocks,
                                       .max_blocks = max_blocks};
    KILN_ASSIGN_OR_RETURN(const kiln::PagedDecodePlan p, kiln::plan_paged_decode(shape, lens, cu, tables, sm_count));
    *out = {p.batch, p.total_q, p.max_seqlen_q, p.max_seq_len, p.splits, p.workspace_elements};
    return {};
  });
}

kiln_code kiln_paged_cascade_decode_plan(const int32_t* shared_block_table, int64_t shared_blocks, int64_t shared_len,
                                         const int32_t* seq_lens, int64_t batch, const int32_t* block_tables,
                                         int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t page_size, int64_t num_blocks, int64_t sm_count,
                                         kiln_paged_cascade_plan_t* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(out, "out"));
    if (batch < 0 || max_blocks < 0)
      return kiln::shape_mismatch("kiln_paged_cascade_decode_plan: negative batch or max_blocks");
    std::span<const int32_t> shared, lens, tables;
    KILN_TRY(span_of(shared_block_table, shared_blocks, "shared_block_table", shared));
    KILN_TRY(span_of(seq_lens, batch, "seq_lens", lens));
    if (block_tables) tables = std::span<const int32_t>(block_tables, std::size_t(batch * max_blocks));
    const kiln::PagedDecodeShape shape{.heads = heads,
                                       .kv_heads = kv_heads,
                                       .head_dim = head_dim,
                                       .page_size = page_size,
                                       .num_blocks = num_blocks,
                                       .max_blocks = max_blocks};
    KILN_ASSIGN_OR_RETURN(const kiln::PagedCascadePlan p,
                          kiln::plan_paged_cascade_decode(shape, shared, shared_len, lens, tables, sm_count));
    *out = {p.batch, p.shared_len, p.max_seq_len, p.shared_splits, p.splits, p.workspace_elements};
    return {};
  });
}

kiln_code kiln_radix_create(kiln_kv_manager* m, kiln_radix** out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(m, "manager"));
    KILN_TRY(need(out, "out"));
    auto r = std::make_unique<kiln_radix>();
    r->tree = std::make_unique<kiln::RadixCache>(*m->m);
    *out = r.release();
    return {};
  });
}

void kiln_radix_destroy(kiln_radix* r) { delete r; }

kiln_code kiln_radix_match(kiln_radix* r, const int32_t* tokens, int64_t num_tokens, int32_t* blocks_out,
                           int64_t capacity, int64_t* num_blocks, int64_t* node) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    std::span<const int32_t> t;
    KILN_TRY(span_of(tokens, num_tokens, "tokens", t));
    const int64_t most = num_tokens / r->tree->page_size();
    if (capacity < most || (most > 0 && !blocks_out))
      return kiln::invalid_argument("radix cache: blocks_out holds " + std::to_string(capacity) + " blocks, a match of " +
                                    std::to_string(num_tokens) + " tokens may need " + std::to_string(most));
    kiln::RadixCache::Match match = r->tree->match_prefix(t);
    std::copy(match.blocks.begin(), match.blocks.end(), blocks_out);
    if (num_blocks) *num_blocks = int64_t(match.blocks.size());
    if (node) *node = match.node;
    return {};
  });
}

kiln_code kiln_radix_insert(kiln_radix* r, const int32_t* tokens, int64_t num_tokens, const int32_t* blocks,
                            int64_t num_blocks, int64_t* node, int64_t* cached_tokens) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    std::span<const int32_t> t, b;
    KILN_TRY(span_of(tokens, num_tokens, "tokens", t));
    KILN_TRY(span_of(blocks, num_blocks, "blocks", b));
    KILN_ASSIGN_OR_RETURN(kiln::RadixCache::InsertResult res, r->tree->insert(t, b));
    if (node) *node = res.node;
    if (cached_tokens) *cached_tokens = res.cached_tokens;
    return {};
  });
}

kiln_code kiln_radix_lock(kiln_radix* r, int64_t node) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    return r->tree->lock(node);
  });
}

kiln_code kiln_radix_unlock(kiln_radix* r, int64_t node) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    return r->tree->unlock(node);
  });
}

kiln_code kiln_radix_evict(kiln_radix* r, int64_t num_blocks, int64_t* freed) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    const int64_t n = r->tree->evict(num_blocks);
    if (freed) *freed = n;
    return {};
  });
}

kiln_code kiln_radix_get_stats(kiln_radix* r, kiln_radix_stats* out) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    KILN_TRY(need(out, "out"));
    const kiln::RadixCache::Stats s = r->tree->stats();
    *out = kiln_radix_stats{s.nodes,           s.cached_tokens,  s.cached_blocks,
                            s.evictable_blocks, s.protected_blocks, s.evicted_blocks,
                            r->tree->reclaimable_blocks()};
    return {};
  });
}

kiln_code kiln_radix_check(kiln_radix* r) {
  return guarded([&]() -> kiln::Status {
    KILN_TRY(need(r, "radix cache"));
    return r->tree->check_invariants();
  });
}

}  // extern "C"
