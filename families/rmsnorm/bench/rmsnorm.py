"""RMSNorm forward anchors: F.rms_norm, an eager formula, and torch.compile of it (bf16)."""
import torch
import torch.nn.functional as F
from triton.testing import do_bench


def rms_eager(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def run(quick):
    shapes = [(t, h) for t in (1, 16, 512, 4096, 32768) for h in (2048, 4096, 5120, 8192, 16384)]
    shapes += [(1, 65536), (16, 65536), (4096, 65536)]
    if quick:
        shapes = [(1, 4096), (4096, 4096), (32768, 4096), (4096, 65536)]
    compiled = torch.compile(rms_eager, dynamic=False)
    rows = []
    print(f"{'tokens':>8} {'hidden':>7} {'F.rms_norm':>11} {'eager':>9} {'compile':>9} {'compile_us':>10}  (GB/s)")
    for m, h in shapes:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        compiled(x, w)
        row = {"tokens": m, "hidden": h}
        for name, fn in (("F.rms_norm", lambda: F.rms_norm(x, (h,), w, 1e-6)),
                         ("eager", lambda: rms_eager(x, w)),
                         ("compile", lambda: compiled(x, w))):
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = 2 * m * h * 2 / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {h:7d} {row['F.rms_norm_gbs']:11.1f} {row['eager_gbs']:9.1f} {row['compile_gbs']:9.1f} "
              f"{row['compile_us']:10.1f}", flush=True)
    return rows
