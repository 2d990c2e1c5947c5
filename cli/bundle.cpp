// `kiln export` and `kiln import`: signed bundles of the cache's kernels and tuning rows
// (remote/bundle.h), for hosts the fleet's remote tier does not reach.
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "cache/tuning.h"
#include "cli/cli.h"
#include "common/paths.h"
#include "common/sha256.h"
#include "daemon/protocol.h"
#include "remote/bundle.h"
#include "remote/config.h"
#include "remote/signed.h"

namespace kiln::cli {
namespace {

// The fleet key from --fleet-key-file, else $KILN_FLEET_KEY_FILE; checked like the remote tier's.
Result<std::string> fleet_key(const std::string& flag) {
  std::string file = flag;
  if (file.empty())
    if (const char* e = std::getenv("KILN_FLEET_KEY_FILE")) file = e;
  if (file.empty())
    return invalid_argument("bundles are signed with the fleet key: give --fleet-key-file or set KILN_FLEET_KEY_FILE");
  KILN_ASSIGN_OR_RETURN(std::string key, remote::read_secret_file(file, "fleet key"));
  if (key.size() < remote::k_min_fleet_key_bytes)
    return invalid_argument("the fleet key in " + file + " is shorter than " +
                            std::to_string(remote::k_min_fleet_key_bytes) + " bytes");
  return key;
}

}  // namespace

int run_export(const GlobalOptions& g, const ExportOptions& o) {
  auto key = fleet_key(o.key_file);
  if (!key.ok()) return report_error(key.status(), k_exit_usage);
  if (!o.arch.empty())
    if (Status s = validate_arch(o.arch); !s.ok()) return report_error(s, k_exit_usage);
  auto store = open_existing_store();
  if (!store.ok()) return report_error(store.status());
  if (!*store) return report_error(not_found("there is no cache at " + cache_file().string() + " to export"));
  auto listed = (*store)->list({o.family, o.arch});
  if (!listed.ok()) return report_error(listed.status());
  remote::BundleContents contents;
  std::int64_t skipped = 0;
  for (const cache::Entry& meta : *listed) {
    auto e = (*store)->show(meta.key);
    if (!e.ok() || !*e) continue;  // evicted meanwhile
    // Only verified kernels leave this host: a damaged row would be signed as good otherwise.
    if (std::int64_t((*e)->cubin.size()) != (*e)->size || sha256_hex((*e)->cubin) != (*e)->checksum) {
      print_warning("skipping " + meta.key.substr(0, 12) + ": its cubin fails its checksum (kiln verify drops it)");
      ++skipped;
      continue;
    }
    contents.entries.push_back(std::move(**e));
  }
  if (!o.no_tuning) {
    auto table = cache::TuningTable::open(**store);
    if (!table.ok()) return report_error(table.status());
    auto rows = (*table)->list({o.family, o.arch});
    if (!rows.ok()) return report_error(rows.status());
    for (const auto& r : *rows)
      contents.tuning.emplace_back(remote::tuning_name(r.family, r.signature, r.setup),
                                   daemon::dump_json(daemon::tuning_record_to_json(r)));
  }
  if (Status s = remote::write_bundle(o.out, *key, contents); !s.ok()) return report_error(s);
  if (o.json) {
    std::cout << nlohmann::json{{"bundle", o.out},
                                {"kernels", contents.entries.size()},
                                {"tuning_rows", contents.tuning.size()},
                                {"skipped", skipped}}
                     .dump(2)
              << "\n";
  } else {
    std::printf("exported %zu kernel(s) and %zu tuning row(s) to %s\n", contents.entries.size(),
                contents.tuning.size(), o.out.c_str());
  }
  return skipped ? k_exit_failure : k_exit_ok;
}

int run_import(const GlobalOptions& g, const ImportOptions& o) {
  auto key = fleet_key(o.key_file);
  if (!key.ok()) return report_error(key.status(), k_exit_usage);
  auto bundle = remote::read_bundle(o.file, *key);
  if (!bundle.ok()) return report_error(bundle.status());
  auto store = cache::Store::open(cache_file());
  if (!store.ok()) return report_error(store.status());
  std::int64_t kernels = 0, tuning = 0;
  std::vector<std::string> failed = bundle->rejected;
  for (const cache::Entry& e : bundle->verified.entries) {
    if (Status s = (*store)->put(e); !s.ok()) failed.push_back(remote::entry_name(e.key) + ": " + s.message());
    else ++kernels;
  }
  if (!bundle->verified.tuning.empty()) {
    auto table = cache::TuningTable::open(**store);
    if (!table.ok()) return report_error(table.status());
    for (const auto& [name, payload] : bundle->verified.tuning) {
      auto j = daemon::parse_json(payload);
      auto rec = j.ok() ? daemon::tuning_record_from_json(*j) : Result<cache::TuningRecord>(j.status());
      // The record name hashes the row's identity: a row that does not match its name is refused.
      if (rec.ok() && remote::tuning_name(rec->family, rec->signature, rec->setup) != name)
        rec = corruption("the tuning row does not match its record name");
      Status s = rec.ok() ? (*table)->put(*rec) : rec.status();
      if (!s.ok()) failed.push_back(name + ": " + s.message());
      else ++tuning;
    }
  }
  if (o.json) {
    std::cout << nlohmann::json{{"bundle", o.file},
                                {"cache_file", cache_file().string()},
                                {"kernels", kernels},
                                {"tuning_rows", tuning},
                                {"rejected", failed}}
                     .dump(2)
              << "\n";
  } else {
    std::printf("imported %lld kernel(s) and %lld tuning row(s) into %s\n", static_cast<long long>(kernels),
                static_cast<long long>(tuning), cache_file().c_str());
  }
  if (failed.empty()) return k_exit_ok;
  std::string details;
  for (const auto& f : failed) details += f + "\n";
  print_error(std::to_string(failed.size()) + " record(s) of the bundle were rejected and not imported", details);
  return k_exit_failure;
}

}  // namespace kiln::cli
