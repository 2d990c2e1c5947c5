// Host side of the GEMM core (families/common/gemm/) that the GEMM families share: the tile parameters,
// their rules, shared-memory size, launch geometry, argument order and the tuning space around a
// choice. Every GEMM family's problem is a GemmProblem. The device comes with the Problem: its SM
// count bounds the persistent grid and its compute capability decides the arch path; an unknown
// device (0) reads as an H100 (device_sms, device_cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kiln/family.h"

namespace kiln::families::gemm {

// The problem of every GEMM family: out [m, n] from A [m, k] and B [n, k] (both K-major). All
// four are keys; m (the token count, which varies call to call) is the one tuning signatures
// bucket.
struct GemmProblem {
  std::int64_t m = 0;     // rows of A and of out (bucketed key)
  std::int64_t n = 0;     // rows of B, columns of out (key)
  std::int64_t k = 0;     // the reduction: columns of A and of B (key)
  std::int64_t mode = 0;  // the family's own code, its scaling or activation (key)
};

// The field list of a GEMM family's problem; mode_doc says what the family's mode codes mean.
inline std::vector<ProblemField> problem_fields(const std::string& mode_doc) {
  return problem_fields_of<GemmProblem>({bucketed(&GemmProblem::m, "m", "rows of A and of out (tokens)"),
                                         key(&GemmProblem::n, "n", "rows of B (K-major), columns of out"),
                                         key(&GemmProblem::k, "k", "the reduction: columns of A and of B"),
                                         key(&GemmProblem::mode, "mode", mode_doc)});
}

// The device facts the heuristic and the checks read. An unknown device (0: a CPU test, `kiln tune`
// with no device) reads as the reference device, an H100: 132 SMs, compute capability 9.0.
inline constexpr std::int64_t k_reference_sms = 132, k_reference_cc = 90;
inline std::int64_t device_sms(const Problem& p) { return p.sm_count ? std::int64_t(p.sm_count) : k_reference_sms; }
inline std::int64_t device_cc(const Problem& p) { return p.cc ? std::int64_t(p.cc) : k_reference_cc; }

// Kernel kinds (families/common/gemm/gemm_common.cuh).
enum Kind { k_fp8_tensor = 0, k_fp8_block = 1, k_gated = 2, k_half = 3 };

// The parameters every GEMM variant has.
inline std::vector<ParamDef> tile_params() {
  return {
      {"path", {}, {"mma", "wgmma"}, "mma: mma.sync (sm_80 and later); wgmma: warp-specialized wgmma (sm_90a)"},
      {"bm", {16, 32, 64, 128}, {}, "tile rows (M); 16 and 32: fp8 and gated on wgmma only, swapped (weights as wgmma's A)"},
      {"bn", {32, 56, 64, 128, 176, 192, 256}, {}, "tile columns (N); 56 and 176: per-tensor fp8 on wgmma only; above 128: fp8 on wgmma only (block scales: 192, 256)"},
      {"stages", {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}, {}, "shared-memory pipeline depth"},
      {"group", {1, 8, 16}, {}, "tile rows per group of the grouped output order (L2 reuse)"},
      {"cluster", {1, 2}, {}, "wgmma: CTAs per thread-block cluster, side by side along N, sharing A by TMA multicast"},
      {"split", {1, 2, 3, 4}, {}, "wgmma, fp8: CTAs (one cluster) sharing a tile's K; partial sums reduced in rank order"},
  };
}

struct Tile {
  bool wgmma;
  int bm, bn, stages, group;
  int cluster = 1;
  int split = 1;
};
inline Tile tile_of(const Params& p) {
  return {*p.get_str("path") == "wgmma", int(*p.get_int("bm")), int(*p.get_int("bn")), int(*p.get_int("stages")),
          int(*p.get_int("group")), int(*p.get_int("cluster")), int(*p.get_int("split"))};
}

inline bool fp8_kind(Kind kind) { return kind == k_fp8_tensor || kind == k_fp8_block; }

// Swapped tiles (wgmma, bm 16 or 32: decode-sized M): the tile's bn rows of B (of each B, gated)
// are wgmma's A, 64 rows per consumer warpgroup, and its bm rows of A (the tokens) are wgmma's N,
// so a stage holds bm + bn rows that are all data instead of 64 rows of A for a handful of tokens.
inline bool swapped(const Tile& t) { return t.wgmma && t.bm < 64; }
// Consumer warpgroups of a wgmma tile: one per 64 rows of wgmma's A.
inline int consumers(const Tile& t) { return (swapped(t) ? t.bn : t.bm) / 64; }
inline std::int64_t element_bytes(Kind kind, DType operand) { return fp8_kind(kind) ? 1 : dtype_size(operand); }

// Whether a wgmma tile stores its output through the staged epilogue's shared memory (gemm_wgmma,
// gemm_wgmma_cluster, and lora_gemm_core for k_half): 128-row tiles (the 64-row ones are for
// decode-sized problems, whose rings take all the shared memory) without split-K, a width in
// boxes of 64 columns.
inline bool staged_epilogue(Kind, const Tile& t) {
  return t.wgmma && t.split == 1 && t.bm == 128 && t.bn % 64 == 0;
}
inline std::int64_t staged_epilogue_bytes(Kind kind, const Tile& t) {
  return staged_epilogue(kind, t) ? (t.bm / 16) * 2048 : 0;
}

// Dynamic shared memory: the stages (128 bytes of K per row of A and of each B), 1024 bytes of
// slack to align them to the swizzle atom, the staged epilogue's 2 KiB per consumer warp, and the
// wgmma path's two mbarriers per stage and, for block scales, each stage's scales (bm a scales,
// the b scale, padded to 16 bytes).
inline std::uint32_t shared_bytes(Kind kind, const Tile& t) {
  const int b_tiles = kind == k_gated ? 2 : 1;
  const int scales = t.wgmma && kind == k_fp8_block ? t.stages * (t.bm + 4) * 4 : 0;
  // Split-K: two mbarriers and the fp32 partial tile (rows of bn + 4 floats).
  const int partial = t.split > 1 ? 16 + t.bm * (t.bn + 4) * 4 : 0;
  const int staged = int(staged_epilogue_bytes(kind, t));
  return std::uint32_t(t.stages * (t.bm + b_tiles * t.bn) * 128 + 1024 + staged + (t.wgmma ? 16 * t.stages : 0) +
                       scales + partial);
}

// What one block may use on a device of compute capability cc (the opt-in maximum).
inline std::uint32_t max_shared_bytes(std::int64_t cc) {
  if (cc == 90 || cc == 100) return 227 * 1024;
  if (cc == 80 || cc == 87) return 163 * 1024;
  return 99 * 1024;
}

// Rules on the tile alone: the mma path's warps cover 32 columns each (bn <= 128 keeps their
// accumulators in registers); wgmma with two accumulators (gated) keeps bn <= 128 for the same
// reason, and block scales (accumulators and one partial-sum set) bn <= 128 (a divisor of 128:
// one scale block per tile), 192 (96 + 96 registers; a tile spans two scale blocks) or 256 (two
// 128-column halves through a 64-column partial-sum set: 128 + 64 registers).
inline Status validate_tile(std::string_view family, Kind kind, const Tile& t) {
  const std::string f(family);
  if (!t.wgmma && t.bn > 128) return invalid_argument(f + ": the mma path takes bn <= 128");
  if (t.bm < 64 && (!t.wgmma || kind == k_half || !(t.bn == 64 || t.bn == 128) || t.cluster != 1))
    return invalid_argument(f + ": bm 16 and 32 (swapped tiles) are for fp8 and gated kernels on the wgmma path, "
                            "with bn 64 or 128 and no A multicast (cluster 1)");
  if (kind == k_gated && t.bn > 128) return invalid_argument(f + ": gated kernels take bn <= 128");
  if (kind == k_fp8_block && t.bn > 128 && !(t.wgmma && (t.bn == 192 || t.bn == 256)))
    return invalid_argument(f + ": block-scaled kernels take bn <= 128, or 192 or 256 on the wgmma path");
  if (!t.wgmma && t.cluster != 1) return invalid_argument(f + ": clusters are for the wgmma path only");
  if (t.split > 1 && (!t.wgmma || kind == k_gated || t.cluster != 1))
    return invalid_argument(f + ": split-K is for fp8 on the wgmma path, without A multicast (cluster 1)");
  if ((t.bn == 56 || t.bn == 176) && (kind != k_fp8_tensor || !t.wgmma))
    return invalid_argument(f + ": bn 56 and 176 are for per-tensor fp8 on the wgmma path only");
  if (shared_bytes(kind, t) > 227 * 1024)
    return invalid_argument(f + ": " + std::to_string(shared_bytes(kind, t)) + " bytes of shared memory exceed 227 KiB");
  return {};
}

// Shape rules common to the GEMM families; `operand` is the A/B element type.
inline Status check_shape(std::string_view family, Kind kind, DType operand, const Tile& t, const Problem& p) {
  const std::string f(family);
  const GemmProblem q = p.as<GemmProblem>();
  const auto m = q.m, n = q.n, k = q.k;
  if (m < 1 || n < 1 || k < 1) return shape_mismatch(f + ": m, n and k must be positive");
  if (m >= (std::int64_t(1) << 31) || n >= (std::int64_t(1) << 31) || k >= (std::int64_t(1) << 31))
    return shape_mismatch(f + ": m, n and k must be below 2^31");
  if (((m + t.bm - 1) / t.bm) * ((n + t.bn - 1) / t.bn) >= (std::int64_t(1) << 31))
    return shape_mismatch(f + ": more than 2^31 output tiles");
  const auto es = element_bytes(kind, operand);
  if ((k * es) % 16)
    return shape_mismatch(f + ": k must be a multiple of " + std::to_string(16 / es) +
                          " (rows of A and B are copied in 16-byte pieces)");
  if (p.alignment < 16) return invalid_argument(f + ": A, B and out need 16-byte aligned base addresses");
  const std::int64_t cc = device_cc(p);
  if (t.wgmma && cc != 90)
    return invalid_argument(f + ": the wgmma path needs sm_90a (compute capability 9.0), the device has " +
                            std::to_string(cc / 10) + "." + std::to_string(cc % 10));
  if (!t.wgmma && cc < 80) return invalid_argument(f + ": needs compute capability 8.0 or later");
  if (shared_bytes(kind, t) > max_shared_bytes(cc))
    return invalid_argument(f + ": the variant needs " + std::to_string(shared_bytes(kind, t)) +
                            " bytes of shared memory, more than compute capability " + std::to_string(cc) + " grants");
  return {};
}

inline std::int64_t tiles(const Tile& t, const Problem& p) {
  const GemmProblem q = p.as<GemmProblem>();
  return ((q.m + t.bm - 1) / t.bm) * ((q.n + t.bn - 1) / t.bn);
}

// The wgmma path's work units: rows of tiles x column tiles in groups of `cluster` (the last group
// padded when the column tiles do not divide).
inline std::int64_t cluster_units(const Tile& t, const Problem& p) {
  const GemmProblem q = p.as<GemmProblem>();
  const std::int64_t tn = (q.n + t.bn - 1) / t.bn;
  return ((q.m + t.bm - 1) / t.bm) * ((tn + t.cluster - 1) / t.cluster);
}

// The wgmma path's persistent grid: one CTA per SM at most, whole clusters (cluster x split CTAs
// each).
inline std::int64_t persistent_ctas(const Tile& t, const Problem& p) {
  const std::int64_t size = t.cluster * t.split;
  const std::int64_t clusters = std::max<std::int64_t>(1, device_sms(p) / size);
  return std::min(cluster_units(t, p), clusters) * size;
}

inline LaunchGeometry geometry(Kind kind, const Tile& t, const Problem& p) {
  LaunchGeometry g;
  const std::int64_t n_tiles = tiles(t, p);
  // wgmma: persistent (at most one CTA per SM); mma: one CTA per tile.
  g.grid.x = std::uint32_t(std::clamp<std::int64_t>(t.wgmma ? persistent_ctas(t, p) : n_tiles, 1, 0x7fffffff));
  g.block.x = std::uint32_t(t.wgmma ? (consumers(t) + 1) * 128 : 2 * t.bn);
  g.shared_bytes = shared_bytes(kind, t);
  return g;
}

// The kernel's name expression (families/common/gemm/gemm_{mma,wgmma}.cuh).
inline std::string name_expression(Kind kind, const std::string& operand, const std::string& out, int act,
                                   const Tile& t) {
  const bool clustered = t.wgmma && t.cluster * t.split > 1;
  const char* kernel = !t.wgmma ? "gemm_mma<" : clustered ? "gemm_wgmma_cluster<" : "gemm_wgmma<";
  return std::string("kiln::gemm::") + kernel + std::to_string(int(kind)) + ", " + operand + ", " + out + ", " +
         std::to_string(act) + ", " + std::to_string(t.bm) + ", " + std::to_string(t.bn) + ", " +
         std::to_string(t.stages) + ", " + std::to_string(t.group) +
         (clustered ? ", " + std::to_string(t.cluster) + ", " + std::to_string(t.split) : std::string()) + ">";
}

// The output's tensor map for the staged epilogue: `rows` rows of `width` 16-bit elements seen as
// bytes, boxes of 16 rows. When the width is not a multiple of 8 (rows not in whole 16-byte
// pieces) the kernels store with their lanes and `stand_in` (a map of an input) takes the slot.
inline TensorMapRequest out_map_request(void* out, std::int64_t width, std::uint64_t rows,
                                        const TensorMapRequest& stand_in) {
  if (width % 8 != 0) return stand_in;
  return {out, std::uint64_t(width) * 2, rows, 16, 0};
}

// Buffers in kernel order: a, b0, b1, a_scale, b_scale, out (unused ones passed as null), then
// m, n, k, tiles_m, tiles_n; the wgmma path adds tensor maps of a, b0 and b1 (b0's again when
// there is no b1; a's box is bm / cluster rows: each CTA of a cluster copies its share of A) and
// of the 16-bit output in boxes of 16 rows (when n is not a multiple of 8 the kernels store
// directly, and A's map stands in). `es`: operand element bytes.
inline void pack(const Tile& t, const Problem& p, std::int64_t es, void* a, void* b0, void* b1, void* a_scale,
                 void* b_scale, void* out, ArgPack& args) {
  const GemmProblem q = p.as<GemmProblem>();
  args.add(a);
  args.add(b0);
  args.add(b1);
  args.add(a_scale);
  args.add(b_scale);
  args.add(out);
  args.add(int(q.m));
  args.add(int(q.n));
  args.add(int(q.k));
  args.add(int((q.m + t.bm - 1) / t.bm));
  args.add(int((q.n + t.bn - 1) / t.bn));
  if (!t.wgmma) return;
  const std::uint64_t row_bytes = std::uint64_t(q.k * es);
  args.add_tensor_map({a, row_bytes, std::uint64_t(q.m), std::uint32_t(t.bm / t.cluster), 0});
  args.add_tensor_map({b0, row_bytes, std::uint64_t(q.n), std::uint32_t(t.bn), 0});
  args.add_tensor_map({b1 ? b1 : b0, row_bytes, std::uint64_t(q.n), std::uint32_t(t.bn), 0});
  args.add_tensor_map(out_map_request(out, q.n, std::uint64_t(q.m), {a, row_bytes, std::uint64_t(q.m), 16, 0}));
}

// Stages for a tile: at least 96 KiB of loads in flight, 4 to 6; on the wgmma path, tiles whose
// stage is at most 24 KiB (the decode-sized problems' tiles, bound by how many bytes each SM has
// in flight, not by the tensor cores) take as many as fit, up to 16 (at M = 128 the deep rings
// are clearly faster than 6 stages for 64 x 32, 64 x 64 and 128 x 56 tiles on Hopper;
// docs/benchmarks.md has the figures); always as the device's shared memory allows.
inline int default_stages(Kind kind, Tile t, std::int64_t cc) {
  const std::int64_t stage = (t.bm + (kind == k_gated ? 2 : 1) * t.bn) * 128;
  t.stages = int(std::clamp<std::int64_t>((96 * 1024 + stage - 1) / stage, 4, 6));
  if (t.wgmma && stage <= 24 * 1024) t.stages = 16;
  while (t.stages > 2 && shared_bytes(kind, t) > max_shared_bytes(cc)) --t.stages;
  return t.stages;
}

// The wgmma path's candidate tiles for a kind, largest first.
inline std::vector<std::pair<int, int>> wgmma_tiles(Kind kind) {
  if (kind == k_fp8_tensor)
    return {{128, 256}, {128, 192}, {128, 176}, {128, 128}, {128, 64}, {128, 56}, {128, 32},
            {64, 64},   {64, 32},   {32, 128},  {32, 64},   {16, 128}, {16, 64}};
  if (kind == k_fp8_block)
    return {{128, 256}, {128, 192}, {128, 128}, {64, 128}, {128, 64}, {128, 32},
            {64, 64},   {64, 32},   {32, 128},  {32, 64},  {16, 128}, {16, 64}};
  return {{128, 128}, {128, 64}, {64, 64}, {32, 128}, {32, 64}, {16, 128}, {16, 64}};
}

// Split-K candidates of the heuristic (wgmma, fp8, no cluster): 2 CTAs per tile for the 128-row
// tiles that decode-sized problems (M = 128) can widen once K is split. Splits of 3 and 4 are in
// the tuning space only: on Hopper they are clearly slower than 2 at the same problems, most
// likely because fewer clusters of 3 or 4 CTAs fit at once than SMs / size (a GPC's SMs, not the
// device's, bound a cluster), which the wave model cannot see.
// Swapped tiles split only with block scales, whose k-steps each wait for their promotion: per
// tensor, a split is slower than none at every decode shape measured on Hopper.
inline std::vector<int> wgmma_splits(Kind kind, int bm, int bn) {
  if (bm < 64) return kind == k_fp8_block ? std::vector<int>{1, 2} : std::vector<int>{1};
  if (kind == k_gated || bm != 128 || !(bn == 64 || bn == 128 || bn == 176)) return {1};
  return {1, 2};
}

// The modelled time of a wgmma tile: waves x (k-steps per CTA x (bm bn + 64 (bm / cluster + bn))
// + the split-K reduction + the epilogue), where a wave is one tile per SM (the grid is
// persistent, whole clusters), a k-step (128 bytes of K) costs its tensor-core work plus a term
// for its loads, which dominates for the small tiles of decode-sized problems, and a split-K
// reduction costs 2 bm bn + twenty k-steps (the partial tile through shared memory, the cluster
// handshakes, one more pass over the output): the constant that puts the model's choice on the
// fastest measured variant at all six M = 128 problems on Hopper (with four k-steps it picks
// splits that are slower; with ten, block-scaled 128 x 7168 x 16384 splits 128 x 128 tiles in
// two, slower than 64 x 128 unsplit with the deep pipelines of default_stages). A tile whose
// consumers store their fragments themselves (not staged_epilogue) costs four k-steps more: the
// tensor cores wait for those stores, where a staged tile's bulk stores run under the next
// tile's K loop (at 1000 tokens, 128 x 176 tiles for the wave count lose to staged 192 and 256).
inline std::int64_t wgmma_cost(Kind kind, const Tile& c, const Problem& p) {
  const std::int64_t size = c.cluster * c.split;
  const std::int64_t per_wave = std::max<std::int64_t>(1, device_sms(p) / size);
  const std::int64_t waves = (cluster_units(c, p) + per_wave - 1) / per_wave;
  const std::int64_t ksteps = (p.as<GemmProblem>().k * element_bytes(kind, DType::bf16) + 127) / 128;
  const std::int64_t step = std::int64_t(c.bm) * c.bn + 64 * (c.bm / c.cluster + c.bn);
  const std::int64_t reduce = c.split > 1 ? 2 * std::int64_t(c.bm) * c.bn + 20 * step : 0;
  const std::int64_t epilogue = staged_epilogue(kind, c) ? 0 : 4 * step;
  return waves * ((ksteps + c.split - 1) / c.split * step + reduce + epilogue);
}

// Block scales with 128 x 256 tiles over at least 64 rows of tiles (M >= 8192) take the grouped
// order in groups of 16 rows of tiles: a wave of 132 tiles then spans 16 x 8.25 tiles (A 2048 rows,
// B 2112 rows) instead of 8 x 16.5 (A 1024, B 4224), fewer bytes of K in flight per k-step through
// L2. At 8192^3 that is slightly but consistently faster in paired runs on Hopper; at M = 4096
// (32 rows of tiles) it is within noise either way, so those keep 8. Per tensor too (faster at
// 8192^3, a tie at 4096 x 4096 x 7168). docs/benchmarks.md has the figures.
inline bool wide_group_kind(Kind kind) { return kind == k_fp8_block || kind == k_fp8_tensor; }
inline bool wide_group(Kind kind, int bm, int bn, const Problem& p) {
  return wide_group_kind(kind) && bm == 128 && bn == 256 && (p.as<GemmProblem>().m + bm - 1) / bm >= 64;
}

// The default tile. wgmma: the candidate (tile, split) with the least wgmma_cost; ties go to the
// larger tile, then to no split. fp8 and gated problems of at most 32 rows take swapped tiles
// that hold every row (B is read once), and only those: at M = 16 they beat the 64-row tiles at
// every fp8 shape measured on Hopper, where the model, which sees the loads of A and B alike and
// not the share of the ring that B gets, rates them level (17 to 32 rows follow the same rule
// unmeasured); group 8, or 16 where wide_group says. No clusters of A multicast:
// they are neutral to slower (docs/kernels.md). mma: 128 x 128 (gated 128 x 64), bm and then
// bn halved while the tiles leave SMs idle. Stages: default_stages.
inline Tile default_tile(Kind kind, const Problem& p) {
  const std::int64_t sms = device_sms(p), cc = device_cc(p);
  Tile t{cc == 90, 128, 128, 4, 8};
  if (t.wgmma) {
    std::int64_t best = -1;
    const std::int64_t m = p.as<GemmProblem>().m;
    const bool swap = kind != k_half && m <= 32;
    for (auto [bm, bn] : wgmma_tiles(kind)) {
      if ((bm < 64) != swap || (swap && m > bm)) continue;
      for (int split : wgmma_splits(kind, bm, bn)) {
        const Tile c{true, bm, bn, 4, 8, 1, split};
        const std::int64_t cost = wgmma_cost(kind, c, p);
        if (best < 0 || cost < best) {
          best = cost;
          t = c;
        }
      }
    }
    if (t.split == 1 && wide_group(kind, t.bm, t.bn, p)) t.group = 16;
  } else {
    if (kind == k_gated) t.bn = 64;
    if (tiles(t, p) < sms) t.bm = 64;
    if (tiles(t, p) < sms) t.bn = 64;
  }
  t.stages = default_stages(kind, t, cc);
  return t;
}

// The heuristic's tiles for every problem (the catalog's tiles): the wgmma candidates with each
// split (and block 128 x 256 in groups of 16 as well: wide_group) and the mma halvings, each with
// default_stages on the device the path is for.
inline std::vector<Tile> default_tiles(Kind kind) {
  std::vector<Tile> out;
  for (auto [bm, bn] : wgmma_tiles(kind))
    for (int split : wgmma_splits(kind, bm, bn)) {
      Tile t{true, bm, bn, 4, 8, 1, split};
      t.stages = default_stages(kind, t, 90);
      out.push_back(t);
      if (split == 1 && wide_group_kind(kind) && bm == 128 && bn == 256) {
        t.group = 16;
        out.push_back(t);
      }
    }
  for (auto [bm, bn] : kind == k_gated ? std::vector<std::pair<int, int>>{{128, 64}, {64, 64}}
                                       : std::vector<std::pair<int, int>>{{128, 128}, {64, 128}, {64, 64}})
    for (std::int64_t cc : {80, 86}) {
      Tile t{false, bm, bn, 4, 8};
      t.stages = default_stages(kind, t, cc);
      if (std::find_if(out.begin(), out.end(), [&](const Tile& o) {
            return !o.wgmma && o.bm == t.bm && o.bn == t.bn && o.stages == t.stages;
          }) == out.end())
        out.push_back(t);
    }
  return out;
}

// Every tile of the heuristic's path that validates and fits the problem: each stage depth (3-6,
// and the wgmma default when deeper) and group order without clusters or split-K, and each tile
// with clusters of 2 (A multicast) or split-K 2-4 at its default stages and group 8.
template <class MakeParams, class Check>
std::vector<Params> tile_space(Kind kind, const Tile& base, MakeParams make, Check check) {
  std::vector<Params> out;
  for (int bm : {16, 32, 64, 128})
    for (int bn : {32, 56, 64, 128, 176, 192, 256}) {
      // Depths 3 to 6, and on the wgmma path the tile's default when deeper (small tiles).
      std::vector<int> depths = {3, 4, 5, 6};
      if (base.wgmma) {
        const int d = default_stages(kind, Tile{true, bm, bn, 4, 8}, 90);
        if (d > 6) depths.push_back(d);
      }
      for (int stages : depths)
        for (int group : {8, 16}) {
          Params p = make(Tile{base.wgmma, bm, bn, stages, group});
          if (check(p)) out.push_back(std::move(p));
        }
      if (!base.wgmma) continue;
      for (auto [cluster, split] : {std::pair{2, 1}, {1, 2}, {1, 3}, {1, 4}}) {
        Tile t{true, bm, bn, 4, 8, cluster, split};
        t.stages = default_stages(kind, t, 90);
        Params p = make(t);
        if (check(p)) out.push_back(std::move(p));
      }
    }
  return out;
}

// Params with `base`'s own parameters and tile t's.
inline Params with_tile(Params base, const Tile& t) {
  base.set("path", t.wgmma ? "wgmma" : "mma")
      .set("bm", std::int64_t(t.bm))
      .set("bn", std::int64_t(t.bn))
      .set("stages", std::int64_t(t.stages))
      .set("group", std::int64_t(t.group))
      .set("cluster", std::int64_t(t.cluster))
      .set("split", std::int64_t(t.split));
  return base;
}

// What the GEMM families share: tile validation, geometry, the tuning space around the
// heuristic's choice, and problem_from_shape's default mode 0. Each family declares its
// problem_fields() with gemm::problem_fields.
class GemmFamily : public Family {
 public:
  virtual Kind kind(const Params& params) const = 0;

