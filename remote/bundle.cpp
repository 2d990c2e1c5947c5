#include "remote/bundle.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/hmac.h"
#include "common/sha256.h"
#include "remote/signed.h"

namespace kiln::remote {
namespace {

using nlohmann::json;

constexpr std::string_view k_magic = "kiln-bundle 1\n";
constexpr std::string_view k_manifest_name = "bundle-manifest";
constexpr std::uint64_t k_max_manifest = 256u << 20;

void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

bool read_u64(std::ifstream& in, std::uint64_t& v) {
  unsigned char b[8];
  if (!in.read(reinterpret_cast<char*>(b), 8)) return false;
  v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(b[i]) << (8 * i);
  return true;
}

}  // namespace

Status write_bundle(const std::filesystem::path& file, std::string_view fleet_key, const BundleContents& contents) {
  json records = json::array();
  std::vector<std::string> sealed;
  for (const cache::Entry& e : contents.entries) {
    sealed.push_back(seal_entry(fleet_key, e));
    records.push_back({{"name", entry_name(e.key)},
                       {"kind", "kernel"},
                       {"what", e.family + "(" + e.params + ") @ " + e.arch},
                       {"bytes", sealed.back().size()},
                       {"sha256", sha256_hex(sealed.back())}});
  }
  for (const auto& [name, payload] : contents.tuning) {
    sealed.push_back(seal(fleet_key, name, payload));
    records.push_back({{"name", name},
                       {"kind", "tuning"},
                       {"what", "tuning row"},
                       {"bytes", sealed.back().size()},
                       {"sha256", sha256_hex(sealed.back())}});
  }
  const std::int64_t now =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string manifest =
      json{{"format", 1}, {"created", now}, {"records", std::move(records)}}.dump(-1, ' ', false,
                                                                                  json::error_handler_t::replace);
  const std::string tagged = seal(fleet_key, k_manifest_name, manifest);

  std::filesystem::path tmp = file;
  tmp += ".part-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return io_error("cannot write " + tmp.string() + ": " + std::strerror(errno));
    std::string head(k_magic);
    put_u64(head, manifest.size());
    out.write(head.data(), std::streamsize(head.size()));
    out.write(tagged.data(), std::streamsize(tagged.size()));
    for (const auto& s : sealed) {
      std::string len;
      put_u64(len, s.size());
      out.write(len.data(), 8);
      out.write(s.data(), std::streamsize(s.size()));
    }
    out.flush();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      return io_error("writing " + tmp.string() + " failed (disk full?)");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return io_error("cannot move the bundle into place at " + file.string() + ": " + ec.message());
  }
  return {};
}

Result<BundleReport> read_bundle(const std::filesystem::path& file, std::string_view fleet_key) {
  std::error_code ec;
  const auto file_size = std::filesystem::file_size(file, ec);
  if (ec) return io_error("cannot read the bundle " + file.string() + ": " + ec.message());
  std::ifstream in(file, std::ios::binary);
  if (!in) return io_error("cannot open the bundle " + file.string());
  auto not_bundle = [&](const std::string& why) { return corruption("the bundle " + file.string() + " " + why); };

  std::string magic(k_magic.size(), '\0');
  if (!in.read(magic.data(), std::streamsize(magic.size())) || magic != k_magic)
    return not_bundle("is not a kiln bundle (no 'kiln-bundle 1' header)");
  std::uint64_t manifest_len = 0;
  if (!read_u64(in, manifest_len) || manifest_len > k_max_manifest || manifest_len + k_tag_bytes > file_size)
    return not_bundle("has a manifest length out of range");
  std::string tagged(manifest_len + k_tag_bytes, '\0');
  if (!in.read(tagged.data(), std::streamsize(tagged.size()))) return not_bundle("is truncated in its manifest");
  auto manifest_text = unseal(fleet_key, k_manifest_name, tagged);
  if (!manifest_text.ok())
    return corruption("the bundle " + file.string() + "'s manifest failed verification; nothing was imported",
                      "signed with another fleet key, or altered");
  json manifest = json::parse(*manifest_text, nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object() || manifest.value("format", 0) != 1 ||
      !manifest.contains("records") || !manifest["records"].is_array())
    return not_bundle("has a manifest kiln cannot read (format 1 expected)");

  BundleReport report;
  report.created = manifest.value("created", std::int64_t{0});
  for (const json& rec : manifest["records"]) {
    const std::string name = rec.value("name", std::string());
    const std::string kind = rec.value("kind", std::string());
    std::uint64_t len = 0;
    if (!read_u64(in, len)) return not_bundle("is truncated: record " + name + " is missing");
    const auto here = static_cast<std::uint64_t>(in.tellg());
    if (len > file_size - std::min<std::uint64_t>(here, file_size)) return not_bundle("is truncated in record " + name);
    std::string sealed(len, '\0');
    if (!in.read(sealed.data(), std::streamsize(len))) return not_bundle("is truncated in record " + name);
    if (sha256_hex(sealed) != rec.value("sha256", std::string())) {
      report.rejected.push_back(name + ": its bytes differ from the manifest's digest");
      continue;
    }
    if (kind == "kernel" && name.rfind("k/", 0) == 0) {
      auto e = open_entry(fleet_key, name.substr(2), sealed);
      if (!e.ok()) {
        report.rejected.push_back(name + ": " + e.status().message());
        continue;
      }
      report.verified.entries.push_back(std::move(e).value());
    } else if (kind == "tuning" && name.rfind("t/", 0) == 0) {
      auto p = unseal(fleet_key, name, sealed);
      if (!p.ok()) {
        report.rejected.push_back(name + ": " + p.status().message());
        continue;
      }
      report.verified.tuning.emplace_back(name, std::string(*p));
    } else {
      report.rejected.push_back(name + ": unknown record kind '" + kind + "'");
    }
  }
  if (in.peek() != std::char_traits<char>::eof()) return not_bundle("has bytes after its last record");
  return report;
}

}  // namespace kiln::remote
