// The embedded resolver's tuned winners (no daemon): the cache file's tuning table first, then
// the fleet's remote tier (a winner found there is kept in the table), then, in `wait` mode only,
// a tuning run here on the device, whose winner is written back to the remote tier. Not
// thread-safe: the runtime calls it under its resolve lock.
#pragma once

#include <memory>
#include <optional>

#include "cache/store.h"
#include "cache/tuning.h"
#include "jit/autotune_mode.h"
#include "jit/builder.h"
#include "jit/device_info.h"
#include "kiln/family.h"
#include "kiln/status.h"
#include "remote/tier.h"

namespace kiln::client {

class EmbeddedTuning {
 public:
  // Opens the tuning table in `store`'s file. Nothing is owned; `remote` may be null.
  static Result<std::unique_ptr<EmbeddedTuning>> open(cache::Store& store, jit::Builder& builder,
                                                      remote::Tier* remote);

  // The tuned winner for `problem` on `device`, or nullopt when there is none (and `mode` is not
  // wait). Errors: the table, or a tuning run, failed.
  Result<std::optional<Params>> winner(const Family& family, const Problem& problem, const jit::DeviceInfo& device,
                                       jit::AutotuneMode mode);

 private:
  EmbeddedTuning(jit::Builder& builder, remote::Tier* remote, std::unique_ptr<cache::TuningTable> table)
      : builder_(builder), remote_(remote), table_(std::move(table)) {}
  jit::Builder& builder_;
  remote::Tier* remote_;
  std::unique_ptr<cache::TuningTable> table_;
};

}  // namespace kiln::client
