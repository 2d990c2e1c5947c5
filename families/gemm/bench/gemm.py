"""PyTorch anchors for the tensor-core GEMMs, the shapes families/gemm/bench/gemm.cpp times.

FP8 (e4m3 -> bf16): torch._scaled_mm with tensorwise scales and, where this torch has them, rowwise
scales ([M, 1] and [1, N]) and block scales (1 x 128 and 128 x 128, see blockwise); the second
operand is the transposed view of a contiguous [N, K] weight, the layout cuBLAS's fp8 path needs
(and kiln's fp8_gemm takes). bf16 torch.mm on the same shapes. Gated MLP (bf16):
silu(x @ Wg^T) * (x @ Wu^T), eager (two cuBLAS GEMMs and the elementwise ops). Medians of
triton.testing.do_bench; TFLOP/s = 2 M N K (gated: 4 M N K) / time.
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

FP8_SHAPES = [(8192, 8192, 8192)] + [(m, n, k) for m in (128, 4096) for n, k in ((7168, 16384), (4096, 7168), (2112, 7168))]
GATED_SHAPES = [(4096, 11008, 4096), (4096, 14336, 4096)]


def bench(fn, quick):
    return do_bench(fn, warmup=25, rep=100 if quick else 300, return_mode="median")


def blockwise(row, a, w, m, n, k, flops, quick, report):
    """cuBLAS's own block-scaled FP8 GEMM, where this torch exposes it: 1 x 128 scales of a (an
    [M, K/128] tensor with M-major strides) and 128 x 128 scales of w (passed transposed: an
    [N/128, K/128] row-major tensor seen as [K/128, N/128]), the DeepSeek-V3 scheme kiln's block
    scaling follows. Checked against a dequantized fp32 product on 64 rows before it is timed."""
    kb, nb = -(-k // 128), -(-n // 128)
    dev = a.device
    sa = (torch.rand(kb, m, device=dev) + 0.5).t()
    sb = (torch.rand(nb, kb, device=dev) + 0.5).t()
    try:
        out = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, ValueError) as e:  # blockwise needs a recent torch, cuBLAS 12.9+, sm_90
        print(f"blockwise _scaled_mm unavailable: {str(e).splitlines()[0]}", flush=True)
        return
    rows = min(m, 64)
    ea = sa[:rows].repeat_interleave(128, dim=1)[:, :k]
    eb = sb.t().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    want = (a[:rows].float() * ea) @ (w.float() * eb).t()
    err = ((out[:rows].float() - want).norm() / want.norm()).item()
    if not err < 2e-2:
        print(f"blockwise _scaled_mm disagrees with the dequantized product (rel err {err:.3g}); not timed", flush=True)
        return
    report(row, "scaled_mm_blockwise",
           bench(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), quick), flops)


def run(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    print(f"\ntorch gemm\n{'M':>6} {'N':>6} {'K':>6} {'what':>24} {'us':>10} {'TFLOP/s':>9}")

    def report(row, what, ms, flops):
        row[what + "_us"] = ms * 1e3
        row[what + "_tflops"] = flops / (ms * 1e-3) / 1e12
        print(f"{row['m']:6d} {row['n']:6d} {row['k']:6d} {what:>24} {ms * 1e3:10.2f} {row[what + '_tflops']:9.1f}",
              flush=True)

    for m, n, k in FP8_SHAPES:
        a = (torch.randn(m, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=dev)
        row = {"family": "gemm", "kind": "fp8", "m": m, "n": n, "k": k}
        flops = 2 * m * n * k
        report(row, "scaled_mm_tensorwise",
               bench(lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), quick), flops)
        sa = torch.rand(m, 1, device=dev) + 0.5
        sb = torch.rand(1, n, device=dev) + 0.5
        try:
            torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            report(row, "scaled_mm_rowwise",
                   bench(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), quick),
                   flops)
        except (RuntimeError, TypeError) as e:  # rowwise needs a recent torch and sm_90
            print(f"rowwise _scaled_mm unavailable: {e}", flush=True)
        blockwise(row, a, w, m, n, k, flops, quick, report)
        ab, wb = a.to(torch.bfloat16), w.to(torch.bfloat16)
        report(row, "bf16_mm", bench(lambda: torch.mm(ab, wb.t()), quick), flops)
        rows.append(row)
        del a, w, ab, wb

    for m, n, k in GATED_SHAPES:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        wg = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        wu = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        row = {"family": "gemm", "kind": "gated_mlp", "m": m, "n": n, "k": k}
        report(row, "gated_silu_eager", bench(lambda: F.silu(x @ wg.t()) * (x @ wu.t()), quick), 4 * m * n * k)
        rows.append(row)
        del x, wg, wu
    return rows
