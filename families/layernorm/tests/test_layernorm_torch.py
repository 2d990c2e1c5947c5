"""LayerNorm through kiln.torch (needs PyTorch; on CUDA when there is a GPU): the custom op
kiln::layer_norm and its autograd, both generated from the declarations, against
torch.nn.functional.layer_norm in fp64, eager and under torch.compile(fullgraph=True)."""
import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")
import kiln.torch as kt  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def reference(x, w, b):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = torch.nn.functional.layer_norm(x64, (x.shape[-1],), w64, b64, 1e-5)
    return y, x64, w64, b64


# The CPU fallback in f32; CUDA in f32 and bf16.
CASES = [("cpu", torch.float32)] + [(d, t) for d in DEVICES if d != "cpu" for t in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_fp64(device, dtype, bias):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, 384, generator=g) + 2).to(device, dtype).requires_grad_()
    w = torch.randn(384, generator=g).to(device, dtype).requires_grad_()
    b = torch.randn(384, generator=g).to(device, dtype).requires_grad_() if bias else None
    dy = torch.randn(4, 7, 384, generator=g).to(device, dtype)
    y = kt.layer_norm(x, w, b)
    y.backward(dy)
    want, x64, w64, b64 = reference(x, w, b)
    want.backward(dy.double())
    tol = TOL[dtype]

    def close(got, ref):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < tol, float(err)

    close(y, want)
    close(x.grad, x64.grad)
    close(w.grad, w64.grad)
    if bias:
        close(b.grad, b64.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of the CUDA op needs a GPU")
def test_compiles_without_graph_breaks_with_gradients():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x, w, b: kt.layer_norm(x, w, b).float().square().sum(), fullgraph=True)
    f(x, w, b).backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    kt.layer_norm(x, w, b).float().square().sum().backward()
    for got, want in zip(grads, (x.grad, w.grad, b.grad)):
        assert torch.equal(got, want)  # same kernels, deterministic reduction


@pytest.mark.parametrize("device,dtype", CASES)
def test_strided_rows_are_taken_as_they_are(device, dtype, monkeypatch):
    """x and dy as slices of wider tensors (rows 448 elements apart): the declarations mark them
    strided_rows, so kiln.torch passes them without a copy, and the results are those of
    contiguous copies."""
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(4, 7, 448, generator=g) + 2).to(device, dtype)
    dy_base = torch.randn(4, 7, 448, generator=g).to(device, dtype)
    w = torch.randn(384, generator=g).to(device, dtype).requires_grad_()
    b = torch.randn(384, generator=g).to(device, dtype).requires_grad_()
    x = base[..., 32:416].requires_grad_()
    dy = dy_base[..., 32:416]
    assert not x.is_contiguous() and not dy.is_contiguous()
    copies = []
    real = torch.Tensor.contiguous

    def counting(t, *args, **kwargs):
        if not t.is_contiguous():
            copies.append(tuple(t.shape))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    y = kt.layer_norm(x, w, b)
    y.backward(dy)
    monkeypatch.undo()
    assert copies == []
    got = (y.detach(), x.grad, w.grad, b.grad)

    xc = x.detach().contiguous().requires_grad_()
    w.grad = b.grad = None
    yc = kt.layer_norm(xc, w, b)
    yc.backward(dy.contiguous())
    for a, c in zip(got, (yc.detach(), xc.grad, w.grad, b.grad)):
        assert torch.equal(a, c)
