// `kiln prewarm --model`: the kernel variants a Hugging Face model's layers use.
//
// A config.json gives the layer shapes (hidden size, intermediate size, heads, KV heads, head
// dim, experts, dtype). For each token bucket and arch, each layer's problem is built the way the
// typed ops build it (contiguous rows) and the family's heuristic picks the variant, exactly as
// the first launch of that shape would; variants are listed once however many layers share them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kiln/family.h"
#include "kiln/spec.h"
#include "kiln/status.h"

namespace kiln::cli {

struct ModelShape {
  std::string name;           // model_type or architectures[0], for people
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t experts = 0;           // 0: dense
  std::int64_t experts_per_token = 0; // routed experts per token (MoE)
  std::int64_t expert_intermediate = 0;
  std::int64_t max_positions = 0;
  std::int64_t activation = 0;        // act_and_mul's code: 0 silu, 1 gelu, 2 gelu_tanh
  DType dtype = DType::bf16;
};

// Reads and checks config.json (a nested "text_config" is used when the top level has no
// hidden_size). invalid_argument names the file and the field that is missing or wrong.
Result<ModelShape> read_model_config(const std::filesystem::path& file);

struct PlannedVariant {
  KernelSpec spec;
  std::string arch;
  std::vector<std::string> uses;  // "attention T=128", one per layer problem that picks it
};

struct ModelPlan {
  std::vector<PlannedVariant> variants;  // in first-use order
  std::vector<std::string> skipped;      // layer problems no variant serves here, with why
};

// The default token buckets when --tokens is not given.
std::vector<std::int64_t> default_token_buckets();

// The multiprocessor count the heuristics assume for an arch (its flagship part: sm_90a an H100
// SXM); `sm_count` > 0 overrides it.
int assumed_sm_count(const std::string& arch, int sm_count);

Result<ModelPlan> plan_model(const ModelShape& model, const std::vector<std::string>& archs,
                             const std::vector<std::int64_t>& tokens, int sm_count = 0);

}  // namespace kiln::cli