  Status validate(const Params& params) const override {
    KILN_TRY(Family::validate(params));
    return validate_tile(name(), kind(params), tile_of(params));
  }
  LaunchGeometry geometry(const Params& params, const Problem& p) const override {
    return gemm::geometry(kind(params), tile_of(params), p);
  }
  // The rules check_shape applies to the device: wgmma on sm_90a only (the 'a' feature set of
  // compute capability 9.0), mma.sync on 8.0 and later, and the tile's shared memory within what
  // the capability grants.
  bool runs_on(const Params& params, const GpuArch& arch) const override {
    const Tile t = tile_of(params);
    if (t.wgmma ? !(arch.capability == 90 && arch.suffix == 'a') : arch.capability < 80) return false;
    return shared_bytes(kind(params), t) <= max_shared_bytes(arch.capability);
  }
  std::vector<Params> tuning_space(const Problem& p) const override {
    const Params h = heuristic(p);
    return tile_space(
        kind(h), tile_of(h), [&](const Tile& t) { return with_tile(h, t); },
        [&](const Params& c) { return validate(c).ok() && check_problem(c, p).ok(); });
  }
  Result<Problem> problem_from_shape(DType dtype,
                                     const std::vector<std::pair<std::string, std::int64_t>>& shape) const override {
    auto full = shape;
    if (std::none_of(shape.begin(), shape.end(), [](const auto& d) { return d.first == "mode"; }))
      full.emplace_back("mode", 0);
    return Family::problem_from_shape(dtype, full);
  }
};

}  // namespace kiln::families::gemm
