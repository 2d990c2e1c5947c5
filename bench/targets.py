#!/usr/bin/env python3
"""Checks kiln's GPU benchmark against the memory-bound targets (docs/benchmarks.md, "Targets"), shape by shape.

Reads the JSON of one `scripts/gpu_run.sh` call (kiln_bench_gpu's and bench/torch_anchors.py's,
measured in the same command) and prints a Markdown table: kiln's time and share of the 1 GiB copy
bandwidth, the fastest PyTorch variant on the same shape, their ratio, and the targets:
  - tokens >= 4096: >= 95% of the copy (90% at hidden 16384, 85% at 65536), never slower than the
    fastest PyTorch variant, and >= 1.10x it where that one is under 86% of the copy;
  - RMSNorm backward: >= 85% of the copy and faster than torch.compile's backward.
And the compute-bound targets (TFLOP/s beside cuBLAS in the same run):
  - fp8_gemm per tensor >= 1.0x torch._scaled_mm (tensorwise), block-scaled >= 0.9x it (and, with
    no target, block-scaled beside cuBLAS's own block-scaled _scaled_mm where it was measured);
  - fused gated MLP >= 1.10x PyTorch's eager silu(x @ Wg^T) * (x @ Wu^T).
And the MoE targets: the grouped GEMM >= 1.05x torch._grouped_mm (bf16) and
torch._scaled_grouped_mm (fp8 rowwise) at each shape and routing, block-scaled FP8 >= 0.95x kiln's
rowwise FP8, and the whole layer forward + backward >= 1.3x a PyTorch layer from _grouped_mm with
eager routing (measured by the anchor).
Each memory-bound row also shows what a device-to-device copy of the same size reaches, as a share
of the 1 GiB figure (kiln_bench_gpu measures copies of 4 .. 256 MiB in the same run; the shape's
bytes are taken as n read + n written and interpolated between those sizes). Where that share is
under the floor, a copy of those bytes itself misses the target: the verdict is still the
target's, and the summary counts these rows apart.

--markdown prints the same verdicts as one table per family, headed by the device, for
docs/benchmarks.md; there a shape that misses only by being slower than its peer (a 1.0x line:
not slower than PyTorch, faster than torch.compile's backward, 1.0x cuBLAS tensorwise) by at most
2% reads as a tie, and a miss where a same-size copy is under the floor too says so.
Usage: bench/targets.py [--markdown] BENCH_JSON TORCH_JSON
"""
import json
import math
import os
import re
import sys

MEMORY_FAMILIES = (("rmsnorm", ("hidden",)), ("add_rmsnorm", ("hidden",)), ("act_and_mul", ("d", "act")),
                   ("rope", ("head_dim", "layout")), ("rmsnorm_rope", ("head_dim",)), ("rmsnorm_bwd", ("hidden",)))
TIE = 0.98  # a peer within 2% of kiln is a tie (markdown only)


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


def memory_rows(bench, torch):
    """One dict per memory-bound shape with a target: the measurements and the verdict."""
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

    out = []
    for family, key_fields in MEMORY_FAMILIES:
        for r in bench.get(family, []):
            if r["tokens"] < 4096:
                continue
            match = {"tokens": r["tokens"], **{k: r[k] for k in key_fields}}
            best = fastest(torch_rows(family, match))
            width = r.get("hidden", r.get("d", 4096))
            frac = r["fraction_of_copy"]
            # The speed the target asks of kiln against its peer (peer time / kiln time).
            peer = need = None
            if family == "rmsnorm_bwd":
                floor = 0.85
                compile_rows = torch_rows(family, match)
                ok = frac >= floor and compile_rows and r["median_us"] < compile_rows[0]["compile_us"]
                if compile_rows:
                    peer, need = ("compile", compile_rows[0]["compile_us"]), 1.0
            else:
                floor = floor_for(width)
                ok = frac >= floor
                if best:
                    speed = best[1] / r["median_us"]
                    need = 1.10 if best[2] / copy < 0.86 else 1.0
                    ok = ok and speed >= need
                    peer = best[:2]
            same = same_size_copy(bench, r["gbs"] * r["median_us"] * 1e3)
            out.append({"family": family, "row": r, "key_fields": key_fields, "frac": frac, "floor": floor,
                        "same": same, "best": best, "peer": peer, "need": need, "ok": bool(ok)})
    return out


