"""PyTorch anchors for activation-and-mul (bf16), the shapes families/act_and_mul/bench/act_and_mul.cpp times.

Times eager act(x[..., :d]) * x[..., d:] (F.silu, F.gelu, F.gelu(approximate="tanh")) and
torch.compile of it, with triton.testing.do_bench (median). Minimal bytes: read rows of 2d, write
rows of d.
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = ([(t, d, "silu") for t in (1, 16, 512, 4096, 32768) for d in (2048, 4096, 8192, 11008, 14336, 16384)] +
          [(4096, 65536, "silu")] +
          [(t, 14336, act) for act in ("gelu", "gelu_tanh") for t in (1, 4096, 32768)])
QUICK_SHAPES = [(1, 4096, "silu"), (4096, 14336, "silu"), (32768, 11008, "silu"), (4096, 14336, "gelu"),
                (4096, 65536, "silu")]


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


EAGER = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    compiled = {act: torch.compile(fn, dynamic=False) for act, fn in EAGER.items()}
    rows = []
    print(f"\ntorch act_and_mul (bf16)\n{'tokens':>8} {'d':>6} {'act':>10} {'eager us':>10} {'GB/s':>8} "
          f"{'compile us':>11} {'GB/s':>8}")
    for m, d, act in (QUICK_SHAPES if quick else SHAPES):
        x = torch.randn(m, 2 * d, device=dev, dtype=torch.bfloat16)
        compiled[act](x)
        nbytes = 3 * m * d * 2
        row = {"family": "act_and_mul", "dtype": "bf16", "tokens": m, "d": d, "act": act}
        for name, fn in (("eager", EAGER[act]), ("compile", compiled[act])):
            ms = do_bench(lambda: fn(x), warmup=25, rep=100 if quick else 200, return_mode="median")
            row[name + "_us"] = ms * 1e3
            row[name + "_gbs"] = nbytes / (ms * 1e-3) / 1e9
        rows.append(row)
        print(f"{m:8d} {d:6d} {act:>10} {row['eager_us']:10.2f} {row['eager_gbs']:8.1f} "
              f"{row['compile_us']:11.2f} {row['compile_gbs']:8.1f}", flush=True)
        del x
    return rows

