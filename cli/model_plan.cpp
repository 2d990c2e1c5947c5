#include "cli/model_plan.h"

#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace kiln::cli {
namespace {

using nlohmann::json;
using Shape = std::vector<std::pair<std::string, std::int64_t>>;

Status bad(const std::filesystem::path& file, const std::string& what) {
  return invalid_argument("model config " + file.string() + ": " + what);
}

// A positive integer field; `fallback` (when > 0) if absent.
Result<std::int64_t> positive(const json& cfg, const std::filesystem::path& file, const char* name,
                              std::int64_t fallback = 0) {
  auto it = cfg.find(name);
  if (it == cfg.end() || it->is_null()) {
    if (fallback > 0) return fallback;
    return bad(file, std::string("missing field '") + name + "'");
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() <= 0 || it->get<std::int64_t>() > (std::int64_t(1) << 31))
    return bad(file, std::string("field '") + name + "' must be a positive integer, not " + it->dump());
  return it->get<std::int64_t>();
}

}  // namespace

Result<ModelShape> read_model_config(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) return invalid_argument("cannot read model config " + file.string());
  std::stringstream ss;
  ss << in.rdbuf();
  json top = json::parse(ss.str(), nullptr, false);
  if (top.is_discarded() || !top.is_object()) return bad(file, "not a JSON object");
  const json& cfg = !top.contains("hidden_size") && top.contains("text_config") && top["text_config"].is_object()
                        ? top["text_config"]
                        : top;
  ModelShape m;
  if (cfg.contains("model_type") && cfg["model_type"].is_string()) m.name = cfg["model_type"].get<std::string>();
  else if (top.contains("architectures") && top["architectures"].is_array() && !top["architectures"].empty() &&
           top["architectures"][0].is_string())
    m.name = top["architectures"][0].get<std::string>();
  KILN_ASSIGN_OR_RETURN(m.hidden, positive(cfg, file, "hidden_size"));
  KILN_ASSIGN_OR_RETURN(m.heads, positive(cfg, file, "num_attention_heads"));
  KILN_ASSIGN_OR_RETURN(m.kv_heads, positive(cfg, file, "num_key_value_heads", m.heads));
  if (m.heads % m.kv_heads != 0)
    return bad(file, "num_attention_heads (" + std::to_string(m.heads) + ") is not a multiple of num_key_value_heads (" +
                         std::to_string(m.kv_heads) + ")");
  if (m.hidden % m.heads != 0 && !cfg.contains("head_dim"))
    return bad(file, "hidden_size is not a multiple of num_attention_heads and no head_dim is given");
  KILN_ASSIGN_OR_RETURN(m.head_dim, positive(cfg, file, "head_dim", m.hidden / m.heads));
  KILN_ASSIGN_OR_RETURN(m.max_positions, positive(cfg, file, "max_position_embeddings", 4096));
  for (const char* name : {"num_experts", "num_local_experts", "n_routed_experts"})
    if (cfg.contains(name) && !cfg[name].is_null()) {
      KILN_ASSIGN_OR_RETURN(m.experts, positive(cfg, file, name));
      break;
    }
  KILN_ASSIGN_OR_RETURN(m.intermediate, positive(cfg, file, "intermediate_size", m.experts ? 1 : 0));
  if (m.experts) {
    KILN_ASSIGN_OR_RETURN(m.experts_per_token, positive(cfg, file, "num_experts_per_tok", 1));
    if (m.experts_per_token > m.experts) return bad(file, "num_experts_per_tok exceeds the number of experts");
    KILN_ASSIGN_OR_RETURN(m.expert_intermediate, positive(cfg, file, "moe_intermediate_size", m.intermediate));
    if (!cfg.contains("intermediate_size") && !cfg.contains("moe_intermediate_size"))
      return bad(file, "missing field 'intermediate_size' (or 'moe_intermediate_size')");
  }
  const std::string dtype = cfg.value("torch_dtype", top.value("torch_dtype", std::string("bfloat16")));
  if (dtype == "bfloat16") m.dtype = DType::bf16;
  else if (dtype == "float16") m.dtype = DType::f16;
  else if (dtype == "float32") m.dtype = DType::f32;
  else return bad(file, "torch_dtype '" + dtype + "' is not one kiln's kernels take (bfloat16, float16, float32)");
  const std::string act = cfg.value("hidden_act", cfg.value("hidden_activation", std::string("silu")));
  if (act == "silu" || act == "swish") m.activation = 0;
  else if (act == "gelu") m.activation = 1;
  else if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_fast") m.activation = 2;
  else return bad(file, "hidden_act '" + act + "' has no gated kernel (silu, gelu, gelu_pytorch_tanh)");
  return m;
}

std::vector<std::int64_t> default_token_buckets() { return {1, 16, 128, 1024, 4096}; }

