"""PyTorch anchors for the MoE grouped GEMM, the shapes families/moe/bench/moe.cpp times.

torch._grouped_mm (bf16) and torch._scaled_grouped_mm (fp8 e4m3, rowwise scales, fast accumulation)
on x [rows, K] sorted by expert with int32 cumulative offsets and w the transposed view of a
contiguous [E, N, K] weight (kiln's grouped_gemm takes that [E, N, K] weight as it is). Routing
balanced (every expert the same rows) and Zipf (expert e's share proportional to 1 / (e + 1), the
same counts as moe.cpp). The weight-gradient form times torch._grouped_mm's 2-D x 2-D case
(dY^T [N, rows] x X [rows, K] grouped along rows), the input-gradient form dY [rows, K] x W [E, K, N]
(the forward's weight as stored). Where kiln.torch imports, the whole MoE layer
(forward + backward, bf16) is timed too: kiln.torch.fused_moe against a layer built from
torch._grouped_mm with eager routing. Medians of triton.testing.do_bench; TFLOP/s = 2 rows N K /
time (the layer: 6 rows H I x 3 for forward and backward, rows = tokens x top_k).
"""
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from anchor_util import kernel_breakdown

SHAPES = [("mixtral_gate_up", 8, 4096, 28672, 4096), ("mixtral_down", 8, 4096, 4096, 14336),
          ("dsv3_gate_up", 256, 1024, 4096, 7168), ("dsv3_down", 256, 1024, 7168, 2048),
          ("dsv3_decode", 256, 16, 4096, 7168)]
WGRAD = [("mixtral_down_wgrad", 8, 4096, 4096, 14336), ("qwen3_down_wgrad", 128, 256, 2048, 768)]
DGRAD = [("mixtral_down_dgrad", 8, 4096, 14336, 4096)]
LAYERS = [("mixtral_layer", 4096, 4096, 14336, 8, 2), ("qwen3_moe_layer", 4096, 2048, 768, 128, 8)]


def bench(fn, quick):
    return do_bench(fn, warmup=10, rep=50 if quick else 200, return_mode="median")


