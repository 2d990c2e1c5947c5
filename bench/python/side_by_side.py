"""kiln from Python against PyTorch eager and torch.compile, on the same inputs, in one process.

For each op: the median over trials of the mean time per call (CUDA events around a loop of
calls, after warm-up), for kiln's own API (outputs preallocated), kiln.torch (allocating, as a
PyTorch user calls it), PyTorch eager and torch.compile of the eager code; ratios are
eager / kiln and compiled / kiln (above 1: kiln is faster). Then the host cost of one call from
Python on a tiny tensor, against a bare cuLaunchKernel issued through ctypes.

  python3 bench/python/side_by_side.py [--quick] [--json FILE]
"""
import argparse
import ctypes
import json
import statistics
import sys
import time

import torch

import kiln
import kiln.torch as kt

F = torch.nn.functional
DEV = "cuda"


def gpu_time_us(fn, warmup, iters, trials):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(times)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], -1)


# --- the cases: (name, shape text, {contender: callable}) ---


def case_rms_norm(t, h, dtype):
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w = torch.randn(h, device=DEV, dtype=dtype)
    y = torch.empty_like(x)

    def eager():
        return F.rms_norm(x, [h], w, 1e-6)

    return {"kiln": lambda: kiln.rms_norm(x, w, 1e-6, out=y), "kiln.torch": lambda: kt.rms_norm(x, [h], w, 1e-6),
            "eager": eager, "compile": torch.compile(eager)}, (x.numel() * 2 + h) * x.element_size()


def case_rms_norm_fwd_bwd(t, h, dtype):
    x = torch.randn(t, h, device=DEV, dtype=dtype, requires_grad=True)
    dy = torch.randn(t, h, device=DEV, dtype=dtype)
    ours = kt.RMSNorm(h, device=DEV, dtype=dtype)
    ref = torch.nn.RMSNorm(h, device=DEV, dtype=dtype)
    compiled = torch.compile(ref)

    def step(mod):
        return lambda: mod(x).backward(dy)

    xd = x.detach()
    w = ours.weight.detach()
    y, inv = torch.empty_like(xd), torch.empty(t, device=DEV)
    dx, dw = torch.empty_like(xd), torch.empty_like(w)
    ws = torch.empty(max(kiln.rms_norm_backward_workspace_elements(xd), 1), device=DEV) if xd.is_cuda else None

    def kiln_fwd_bwd():  # the kernels alone: no autograd, no allocation
        kiln.rms_norm(xd, w, 1e-6, out=y, inv_rms=inv)
        kiln.rms_norm_backward(dy, xd, w, inv, dx=dx, dw=dw, workspace=ws)

    return {"kiln": kiln_fwd_bwd, "kiln.torch": step(ours), "eager": step(ref), "compile": step(compiled)}, None


def case_add_rms_norm(t, h, dtype):
    x, r = torch.randn(t, h, device=DEV, dtype=dtype), torch.randn(t, h, device=DEV, dtype=dtype)
    w = torch.randn(h, device=DEV, dtype=dtype)
    y, ro = torch.empty_like(x), torch.empty_like(x)

    def eager():
        s = x + r
        return F.rms_norm(s, [h], w, 1e-6), s

    return {"kiln": lambda: kiln.add_rms_norm(x, r, w, out=y, residual_out=ro),
            "kiln.torch": lambda: kt.add_rms_norm(x, r, w), "eager": eager,
            "compile": torch.compile(eager)}, (x.numel() * 4 + h) * x.element_size()


def case_silu_and_mul(t, inter, dtype):
    x = torch.randn(t, 2 * inter, device=DEV, dtype=dtype)
    out = torch.empty(t, inter, device=DEV, dtype=dtype)

    def eager():
        return F.silu(x[:, :inter]) * x[:, inter:]

    return {"kiln": lambda: kiln.act_and_mul(x, "silu", out=out), "kiln.torch": lambda: kt.silu_and_mul(x),
            "eager": eager, "compile": torch.compile(eager)}, (x.numel() + out.numel()) * x.element_size()


