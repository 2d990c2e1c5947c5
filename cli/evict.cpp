// `kiln evict`: shrink the cache least recently used first, pin and unpin entries; and the pinning
// behind `kiln prewarm --pin`. The size cap itself is kept by every process that stores
// (cache::Store::put, KILN_CACHE_MAX_MB); this command applies it, or a tighter one, on demand.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "cli/cli.h"
#include "common/paths.h"
#include "jit/builder.h"

namespace kiln::cli {
namespace {

// The full key of a key or unique key prefix.
Result<std::string> full_key(cache::Store& store, const std::string& key_or_prefix) {
  KILN_ASSIGN_OR_RETURN(auto e, store.show(key_or_prefix));
  if (!e) return not_found("no cached entry with key " + key_or_prefix);
  return e->key;
}

}  // namespace

Status pin_variants(const std::vector<std::pair<KernelSpec, std::string>>& variants) {
  auto store = cache::Store::open(cache_file());
  if (!store.ok()) return store.status();
  jit::Builder keys(nullptr, &Registry::global());
  std::size_t pinned = 0;
  for (const auto& [spec, arch] : variants) {
    KILN_ASSIGN_OR_RETURN(std::string text, keys.key_text(spec, arch));
    const std::string key = text.substr(0, text.find('\n'));
    Status s = (*store)->pin(key);
    // A variant that failed to compile has no entry: nothing to pin, and prewarm reported it.
    if (s.code() == Code::not_found) continue;
    KILN_TRY(s);
    ++pinned;
  }
  std::fprintf(stderr, "kiln: pinned %zu of %zu variants\n", pinned, variants.size());
  return {};
}

int run_evict(const GlobalOptions& g, const EvictOptions& o) {
  if (o.all && o.max_mb) return report_error(invalid_argument("give --all or --max-mb, not both"), k_exit_usage);
  auto opened = open_existing_store();
  if (!opened.ok()) return report_error(opened.status());
  if (!*opened) {
    std::printf("no cache at %s: nothing to evict\n", cache_file().c_str());
    return k_exit_ok;
  }
  cache::Store& store = **opened;

  std::vector<std::string> pinned, unpinned;
  for (const auto& [list, value, out] : {std::tuple{&o.pin, true, &pinned}, std::tuple{&o.unpin, false, &unpinned}})
    for (const auto& k : *list) {
      auto key = full_key(store, k);
      if (!key.ok()) return report_error(key.status(), k_exit_usage);
      if (Status s = store.pin(*key, value); !s.ok()) return report_error(s);
      out->push_back(*key);
    }

  // With only --pin/--unpin nothing is evicted; otherwise down to --max-mb, zero, or the cap.
  const bool evicting = o.all || o.max_mb || (o.pin.empty() && o.unpin.empty());
  cache::EvictReport report;
  std::int64_t target = -1;
  if (evicting) {
    auto st = store.stats();
    if (!st.ok()) return report_error(st.status());
    target = o.all ? 0 : o.max_mb ? std::int64_t(std::llround(*o.max_mb * 1024 * 1024)) : st->max_bytes;
    if (target <= 0 && !o.all && !o.max_mb) {
      std::printf("the cache has no size cap (KILN_CACHE_MAX_MB=0): give --max-mb or --all\n");
      return k_exit_ok;
    }
    auto r = store.evict_to(target);
    if (!r.ok()) return report_error(r.status());
    report = *r;
  }
  auto after = store.stats();
  if (!after.ok()) return report_error(after.status());

  if (o.json) {
    nlohmann::json j = {{"cache_file", cache_file().string()},
                        {"target_bytes", target},
                        {"bytes_before", report.bytes_before},
                        {"bytes_after", evicting ? report.bytes_after : after->bytes},
                        {"evicted", report.evicted_keys},
                        {"pinned", pinned},
                        {"unpinned", unpinned},
                        {"entries", after->entries},
                        {"pinned_entries", after->pinned_entries},
                        {"evictions_total", after->evictions}};
    std::cout << j.dump(2) << "\n";
    return k_exit_ok;
  }
  for (const auto& k : pinned) std::printf("pinned   %s\n", k.c_str());
  for (const auto& k : unpinned) std::printf("unpinned %s\n", k.c_str());
  if (evicting) {
    for (const auto& k : report.evicted_keys) std::printf("evicted  %s\n", k.c_str());
    std::printf("evicted %zu entries: %s -> %s (target %s); %lld left, %lld pinned (%s)\n",
                report.evicted_keys.size(), human_bytes(report.bytes_before).c_str(),
                human_bytes(report.bytes_after).c_str(), human_bytes(target).c_str(),
                static_cast<long long>(after->entries), static_cast<long long>(after->pinned_entries),
                human_bytes(after->pinned_bytes).c_str());
  }
  return k_exit_ok;
}

}  // namespace kiln::cli