def counts(experts, rows, zipf):
    if not zipf:
        c = [rows // experts] * experts
        c[0] += rows - rows // experts * experts
        return c
    h = sum(1.0 / (e + 1) for e in range(experts))
    c = [math.floor(rows / h / (e + 1)) for e in range(experts)]
    c[0] += rows - sum(c)
    return c


def eager_moe(x, logits, w_gate_up, w_down, top_k):
    """A PyTorch MoE layer from torch._grouped_mm with eager routing: softmax top-k (renormalized),
    sort by expert, gather, grouped gate_up, SiLU-and-mul, grouped down, weighted scatter-add."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=experts), 0).to(torch.int32)
    xs = x[order // top_k]
    h = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    ys = torch._grouped_mm(a, w_down.transpose(-2, -1), offs=offs)
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, order // top_k, ys.float() * w.reshape(-1)[order].unsqueeze(1))
    return out.to(x.dtype)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    bf = torch.bfloat16
    rows_out = []
    print(f"\ntorch moe\n{'shape':<20} {'routing':>8} {'what':>28} {'us':>10} {'TFLOP/s':>9}")

    def report(row, what, ms, flops):
        row[what + "_us"] = ms * 1e3
        row[what + "_tflops"] = flops / (ms * 1e-3) / 1e12
        print(f"{row['shape']:<20} {row['routing']:>8} {what:>28} {ms * 1e3:10.1f} {row[what + '_tflops']:9.1f}",
              flush=True)

    shapes = SHAPES if not quick else [SHAPES[1], SHAPES[3], SHAPES[4]]
    for name, experts, per, n, k in shapes:
        total = experts * per
        x = torch.randn(total, k, device=dev, dtype=bf)
        w = torch.randn(experts, n, k, device=dev, dtype=bf) * k ** -0.5
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn)
        sa = torch.ones(total, device=dev, dtype=torch.float32)
        sb = torch.ones(experts, n, device=dev, dtype=torch.float32)
        for zipf in (False, True):
            offs = torch.tensor(counts(experts, total, zipf), device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
            row = {"family": "moe", "kind": "grouped_gemm", "shape": name, "routing": "zipf" if zipf else "balanced",
                   "rows": total, "n": n, "k": k, "experts": experts}
            flops = 2 * total * n * k
            wt = w.transpose(-2, -1)
            report(row, "grouped_mm_bf16", bench(lambda: torch._grouped_mm(x, wt, offs=offs), quick), flops)
            if hasattr(torch, "_scaled_grouped_mm"):
                w8t = w8.transpose(-2, -1)
                try:
                    report(row, "scaled_grouped_mm_fp8_rowwise",
                           bench(lambda: torch._scaled_grouped_mm(x8, w8t, sa, sb, offs=offs, out_dtype=bf,
                                                                  use_fast_accum=True), quick), flops)
                except (RuntimeError, TypeError, ValueError) as e:  # needs sm_90 and a recent torch
                    print(f"_scaled_grouped_mm unavailable: {str(e).splitlines()[0]}", flush=True)
            rows_out.append(row)
        del x, w, x8, w8

    for name, experts, per, n, k in WGRAD:
        total = experts * per
        dy = torch.randn(total, n, device=dev, dtype=bf)
        xx = torch.randn(total, k, device=dev, dtype=bf)
        for zipf in (False, True):
            offs = torch.tensor(counts(experts, total, zipf), device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
            row = {"family": "moe", "kind": "grouped_gemm", "shape": name, "routing": "zipf" if zipf else "balanced",
                   "rows": total, "n": n, "k": k, "experts": experts}
            dyt = dy.t()
            try:
                report(row, "grouped_mm_bf16", bench(lambda: torch._grouped_mm(dyt, xx, offs=offs), quick),
                       2 * total * n * k)
            except (RuntimeError, TypeError, ValueError) as e:
                print(f"_grouped_mm 2d x 2d unavailable: {str(e).splitlines()[0]}", flush=True)
            rows_out.append(row)
        del dy, xx

    for name, experts, per, n, k in DGRAD:
        total = experts * per
        dy = torch.randn(total, k, device=dev, dtype=bf)
        w = torch.randn(experts, k, n, device=dev, dtype=bf) * k ** -0.5
        for zipf in (False, True):
            offs = torch.tensor(counts(experts, total, zipf), device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
            row = {"family": "moe", "kind": "grouped_gemm", "shape": name, "routing": "zipf" if zipf else "balanced",
                   "rows": total, "n": n, "k": k, "experts": experts}
            report(row, "grouped_mm_bf16", bench(lambda: torch._grouped_mm(dy, w, offs=offs), quick),
                   2 * total * n * k)
            rows_out.append(row)
        del dy, w

    try:
        import kiln.torch as kt
    except Exception as e:  # the anchors run without kiln's Python package too
        print(f"kiln.torch not importable ({e}); MoE layer comparison skipped", flush=True)
        kt = None
    for name, tokens, hidden, inter, experts, top_k in LAYERS if not quick else LAYERS[:1]:
        x = torch.randn(tokens, hidden, device=dev, dtype=bf, requires_grad=True)
        logits = torch.randn(tokens, experts, device=dev, dtype=bf, requires_grad=True)
        wgu = (torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf) * hidden ** -0.5).requires_grad_()
        wd = (torch.randn(experts, hidden, inter, device=dev, dtype=bf) * inter ** -0.5).requires_grad_()
        dout = torch.randn(tokens, hidden, device=dev, dtype=bf)
        row = {"family": "moe", "kind": "layer", "shape": name, "routing": "softmax", "tokens": tokens,
               "hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k}
        flops = 3 * 6 * tokens * top_k * hidden * inter

        def step(fn):
            def go():
                x.grad = logits.grad = wgu.grad = wd.grad = None
                fn(x, logits, wgu, wd, top_k).backward(dout)
            return go

        try:
            report(row, "torch_layer_fwd_bwd", bench(step(eager_moe), quick), flops)
        except (RuntimeError, TypeError, NotImplementedError) as e:  # _grouped_mm's backward needs a recent torch
            print(f"PyTorch MoE layer backward unavailable: {str(e).splitlines()[0]}", flush=True)
        if kt is not None:
            kiln_step = step(lambda *a: kt.fused_moe(*a, activation="silu"))
            report(row, "kiln_fused_moe_fwd_bwd", bench(kiln_step, quick), flops)
            if "torch_layer_fwd_bwd_us" in row:
                row["kiln_over_torch"] = row["torch_layer_fwd_bwd_us"] / row["kiln_fused_moe_fwd_bwd_us"]
            row["kiln_kernels"] = kernel_breakdown(kiln_step)
        rows_out.append(row)
    return rows_out
