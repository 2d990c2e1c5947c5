#include "client/embedded_tuning.h"

#include "jit/autotune.h"
#include "jit/tuning_setup.h"
#include "remote/tuning.h"

namespace kiln::client {

Result<std::unique_ptr<EmbeddedTuning>> EmbeddedTuning::open(cache::Store& store, jit::Builder& builder,
                                                             remote::Tier* remote) {
  KILN_ASSIGN_OR_RETURN(auto table, cache::TuningTable::open(store));
  return std::unique_ptr<EmbeddedTuning>(new EmbeddedTuning(builder, remote, std::move(table)));
}

Result<std::optional<Params>> EmbeddedTuning::winner(const Family& family, const Problem& problem,
                                                     const jit::DeviceInfo& device, jit::AutotuneMode mode) {
  KILN_ASSIGN_OR_RETURN(cache::Setup setup,
                        jit::tuning_setup(family, problem, device.arch, device.name, device.driver_version));
  const std::string name(family.name());
  const std::string signature = family.signature(problem);
  KILN_ASSIGN_OR_RETURN(auto found, table_->lookup(name, signature, setup));
  if (!found && remote_) found = remote::fetch_winner(*remote_, *table_, name, signature, setup);
  if (found) {
    KILN_ASSIGN_OR_RETURN(Params p, Params::parse(found->winner));
    return std::optional<Params>(std::move(p));
  }
  // Embedded clients never tune in the background: timing next to the caller's own kernels would
  // measure both. `wait` tunes here, now, holding the GPU lock like kilnd does.
  if (mode != jit::AutotuneMode::wait) return std::optional<Params>();
  jit::TuneOptions o;
  o.device = device.ordinal;
  jit::Tuner tuner(&builder_, table_.get());
  KILN_ASSIGN_OR_RETURN(cache::TuningRecord rec, tuner.tune(family, problem, o));
  if (remote_) remote::share_winner(*remote_, rec);
  if (rec.winner.empty()) return std::optional<Params>();
  KILN_ASSIGN_OR_RETURN(Params p, Params::parse(rec.winner));
  return std::optional<Params>(std::move(p));
}

}  // namespace kiln::client
