"""PyTorch anchors for the shapes kiln_bench_gpu times, measured in the same command.

Times F.rms_norm, an eager x * rsqrt(mean(x^2) + eps) * w, and torch.compile of the latter with
triton.testing.do_bench (median, milliseconds), and a 1 GiB device copy. Prints one line per row
and writes JSON. Minimal bytes: read x, write y (the weight is negligible).
"""
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def rms_eager(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    shapes = [(32768, 4096), (4096, 4096), (32768, 8192), (4096, 65536), (1, 4096), (16, 4096)]
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    res["copy_gbs"] = 2 * n / (ms * 1e-3) / 1e9
    print(f"torch copy 1 GiB: {res['copy_gbs']:.1f} GB/s")
    compiled = torch.compile(rms_eager, dynamic=False)
    for m, h in shapes:
        x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        w = torch.randn(h, device=dev, dtype=torch.bfloat16)
        compiled(x, w)
        row = {"tokens": m, "hidden": h}
        for name, fn in [("F.rms_norm", lambda: F.rms_norm(x, (h,), w, 1e-6)),
                         ("eager", lambda: rms_eager(x, w)),
                         ("compile", lambda: compiled(x, w))]:
            t = do_bench(fn, warmup=25, rep=200, return_mode="median")
            row[name + "_us"] = t * 1e3
            row[name + "_gbs"] = 2 * m * h * 2 / (t * 1e-3) / 1e9
        res["rows"].append(row)
        print(f"torch {m:6d}x{h:6d}: F.rms_norm {row['F.rms_norm_gbs']:8.1f} GB/s  eager {row['eager_gbs']:8.1f}  "
              f"compile {row['compile_gbs']:8.1f} ({row['compile_us']:.1f} us)")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
