#!/usr/bin/env python3
"""Checks kiln's GPU benchmark against the memory-bound targets of issue 3, shape by shape.

Reads the JSON of one `scripts/gpu_run.sh` call (kiln_bench_gpu's and bench/torch_anchors.py's,
measured in the same command) and prints a Markdown table: kiln's time and share of the 1 GiB copy
bandwidth, the fastest PyTorch variant on the same shape, their ratio, and the targets:
  - tokens >= 4096: >= 95% of the copy (90% at hidden 16384, 85% at 65536), never slower than the
    fastest PyTorch variant, and >= 1.10x it where that one is under 86% of the copy;
  - RMSNorm backward: >= 85% of the copy and faster than torch.compile's backward.
And the compute-bound targets of issue 8 (TFLOP/s beside cuBLAS in the same run):
  - fp8_gemm per tensor >= 1.0x torch._scaled_mm (tensorwise), block-scaled >= 0.9x it (and, with
    no target, block-scaled beside cuBLAS's own block-scaled _scaled_mm where it was measured);
  - fused gated MLP >= 1.10x PyTorch's eager silu(x @ Wg^T) * (x @ Wu^T).
Each memory-bound row also shows what a device-to-device copy of the same size reaches, as a share
of the 1 GiB figure (kiln_bench_gpu measures copies of 4 .. 256 MiB in the same run; the shape's
bytes are taken as n read + n written and interpolated between those sizes). Where that share is
under the floor, a copy of those bytes itself misses the target: the verdict is still the
target's, and the summary counts these rows apart.
Usage: bench/targets.py BENCH_JSON TORCH_JSON
"""
import json
import math
import sys


def floor_for(hidden):
    return 0.85 if hidden >= 65536 else 0.90 if hidden >= 16384 else 0.95


def same_size_copy(bench, total_bytes):
    """GB/s of a copy moving total_bytes (half read, half written), interpolated in log size
    between the measured sizes; None when the bench JSON has none."""
    sizes = sorted((float(k[:-3]) * 2**20, v) for k, v in bench.get("copy_gbs_by_size", {}).items()
                   if k.endswith("MiB"))
    if not sizes:
        return None
    sizes.append((2.0**30, bench["copy_gbs"]))
    n = total_bytes / 2
    if n <= sizes[0][0]:
        return sizes[0][1]
    for (a, ga), (b, gb) in zip(sizes, sizes[1:]):
        if n <= b:
            t = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))
            return ga + t * (gb - ga)
    return sizes[-1][1]