int assumed_sm_count(const std::string& arch, int sm_count) {
  if (sm_count > 0) return sm_count;
  static const std::map<std::string, int> k_parts = {
      {"sm_80", 108}, {"sm_86", 84}, {"sm_87", 16}, {"sm_89", 142}, {"sm_90", 132}, {"sm_90a", 132},
      {"sm_100", 148}, {"sm_100a", 148}, {"sm_120", 170}, {"sm_120a", 170}};
  auto it = k_parts.find(arch);
  return it != k_parts.end() ? it->second : 132;
}

Result<ModelPlan> plan_model(const ModelShape& m, const std::vector<std::string>& archs,
                             const std::vector<std::int64_t>& tokens, int sm_count) {
  struct Layer {
    const char* family;
    std::string use;
    Shape shape;
  };
  ModelPlan plan;
  std::map<std::string, std::size_t> seen;  // "spec @ arch" -> index in plan.variants
  const Registry& registry = Registry::global();
  for (const std::string& arch : archs) {
    KILN_ASSIGN_OR_RETURN(GpuArch ga, parse_arch(arch));
    for (std::int64_t t : tokens) {
      const std::string tt = " T=" + std::to_string(t);
      std::vector<Layer> layers = {
          {"rmsnorm", "norm" + tt, {{"rows", t}, {"cols", m.hidden}, {"x_row_stride", m.hidden}, {"y_row_stride", m.hidden}}},
          {"add_rmsnorm", "residual+norm" + tt,
           {{"rows", t}, {"cols", m.hidden}, {"x_row_stride", m.hidden}, {"residual_row_stride", m.hidden},
            {"y_row_stride", m.hidden}, {"residual_out_row_stride", m.hidden}}},
          {"rope", "rope" + tt,
           {{"tokens", t}, {"q_heads", m.heads}, {"kv_heads", m.kv_heads}, {"head_dim", m.head_dim}, {"layout", 0},
            {"max_pos", m.max_positions}, {"q_stride", m.heads * m.head_dim}, {"k_stride", m.kv_heads * m.head_dim},
            {"q_out_stride", m.heads * m.head_dim}, {"k_out_stride", m.kv_heads * m.head_dim}}},
          {"attention", "attention (causal prefill)" + tt,
           {{"batch", 1}, {"seqlen_q", t}, {"seqlen_k", t}, {"heads", m.heads}, {"kv_heads", m.kv_heads},
            {"head_dim", m.head_dim}, {"head_dim_v", m.head_dim}, {"causal", 1}, {"varlen", 0}}},
      };
      if (m.experts == 0) {
        layers.push_back({"act_and_mul", "mlp act*up" + tt,
                          {{"rows", t}, {"d", m.intermediate}, {"x_row_stride", 2 * m.intermediate},
                           {"out_row_stride", m.intermediate}, {"activation", m.activation}}});
        layers.push_back({"gated_mlp", "fused gated mlp" + tt,
                          {{"m", t}, {"n", m.intermediate}, {"k", m.hidden}, {"mode", m.activation == 0 ? 0 : 1}}});
      } else {
        // Routed tokens: each token goes to experts_per_token experts.
        const std::int64_t rows = t * m.experts_per_token;
        layers.push_back({"act_and_mul", "expert act*up" + tt,
                          {{"rows", rows}, {"d", m.expert_intermediate}, {"x_row_stride", 2 * m.expert_intermediate},
                           {"out_row_stride", m.expert_intermediate}, {"activation", m.activation}}});
      }
      for (const Layer& l : layers) {
        const Family* f = registry.find(l.family);
        const std::string where = std::string(l.family) + " " + l.use + " @ " + arch;
        if (!f) {
          plan.skipped.push_back(where + ": no family '" + l.family + "' is registered");
          continue;
        }
        auto problem = f->problem_from_shape(m.dtype, l.shape);
        if (!problem.ok()) {
          plan.skipped.push_back(where + ": " + problem.status().message());
          continue;
        }
        problem->cc = std::uint8_t(ga.capability);
        problem->sm_count = std::uint16_t(assumed_sm_count(arch, sm_count));
        const Params params = f->heuristic(*problem);
        if (Status s = f->validate(params); !s.ok()) {
          plan.skipped.push_back(where + ": " + s.message());
          continue;
        }
        if (Status s = f->check_problem(params, *problem); !s.ok()) {
          plan.skipped.push_back(where + ": " + s.message());
          continue;
        }
        if (!f->runs_on(params, ga)) {
          plan.skipped.push_back(where + ": the variant the heuristic picks does not run on " + arch);
          continue;
        }
        KernelSpec spec{std::string(f->name()), params};
        const std::string id = spec.canonical() + " @ " + arch;
        auto [it, fresh] = seen.emplace(id, plan.variants.size());
        if (fresh) plan.variants.push_back({spec, arch, {}});
        plan.variants[it->second].uses.push_back(l.use);
      }
    }
  }
  return plan;
}

}  // namespace kiln::cli
