"""PyTorch anchors for RoPE on q and k (bf16), the shapes families/rope/bench/rope.cpp times.

q [tokens, 32, d] and k [tokens, 8, d], f32 cos/sin cache [max_pos, d/2] gathered by position ids
0..tokens-1, out of place; neox (half-split) and gptj (interleaved), eager and torch.compile, timed
with triton.testing.do_bench (median). Minimal bytes as kiln counts them: read q and k, write the
outputs, plus the f32 cos/sin rows and the i64 position ids.
"""
import torch
from triton.testing import do_bench

Q_HEADS, KV_HEADS = 32, 8
SHAPES = [(layout, d, t) for layout in ("neox", "gptj") for d in (64, 128) for t in (1, 16, 512, 4096, 32768)]
QUICK_SHAPES = [("neox", 128, 1), ("neox", 128, 4096), ("neox", 128, 16384), ("gptj", 64, 32768)]


def rotate(x, c, s, neox):
    xf = x.float()
    if neox:
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)


def rope_neox(q, k, cos, sin, pos):
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    return rotate(q, c, s, True), rotate(k, c, s, True)


def rope_gptj(q, k, cos, sin, pos):
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    return rotate(q, c, s, False), rotate(k, c, s, False)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    eager = {"neox": rope_neox, "gptj": rope_gptj}
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in eager.items()}
    rows = []
    print(f"\ntorch rope (bf16, {Q_HEADS} q + {KV_HEADS} kv heads, f32 cos/sin)\n"
          f"{'tokens':>8} {'d':>4} {'layout':>6} {'eager us':>10} {'GB/s':>8} {'compile us':>11} {'GB/s':>8}")
    for layout, d, m in (QUICK_SHAPES if quick else SHAPES):
        max_pos = max(m, 4096)
        q = torch.randn(m, Q_HEADS, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(m, KV_HEADS, d, device=dev, dtype=torch.bfloat16)
        inv = 10000.0 ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
        ang = torch.arange(max_pos, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().float(), ang.sin().float()
        pos = torch.arange(m, device=dev, dtype=torch.int64)
        compiled[layout](q, k, cos, sin, pos)
        nbytes = 2 * (Q_HEADS + KV_HEADS) * m * d * 2 + m * (d * 4 + 8)
        row = {"family": "rope", "dtype": "bf16", "tokens": m, "head_dim": d, "layout": layout,
               "q_heads": Q_HEADS, "kv_heads": KV_HEADS}
        for name, fn in (("eager", eager[layout]), ("compile", compiled[layout])):
            ms = do_bench(lambda: fn(q, k, cos, sin, pos), warmup=25, rep=100 if quick else 200, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {d:4d} {layout:>6} {row['eager_us']:10.2f} {row['eager_gbs']:8.1f} "
              f"{row['compile_us']:11.2f} {row['compile_gbs']:8.1f}", flush=True)
        del q, k, cos, sin, pos
    return rows