def main():
    bench = json.load(open(sys.argv[1]))
    torch = json.load(open(sys.argv[2]))
    copy = bench["copy_gbs"]

    def torch_rows(family, match):
        return [r for r in torch.get(family, []) if all(r.get(k) == v for k, v in match.items())]

    def fastest(rows):
        best = None
        for r in rows:
            for key in ("eager_us", "F.rms_norm_us", "compile_us"):
                if key in r and r[key] > 0 and (best is None or r[key] < best[1]):
                    best = (key[:-3], r[key], r[key.replace("_us", "_gbs")])
        return best

    lines = ["| family | shape | kiln µs | % copy | floor | same-size copy % | fastest PyTorch | its µs | its % copy | "
             "kiln speedup | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    copy_misses = 0  # missed shapes where a copy of the same size is under the floor too
    for family, key_fields in (("rmsnorm", ("hidden",)), ("add_rmsnorm", ("hidden",)),
                               ("act_and_mul", ("d", "act")), ("rope", ("head_dim", "layout")),
                               ("rmsnorm_rope", ("head_dim",)), ("rmsnorm_bwd", ("hidden",))):
        for r in bench.get(family, []):
            if r["tokens"] < 4096:
                continue
            match = {"tokens": r["tokens"], **{k: r[k] for k in key_fields}}
            best = fastest(torch_rows(family, match))
            width = r.get("hidden", r.get("d", 4096))
            frac = r["fraction_of_copy"]
            if family == "rmsnorm_bwd":
                floor = 0.85
                compile_rows = torch_rows(family, match)
                ok = frac >= floor and compile_rows and r["median_us"] < compile_rows[0]["compile_us"]
            else:
                floor = floor_for(width)
                ok = frac >= floor
                if best:
                    speed = best[1] / r["median_us"]
                    ok = ok and speed >= (1.10 if best[2] / copy < 0.86 else 1.0)
            total += 1
            met += bool(ok)
            shape = f"{r['tokens']} x " + ", ".join(f"{k}={r[k]}" for k in key_fields)
            same = same_size_copy(bench, r["gbs"] * r["median_us"] * 1e3)
            same_text = f"{100 * same / copy:.1f}" if same else "-"
            if not ok and same and same / copy < floor:
                copy_misses += 1
            head = f"| {family} | {shape} | {r['median_us']:.1f} | {100 * frac:.1f} | {100 * floor:.0f} | {same_text} | "
            if best:
                lines.append(head + f"{best[0]} | {best[1]:.1f} | {100 * best[2] / copy:.1f} | "
                             f"{best[1] / r['median_us']:.2f}x | {'met' if ok else 'MISSED'} |")
            else:
                lines.append(head + f"(not measured) | | | | {'met' if ok else 'MISSED'} |")
    print("\n".join(lines))
    print(f"\n{met} of {total} shapes meet their targets (copy: {copy:.0f} GB/s, 1 GiB cuMemcpyDtoD); of the "
          f"{total - met} missed, {copy_misses} have a floor above what a copy of the same size reaches.")
    gemm_targets(bench, torch)
    host = bench.get("host_us", {})
    gpu = bench.get("gpu_us", {})
    if host or gpu:
        print(f"decode: host {json.dumps(host)}; GPU {json.dumps(gpu)}")


def gemm_targets(bench, torch):
    rows = [r for r in bench.get("gemm", []) if r["kind"] in ("fp8", "gated_mlp")]
    if not rows:
        return
    anchors = {(r["kind"], r["m"], r["n"], r["k"]): r for r in torch.get("gemm", [])}
    lines = ["", "| kernel | M x N x K | kiln µs | kiln TFLOP/s | cuBLAS anchor | its TFLOP/s | ratio | target | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    for r in rows:
        fp8 = r["kind"] == "fp8"
        anchor = anchors.get(("fp8" if fp8 else "gated_mlp", r["m"], r["n"], r["k"]))
        what = "scaled_mm_tensorwise" if fp8 else "gated_silu_eager"
        target = (1.0 if r["scales"] == "tensor" else 0.9) if fp8 else 1.10
        name = f"fp8_gemm {r['scales']}" if fp8 else "fused_gated_mlp"
        shape = f"{r['m']} x {r['n']} x {r['k']}"
        total += 1
        if not anchor or what + "_us" not in anchor:
            lines.append(f"| {name} | {shape} | {r['median_us']:.1f} | {r['tflops']:.1f} | (not measured) | | | "
                         f"{target:.2f}x | MISSED |")
            continue
        ratio = anchor[what + "_us"] / r["median_us"]
        ok = ratio >= target
        met += ok
        lines.append(f"| {name} | {shape} | {r['median_us']:.1f} | {r['tflops']:.1f} | {what} | "
                     f"{anchor[what + '_tflops']:.1f} | {ratio:.2f}x | {target:.2f}x | {'met' if ok else 'MISSED'} |")
    print("\n".join(lines))
    print(f"\n{met} of {total} GEMM shapes meet their targets.")
    # No target of its own: kiln's block-scaled kernels beside cuBLAS's block-scaled _scaled_mm
    # (1 x 128 and 128 x 128 scales, where this torch has it), and where cuBLAS's own block-scaled
    # kernel stands against the 0.9x-of-tensorwise line.
    block = [(r, anchors.get(("fp8", r["m"], r["n"], r["k"]))) for r in rows
             if r["kind"] == "fp8" and r["scales"] == "block"]
    block = [(r, a) for r, a in block if a and "scaled_mm_blockwise_us" in a and "scaled_mm_tensorwise_us" in a]
    if block:
        out = ["", "| block-scaled | kiln µs | cuBLAS block-scaled µs | kiln / cuBLAS block-scaled | "
               "cuBLAS block-scaled / tensorwise |", "|---|---|---|---|---|"]
        for r, a in block:
            out.append(f"| {r['m']} x {r['n']} x {r['k']} | {r['median_us']:.1f} | {a['scaled_mm_blockwise_us']:.1f} | "
                       f"{a['scaled_mm_blockwise_us'] / r['median_us']:.2f}x | "
                       f"{a['scaled_mm_tensorwise_us'] / a['scaled_mm_blockwise_us']:.2f}x |")
        print("\n".join(out))


if __name__ == "__main__":
    main()
