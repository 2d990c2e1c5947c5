// `kiln export` / `kiln import`: a signed bundle carries one host's kernels and tuning rows to
// another; every record is verified on import, a tampered one is rejected alone, a tampered
// manifest or another fleet's key refuses the whole bundle, and an unsafe key file is refused.
#include <set>

#include "cache/tuning.h"
#include "daemon/protocol.h"
#include "remote/bundle.h"
#include "remote/signed.h"
#include "tests/cli/sandbox.h"
#include "tests/remote/redis_harness.h"

namespace kiln::testing {
namespace {

const fs::path k_models = KILN_TEST_MODELS;

std::set<std::string> cached(Sandbox& sb) {
  std::set<std::string> out;
  for (const auto& e : sb.kiln_json({"ls", "--embedded", "--json"}))
    out.insert(e["key"].get<std::string>() + " " + e["checksum"].get<std::string>());
  return out;
}

class Bundle : public ::testing::Test {
 protected:
  void SetUp() override {
    key = write_secret(a.root() / "fleet.key", "bundle test fleet key 0123456789\n");
    a.set_env("KILN_FLEET_KEY_FILE", key.string());
    b.set_env("KILN_FLEET_KEY_FILE", key.string());
    Proc p = a.kiln({"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(), "--arch", "sm_80",
                     "--tokens", "16"});
    ASSERT_EQ(p.rc, 0) << p.all();
    bundle = a.root() / "kernels.kbundle";
    Proc e = a.kiln({"export", "--embedded", "--out", bundle.string()});
    ASSERT_EQ(e.rc, 0) << e.all();
    ASSERT_TRUE(fs::exists(bundle));
  }
  std::string read_bundle_bytes() { return slurp(bundle); }
  void write_bundle_bytes(const std::string& bytes) { std::ofstream(bundle, std::ios::binary | std::ios::trunc) << bytes; }

  Sandbox a, b;
  fs::path key, bundle;
};

TEST_F(Bundle, CarriesTheCacheToAnotherHost) {
  int rc = -1;
  json r = b.kiln_json({"import", "--embedded", bundle.string(), "--json"}, &rc);
  ASSERT_EQ(rc, 0) << r.dump(2);
  const auto theirs = cached(a);
  EXPECT_EQ(r["kernels"], theirs.size());
  EXPECT_TRUE(r["rejected"].empty());
  EXPECT_EQ(cached(b), theirs) << "the same keys with the same cubins";
  // Imported kernels are served as cache hits: prewarming the same model compiles nothing.
  json again = b.kiln_json({"prewarm", "--embedded", "--model", (k_models / "tiny_llama.json").string(), "--arch",
                            "sm_80", "--tokens", "16", "--json"});
  EXPECT_EQ(again["compiled"], 0);
  EXPECT_EQ(again["cached"], theirs.size());
  Proc verify = b.kiln({"verify", "--embedded"});
  EXPECT_EQ(verify.rc, 0) << verify.all();
}

TEST_F(Bundle, ATamperedRecordIsRejectedAndTheOthersImported) {
  std::string bytes = read_bundle_bytes();
  bytes[bytes.size() - 200] = char(bytes[bytes.size() - 200] ^ 0x04);  // inside the last record
  write_bundle_bytes(bytes);
  int rc = -1;
  json r = b.kiln_json({"import", "--embedded", bundle.string(), "--json"}, &rc);
  EXPECT_EQ(rc, 1);
  ASSERT_EQ(r["rejected"].size(), 1u) << r.dump(2);
  EXPECT_EQ(r["kernels"], cached(a).size() - 1);
  EXPECT_EQ(cached(b).size(), cached(a).size() - 1);
}

TEST_F(Bundle, ATamperedManifestOrAnotherFleetKeyRefusesTheWholeBundle) {
  const fs::path other = write_secret(b.root() / "other.key", "some other fleet's key 0123456789\n");
  Proc wrong = b.kiln({"import", "--embedded", bundle.string(), "--fleet-key-file", other.string()});
  EXPECT_EQ(wrong.rc, 1) << wrong.all();
  EXPECT_NE(wrong.err.find("manifest failed verification"), std::string::npos) << wrong.all();

  const std::string original = read_bundle_bytes();
  std::string bytes = original;
  bytes[14 + 8 + 20] = char(bytes[14 + 8 + 20] ^ 0x01);  // inside the manifest
  write_bundle_bytes(bytes);
  Proc r = b.kiln({"import", "--embedded", bundle.string()});
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_NE(r.err.find("manifest failed verification"), std::string::npos) << r.all();

  write_bundle_bytes(original.substr(0, original.size() - 10));
  r = b.kiln({"import", "--embedded", bundle.string()});
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.all();

  write_bundle_bytes("not a bundle at all");
  r = b.kiln({"import", "--embedded", bundle.string()});
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_TRUE(cached(b).empty()) << "nothing was imported";
}

TEST_F(Bundle, RefusesAFleetKeyOthersCanRead) {
  const fs::path open_key = write_secret(b.root() / "open.key", "bundle test fleet key 0123456789\n", 0644);
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"import", "--embedded", bundle.string(), "--fleet-key-file", open_key.string()},
           {"export", "--embedded", "--out", (b.root() / "x").string(), "--fleet-key-file", open_key.string()}}) {
    Proc r = b.kiln(args);
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_NE(r.err.find("must be 0600"), std::string::npos) << r.all();
  }
  b.set_env("KILN_FLEET_KEY_FILE", "");
  Proc none = b.kiln({"import", "--embedded", bundle.string()});
  EXPECT_EQ(none.rc, 2) << none.all();
}

