// Tuning winners shared through the remote tier, by kilnd's tuning service and the embedded
// resolver alike. A record's payload is the tuning row in the protocol's JSON form
// (daemon/protocol.h), signed under tuning_name(family, signature, setup) (remote/signed.h).
#pragma once

#include <optional>
#include <string>

#include "cache/tuning.h"
#include "remote/tier.h"

namespace kiln::remote {

// The winner another host tuned for exactly this family, signature and setup, stored in `table`
// too; nullopt when the tier has none, or one that does not decode or does not match.
std::optional<cache::TuningRecord> fetch_winner(Tier& tier, cache::TuningTable& table, const std::string& family,
                                                const std::string& signature, const cache::Setup& setup);

// Queues the write-back of a run tuned here; nothing for a run without a winner.
void share_winner(Tier& tier, const cache::TuningRecord& record);

}  // namespace kiln::remote
