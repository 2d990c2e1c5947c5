// libFuzzer target (docs/reliability.md, item 11): everything kilnd does with a peer's bytes before
// a request reaches a compile worker, and everything the client library does with a daemon's reply.
//
// Input: a 16-byte frame header, then the frame body. The header goes through decode_header and
// check_limits (as the server reads it); the body through parse_json and, when it is an object,
// the daemon's validation of a `get` (KernelSpec::parse, validate_arch, Registry::resolve, the
// family's render) and the client's decoding of a reply (reply_status, entry_from_json,
// parse_source). The raw body is also fed to the spec parser directly, so that spec syntax is
// explored without the fuzzer first having to discover JSON.
//
// Invariants checked (a violation aborts, which libFuzzer reports as a crash):
//  - a spec that parses re-parses from its canonical text to the same canonical text;
//  - JSON the daemon would send (dump_json) is JSON it can read back (parse_json);
//  - no spec that resolves renders source containing a preprocessor directive from its params.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "daemon/protocol.h"
#include "kiln/family.h"
#include "kiln/spec.h"

namespace {

using kiln::KernelSpec;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

void spec_roundtrip(std::string_view text) {
  auto spec = KernelSpec::parse(text);
  if (!spec.ok()) return;
  const std::string canon = spec->canonical();
  auto again = KernelSpec::parse(canon);
  check(again.ok(), "canonical spec text re-parses");
  check(again->canonical() == canon, "canonical spec text is a fixed point");
}

void validate_get(const nlohmann::json& req) {
  auto spec_it = req.find("spec");
  auto arch_it = req.find("arch");
  if (arch_it != req.end() && arch_it->is_string()) (void)kiln::validate_arch(arch_it->get<std::string>());
  if (spec_it == req.end() || !spec_it->is_string()) return;
  const std::string text = spec_it->get<std::string>();
  spec_roundtrip(text);
  auto spec = KernelSpec::parse(text);
  if (!spec.ok()) return;
  auto family = kiln::Registry::global().resolve(*spec);
  if (!family.ok()) return;
  auto rendered = (*family)->render(spec->params);
  if (!rendered.ok()) return;
  // Params are validated against closed schemas, so what reaches NVRTC is the family's own text:
  // a '#' never comes from a parameter value.
  check(rendered->name_expression.find('#') == std::string::npos, "no directive in a name expression");
}

void decode_reply(const nlohmann::json& j) {
  (void)kiln::daemon::reply_status(j);
  if (auto e = j.find("entry"); e != j.end()) (void)kiln::daemon::entry_from_json(*e);
  (void)kiln::daemon::entry_from_json(j);
  if (auto s = j.find("source"); s != j.end() && s->is_string()) (void)kiln::daemon::parse_source(s->get<std::string>());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::daemon;
  if (size < k_header_size) {
    spec_roundtrip(std::string_view(reinterpret_cast<const char*>(data), size));
    return 0;
  }
  HeaderBytes hb{};
  std::memcpy(hb.data(), data, k_header_size);
  auto header = decode_header(hb);
  if (header.ok()) {
    (void)check_limits(*header, FrameKind::request);
    (void)check_limits(*header, FrameKind::reply);
    check(decode_header(encode_header(*header)).ok(), "an encoded header decodes");
  }
  const std::string_view body(reinterpret_cast<const char*>(data) + k_header_size, size - k_header_size);
  spec_roundtrip(body);
  auto parsed = parse_json(body);
  if (!parsed.ok()) return 0;
  const std::string text = dump_json(*parsed);
  check(parse_json(text).ok(), "dump_json output parses");
  if (!parsed->is_object()) return 0;
  validate_get(*parsed);
  decode_reply(*parsed);
  return 0;
}
