#include "remote/tuning.h"

#include <cstdio>

#include "daemon/protocol.h"
#include "remote/signed.h"

namespace kiln::remote {

std::optional<cache::TuningRecord> fetch_winner(Tier& tier, cache::TuningTable& table, const std::string& family,
                                                const std::string& signature, const cache::Setup& setup) {
  auto payload = tier.get_record(tuning_name(family, signature, setup));
  if (!payload) return std::nullopt;
  auto j = daemon::parse_json(*payload);
  if (!j.ok()) return std::nullopt;
  auto rec = daemon::tuning_record_from_json(*j);
  // The name hashes these fields, so a mismatch means a collision or a bug: not used.
  if (!rec.ok() || rec->family != family || rec->signature != signature || !(rec->setup == setup) ||
      rec->winner.empty())
    return std::nullopt;
  if (Status s = table.put(*rec); !s.ok())
    std::fprintf(stderr, "kiln: remote: could not keep a tuned winner from %s: %s\n", tier.describe().c_str(),
                 s.to_string().c_str());
  return std::move(rec).value();
}

void share_winner(Tier& tier, const cache::TuningRecord& record) {
  if (record.winner.empty()) return;
  tier.put_record(tuning_name(record.family, record.signature, record.setup),
                  daemon::dump_json(daemon::tuning_record_to_json(record)));
}

}  // namespace kiln::remote
