"""PyTorch anchor for the paged decode (bf16, H32/KV8, one query, D128), the shapes
families/paged_attention/bench/paged_attention.cpp times: torch's SDPA over a contiguous KV (cuDNN
and flash backends, enable_gqa, or K/V repeated per head where a backend refuses GQA) for batch
{1, 8, 64, 256} x context {512, 2k, 8k, 32k} (B256 at 32k left out, as in kiln's section), and the
cascade shape without sharing (32 requests x 4352 keys). GB/s counts the K and V bytes of the KV
heads once; kiln's paged rows are to be read against these (the target: paged at page 16
at least 0.92x the contiguous SDPA of the same run).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

H, HK, D = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def shapes(quick):
    if quick:
        return [(1, 32768), (8, 8192), (64, 2048), (256, 512)]
    return [(b, l) for b in (1, 8, 64, 256) for l in (512, 2048, 8192, 32768) if b * l <= (1 << 21)]


def time_sdpa(b, lk, quick):
    dev = torch.device("cuda")
    q = torch.randn(b, H, 1, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, HK, lk, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    nbytes = 2 * b * HK * lk * D * 2
    row = {}
    for name, backend in BACKENDS.items():
        row[name + "_us"] = row[name + "_gbs"] = float("nan")
        row[name + "_how"] = "-"
        for how in ("gqa", "repeat"):
            try:
                if how == "gqa":
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                else:
                    kr, vr = (x.repeat_interleave(H // HK, dim=1) for x in (k, v))
                    fn = lambda: F.scaled_dot_product_attention(q, kr, vr)
                with torch.no_grad(), sdpa_kernel(backend):
                    fn()
                    ms = do_bench(fn, warmup=25, rep=100 if quick else 200, return_mode="median")
                row[name + "_us"], row[name + "_gbs"] = ms * 1e3, nbytes / (ms * 1e-3) / 1e9
                row[name + "_how"] = how
                break
            except (RuntimeError, TypeError):  # the backend (or this torch) does not take it
                continue
    return row


def run(quick: bool) -> list[dict]:
    rows = []
    print(f"\ntorch SDPA decode, contiguous KV (bf16, H{H}/KV{HK}, lq 1, D{D})\n{'B':>4} {'lk':>6} "
          f"{'cudnn us':>10} {'GB/s':>8} {'how':>6} {'flash us':>10} {'GB/s':>8} {'how':>6}")
    for b, lk in shapes(quick) + [(32, 4096 + 256)]:
        row = {"family": "paged_attention", "kind": "sdpa_decode", "dtype": "bf16", "batch": b, "heads": H,
               "kv_heads": HK, "seqlen_q": 1, "seqlen_k": lk, "head_dim": D}
        row.update(time_sdpa(b, lk, quick))
        print(f"{b:>4} {lk:>6} {row['cudnn_us']:>10.1f} {row['cudnn_gbs']:>8.0f} {row['cudnn_how']:>6} "
              f"{row['flash_us']:>10.1f} {row['flash_gbs']:>8.0f} {row['flash_how']:>6}", flush=True)
        rows.append(row)
    return rows
