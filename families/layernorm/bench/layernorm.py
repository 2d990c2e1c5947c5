"""PyTorch anchors for LayerNorm (bf16, with bias), the shapes families/layernorm/bench/layernorm.cpp times.

Times torch.nn.functional.layer_norm forward, and its backward (autograd of the forward with
grads for x, weight and bias, timed as the backward alone with retain_graph), eager and under
torch.compile, with triton.testing.do_bench (median).
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

# (rows, cols, row stride): rows of a wider tensor where the stride exceeds cols.
SHAPES = [(r, c, c) for r in (1, 16, 77, 1000, 4096, 16384) for c in (896, 2880, 4096, 8192)] + [
    (16, 4096, 4160), (4096, 4096, 4160), (16384, 8192, 8256)]
QUICK_SHAPES = [(16, 4096, 4096), (4096, 4096, 4096), (16384, 8192, 8192), (16384, 8192, 8256)]


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    compiled = torch.compile(layer_norm, dynamic=False)
    rows = []
    print(f"\ntorch layernorm (bf16)\n{'rows':>8} {'cols':>6} {'stride':>6} {'pass':>5} {'eager us':>10} "
          f"{'compile us':>11}")
    for r, c, stride in (QUICK_SHAPES if quick else SHAPES):
        x = torch.randn(r, stride, device=dev, dtype=torch.bfloat16)[:, :c].requires_grad_()
        w = torch.randn(c, device=dev, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(c, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(r, stride, device=dev, dtype=torch.bfloat16)[:, :c]
        for pass_ in ("fwd", "bwd"):
            row = {"family": "layernorm", "dtype": "bf16", "rows": r, "cols": c, "stride": stride, "pass": pass_}
            for name, fn in (("eager", layer_norm), ("compile", compiled)):
                if pass_ == "fwd":
                    with torch.no_grad():
                        fn(x, w, b)
                        ms = do_bench(lambda: fn(x, w, b), warmup=25, rep=100 if quick else 200, return_mode="median")
                else:
                    y = fn(x, w, b)
                    y.backward(dy, retain_graph=True)
                    ms = do_bench(lambda: y.backward(dy, retain_graph=True), warmup=25, rep=100 if quick else 200,
                                  grad_to_none=[x, w, b], return_mode="median")
                row[name + "_us"] = ms * 1e3
            print(f"{r:>8} {c:>6} {stride:>6} {pass_:>5} {row['eager_us']:>10.2f} {row['compile_us']:>11.2f}",
                  flush=True)
            rows.append(row)
    return rows
