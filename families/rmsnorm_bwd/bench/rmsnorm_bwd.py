"""RMSNorm backward anchors (bf16): autograd through F.rms_norm (eager), and torch.compile of a
manual RMSNorm's forward + backward, timing the backward only (dx and dw from a given dy).

Bytes counted as kiln's section counts them: read dy, x, w and the saved inverse RMS, write dx.
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench


def rms_manual(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def backward_timer(fn, x, w, dy):
    """A callable running only the backward of fn(x, w) for dy (the graph is rebuilt untimed)."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    y = fn(x, w)

    def step():
        torch.autograd.grad(y, (x, w), dy, retain_graph=True)

    return step


def run(quick):
    shapes = [(t, h) for t in (4096, 32768) for h in (2048, 4096, 8192, 16384)] + [(4096, 65536)]
    if quick:
        shapes = [(4096, 4096), (32768, 4096), (4096, 65536)]
    compiled = torch.compile(rms_manual, dynamic=False)
    rows = []
    print(f"{'tokens':>8} {'hidden':>7} {'eager':>9} {'compile':>9} {'eager_us':>9} {'compile_us':>10}  (GB/s)")
    for m, h in shapes:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": m, "hidden": h}
        nbytes = 3 * m * h * 2 + h * 2 + m * 4
        for name, fn in (("eager", lambda a, b: F.rms_norm(a, (h,), b, 1e-6)), ("compile", compiled)):
            step = backward_timer(fn, x, w, dy)
            step()
            ms = do_bench(step, warmup=10, rep=100, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {h:7d} {row['eager_gbs']:9.1f} {row['compile_gbs']:9.1f} {row['eager_us']:9.1f} "
              f"{row['compile_us']:10.1f}", flush=True)
        del x, w, dy
        torch.cuda.empty_cache()
    return rows
