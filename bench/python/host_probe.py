"""Where the host time of a training step goes, on tensors small enough that the GPU never
waits: kiln's RMSNorm step and its parts (the autograd.Function forward, the backward's pieces,
allocations, a bare op call), beside PyTorch's step and a trivial Python autograd.Function, with
the autograd engine's device threads on and off. Then a profile of the CPU side of kiln's step.

  python3 bench/python/host_probe.py [ROWS HIDDEN]
"""
import statistics
import sys
import threading
import time

import torch

import kiln
import kiln.torch as kt
from kiln import ops as kops

F = torch.nn.functional


def host_us(fn, steps=500, trials=7):
    for _ in range(50):
        fn()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / steps)
    return statistics.median(times)


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def main():
    rows, hidden = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (8, 256)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd, wd = x.detach(), w.detach()
    dy = torch.randn_like(x)
    y, inv = torch.empty_like(xd), torch.empty(rows, device="cuda")
    dx, dw = torch.empty_like(xd), torch.empty_like(wd)
    ws = torch.empty(max(kops.rms_norm_backward_workspace_elements(xd), 1), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    cases = {
        "torch.empty": lambda: torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16),
        "workspace_elements": lambda: kops.rms_norm_backward_workspace_elements(xd),
        "kiln.rms_norm prealloc": lambda: kiln.rms_norm(xd, wd, 1e-6, out=y),
        "kiln.rms_norm prealloc+stream": lambda: kiln.rms_norm(xd, wd, 1e-6, out=y, stream=stream),
        "kiln.rms_norm +inv_rms": lambda: kiln.rms_norm(xd, wd, 1e-6, out=y, inv_rms=inv),
        "kiln.rms_norm_backward prealloc": lambda: kiln.rms_norm_backward(dy, xd, wd, inv, dx=dx, dw=dw, workspace=ws),
        "kt.rms_norm no grad": lambda: kt.rms_norm(xd, [hidden], wd, 1e-6),
        "kt._rms_norm_fwd_impl": lambda: kt._rms_norm_fwd_impl(xd, wd, 1e-6),
        "kt._rms_norm_backward_impl": lambda: kt._rms_norm_backward_impl(dy, xd, wd, inv),
        "kt.rms_norm fwd with grad": lambda: kt.rms_norm(x, [hidden], w, 1e-6),
        "F.rms_norm fwd with grad": lambda: F.rms_norm(x, (hidden,), w, 1e-6),
        "kiln step": lambda: torch.autograd.grad(kt.rms_norm(x, [hidden], w, 1e-6), [x, w], dy),
        "torch step": lambda: torch.autograd.grad(F.rms_norm(x, (hidden,), w, 1e-6), [x, w], dy),
        "Twice step": lambda: torch.autograd.grad(Twice.apply(x), [x], dy),
        "x*2 step": lambda: torch.autograd.grad(x * 2, [x], dy),
    }
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} rows {rows} hidden {hidden}")
    print("threads:", [t.name for t in threading.enumerate()], "switch interval", sys.getswitchinterval())
    for mt in (True, False):
        torch.autograd.set_multithreading_enabled(mt)
        for name, fn in cases.items():
            if not mt and "step" not in name:
                continue
            print(f"multithreading {mt!s:5s} {name:32s} {host_us(fn):8.1f} us", flush=True)
    torch.autograd.set_multithreading_enabled(True)
    import cProfile
    import pstats
    step = cases["kiln step"]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        step()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
