"""PyTorch anchors for fused add + RMSNorm (bf16), the shapes families/add_rmsnorm/bench/add_rmsnorm.cpp times.

Times an eager h = x + residual; y = rmsnorm(h) * w (h rounded to bf16, as kiln does), the same
with F.rms_norm, and torch.compile of the eager function, with triton.testing.do_bench (median).
Minimal bytes: read x and residual, write y and h.
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = [(t, h) for t in (1, 16, 512, 4096, 32768) for h in (2048, 4096, 8192, 16384)] + [(4096, 65536)]
QUICK_SHAPES = [(1, 4096), (4096, 4096), (32768, 4096), (4096, 65536)]


def add_rms_eager(x, r, w, eps=1e-6):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype), h


def add_rms_functional(x, r, w, eps=1e-6):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, eps), h


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    compiled = torch.compile(add_rms_eager, dynamic=False)
    impls = [("eager", add_rms_eager), ("compile", compiled)]
    if hasattr(F, "rms_norm"):
        impls.insert(1, ("F.rms_norm", add_rms_functional))
    rows = []
    print(f"\ntorch add_rmsnorm (bf16)\n{'tokens':>8} {'hidden':>7} " +
          " ".join(f"{name + ' us':>14} {'GB/s':>8}" for name, _ in impls))
    for m, hdim in (QUICK_SHAPES if quick else SHAPES):
        x = torch.randn(m, hdim, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, hdim, device=dev, dtype=torch.bfloat16)
        w = torch.randn(hdim, device=dev, dtype=torch.bfloat16)
        compiled(x, r, w)
        nbytes = 4 * m * hdim * 2 + hdim * 2
        row = {"family": "add_rmsnorm", "dtype": "bf16", "tokens": m, "hidden": hdim}
        for name, fn in impls:
            ms = do_bench(lambda: fn(x, r, w), warmup=25, rep=100 if quick else 200, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {hdim:7d} " +
              " ".join(f"{row[name + '_us']:14.2f} {row[name + '_gbs']:8.1f}" for name, _ in impls), flush=True)
        del x, r, w
    return rows

