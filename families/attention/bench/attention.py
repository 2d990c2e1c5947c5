"""PyTorch anchors for the attention forward and backward (bf16), the shapes
families/attention/bench/attention.cpp times: torch.nn.functional.scaled_dot_product_attention with
the cuDNN and the flash backends, full and causal, with triton.testing.do_bench (median). TFLOP/s
counts 4 B H S^2 D for the forward and 2.5 times that for the backward (the backward alone: out is
computed once, then out.backward(dout, retain_graph=True) is timed), half for causal.
Then the decode shapes (bf16, H32/KV8, one query, D128, 8k and 32k keys): SDPA with enable_gqa on
the cuDNN and flash backends, and on K/V repeated to every query head (repeat_interleave, outside
the timing) where a backend refuses GQA; GB/s counts the K and V bytes of the KV heads once.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SHAPES = [(4, 32, 4096, 128), (2, 16, 8192, 128), (4, 32, 4096, 64), (2, 16, 4096, 256)]
QUICK_SHAPES = [(4, 32, 4096, 128), (2, 16, 4096, 256)]
BWD_SHAPES = [(4, 32, 4096, 128), (2, 16, 8192, 128), (4, 32, 4096, 64), (2, 16, 4096, 256)]
BWD_QUICK_SHAPES = [(4, 32, 4096, 128)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
DECODE_SHAPES = [(1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 8192), (64, 32768)]
QUICK_DECODE_SHAPES = [(1, 32768), (8, 8192), (64, 8192)]


def run(quick: bool) -> list[dict]:
    return run_forward(quick) + run_backward(quick) + run_decode(quick)


def run_forward(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    print(f"\ntorch attention forward (bf16)\n{'B':>3} {'H':>4} {'S':>6} {'D':>5} {'causal':>7} "
          f"{'cudnn us':>10} {'cudnn TF':>9} {'flash us':>10} {'flash TF':>9}")
    for b, h, s, d in (QUICK_SHAPES if quick else SHAPES):
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            row = {"family": "attention", "dtype": "bf16", "batch": b, "heads": h, "seq": s, "head_dim": d,
                   "causal": causal}
            for name, backend in BACKENDS.items():
                try:
                    with torch.no_grad(), sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25,
                                      rep=100 if quick else 200, return_mode="median")
                    row[name + "_us"], row[name + "_tflops"] = ms * 1e3, flops / (ms * 1e-3) / 1e12
                except RuntimeError:  # the backend does not take this shape on this GPU
                    row[name + "_us"] = row[name + "_tflops"] = float("nan")
            print(f"{b:>3} {h:>4} {s:>6} {d:>5} {str(causal):>7} {row['cudnn_us']:>10.1f} {row['cudnn_tflops']:>9.1f} "
                  f"{row['flash_us']:>10.1f} {row['flash_tflops']:>9.1f}", flush=True)
            rows.append(row)
    return rows


def run_decode(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    h, hk, d = 32, 8, 128
    rows = []
    print(f"\ntorch attention decode (bf16, H{h}/KV{hk}, lq 1, D{d})\n{'B':>3} {'lk':>6} "
          f"{'cudnn us':>10} {'GB/s':>8} {'how':>6} {'flash us':>10} {'GB/s':>8} {'how':>6}")
    for b, lk in (QUICK_DECODE_SHAPES if quick else DECODE_SHAPES):
        q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, lk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * b * hk * lk * d * 2
        row = {"family": "attention", "kind": "decode", "dtype": "bf16", "batch": b, "heads": h, "kv_heads": hk,
               "seqlen_q": 1, "seqlen_k": lk, "head_dim": d}
        for name, backend in BACKENDS.items():
            row[name + "_us"] = row[name + "_gbs"] = float("nan")
            row[name + "_how"] = "-"
            for how in ("gqa", "repeat"):
                try:
                    if how == "gqa":
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    else:
                        kr, vr = (x.repeat_interleave(h // hk, dim=1) for x in (k, v))
                        fn = lambda: F.scaled_dot_product_attention(q, kr, vr)
                    with torch.no_grad(), sdpa_kernel(backend):
                        fn()
                        ms = do_bench(fn, warmup=25, rep=100 if quick else 200, return_mode="median")
                    row[name + "_us"], row[name + "_gbs"] = ms * 1e3, nbytes / (ms * 1e-3) / 1e9
                    row[name + "_how"] = how
                    break
                except (RuntimeError, TypeError):  # the backend (or this torch) does not take it
                    continue
        print(f"{b:>3} {lk:>6} {row['cudnn_us']:>10.1f} {row['cudnn_gbs']:>8.0f} {row['cudnn_how']:>6} "
              f"{row['flash_us']:>10.1f} {row['flash_gbs']:>8.0f} {row['flash_how']:>6}", flush=True)
        rows.append(row)
    return rows


def run_backward(quick: bool) -> list[dict]:
    dev = torch.device("cuda")
    rows = []
    print(f"\ntorch attention backward (bf16)\n{'B':>3} {'H':>4} {'S':>6} {'D':>5} {'causal':>7} "
          f"{'cudnn us':>10} {'cudnn TF':>9} {'flash us':>10} {'flash TF':>9}")
    for b, h, s, d in (BWD_QUICK_SHAPES if quick else BWD_SHAPES):
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            row = {"family": "attention", "kind": "backward", "dtype": "bf16", "batch": b, "heads": h, "seq": s,
                   "head_dim": d, "causal": causal}
            for name, backend in BACKENDS.items():
                try:
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        out.backward(dout, retain_graph=True)
                        ms = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=25,
                                      rep=100 if quick else 200, grad_to_none=[q, k, v], return_mode="median")
                    row[name + "_us"], row[name + "_tflops"] = ms * 1e3, flops / (ms * 1e-3) / 1e12
                except RuntimeError:  # the backend does not take this shape on this GPU
                    row[name + "_us"] = row[name + "_tflops"] = float("nan")
                out = None
            print(f"{b:>3} {h:>4} {s:>6} {d:>5} {str(causal):>7} {row['cudnn_us']:>10.1f} {row['cudnn_tflops']:>9.1f} "
                  f"{row['flash_us']:>10.1f} {row['flash_tflops']:>9.1f}", flush=True)
            rows.append(row)
    return rows


def run_masks(quick: bool) -> list[dict]:
    """FlexAttention (torch.compile of flex_attention with a block mask) at the cases of the C++
    bench's masks part: a causal sliding window of 128 to 4096 keys at B2 H32 S8192 D128 (TFLOP/s
    on the window's work, 4 B H S W D), cuDNN's causal SDPA at the same shape, windows of 128, 256
    and 512 at B1 H64/KV8 S8192 D64 (GPT-OSS's local layers are 128), and 8 packed documents of
    2048 tokens, causal within each (H32 D128, 8 x 2 H 2048^2 D). Where kiln is importable, kiln's
    forward (kiln.torch.flash_attn_func, [B, S, H, D] copies of the same inputs) is timed beside
    each, the two alternating over rounds (median of the rounds' medians) so that the GPU's clock
    drift moves both alike; the row then carries kiln's time and the ratio."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    try:
        import kiln.torch as kt
    except ImportError:
        kt = None
    dev = torch.device("cuda")
    fa = torch.compile(flex_attention)
    rep = 40 if quick else 80
    rounds = 2 if quick else 3
    rows = []
    print(f"\ntorch attention masks (bf16)\n{'case':<36} {'median_us':>10} {'TFLOP/s':>9} {'kiln_us':>9} "
          f"{'kiln TF':>8} {'kiln/peer':>9}")

    def bench(fn):
        with torch.no_grad():
            fn()
            return do_bench(fn, warmup=25, rep=rep, return_mode="median")

    def rec(name: str, fn, flops: float, kiln_fn=None):
        peer, mine = [], []
        for _ in range(rounds):
            peer.append(bench(fn))
            if kiln_fn is not None:
                mine.append(bench(kiln_fn))
        ms = sorted(peer)[len(peer) // 2]
        row = {"family": "attention", "kind": "mask", "case": name, "median_us": ms * 1e3,
               "tflops": flops / (ms * 1e-3) / 1e12}
        line = f"{name:<36} {row['median_us']:>10.1f} {row['tflops']:>9.1f}"
        if mine:
            kms = sorted(mine)[len(mine) // 2]
            row.update(kiln_us=kms * 1e3, kiln_tflops=flops / (kms * 1e-3) / 1e12, kiln_speedup=ms / kms)
            line += f" {row['kiln_us']:>9.1f} {row['kiln_tflops']:>8.1f} {row['kiln_speedup']:>8.2f}x"
        print(line, flush=True)
        rows.append(row)

    def kiln_window(q, k, v, w, causal=True):
        if kt is None:
            return None
        qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return lambda: kt.flash_attn_func(qs, ks, vs, causal=causal, window_size=(w - 1 if w else -1, 0 if causal
                                                                                   else -1))

    b, h, s, d = 2, 32, 8192, 128
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for w in ((1024,) if quick else (128, 256, 512, 1024, 2048, 4096)):
        def window(bi, hi, qi, ki, w=w):
            return (qi >= ki) & (qi - ki < w)
        mask = create_block_mask(window, B=None, H=None, Q_LEN=s, KV_LEN=s)
        rec(f"flex window {w} B2 S8192", lambda: fa(q, k, v, block_mask=mask), 4.0 * b * h * s * w * d,
            kiln_window(q, k, v, w))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rec("cudnn causal B2 S8192", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            2.0 * b * h * s * s * d, kiln_window(q, k, v, 0))
    causal_mask = create_block_mask(lambda bi, hi, qi, ki: qi >= ki, B=None, H=None, Q_LEN=s, KV_LEN=s)
    rec("flex causal B2 S8192", lambda: fa(q, k, v, block_mask=causal_mask), 2.0 * b * h * s * s * d,
        kiln_window(q, k, v, 0))
    # Local layers of GPT-OSS's shape: 64 query heads over 8 KV heads of 64.
    q3 = torch.randn(1, 64, s, 64, device=dev, dtype=torch.bfloat16)
    k3, v3 = (torch.randn(1, 8, s, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for w in ((128,) if quick else (128, 256, 512)):
        mask3 = create_block_mask(lambda bi, hi, qi, ki, w=w: (qi >= ki) & (qi - ki < w), B=None, H=None, Q_LEN=s,
                                  KV_LEN=s)
        rec(f"flex window {w} H64/8 D64 B1 S8192", lambda: fa(q3, k3, v3, block_mask=mask3, enable_gqa=True),
            4.0 * 64 * s * w * 64, kiln_window(q3, k3, v3, w))
    docs, length = 8, 2048
    total = docs * length
    q2, k2, v2 = (torch.randn(1, h, total, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    doc = torch.arange(total, device=dev) // length

    def packed(bi, hi, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)
    mask2 = create_block_mask(packed, B=None, H=None, Q_LEN=total, KV_LEN=total)
    kiln_packed = None
    if kt is not None:
        qp, kp, vp = (x[0].transpose(0, 1).contiguous() for x in (q2, k2, v2))
        cu = torch.arange(0, total + 1, length, device=dev, dtype=torch.int32)
        kiln_packed = lambda: kt.flash_attn_varlen_func(qp, kp, vp, cu, cu, length, length, causal=True)  # noqa: E731
    rec("flex packed 8 docs x 2048 causal", lambda: fa(q2, k2, v2, block_mask=mask2),
        docs * 2.0 * h * length * length * d, kiln_packed)
    return rows