def gemm_rows(bench, torch):
    """One dict per fp8_gemm / fused gated MLP shape: kiln, its cuBLAS or eager anchor, the verdict."""
    anchors = {(r["kind"], r["m"], r["n"], r["k"]): r for r in torch.get("gemm", [])}
    out = []
    for r in bench.get("gemm", []):
        if r["kind"] not in ("fp8", "gated_mlp"):
            continue
        fp8 = r["kind"] == "fp8"
        anchor = anchors.get(("fp8" if fp8 else "gated_mlp", r["m"], r["n"], r["k"]))
        what = "scaled_mm_tensorwise" if fp8 else "gated_silu_eager"
        target = (1.0 if r["scales"] == "tensor" else 0.9) if fp8 else 1.10
        ratio = None
        if anchor and what + "_us" in anchor:
            ratio = anchor[what + "_us"] / r["median_us"]
        out.append({"row": r, "fp8": fp8, "anchor": anchor, "what": what, "target": target, "ratio": ratio,
                    "ok": ratio is not None and ratio >= target})
    return out


def main():
    bench = json.load(open(sys.argv[1]))
    torch = json.load(open(sys.argv[2]))
    copy = bench["copy_gbs"]

    lines = ["| family | shape | kiln µs | % copy | floor | same-size copy % | fastest PyTorch | its µs | its % copy | "
             "kiln speedup | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    copy_misses = 0  # missed shapes where a copy of the same size is under the floor too
    for m in memory_rows(bench, torch):
        r, best, floor, same, ok = m["row"], m["best"], m["floor"], m["same"], m["ok"]
        total += 1
        met += ok
        shape = f"{r['tokens']} x " + ", ".join(f"{k}={r[k]}" for k in m["key_fields"])
        same_text = f"{100 * same / copy:.1f}" if same else "-"
        if not ok and same and same / copy < floor:
            copy_misses += 1
        head = (f"| {m['family']} | {shape} | {r['median_us']:.1f} | {100 * m['frac']:.1f} | {100 * floor:.0f} | "
                f"{same_text} | ")
        if best:
            lines.append(head + f"{best[0]} | {best[1]:.1f} | {100 * best[2] / copy:.1f} | "
                         f"{best[1] / r['median_us']:.2f}x | {'met' if ok else 'MISSED'} |")
        else:
            lines.append(head + f"(not measured) | | | | {'met' if ok else 'MISSED'} |")
    print("\n".join(lines))
    print(f"\n{met} of {total} shapes meet their targets (copy: {copy:.0f} GB/s, 1 GiB cuMemcpyDtoD); of the "
          f"{total - met} missed, {copy_misses} have a floor above what a copy of the same size reaches.")
    gemm_targets(bench, torch)
    moe_targets(bench, torch)
    host = bench.get("host_us", {})
    gpu = bench.get("gpu_us", {})
    if host or gpu:
        print(f"decode: host {json.dumps(host)}; GPU {json.dumps(gpu)}")


def gemm_targets(bench, torch):
    rows = gemm_rows(bench, torch)
    if not rows:
        return
    lines = ["", "| kernel | M x N x K | kiln µs | kiln TFLOP/s | cuBLAS anchor | its TFLOP/s | ratio | target | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    for g in rows:
        r, anchor, what, target = g["row"], g["anchor"], g["what"], g["target"]
        name = f"fp8_gemm {r['scales']}" if g["fp8"] else "fused_gated_mlp"
        shape = f"{r['m']} x {r['n']} x {r['k']}"
        total += 1
        if g["ratio"] is None:
            lines.append(f"| {name} | {shape} | {r['median_us']:.1f} | {r['tflops']:.1f} | (not measured) | | | "
                         f"{target:.2f}x | MISSED |")
            continue
        met += g["ok"]
        lines.append(f"| {name} | {shape} | {r['median_us']:.1f} | {r['tflops']:.1f} | {what} | "
                     f"{anchor[what + '_tflops']:.1f} | {g['ratio']:.2f}x | {target:.2f}x | "
                     f"{'met' if g['ok'] else 'MISSED'} |")
    print("\n".join(lines))
    print(f"\n{met} of {total} GEMM shapes meet their targets.")
    # No target of its own: kiln's block-scaled kernels beside cuBLAS's block-scaled _scaled_mm
    # (1 x 128 and 128 x 128 scales, where this torch has it), and where cuBLAS's own block-scaled
    # kernel stands against the 0.9x-of-tensorwise line.
    block = [(g["row"], g["anchor"]) for g in rows if g["fp8"] and g["row"]["scales"] == "block"]
    block = [(r, a) for r, a in block if a and "scaled_mm_blockwise_us" in a and "scaled_mm_tensorwise_us" in a]
    if block:
        out = ["", "| block-scaled | kiln µs | cuBLAS block-scaled µs | kiln / cuBLAS block-scaled | "
               "cuBLAS block-scaled / tensorwise |", "|---|---|---|---|---|"]
        for r, a in block:
            out.append(f"| {r['m']} x {r['n']} x {r['k']} | {r['median_us']:.1f} | {a['scaled_mm_blockwise_us']:.1f} | "
                       f"{a['scaled_mm_blockwise_us'] / r['median_us']:.2f}x | "
                       f"{a['scaled_mm_tensorwise_us'] / a['scaled_mm_blockwise_us']:.2f}x |")
        print("\n".join(out))


def moe_targets(bench, torch):
    """The grouped GEMM beside its PyTorch anchor per shape and routing (>= 1.05x), and the layer's
    forward + backward (>= 1.3x), as the anchor measured both."""
    anchors = {(r["shape"], r["routing"]): r for r in torch.get("moe", []) if r.get("kind") == "grouped_gemm"}
    lines = ["", "| MoE kernel | shape | routing | kiln µs | kiln TFLOP/s | PyTorch anchor | its TFLOP/s | ratio | "
             "target | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    met = total = 0
    for r in bench.get("moe", []):
        if r.get("kind") not in ("grouped_gemm", "grouped_gemm_fp8"):
            continue
        what = "scaled_grouped_mm_fp8_rowwise" if r["kind"] == "grouped_gemm_fp8" else "grouped_mm_bf16"
        anchor = anchors.get((r["shape"].replace("_masked", ""), r["routing"]))
        total += 1
        if not anchor or what + "_us" not in anchor:
            lines.append(f"| {r['kind']} | {r['shape']} | {r['routing']} | {r['median_us']:.1f} | {r['tflops']:.1f} | "
                         f"(not measured) | | | 1.05x | MISSED |")
            continue
        ratio = anchor[what + "_us"] / r["median_us"]
        met += ratio >= 1.05
        lines.append(f"| {r['kind']} | {r['shape']} | {r['routing']} | {r['median_us']:.1f} | {r['tflops']:.1f} | "
                     f"{what} | {anchor[what + '_tflops']:.1f} | {ratio:.2f}x | 1.05x | "
                     f"{'met' if ratio >= 1.05 else 'MISSED'} |")
    # Block-scaled FP8 against kiln's own rowwise FP8 on the same shape and routing (>= 0.95x).
    rowwise = {(r["shape"], r["routing"]): r for r in bench.get("moe", []) if r.get("kind") == "grouped_gemm_fp8"}
    for r in bench.get("moe", []):
        base = rowwise.get((r["shape"], r["routing"])) if r.get("kind") == "grouped_gemm_fp8_block" else None
        if not base:
            continue
        total += 1
        ratio = base["median_us"] / r["median_us"]
        met += ratio >= 0.95
        lines.append(f"| grouped_gemm_fp8_block | {r['shape']} | {r['routing']} | {r['median_us']:.1f} | "
                     f"{r['tflops']:.1f} | kiln fp8 rowwise | {base['tflops']:.1f} | {ratio:.2f}x | 0.95x | "
                     f"{'met' if ratio >= 0.95 else 'MISSED'} |")
    for a in torch.get("moe", []):
        if a.get("kind") != "layer" or "kiln_over_torch" not in a:
            continue
        total += 1
        met += a["kiln_over_torch"] >= 1.3
        lines.append(f"| fused_moe fwd+bwd | {a['shape']} | {a['routing']} | {a['kiln_fused_moe_fwd_bwd_us']:.1f} | "
                     f"{a['kiln_fused_moe_fwd_bwd_tflops']:.1f} | torch layer | {a['torch_layer_fwd_bwd_tflops']:.1f} | "
                     f"{a['kiln_over_torch']:.2f}x | 1.30x | {'met' if a['kiln_over_torch'] >= 1.3 else 'MISSED'} |")
    if total:
        print("\n".join(lines))
        print(f"\n{met} of {total} MoE rows meet their targets.")


def verdict(ok, ratio, need, copy_short):
    """The markdown verdict: met, tie (missed only by a 1.0x line, by at most 2%), or missed."""
    if ok:
        return "met"
    if need == 1.0 and ratio is not None and TIE <= ratio < 1.0:
        return "tie"
    return "missed (copy under the floor too)" if copy_short else "missed"


def tally(verdicts):
    parts = [f"{sum(v == 'met' for v in verdicts)} met"]
    ties = sum(v == "tie" for v in verdicts)
    if ties:
        parts.append(f"{ties} tied with the peer")
    missed = sum(v.startswith("missed") for v in verdicts)
    if missed:
        parts.append(f"{missed} missed")
    return f"{len(verdicts)} shapes: " + ", ".join(parts) + "."


def markdown(bench_path, torch_path):
    bench = json.load(open(bench_path))
    torch = json.load(open(torch_path))
    copy = bench["copy_gbs"]
    device = bench.get("device", "unknown device")
    date = re.match(r"\d{4}-\d{2}-\d{2}", os.path.basename(bench_path))
    driver = bench.get("driver_version")
    run = [f"{date.group(0)}, " if date else "", device]
    if driver:
        run.append(f", CUDA driver API {driver // 1000}.{driver % 1000 // 10}")
    if torch.get("torch"):
        run.append(f", torch {torch['torch']}")
    print("".join(run) + f"; 1 GiB device-to-device copy: {copy:.0f} GB/s (kiln)"
          + (f", {torch['copy_gbs']:.0f} GB/s (PyTorch)." if "copy_gbs" in torch else "."))
    print(f"\nSource: `{bench_path}`, `{torch_path}`.")

    names = {"hidden": "hidden", "d": "d", "act": "activation", "head_dim": "head_dim", "layout": "layout"}
    rows = memory_rows(bench, torch)
    for family, key_fields in MEMORY_FAMILIES:
        mine = [m for m in rows if m["family"] == family]
        if not mine:
            continue
        peer_name = "torch.compile" if family == "rmsnorm_bwd" else "fastest PyTorch"
        print(f"\n### {family} ({device})\n")
        print("| tokens | " + " | ".join(names[k] for k in key_fields) + " | kiln µs | % of copy | floor % | "
              f"same-size copy % | {peer_name} | its µs | its % of copy | kiln speedup | target | verdict |")
        print("|" + "---|" * (len(key_fields) + 11))
        verdicts = []
        for m in mine:
            r, same, peer, need = m["row"], m["same"], m["peer"], m["need"]
            ratio = peer[1] / r["median_us"] if peer else None
            copy_short = bool(same) and same / copy < m["floor"]
            v = verdict(m["ok"], ratio if m["frac"] >= m["floor"] else None, need, copy_short)
            verdicts.append(v)
            same_text = f"{100 * same / copy:.1f}" if same else "-"
            if peer:
                gbs = next(t for t in torch[family] if all(t.get(k) == r[k] for k in ("tokens", *key_fields)))
                peer_gbs = gbs.get(peer[0] + "_gbs")
                peer_text = (f"{peer[0]} | {peer[1]:.1f} | {100 * peer_gbs / copy:.1f}" if peer_gbs
                             else f"{peer[0]} | {peer[1]:.1f} | -")
                target = f"{100 * m['floor']:.0f}%, {need:.2f}x"
            else:
                peer_text, ratio = "(not measured) | | ", None
                target = f"{100 * m['floor']:.0f}%"
            ratio_text = f"{ratio:.2f}x" if ratio else ""
            print(f"| {r['tokens']} | " + " | ".join(str(r[k]) for k in key_fields)
                  + f" | {r['median_us']:.1f} | {100 * m['frac']:.1f} | {100 * m['floor']:.0f} | {same_text} | "
                  f"{peer_text} | {ratio_text} | {target} | {v} |")
        print("\n" + tally(verdicts))

    gemm = gemm_rows(bench, torch)
    fp8 = [g for g in gemm if g["fp8"]]
    if fp8:
        print(f"\n### fp8_gemm ({device})\n")
        print("| M x N x K | scales | kiln µs | kiln TFLOP/s | cuBLAS tensorwise µs | kiln / tensorwise | target | "
              "verdict | cuBLAS block-scaled µs | kiln / cuBLAS block-scaled |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        verdicts = []
        for g in fp8:
            r, a = g["row"], g["anchor"] or {}
            v = verdict(g["ok"], g["ratio"], g["target"], False)
            verdicts.append(v)
            tensorwise = f"{a['scaled_mm_tensorwise_us']:.1f}" if "scaled_mm_tensorwise_us" in a else "(not measured)"
            ratio = f"{g['ratio']:.2f}x" if g["ratio"] else ""
            block = ""
            if r["scales"] == "block" and "scaled_mm_blockwise_us" in a:
                block = f"{a['scaled_mm_blockwise_us']:.1f} | {a['scaled_mm_blockwise_us'] / r['median_us']:.2f}x"
            else:
                block = " | "
            print(f"| {r['m']} x {r['n']} x {r['k']} | {r['scales']} | {r['median_us']:.1f} | {r['tflops']:.1f} | "
                  f"{tensorwise} | {ratio} | {g['target']:.2f}x | {v} | {block} |")
        print("\n" + tally(verdicts))
        both = [g["anchor"] for g in fp8 if g["row"]["scales"] == "block" and g["anchor"]
                and "scaled_mm_blockwise_us" in g["anchor"] and "scaled_mm_tensorwise_us" in g["anchor"]]
        if both:
            print("cuBLAS's own block-scaled kernel against its tensorwise one (no target of its own): "
                  + ", ".join(f"{a['m']} x {a['n']} x {a['k']} "
                              f"{a['scaled_mm_tensorwise_us'] / a['scaled_mm_blockwise_us']:.2f}x" for a in both)
                  + ".")
    gated = [g for g in gemm if not g["fp8"]]
    if gated:
        print(f"\n### gated_mlp ({device})\n")
        print("| M x N x K | kiln µs | kiln TFLOP/s | PyTorch eager µs | its TFLOP/s | kiln speedup | target | verdict |")
        print("|---|---|---|---|---|---|---|---|")
        verdicts = []
        for g in gated:
            r, a = g["row"], g["anchor"] or {}
            v = verdict(g["ok"], g["ratio"], g["target"], False)
            verdicts.append(v)
            eager = (f"{a['gated_silu_eager_us']:.1f} | {a['gated_silu_eager_tflops']:.1f}"
                     if "gated_silu_eager_us" in a else "(not measured) | ")
            ratio = f"{g['ratio']:.2f}x" if g["ratio"] else ""
            print(f"| {r['m']} x {r['n']} x {r['k']} | {r['median_us']:.1f} | {r['tflops']:.1f} | {eager} | {ratio} | "
                  f"{g['target']:.2f}x | {v} |")
        print("\n" + tally(verdicts))

    host, gpu = bench.get("host_us", {}), bench.get("gpu_us", {})
    compile_ms, warm, daemon = bench.get("compile_ms", {}), bench.get("warm_hit_ms", {}), bench.get("daemon", {})
    facts = []
    if "op_call" in host and "bare_cuLaunchKernel_same_kernel" in host:
        # The bench's ratio is the median of paired rounds' ratios, not a ratio of the two medians.
        ratio = host.get("ratio", host["op_call"] / host["bare_cuLaunchKernel_same_kernel"])
        facts.append(("host time of one `kiln::rms_norm` call (handle cached) / a bare `cuLaunchKernel` of the same kernel",
                      f"{host['op_call']:.2f} / {host['bare_cuLaunchKernel_same_kernel']:.2f} µs (paired: {ratio:.2f}x)"))
    if "rmsnorm_1x4096" in gpu and "empty_kernel" in gpu:
        facts.append(("GPU time of `rms_norm` 1 x 4096 bf16 / an empty kernel",
                      f"{gpu['rmsnorm_1x4096']:.2f} / {gpu['empty_kernel']:.2f} µs "
                      f"({gpu['rmsnorm_1x4096'] / gpu['empty_kernel']:.2f}x)"))
    if {"first_in_process", "warm_process_median", "pch_warm_median"} <= compile_ms.keys():
        facts.append(("NVRTC compile of one RMSNorm variant: first in a process / later (median) / with a warm PCH (median)",
                      f"{compile_ms['first_in_process']:.0f} / {compile_ms['warm_process_median']:.0f} / "
                      f"{compile_ms['pch_warm_median']:.0f} ms"))
    if {"open_lookup_verify_load_median", "open_lookup_verify_median"} <= warm.keys():
        facts.append(("cache hit in a new runtime: open, look up, verify, load the module / without the load (medians)",
                      f"{warm['open_lookup_verify_load_median']:.2f} / {warm['open_lookup_verify_median']:.2f} ms"))
    if {"cold_get_ms", "second_compile_get_ms", "warm_get_p50_us", "warm_get_p99_us"} <= daemon.keys():
        facts.append(("kilnd `get`: first (compiles) / a second variant / a cached kernel (p50, p99)",
                      f"{daemon['cold_get_ms']:.0f} / {daemon['second_compile_get_ms']:.0f} ms / "
                      f"{daemon['warm_get_p50_us']:.0f}, {daemon['warm_get_p99_us']:.0f} µs"))
    if facts:
        print(f"\n### Host side ({device})\n")
        print("| what | measured |\n|---|---|")
        for what, value in facts:
            print(f"| {what} | {value} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--markdown":
        markdown(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        main()
    else:
        sys.exit(__doc__.strip().splitlines()[-1])
