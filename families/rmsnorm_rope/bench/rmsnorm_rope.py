"""PyTorch anchors for fused RMSNorm + RoPE (bf16), the shapes families/rmsnorm_rope/bench/rmsnorm_rope.cpp times.

x [1, tokens, 4096], weight [4096], bf16 cos/sin [tokens, d] (full head_dim, HF rotate_half form);
the RMSNorm in fp32 over the whole row, then per head n * cos + rotate_half(n) * sin, eager and
torch.compile, timed with triton.testing.do_bench (median). Minimal bytes as kiln counts them:
read x, write y, plus the cos/sin rows and the weight once.
"""
import torch
from triton.testing import do_bench

HIDDEN = 4096
SHAPES = [(d, t) for d in (64, 128) for t in (1, 16, 512, 4096, 32768)]
QUICK_SHAPES = [(128, 1), (128, 4096), (64, 32768)]


def rmsnorm_rope(x, w, cos, sin, eps=1e-6):
    b, s, h = x.shape
    d = cos.shape[-1]
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).view(b, s, h // d, d)
    n1, n2 = n.chunk(2, dim=-1)
    rot = torch.cat([-n2, n1], dim=-1)
    c, sn = cos.float().view(1, s, 1, d), sin.float().view(1, s, 1, d)
    return (n * c + rot * sn).to(x.dtype).view(b, s, h)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    compiled = torch.compile(rmsnorm_rope, dynamic=False)
    rows = []
    print(f"\ntorch rmsnorm_rope (bf16, hidden {HIDDEN}, bf16 cos/sin)\n"
          f"{'tokens':>8} {'d':>4} {'eager us':>10} {'GB/s':>8} {'compile us':>11} {'GB/s':>8}")
    for d, m in (QUICK_SHAPES if quick else SHAPES):
        x = torch.randn(1, m, HIDDEN, device=dev, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
        inv = 10000.0 ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
        ang = torch.arange(m, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        compiled(x, w, cos, sin)
        nbytes = 2 * m * HIDDEN * 2 + 2 * m * d * 2 + HIDDEN * 2
        row = {"family": "rmsnorm_rope", "dtype": "bf16", "tokens": m, "hidden": HIDDEN, "head_dim": d}
        for name, fn in (("eager", rmsnorm_rope), ("compile", compiled)):
            ms = do_bench(lambda: fn(x, w, cos, sin), warmup=25, rep=100 if quick else 200, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {d:4d} {row['eager_us']:10.2f} {row['eager_gbs']:8.1f} "
              f"{row['compile_us']:11.2f} {row['compile_gbs']:8.1f}", flush=True)
        del x, w, cos, sin
    return rows
