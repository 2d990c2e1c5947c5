"""PyTorch anchors for fused LoRA, the shapes families/lora/bench/lora.cpp times.

Per shape (bf16, rank r, scale 2): the cuBLAS base GEMM alone (F.linear(x, W)), PyTorch eager base
+ adapter as PEFT computes it (F.linear(x, W) + F.linear(F.linear(x, A), B) * s), and, where
kiln.torch imports, kiln.torch.lora_linear; the ratios to the base GEMM are what the targets read
(fused <= 1.10x at M >= 4096, <= 1.25x at M <= 16). Then a LoRA MLP training step (forward +
backward, hidden 4096, intermediate 11008, rank 16, 8192 tokens): PEFT-style eager, the same under
torch.compile, and kt.LoRA_MLP; and a decode batch of 16 rows over 16 adapters (ranks 16 and 64)
against one adapter through kt.lora_linear_multi. Medians of triton.testing.do_bench. Each
lora_linear shape also times the multi-adapter path on one adapter (kt.lora_linear_multi, every
row on adapter 0); kiln's first shape, its MLP step and the 16-adapter batches print one call's
GPU time by kernel.
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from anchor_util import kernel_breakdown

SHAPES = [("llama_4096_r16", 8192, 4096, 4096, 16), ("llama_mlp_up_r64", 8192, 14336, 4096, 64),
          ("m4096_r16", 4096, 4096, 4096, 16), ("decode16_r16", 16, 4096, 4096, 16)]


def bench(fn, quick):
    return do_bench(fn, warmup=10, rep=50 if quick else 200, return_mode="median")


def peft_mlp(x, wg, wu, wd, ag, bg, au, bu, ad, bd, s):
    def lin(v, w, a, b):
        return F.linear(v, w) + F.linear(F.linear(v, a), b) * s

    return lin(F.silu(lin(x, wg, ag, bg)) * lin(x, wu, au, bu), wd, ad, bd)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    bf = torch.bfloat16
    rows_out = []
    try:
        import kiln.torch as kt
    except Exception as e:  # the anchors run without kiln's Python package too
        print(f"kiln.torch not importable ({e}); kiln's columns skipped", flush=True)
        kt = None
    print(f"\ntorch lora\n{'shape':<20} {'what':>22} {'us':>10} {'x base':>8}")

    def report(row, what, ms):
        row[what + "_us"] = ms * 1e3
        if "cublas_base_us" in row:
            row[what + "_over_base"] = row[what + "_us"] / row["cublas_base_us"]
        print(f"{row['shape']:<20} {what:>22} {ms * 1e3:10.1f} {row.get(what + '_over_base', 1.0):8.2f}", flush=True)

    s = 2.0
    for name, m, n, k, r in SHAPES if not quick else [SHAPES[0], SHAPES[3]]:
        x = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5
        a = torch.randn(r, k, device=dev, dtype=bf) * k ** -0.5
        b = torch.randn(n, r, device=dev, dtype=bf) * r ** -0.5
        row = {"family": "lora", "kind": "lora_linear", "shape": name, "m": m, "n": n, "k": k, "r": r}
        report(row, "cublas_base", bench(lambda: F.linear(x, w), quick))
        report(row, "eager_base_plus_adapter", bench(lambda: F.linear(x, w) + F.linear(F.linear(x, a), b) * s, quick))
        if kt is not None:
            report(row, "kiln_lora_linear", bench(lambda: kt.lora_linear(x, w, a, b, None, s), quick))
            # The multi-adapter path (one adapter, every row on it): the wgmma kernel whose tail
            # sums the shrink's partial sums, beside lora_linear's core path.
            idx0 = torch.zeros(m, dtype=torch.int32, device=dev)
            ranks1 = torch.full((1,), r, dtype=torch.int32, device=dev)
            scales1 = torch.full((1,), s, dtype=torch.float32, device=dev)
            report(row, "kiln_multi_path_one_adapter",
                   bench(lambda: kt.lora_linear_multi(x, w, a[None], b[None], idx0, ranks1, scales1), quick))
            if name == SHAPES[0][0]:
                row["kiln_kernels"] = kernel_breakdown(lambda: kt.lora_linear(x, w, a, b, None, s))
        rows_out.append(row)

    hidden, inter, r, tokens = 4096, 11008, 16, 2048 if quick else 8192
    x = torch.randn(tokens, hidden, device=dev, dtype=bf, requires_grad=True)
    ws = [torch.randn(inter, hidden, device=dev, dtype=bf) * hidden ** -0.5 for _ in range(2)]
    wd = torch.randn(hidden, inter, device=dev, dtype=bf) * inter ** -0.5
    ad = [(torch.randn(r, d, device=dev, dtype=bf) * d ** -0.5).requires_grad_() for d in (hidden, hidden, inter)]
    bd = [(torch.randn(d, r, device=dev, dtype=bf) * 0.01).requires_grad_() for d in (inter, inter, hidden)]
    dout = torch.randn(tokens, hidden, device=dev, dtype=bf)
    row = {"family": "lora", "kind": "lora_mlp_step", "shape": f"mlp_{hidden}_{inter}_r{r}", "tokens": tokens}

    def step(f):
        def go():
            x.grad = None
            for t in ad + bd:
                t.grad = None
            f().backward(dout)
        return go

    peft = lambda: peft_mlp(x, ws[0], ws[1], wd, ad[0], bd[0], ad[1], bd[1], ad[2], bd[2], s)
    report(row, "peft_eager_fwd_bwd", bench(step(peft), quick))
    compiled = torch.compile(peft_mlp)
    report(row, "peft_compile_fwd_bwd",
           bench(step(lambda: compiled(x, ws[0], ws[1], wd, ad[0], bd[0], ad[1], bd[1], ad[2], bd[2], s)), quick))
    if kt is not None:
        mlp = kt.LoRA_MLP(hidden, inter, r, alpha=s * r, device=dev, dtype=bf)
        with torch.no_grad():
            mlp.gate_up_weight.copy_(torch.cat(ws))
            mlp.down_weight.copy_(wd)
        params = [p for p in mlp.parameters() if p.requires_grad]

        def kiln_step():
            x.grad = None
            for p in params:
                p.grad = None
            mlp(x).backward(dout)

        report(row, "kiln_lora_mlp_fwd_bwd", bench(kiln_step, quick))
        row["kiln_kernels"] = kernel_breakdown(kiln_step)
        row["peft_eager_kernels"] = kernel_breakdown(step(peft))
        row["kiln_speedup_over_eager"] = row["peft_eager_fwd_bwd_us"] / row["kiln_lora_mlp_fwd_bwd_us"]
        row["kiln_speedup_over_compile"] = row["peft_compile_fwd_bwd_us"] / row["kiln_lora_mlp_fwd_bwd_us"]
    rows_out.append(row)

    for r in (16, 64):
        if kt is None:
            break
        m, n, k, adapters = 16, 4096, 4096, 16
        x = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5
        a = torch.randn(adapters, r, k, device=dev, dtype=bf) * k ** -0.5
        b = torch.randn(adapters, n, r, device=dev, dtype=bf) * 0.1
        ranks = torch.full((adapters,), r, dtype=torch.int32, device=dev)
        scales = torch.ones(adapters, device=dev)
        spread = torch.arange(m, dtype=torch.int32, device=dev) % adapters
        one = torch.zeros(m, dtype=torch.int32, device=dev)
        row = {"family": "lora", "kind": "lora_multi_decode", "shape": f"decode16_16_adapters_r{r}"}
        report(row, "kiln_one_adapter", bench(lambda: kt.lora_linear_multi(x, w, a, b, one, ranks, scales), quick))
        report(row, "kiln_16_adapters", bench(lambda: kt.lora_linear_multi(x, w, a, b, spread, ranks, scales), quick))
        row["ratio_16_over_1"] = row["kiln_16_adapters_us"] / row["kiln_one_adapter_us"]
        row["kiln_16_adapters_kernels"] = kernel_breakdown(lambda: kt.lora_linear_multi(x, w, a, b, spread, ranks, scales))
        rows_out.append(row)
    return rows_out
