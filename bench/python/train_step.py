"""Training steps, forward + backward, timed by the wall clock: kiln.torch against PyTorch eager,
torch.compile and Liger (where liger_kernel is installed) on the same inputs, in one process.

A step is `outs = f(inputs); torch.autograd.grad(outs, inputs + parameters, grads)`: what a
training loop pays per op, the autograd engine and every allocation included. For each contender:

- wall: the median over trials of (host clock over a loop of steps, synchronized at both ends) /
  steps, the contenders' loops taking turns within each trial; the GPU never waits for anything
  but the host;
- kernels: the GPU time of the kernels (and memsets/copies) one step launches, summed from
  torch.profiler's device events over a loop of steps;
- wall / kernels: 1.0 means the step is as fast as its kernels; above, host cost shows.

Then kiln's speedup per step over each peer (peer wall / kiln wall).

  python3 bench/python/train_step.py [--quick] [--only SUBSTR,...] [--contenders kiln,eager,...] [--json FILE]
  python3 bench/python/train_step.py --markdown FILE.json    # the table of docs/benchmarks.md
"""
import argparse
import json
import statistics
import sys
import time

import torch

import kiln.torch as kt

F = torch.nn.functional
DEV = "cuda"
DT = torch.bfloat16


def _liger():
    try:
        from liger_kernel.ops import fused_add_rms_norm, geglu, layer_norm, rms_norm, rope, swiglu
        return {"rms_norm": rms_norm.LigerRMSNormFunction, "add_rms_norm": fused_add_rms_norm.LigerFusedAddRMSNormFunction,
                "silu_mul": swiglu.LigerFusedGateUpSiLUMulFunction, "gelu_mul": geglu.LigerGELUMulFunction,
                "rope": rope.LigerRopeFunction, "layer_norm": layer_norm.LigerLayerNormFunction}
    except Exception as e:  # not installed, or a version without these entry points
        print(f"liger_kernel unavailable: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return {}


LIGER = _liger()


def rnd(*shape, grad=True, dtype=DT):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], -1)


# --- cases: name, shape text, inputs (tensors needing grads), upstream gradients, contenders ---


def case_rms_norm(t, h):
    x, w = rnd(t, h), rnd(h)

    def eager(x, w):
        return F.rms_norm(x, (h,), w, 1e-6)

    c = {"kiln": lambda x, w: kt.rms_norm(x, [h], w, 1e-6), "eager": eager, "compile": torch.compile(eager)}
    if "rms_norm" in LIGER:
        c["liger"] = lambda x, w: LIGER["rms_norm"].apply(x, w, 1e-6, 0.0, "llama", True)
    return f"rms_norm {t}x{h}", [x, w], [torch.randn(t, h, device=DEV, dtype=DT)], c


def case_add_rms_norm(t, h):
    x, r, w = rnd(t, h), rnd(t, h), rnd(h)

    def eager(x, r, w):
        s = x + r
        return F.rms_norm(s, (h,), w, 1e-6), s

    c = {"kiln": lambda x, r, w: kt.add_rms_norm(x, r, w, 1e-6), "eager": eager, "compile": torch.compile(eager)}
    if "add_rms_norm" in LIGER:
        c["liger"] = lambda x, r, w: LIGER["add_rms_norm"].apply(x, r, w, 1e-6, 0.0, "llama", False)
    grads = [torch.randn(t, h, device=DEV, dtype=DT), torch.randn(t, h, device=DEV, dtype=DT)]
    return f"add_rms_norm {t}x{h}", [x, r, w], grads, c


def case_act_and_mul(t, inter, activation):
    x = rnd(t, 2 * inter)

    def eager(x):
        g, u = x.chunk(2, dim=-1)
        a = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
        return a * u

    c = {"kiln": lambda x: kt.act_and_mul(x, activation), "eager": eager, "compile": torch.compile(eager)}
    if activation == "silu" and "silu_mul" in LIGER:
        c["liger"] = lambda x: LIGER["silu_mul"].apply(x)
    elif activation == "gelu_tanh" and "gelu_mul" in LIGER:
        # Liger's GeGLU takes the two halves as separate tensors (it makes them contiguous).
        c["liger"] = lambda x: LIGER["gelu_mul"].apply(*x.chunk(2, dim=-1))
    return f"act_and_mul[{activation}] {t}x{inter}", [x], [torch.randn(t, inter, device=DEV, dtype=DT)], c