// Tuning rows travel too (made up here: tuning needs a GPU); a row under another row's name is
// refused.
TEST(BundleTuning, RowsAreImportedAndCheckedAgainstTheirNames) {
  Sandbox b;
  const fs::path key = write_secret(b.root() / "fleet.key", "bundle test fleet key 0123456789\n");
  cache::TuningRecord r;
  r.family = "rmsnorm";
  r.signature = "dtype=bf16,align=16,rows<=4096,cols=4096,x_row_stride=4096,y_row_stride=4096";
  r.setup = {"sm_90a", "NVIDIA H100 80GB HBM3", "580.65.06 cuda 13000", std::string(64, 'a')};
  r.winner = "block=256,bulk=0,dtype=bf16,row=0,vec=8";
  r.winner_ms = 0.01;
  r.heuristic = r.winner;
  r.heuristic_ms = 0.01;
  r.candidates.push_back({r.winner, cache::CandidateStatus::ok, 0.01, 0.01, 20, ""});
  cache::TuningRecord moved = r;
  moved.signature = "dtype=bf16,align=16,rows<=64,cols=4096,x_row_stride=4096,y_row_stride=4096";
  remote::BundleContents contents;
  contents.tuning.emplace_back(remote::tuning_name(r.family, r.signature, r.setup),
                               daemon::dump_json(daemon::tuning_record_to_json(r)));
  contents.tuning.emplace_back(remote::tuning_name(r.family, r.signature + ",x", r.setup),
                               daemon::dump_json(daemon::tuning_record_to_json(moved)));
  const fs::path file = b.root() / "tuning.kbundle";
  ASSERT_TRUE(remote::write_bundle(file, "bundle test fleet key 0123456789", contents).ok());
  int rc = -1;
  json out = b.kiln_json({"import", "--embedded", file.string(), "--fleet-key-file", key.string(), "--json"}, &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_EQ(out["tuning_rows"], 1);
  ASSERT_EQ(out["rejected"].size(), 1u);
  json tuned = b.kiln_json({"ls", "--embedded", "--tuned", "--json"});
  ASSERT_EQ(tuned.size(), 1u) << tuned.dump(2);
  EXPECT_EQ(tuned[0]["signature"], r.signature);
}

}  // namespace
}  // namespace kiln::testing
