"""act_and_mul (SiLU, bf16) at one size, kiln against Liger, timed several ways on the GPU: CUDA
graphs of 1, 2 and 8 calls (replays timed with events, synchronized between replays, median of 7),
the profiler's kernel time inside each graph, and a plain loop of 4 calls. For telling a kernel's
time from how a harness times it (the shape sweep times one-call graphs for the largest sizes).

  python3 bench/python/graph_timing_probe.py ROWS D      # x is [ROWS, 2 * D]; needs liger_kernel
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import kiln.torch as kt
from liger_kernel.ops.swiglu import LigerSiLUMulFunction


def replay_us(graph, calls):
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), min(times), max(times)


def kernel_us(graph, calls):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(kernels) / calls, len(kernels)


def main():
    rows, d = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * d, device="cuda", dtype=torch.bfloat16)
    gate, up = x[:, :d].contiguous(), x[:, d:].contiguous()
    contenders = {"kiln": lambda: kt.act_and_mul(x, "silu"), "liger": lambda: LigerSiLUMulFunction.apply(gate, up)}
    stream = torch.cuda.Stream()
    for order in (("kiln", "liger"), ("liger", "kiln")):
        for name in order:
            fn = contenders[name]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            parts = []
            for calls in (1, 2, 8):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(calls):
                        fn()
                med, lo, hi = replay_us(graph, calls)
                k, n = kernel_us(graph, calls)
                parts.append(f"graph of {calls}: {med:.1f} us ({lo:.1f}-{hi:.1f}), kernels {k:.1f} us [{n}]")
                graph.reset()
            loop = []
            for _ in range(7):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(4):
                    fn()
                end.record()
                end.synchronize()
                loop.append(start.elapsed_time(end) * 1e3 / 4)
            print(f"{rows} x {d} {name}: " + " | ".join(parts) + f" | loop {statistics.median(loop):.1f} us", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
