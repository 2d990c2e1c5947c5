"""LoRA from Python on CUDA tensors: kiln.torch.lora_linear forward and gradients against fp64
autograd of the eager PEFT form (F.linear(x, W) + F.linear(F.linear(x, A), B) * s) at ranks 1, 8,
64 and 128 with k and n not multiples of any tile and scale 0; LoRA_MLP (SwiGLU, GeGLU) and
LoRA_QKV forward + backward against the same modules written in fp64 eager; the multi-adapter op
(decode and prefill batches, mixed ranks, slices, rows without an adapter) against a per-row fp64
loop; torch.compile(fullgraph=True)."""
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln.torch as kt  # noqa: E402

F = torch.nn.functional
DEV = "cuda"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def params(m, n, k, r, dtype, bias=False):
    x = torch.randn(m, k, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
    a = (torch.randn(r, k, device=DEV) / k ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(n, r, device=DEV) / r ** 0.5).to(dtype).requires_grad_()
    bb = torch.randn(n, device=DEV, dtype=dtype, requires_grad=True) if bias else None
    return x, w, a, b, bb


def ref_grads(x, w, a, b, bias, s, dout):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, a, b, bias)]
    xd, ad, bd, biasd = leaves
    out = F.linear(xd, w.double()) + F.linear(F.linear(xd, ad), bd) * s
    if biasd is not None:
        out = out + biasd
    out.backward(dout.double())
    return out, [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("rank", [1, 8, 64, 128])
@pytest.mark.parametrize("m", [1, 16, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_linear_forward_and_grads(rank, m, dtype):
    n, k, s = 392, 520, 2.0
    x, w, a, b, bias = params(m, n, k, rank, dtype, bias=m == 16)
    out = kt.lora_linear(x, w, a, b, bias, s)
    dout = torch.randn_like(out)
    out.backward(dout)
    want, grads = ref_grads(x, w, a, b, bias, s, dout)
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-3
    assert rel(out, want) < tol
    for got, ref, name in zip((x.grad, a.grad, b.grad, None if bias is None else bias.grad), grads, "xabc"):
        if ref is not None:
            assert rel(got, ref) < 2 * tol, name


def test_scale_zero_is_the_base_gemm():
    x, w, a, b, _ = params(64, 264, 392, 16, torch.bfloat16)
    out = kt.lora_linear(x, w, a, b, None, 0.0)
    torch.testing.assert_close(out.float(), (x.double() @ w.double().t()).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_lora_mlp_forward_backward(activation):
    torch.manual_seed(1)
    mlp = kt.LoRA_MLP(256, 688, r=16, alpha=32, activation=activation, device=DEV, dtype=torch.bfloat16)
    for p in (mlp.lora_B_gate, mlp.lora_B_up, mlp.lora_B_down):
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(4, 37, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = mlp(x)
    dout = torch.randn_like(out)
    out.backward(dout)

    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    I, s = 688, mlp.scale
    ps = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters() if p.requires_grad}
    xd = x.detach().double().requires_grad_()
    wg, wu = mlp.gate_up_weight.double()[:I], mlp.gate_up_weight.double()[I:]

    def lin(v, w, a, b):
        return F.linear(v, w) + F.linear(F.linear(v, a), b) * s

    ref = lin(act(lin(xd, wg, ps["lora_A_gate"], ps["lora_B_gate"])) * lin(xd, wu, ps["lora_A_up"], ps["lora_B_up"]),
              mlp.down_weight.double(), ps["lora_A_down"], ps["lora_B_down"])
    ref.backward(dout.double())
    assert rel(out, ref) < 1.5e-2
    assert rel(x.grad, xd.grad) < 2e-2
    for n, p in mlp.named_parameters():
        if p.requires_grad:
            assert rel(p.grad, ps[n].grad) < 2e-2, n


def test_lora_qkv_forward_backward():
    qkv = kt.LoRA_QKV(256, 256, 64, r=8, alpha=16, bias=True, device=DEV, dtype=torch.bfloat16)
    for p in qkv.lora_B:
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(300, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv(x)
    assert q.shape == (300, 256) and k.shape == (300, 64) and v.shape == (300, 64)
    douts = [torch.randn_like(t) for t in (q, k, v)]
    torch.autograd.backward([q, k, v], douts)
    xd = x.detach().double().requires_grad_()
    A = [a.detach().double().requires_grad_() for a in qkv.lora_A]
    B = [b.detach().double().requires_grad_() for b in qkv.lora_B]
    ws = qkv.qkv_weight.double().split([256, 64, 64])
    bs = qkv.bias.double().split([256, 64, 64])
    refs = [F.linear(xd, w) + F.linear(F.linear(xd, a), b) * qkv.scale + c for w, a, b, c in zip(ws, A, B, bs)]
    torch.autograd.backward(refs, [d.double() for d in douts])
    for got, ref in zip((q, k, v), refs):
        assert rel(got, ref) < 8e-3
    assert rel(x.grad, xd.grad) < 1.5e-2
    for p, r in zip(list(qkv.lora_A) + list(qkv.lora_B), A + B):
        assert rel(p.grad, r.grad) < 1.5e-2


@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("decode", [True, False])
def test_multi_adapter_matches_a_per_row_loop(slices, decode):
    adapters, r, k = 16, 128, 520
    n = 384
    m = 16 if decode else 1000
    ends = {1: (0, 0), 2: (192, 0), 3: (256, 320)}[slices]
    bounds = {1: [0, n], 2: [0, 192, n], 3: [0, 256, 320, n]}[slices]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).bfloat16()
    a = (torch.randn(adapters, slices * r, k, device=DEV) / k ** 0.5).bfloat16()
    b = (torch.randn(adapters, n, r, device=DEV) * 0.1).bfloat16()
    ranks = torch.tensor([8, 16, 32, 64, 128] * 3 + [8], dtype=torch.int32, device=DEV)
    scales = torch.rand(adapters, device=DEV) + 0.25
    if decode:
        idx = torch.randint(-1, adapters, (m,), device=DEV, dtype=torch.int32)
    else:
        idx = torch.repeat_interleave(torch.randint(-1, adapters, (10,), device=DEV, dtype=torch.int32), m // 10)
    out = kt.lora_linear_multi(x, w, a, b, idx, ranks, scales, None, *ends)
    want = x.double() @ w.double().t()
    for i in range(m):
        e = int(idx[i])
        if e < 0:
            continue
        rk = int(ranks[e])
        for j in range(slices):
            t = x[i].double() @ a[e, j * r:j * r + rk].double().t()
            want[i, bounds[j]:bounds[j + 1]] += float(scales[e]) * (b[e, bounds[j]:bounds[j + 1], :rk].double() @ t)
    assert rel(out, want) < 8e-3


def test_compiled_lora_mlp_training_step():
    mlp = kt.LoRA_MLP(256, 512, r=16, alpha=16, device=DEV, dtype=torch.bfloat16)
    for p in (mlp.lora_B_gate, mlp.lora_B_up, mlp.lora_B_down):
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    eager_out = mlp(x)
    eager_out.float().square().mean().backward()
    eager_grads = [p.grad.clone() for p in mlp.parameters() if p.requires_grad]
    mlp.zero_grad()
    compiled = torch.compile(mlp, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, eager_out)
    for g, p in zip(eager_grads, [p for p in mlp.parameters() if p.requires_grad]):
        torch.testing.assert_close(p.grad, g, rtol=1e-2, atol=1e-3)