def case_rope(t, heads, kv_heads, d):
    q, k = rnd(t, heads, d), rnd(t, kv_heads, d)
    rope = kt.RotaryEmbedding(d, max_positions=t)
    cos_h, sin_h = rope.cos_sin(DEV)
    pos = torch.arange(t, device=DEV)
    cos, sin = torch.cat([cos_h, cos_h], -1).to(DT), torch.cat([sin_h, sin_h], -1).to(DT)  # full width

    def eager(q, k):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    c = {"kiln": lambda q, k: rope(q, k, pos), "eager": eager, "compile": torch.compile(eager)}
    if "rope" in LIGER:
        # Liger's layout is (batch, heads, seq, dim): the [tokens, heads, dim] tensors seen as one sequence.
        def liger(q, k):
            qo, ko = LIGER["rope"].apply(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
            return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]
        c["liger"] = liger
    grads = [torch.randn(t, heads, d, device=DEV, dtype=DT), torch.randn(t, kv_heads, d, device=DEV, dtype=DT)]
    return f"rope {t}x{heads}/{kv_heads}x{d}", [q, k], grads, c


def case_rms_norm_rope(b, s, heads, d):
    h = heads * d
    x, w = rnd(b, s, h), rnd(h)
    ang = torch.arange(s, device=DEV, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d))[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def eager(x, w):
        n = F.rms_norm(x, (h,), w, 1e-6).view(b, s, heads, d)
        c, sn = cos[None, :, None, :].to(DT), sin[None, :, None, :].to(DT)
        return (n * c + rotate_half(n) * sn).view(b, s, h)

    c = {"kiln": lambda x, w: kt.fused_rmsnorm_rope(x, w, cos, sin, 1e-6, heads), "eager": eager,
         "compile": torch.compile(eager)}
    return f"rms_norm_rope {b}x{s}x{heads}x{d}", [x, w], [torch.randn(b, s, h, device=DEV, dtype=DT)], c


def case_gated_mlp(t, h, inter):
    x, wg, wu = rnd(t, h), rnd(inter, h) * 0.02, rnd(inter, h) * 0.02
    wg, wu = wg.detach().requires_grad_(), wu.detach().requires_grad_()

    def eager(x, wg, wu):
        return F.silu(x @ wg.t()) * (x @ wu.t())

    c = {"kiln": lambda x, wg, wu: kt.fused_gated_mlp(x, wg, wu, "silu"), "eager": eager,
         "compile": torch.compile(eager)}
    return f"gated_mlp {t}x{h}x{inter}", [x, wg, wu], [torch.randn(t, inter, device=DEV, dtype=DT)], c


def case_layer_norm(t, h):
    x, w, bias = rnd(t, h), rnd(h), rnd(h)

    def eager(x, w, bias):
        return F.layer_norm(x, (h,), w, bias, 1e-5)

    c = {"kiln": lambda x, w, bias: kt.layer_norm(x, w, bias, 1e-5), "eager": eager, "compile": torch.compile(eager)}
    if "layer_norm" in LIGER:
        c["liger"] = lambda x, w, bias: LIGER["layer_norm"].apply(x, w, bias, 1e-5)
    return f"layer_norm {t}x{h}", [x, w, bias], [torch.randn(t, h, device=DEV, dtype=DT)], c


def _cudnn_first(f):
    """f with SDPA preferring cuDNN's kernels (then flash, memory-efficient, math): the attention a
    PyTorch training stack on Hopper gets at its best."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def g(*args):
        with sdpa_kernel(order, set_priority=True):
            return f(*args)
    return g


def case_llama_layer(b, s, hidden, heads, kv_heads, inter):
    """A Llama decoder layer, forward + backward: RMSNorm, QKV projection, RoPE, causal GQA
    attention, output projection, residual add + RMSNorm, SwiGLU MLP, residual. kiln: its norms,
    RoPE, attention and gated MLP, with cuBLAS (torch.matmul) for the other projections; the peers:
    eager PyTorch with SDPA on cuDNN, torch.compile of it, and Liger's norm, RoPE and SwiGLU with
    the same SDPA."""
    d, t, eps = hidden // heads, b * s, 1e-5
    sc = hidden ** -0.5
    x = rnd(t, hidden)
    params = [rnd(hidden), rnd((heads + 2 * kv_heads) * d, hidden) * sc, rnd(hidden, heads * d) * sc, rnd(hidden),
              rnd(inter, hidden) * sc, rnd(inter, hidden) * sc, rnd(hidden, inter) * inter ** -0.5]
    params = [p.detach().requires_grad_() for p in params]
    rope = kt.RotaryEmbedding(d, max_positions=s)
    cos_h, sin_h = rope.cos_sin(DEV)
    pos = torch.arange(s, device=DEV).repeat(b)
    cos, sin = torch.cat([cos_h, cos_h], -1)[pos].to(DT), torch.cat([sin_h, sin_h], -1)[pos].to(DT)
    split = [heads * d, kv_heads * d, kv_heads * d]

    def torch_layer(x, n1, wqkv, wo, n2, wg, wu, wd, norm=None, add_norm=None, rot=None, swiglu=None):
        h = norm(x, n1) if norm else F.rms_norm(x, (hidden,), n1, eps)
        q, k, v = (h @ wqkv.t()).split(split, -1)
        q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
        if rot:
            q, k = rot(q, k)
        else:
            c, sn = cos[:, None, :], sin[:, None, :]
            q, k = q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
        heads_first = lambda y, n: y.view(b, s, n, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
                                           is_causal=True, enable_gqa=True)
        a = o.transpose(1, 2).reshape(t, heads * d) @ wo.t()
        if add_norm:
            h2, r = add_norm(a, x, n2)
        else:
            r = a + x
            h2 = F.rms_norm(r, (hidden,), n2, eps)
        m = swiglu(h2 @ wg.t(), h2 @ wu.t()) if swiglu else F.silu(h2 @ wg.t()) * (h2 @ wu.t())
        return r + m @ wd.t()

    def kiln_layer(x, n1, wqkv, wo, n2, wg, wu, wd):
        h = kt.rms_norm(x, [hidden], n1, eps)
        q, k, v = (h @ wqkv.t()).split(split, -1)
        q, k = rope(q.reshape(t, heads, d), k.reshape(t, kv_heads, d), pos)
        o = kt.flash_attn_func(q.view(b, s, heads, d), k.view(b, s, kv_heads, d), v.reshape(b, s, kv_heads, d),
                               causal=True)
        a = o.reshape(t, heads * d) @ wo.t()
        h2, r = kt.add_rms_norm(a, x, n2, eps)
        return r + kt.fused_gated_mlp(h2, wg, wu, "silu") @ wd.t()

    c = {"kiln": kiln_layer, "eager": _cudnn_first(torch_layer), "compile": _cudnn_first(torch.compile(torch_layer))}
    if all(n in LIGER for n in ("rms_norm", "add_rms_norm", "rope", "silu_mul")):
        def liger_layer(x, n1, wqkv, wo, n2, wg, wu, wd):
            def rot(q, k):
                qo, ko = LIGER["rope"].apply(q.view(b, s, heads, d).transpose(1, 2), k.view(b, s, kv_heads, d).transpose(1, 2),
                                             cos.view(b, s, d)[:1], sin.view(b, s, d)[:1])
                return qo.transpose(1, 2).reshape(t, heads, d), ko.transpose(1, 2).reshape(t, kv_heads, d)
            return torch_layer(x, n1, wqkv, wo, n2, wg, wu, wd,
                               norm=lambda y, w: LIGER["rms_norm"].apply(y, w, eps, 0.0, "llama", True),
                               add_norm=lambda y, r, w: LIGER["add_rms_norm"].apply(y, r, w, eps, 0.0, "llama", False),
                               rot=rot, swiglu=lambda g, u: LIGER["silu_mul"].apply(torch.cat([g, u], -1)))
        c["liger"] = _cudnn_first(liger_layer)
    return (f"llama_layer {b}x{s} h{hidden} {heads}/{kv_heads}x{d} i{inter}", [x] + params,
            [torch.randn(t, hidden, device=DEV, dtype=DT)], c)


def cases(quick):
    out = [case_rms_norm(8192, 5120), case_rms_norm(4096, 2880)]
    if quick:
        return out
    out += [case_add_rms_norm(8192, 4096), case_add_rms_norm(4096, 2880),
            case_act_and_mul(8192, 14336, "silu"), case_act_and_mul(4096, 2880, "silu"),
            case_act_and_mul(8192, 14336, "gelu_tanh"),
            case_rope(8192, 32, 8, 128), case_rope(4096, 64, 8, 64),
            case_rms_norm_rope(4, 2047, 28, 128),
            case_layer_norm(8192, 4096),
            case_gated_mlp(8192, 4096, 14336),
            case_llama_layer(1, 8192, 4096, 32, 8, 14336)]
    return out


# --- timing ---


def step_fn(f, inputs, grads):
    def step():
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, inputs, grads[:len(outs)])
    return step


def loop_us(step, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / steps


def wall_us(step_of, steps, trials):
    """Median wall time per step of each contender, their loops interleaved trial by trial so that
    a drift of the host's speed during the run reaches every contender alike."""
    times = {who: [] for who in step_of}
    for _ in range(trials):
        for who, step in step_of.items():
            times[who].append(loop_us(step, steps))
    return {who: statistics.median(t) for who, t in times.items()}


def kernel_us(step, steps):
    """GPU time of the device activity of one step: kernels, memsets and copies from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total += e.device_time_total
    return total / steps


def peak_mib(step):
    """Memory one step allocates at its peak beyond what was allocated before it, MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def check(name, contenders, inputs, grads):
    """kiln's outputs and gradients against eager's in fp32 on the same inputs (relative L2)."""
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ref = contenders["eager"](*ref_in)
    ref = ref if isinstance(ref, tuple) else (ref,)
    ref_g = torch.autograd.grad(ref, ref_in, [g.float() for g in grads[:len(ref)]])
    outs = contenders["kiln"](*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    got_g = torch.autograd.grad(outs, inputs, grads[:len(outs)])
    worst = 0.0
    for a, b in list(zip(outs, ref)) + list(zip(got_g, ref_g)):
        worst = max(worst, ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item())
    ok = worst < 3e-2
    print(f"{name}: kiln vs fp32 eager, worst rel err over outputs and grads {worst:.2e} {'ok' if ok else 'FAIL'}",
          flush=True)
    return worst, ok


def markdown(path):
    """The Markdown table of a run's JSON: per case, wall and kernel time per step for each
    contender, kiln's wall / kernels, and kiln's speedup over each peer."""
    with open(path) as fh:
        data = json.load(fh)
    peers = ("eager", "compile", "liger")
    print(f"{data['device']}, torch {data['torch']}; µs per forward + backward step (wall / GPU time of its kernels).\n")
    print("| case | kiln | eager | torch.compile | Liger | kiln wall / kernels | kiln speedup: eager / compile / Liger |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in data["rows"]:
        w, k = r["wall_us"], r["kernel_us"]
        cells = [f"{w[c]:.0f} / {k[c]:.0f}" if c in w else "-" for c in ("kiln",) + peers]
        speed = " / ".join(f"{w[p] / w['kiln']:.2f}x" if p in w else "-" for p in peers)
        print(f"| {r['case']} | " + " | ".join(cells) + f" | {w['kiln'] / k['kiln']:.2f} | {speed} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", help="run only the cases whose name contains one of these (comma-separated)")
    ap.add_argument("--contenders", help="time only these (comma-separated; kiln and eager always run)")
    ap.add_argument("--markdown", metavar="FILE", help="print the table of a run's JSON and exit (no GPU)")
    args = ap.parse_args()
    if args.markdown:
        markdown(args.markdown)
        return 0
    torch.manual_seed(0)
    steps, trials = (30, 5) if args.quick else (50, 7)
    rows, failed = [], False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name, inputs, grads, contenders in cases(args.quick and not args.only):
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        if args.contenders:
            keep = set(args.contenders.split(",")) | {"kiln", "eager"}
            contenders = {who: f for who, f in contenders.items() if who in keep}
        err, ok = check(name, contenders, inputs, grads)
        failed |= not ok
        row = {"case": name, "rel_err": err, "wall_us": {}, "kernel_us": {}}
        step_of = {}
        for who, f in contenders.items():
            step = step_fn(f, inputs, grads)
            try:
                for _ in range(5):
                    step()
                step_of[who] = step
            except Exception as e:  # a peer that cannot run this case
                row.setdefault("errors", {})[who] = f"{type(e).__name__}: {str(e)[:200]}"
        row["wall_us"] = wall_us(step_of, steps, trials)
        for who, step in step_of.items():
            row["kernel_us"][who] = kernel_us(step, 10)
            row.setdefault("peak_mib", {})[who] = peak_mib(step)
        rows.append(row)
        k = row["wall_us"]["kiln"]
        parts = [f"{who} {w:8.1f} ({row['kernel_us'][who]:7.1f} gpu, {w / row['kernel_us'][who]:.2f}x, "
                 f"{row['peak_mib'][who]:.0f} MiB)"
                 for who, w in row["wall_us"].items()]
        print(f"{name:40s} " + "  ".join(parts), flush=True)
        speed = {who: w / k for who, w in row["wall_us"].items() if who != "kiln"}
        row["speedup"] = speed
        print(f"{'':40s} kiln speedup: " + ", ".join(f"{who} {s:.2f}x" for who, s in speed.items()), flush=True)
    print("\nsummary: case | kiln wall us | kiln kernels us | wall/kernels | speedup vs eager / compile / liger")
    for r in rows:
        k, kk = r["wall_us"]["kiln"], r["kernel_us"]["kiln"]
        sp = " / ".join(f"{r['speedup'][p]:.2f}x" if p in r["speedup"] else "-" for p in ("eager", "compile", "liger"))
        print(f"{r['case']:40s} | {k:8.1f} | {kk:8.1f} | {k / kk:5.2f} | {sp}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