def case_rope(t, heads, kv_heads, head_dim, dtype):
    q = torch.randn(t, heads, head_dim, device=DEV, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=DEV, dtype=dtype)
    freqs = torch.outer(torch.arange(8192, device=DEV).float(),
                        1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim)))
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.randint(0, 8192, (t,), device=DEV)
    qo, ko = torch.empty_like(q), torch.empty_like(k)

    def eager():
        c = torch.cat([cos[pos], cos[pos]], -1)[:, None, :]
        s = torch.cat([sin[pos], sin[pos]], -1)[:, None, :]
        return ((q.float() * c + rotate_half(q.float()) * s).to(dtype),
                (k.float() * c + rotate_half(k.float()) * s).to(dtype))

    return {"kiln": lambda: kiln.apply_rope_qk(q, k, cos, sin, pos, q_out=qo, k_out=ko),
            "kiln.torch": lambda: kt.apply_rope_qk(q, k, cos, sin, pos), "eager": eager,
            "compile": torch.compile(eager)}, 2 * (q.numel() + k.numel()) * q.element_size()


def case_rms_norm_rope(b, s, h, head_dim, dtype):
    x = torch.randn(b, s, h, device=DEV, dtype=dtype)
    w = torch.randn(h, device=DEV, dtype=dtype)
    cos, sin = torch.randn(s, head_dim, device=DEV, dtype=dtype), torch.randn(s, head_dim, device=DEV, dtype=dtype)
    out = torch.empty_like(x)

    def eager():
        n = F.rms_norm(x, [h], w, 1e-6).view(b, s, h // head_dim, head_dim)
        c, sn = cos.view(1, s, 1, head_dim), sin.view(1, s, 1, head_dim)
        return (n * c + rotate_half(n) * sn).view(b, s, h)

    return {"kiln": lambda: kiln.rms_norm_rope(x, w, cos, sin, out=out),
            "kiln.torch": lambda: kt.fused_rmsnorm_rope(x, w, cos, sin), "eager": eager,
            "compile": torch.compile(eager)}, (2 * x.numel() + h) * x.element_size()


def cases(quick):
    bf16 = torch.bfloat16
    yield "rms_norm", "4096x4096 bf16", lambda: case_rms_norm(4096, 4096, bf16)
    if not quick:
        yield "rms_norm", "32x4096 bf16", lambda: case_rms_norm(32, 4096, bf16)
        yield "rms_norm", "16384x8192 bf16", lambda: case_rms_norm(16384, 8192, bf16)
    yield "rms_norm fwd+bwd", "4096x4096 bf16", lambda: case_rms_norm_fwd_bwd(4096, 4096, bf16)
    yield "add_rms_norm", "4096x4096 bf16", lambda: case_add_rms_norm(4096, 4096, bf16)
    yield "silu_and_mul", "4096x(2x14336) bf16", lambda: case_silu_and_mul(4096, 14336, bf16)
    yield "apply_rope_qk", "4096 tok, 32/8 heads x128 bf16", lambda: case_rope(4096, 32, 8, 128, bf16)
    yield "rms_norm_rope", "4x1024x4096, hd 128 bf16", lambda: case_rms_norm_rope(4, 1024, 4096, 128, bf16)


# --- host overhead ---

_NOOP_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry kiln_bench_noop(.param .u64 a, .param .u64 b, .param .u64 c)
{
  ret;
}
"""


def raw_launcher():
    """cuLaunchKernel of an empty 3-pointer kernel through ctypes: the least a Python call can cost."""
    cuda = ctypes.CDLL("libcuda.so.1")
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    torch.zeros(1, device=DEV)  # the primary context is current now
    if cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_NOOP_PTX)) != 0:
        raise RuntimeError("cuModuleLoadData failed")
    if cuda.cuModuleGetFunction(ctypes.byref(func), module, b"kiln_bench_noop") != 0:
        raise RuntimeError("cuModuleGetFunction failed")
    launch = cuda.cuLaunchKernel
    u = ctypes.c_uint
    launch.argtypes = (ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    launch.restype = ctypes.c_int
    return launch, func.value


def host_us(fn, loops):
    """Best mean host time per call over `loops` loops of 500 calls. 500 stays below the driver's
    launch queue depth (1024), so a call never waits for the GPU to drain the queue: what is timed
    is the host's work."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / 500)
        torch.cuda.synchronize()
    return best


def host_overhead(loops):
    x = torch.randn(1, 128, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(128, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    launch, func = raw_launcher()
    vals = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(y.data_ptr())]
    params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in vals])
    stream = torch.cuda.current_stream().cuda_stream
    raw_stream = torch._C._cuda_getCurrentRawStream

    def raw():
        launch(func, 1, 1, 1, 32, 1, 1, 0, stream, params, None)

    def raw_gathering():  # what any binding must also do: read the pointers and the current stream
        x.data_ptr(), w.data_ptr(), y.data_ptr()
        launch(func, 1, 1, 1, 32, 1, 1, 0, raw_stream(0), params, None)

    # The parts of a kiln call: kiln._fast reading the three tensors and the current stream (the
    # op's own path, stopped before the C op), and the C op alone through ctypes on kiln_tensor
    # structs built once here (validation, handle lookup, launch; plus ctypes' own cost).
    from kiln import _fast
    from kiln import ops as kops

    class KT(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("rank", ctypes.c_int32),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("device_kind", ctypes.c_int32), ("device_index", ctypes.c_int32)]

    def kt_of(t):
        n = t.dim()
        shape, strides = (ctypes.c_int64 * n)(*t.shape), (ctypes.c_int64 * n)(*t.stride())
        s = KT(t.data_ptr(), 2, n, shape, strides, 1, t.get_device())
        s._keep = (shape, strides)
        return s

    structs = [kt_of(t) for t in (x, w, y)]
    from kiln._lib import lib as kiln_lib

    c_op = kiln_lib.kiln_rms_norm_inv
    c_op_args = (None, *[ctypes.byref(s) for s in structs], None, ctypes.c_double(1e-6), ctypes.c_void_p(stream))

    def c_op_only():
        c_op(*c_op_args)

    fast_call = _fast.call

    rows = {
        "raw cuLaunchKernel (ctypes, prebuilt args)": raw,
        "  part: kiln._fast reads 3 torch tensors + current stream": lambda: fast_call(kops._READ, None, None, x, w, y),
        "  part: kiln C op through ctypes, structs prepared": c_op_only,
        "  part: kiln._fast.call, no Python wrapper": lambda: fast_call(kops._RMS_NORM, None, None, x, w, y, None, 1e-6),
        "raw cuLaunchKernel + data_ptr() x3 + current stream": raw_gathering,
        "kiln.rms_norm(x, w, out=y)": lambda: kiln.rms_norm(x, w, out=y),
        "kiln.rms_norm(x, w, out=y, stream=s)": lambda: kiln.rms_norm(x, w, out=y, stream=stream),
        "kiln.torch.rms_norm (allocates y)": lambda: kt.rms_norm(x, [128], w, 1e-6),
        "torch.ops.kiln.rms_norm (dispatcher)": lambda: torch.ops.kiln.rms_norm(x, w, 1e-6),
        "torch F.rms_norm (eager)": lambda: F.rms_norm(x, [128], w, 1e-6),
    }
    return {name: host_us(fn, loops) for name, fn in rows.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--host-only", action="store_true", help="only the host cost per call")
    args = ap.parse_args()
    warmup, iters, trials = (5, 20, 5) if args.quick else (10, 50, 9)
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, torch {torch.__version__}, kiln {kiln.__version__} (abi {kiln.abi_version()}), "
          f"python {sys.version.split()[0]}")
    results = {"device": props.name, "torch": torch.__version__, "ops": [], "host_us": {}}
    contenders = ["kiln", "kiln.torch", "eager", "compile"]
    print(f"{'op':18s} {'shape':32s} " + " ".join(f"{c + ' us':>13s}" for c in contenders)
          + f" {'eager/kiln':>10s} {'compile/kiln':>12s} {'kiln GB/s':>9s}")
    for name, shape, make in ([] if args.host_only else cases(args.quick)):
        fns, nbytes = make()
        us = {c: gpu_time_us(fns[c], warmup, iters, trials) for c in contenders}
        gbs = nbytes / us["kiln"] / 1e3 if nbytes else float("nan")
        print(f"{name:18s} {shape:32s} " + " ".join(f"{us[c]:13.2f}" for c in contenders)
              + f" {us['eager'] / us['kiln']:10.2f} {us['compile'] / us['kiln']:12.2f} {gbs:9.0f}", flush=True)
        results["ops"].append({"op": name, "shape": shape, "us": us, "bytes": nbytes})
        del fns
        torch.cuda.empty_cache()
    print("\nhost time per call from Python (1x128 bf16; best mean of loops of 500 calls)")
    host = host_overhead(5 if args.quick else 20)
    base = host["raw cuLaunchKernel (ctypes, prebuilt args)"]
    for name, us in host.items():
        print(f"  {name:55s} {us:7.2f} us  (+{us - base:5.2f} over raw)")
    results["host_us"] = host
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
