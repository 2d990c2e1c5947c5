"""PyTorch anchors for kiln's GPU benchmark, run in the same command as kiln_bench_gpu.

Measures the device copy bandwidth, then imports every family's anchor, families/<name>/bench/*.py
(the same layout under gpu-dist/), and calls its run(quick) -> list of row dicts. Each module times PyTorch eager and torch.compile on the shapes
kiln's section of the same name times, with triton.testing.do_bench medians.

    python3 bench/torch_anchors.py [--quick] [--json FILE] [--only NAME]
"""
import argparse
import importlib.util
import json
import pathlib
import traceback

import torch
from triton.testing import do_bench


def copy_gbs():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", help="anchor names (file stems), comma-separated")
    args = ap.parse_args()
    # Every anchor compiles one graph per shape; dynamo's default limit (8) would silently fall
    # back to eager after the eighth and report eager numbers as torch.compile's.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 20
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy_gbs()}
    print(f"torch {res['torch']} on {res['device']}: copy 1 GiB {res['copy_gbs']:.1f} GB/s", flush=True)
    failed = False
    anchors = sorted((pathlib.Path(__file__).resolve().parent.parent / "families").glob("*/bench/*.py"),
                     key=lambda p: p.stem)
    for path in anchors:
        if args.only and path.stem not in args.only.split(","):
            continue
        print(f"\n== torch {path.stem} ==", flush=True)
        try:
            spec = importlib.util.spec_from_file_location(f"anchor_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            res[path.stem] = mod.run(args.quick)
        except Exception:  # one broken anchor must not hide the others
            traceback.print_exc()
            failed = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
