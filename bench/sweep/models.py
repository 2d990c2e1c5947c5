"""The shapes of public model families for kiln's shape sweep: hidden size, MLP intermediate size
(per expert for MoE models), attention heads, KV heads and head size, as each model's published
configuration gives them, and the token counts and batch layouts every op is swept over.

points(op) lists the sweep's points for one op, dedupe(points) merges the points of models that
share every size; `python3 bench/sweep/models.py [OP]` counts them.
"""
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int = 0  # the rotated part of a head when it is not all of it (DeepSeek's MLA)

    @property
    def rotary_dim(self):
        return self.rope_dim or self.head_dim


MODELS = (
    Model("llama3-8b", 4096, 14336, 32, 8, 128),
    Model("llama3-70b", 8192, 28672, 64, 8, 128),
    Model("qwen2.5-0.5b", 896, 4864, 14, 2, 64),
    Model("qwen2.5-7b", 3584, 18944, 28, 4, 128),
    Model("qwen2.5-72b", 8192, 29568, 64, 8, 128),
    Model("qwen3-8b", 4096, 12288, 32, 8, 128),
    Model("qwen3-32b", 5120, 25600, 64, 8, 128),
    Model("mistral-7b", 4096, 14336, 32, 8, 128),
    Model("mistral-nemo-12b", 5120, 14336, 32, 8, 128),
    Model("mixtral-8x7b", 4096, 14336, 32, 8, 128),
    Model("gemma2-9b", 3584, 14336, 16, 8, 256),
    Model("gemma3-27b", 5376, 21504, 32, 16, 128),
    Model("phi3-mini", 3072, 8192, 32, 32, 96),
    Model("phi4-14b", 5120, 17920, 40, 10, 128),
    Model("deepseek-v3", 7168, 18432, 128, 128, 128, rope_dim=64),
    Model("gpt-oss-120b", 2880, 2880, 64, 8, 64),
    Model("command-r-35b", 8192, 22528, 64, 64, 128),
)

# Token counts: decode (1, 3), small prefill and odd sizes (16, 77, 1000), and training-sized ones
# just below and at powers of two (4095, 8191, 16384).
TOKENS = (1, 3, 16, 77, 1000, 4095, 8191, 16384)
# Batches of odd sequence lengths, as (batch, seq): the rows are batch * seq.
BATCHES = ((4, 2047), (3, 1337), (8, 511))

# Memory-bound ops, by the width their rows have in a model (act_and_mul: the width of its output,
# half of its input's).
ROW_OPS = {
    "rms_norm": lambda m: m.hidden,
    "rms_norm_backward": lambda m: m.hidden,
    "add_rms_norm": lambda m: m.hidden,
    "add_rms_norm_backward": lambda m: m.hidden,
    "layer_norm": lambda m: m.hidden,
    "layer_norm_backward": lambda m: m.hidden,
    "act_and_mul": lambda m: m.intermediate,
    "act_and_mul_backward": lambda m: m.intermediate,
}
ROPE_OPS = ("apply_rope_qk", "apply_rope_qk_backward", "rms_norm_rope", "rms_norm_rope_backward")
GEMM_OPS = ("fp8_gemm", "fused_gated_mlp")
# GEMM shapes (N, K) whose K is not a multiple of 128, beside the models' own (of which only
# gpt-oss has one).
ODD_K = ((4096, 4160), (14336, 4032), (7168, 2112))


def row_layouts():
    """(label, batch, seq) for every token count (one sequence) and batch layout."""
    return [(f"t{t}", 1, t) for t in TOKENS] + [(f"b{b}x{s}", b, s) for b, s in BATCHES]


def points(op):
    """Every point of the sweep for `op`: dicts with the model, a label for the row layout and
    the sizes the op takes, `batch` and `seq` among them (rows = batch * seq). Rows also come with
    a padded row stride (a view into a wider tensor) for the memory-bound ops."""
    out = []
    for m in MODELS:
        for label, batch, seq in row_layouts():
            rows = batch * seq
            if op in ROW_OPS:
                cols = ROW_OPS[op](m)
                for strided in (False, True):
                    out.append({"model": m.name, "rows_label": label, "batch": batch, "seq": seq, "rows": rows,
                                "cols": cols, "row_stride": cols + 64 if strided else cols})
            elif op in ROPE_OPS:
                out.append({"model": m.name, "rows_label": label, "batch": batch, "seq": seq, "tokens": rows,
                            "q_heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.rotary_dim})
            elif op in GEMM_OPS:
                # The MLP's gate/up projection (N = intermediate, K = hidden) and its down
                # projection (N = hidden, K = intermediate), whose K need not be a multiple of 128.
                gemm = {"model": m.name, "rows_label": label, "batch": batch, "seq": seq, "m": rows}
                out.append({**gemm, "n": m.intermediate, "k": m.hidden})
                if op == "fp8_gemm":
                    out.append({**gemm, "n": m.hidden, "k": m.intermediate})
            else:
                raise KeyError(f"no sweep for op {op!r}")
    if op in GEMM_OPS:
        for label, batch, seq in row_layouts():
            for n, k in ODD_K:
                out.append({"model": "odd-k", "rows_label": label, "batch": batch, "seq": seq, "m": batch * seq,
                            "n": n, "k": k})
    return out


def dedupe(pts):
    """The points with equal sizes merged into one, in first-seen order: each keeps its sizes and
    lists the models it stands for under `models` (no `model`)."""
    merged = {}
    for p in pts:
        sizes = {k: v for k, v in p.items() if k != "model"}
        key = tuple(sorted(sizes.items()))
        if key not in merged:
            merged[key] = {**sizes, "models": []}
        if p["model"] not in merged[key]["models"]:
            merged[key]["models"].append(p["model"])
    return list(merged.values())


def all_ops():
    return list(ROW_OPS) + list(ROPE_OPS) + list(GEMM_OPS)


if __name__ == "__main__":
    for op in sys.argv[1:] or all_ops():
        pts = points(op)
        print(f"{op}: {len(pts)} points over {len(MODELS)} models, {len(dedupe(pts))} distinct")
