"""Helpers the families' PyTorch anchors (families/<name>/bench/*.py) share; bench/torch_anchors.py
runs them with this folder on sys.path (it is the script's own folder)."""
import torch


def kernel_breakdown(fn, top=12):
    """The GPU time of one step of fn by kernel name (torch.profiler, after a warm-up step), the
    largest first; printed, and returned as [name, us] pairs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.device_time_total
    items = sorted(totals.items(), key=lambda kv: -kv[1])
    print(f"  kernels of one step: {sum(totals.values()):.0f} us in all", flush=True)
    for name, us in items[:top]:
        print(f"    {us:10.1f} us  {name[:110]}", flush=True)
    return [[name, us] for name, us in items[:top]]
