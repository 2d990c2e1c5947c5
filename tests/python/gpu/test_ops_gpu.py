"""Every kiln op on CUDA tensors against PyTorch, through kiln's own API and kiln.torch, on random
inputs; the array protocols; streams; errors before launch; the handle cache; daemon and embedded
resolvers."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln
import kiln.torch as kt  # noqa: E402

F = torch.nn.functional

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def grad_close(actual, expected, dtype):
    """Gradients: elementwise in f32; in 16 bits, where a rounded dy and cancellation in dx make
    elementwise bounds brittle, the relative error of the whole tensor."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-4, atol=1e-4)
        return
    err = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert err < 2e-2, f"relative error {err:.3g}"


def ref_rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], -1)


def ref_rope(x, cos, sin, pos, layout):
    xf = x.float()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    if layout == "neox":
        return xf * torch.cat([c, c], -1) + rotate_half(xf) * torch.cat([s, s], -1)
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)


def ref_rms_norm_rope(x, w, cos, sin, eps):
    b, s, hidden = x.shape
    head_dim = cos.shape[-1]
    n = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float())
    n = n.reshape(b, s, hidden // head_dim, head_dim)
    c, sn = cos.reshape(1, s, 1, head_dim).float(), sin.reshape(1, s, 1, head_dim).float()
    return (n * c + rotate_half(n) * sn).reshape(b, s, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 4096), (3, 7, 1000), (1, 128), (257, 5120)])
def test_rms_norm(dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    close(kiln.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), dtype)
    close(kt.rms_norm(x, [shape[-1]], w, 1e-6), ref_rms_norm(x, w, 1e-6), dtype)
    y, inv = kiln.rms_norm_with_inv_rms(x, w, 1e-6)
    torch.testing.assert_close(inv.reshape(-1), torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6).reshape(-1),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_backward_core(dtype):
    x = torch.randn(64, 2048, device="cuda", dtype=dtype)
    w = torch.randn(2048, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    _, inv = kiln.rms_norm_with_inv_rms(x, w)
    dx, dw = kiln.rms_norm_backward(dy, x, w, inv)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    (ref_rms_norm(xr, wr, 1e-6) * dy.float()).sum().backward()
    grad_close(dx, xr.grad, dtype)
    grad_close(dw, wr.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,normalized", [((8, 3, 1024), (1024,)), ((5, 4, 256), (4, 256)), ((1, 4096), 4096)])
def test_rmsnorm_module_matches_torch_forward_and_backward(dtype, shape, normalized):
    ref = torch.nn.RMSNorm(normalized, eps=1e-5, device="cuda", dtype=dtype)
    mod = kt.RMSNorm(normalized, eps=1e-5, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn_like(ref.weight))
    mod.load_state_dict(ref.state_dict())  # same keys
    assert set(mod.state_dict()) == set(ref.state_dict()) == {"weight"}
    x = torch.randn(shape, device="cuda", dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    # The reference in fp32 (torch's own bf16 RMSNorm rounds intermediates).
    ref32 = torch.nn.RMSNorm(normalized, eps=1e-5, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        ref32.weight.copy_(ref.weight.float())
    ya, yb = mod(xa), ref32(xb.float())
    close(ya, yb, dtype)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy.float())
    grad_close(xa.grad, xb.grad, dtype)
    grad_close(mod.weight.grad, ref32.weight.grad, dtype)


def test_rmsnorm_module_without_affine_and_default_eps():
    ref = torch.nn.RMSNorm(512, elementwise_affine=False)
    mod = kt.RMSNorm(512, elementwise_affine=False)
    assert mod.weight is None and len(mod.state_dict()) == 0
    x = torch.randn(16, 512, device="cuda", requires_grad=True)
    close(mod(x), ref(x), torch.float32)
    mod(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rmsnorm_module_falls_back_for_mixed_dtypes():
    mod = kt.RMSNorm(256, device="cuda")  # f32 weight
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.RMSNorm(256, device="cuda")
    torch.testing.assert_close(mod(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    x = torch.randn(33, 4096, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    y, h = kt.add_rms_norm(x, r, w, 1e-6)
    h_ref = (x.float() + r.float()).to(dtype)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    close(y, ref_rms_norm(h_ref, w, 1e-6), dtype)
    y2, h2 = kiln.add_rms_norm(x, r, w, out=x, residual_out=r)  # in place
    assert y2 is x and h2 is r
    torch.testing.assert_close(r, h_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul(dtype, act):
    x = torch.randn(4, 77, 2 * 1408, device="cuda", dtype=dtype)
    g, u = x.float().chunk(2, -1)
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    close(kt.act_and_mul(x, act), fn(g) * u, dtype)
    close(kiln.act_and_mul(x, act), fn(g) * u, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_gradients_match_fp64_autograd(dtype, act):
    """kt.act_and_mul's autograd (kiln::act_and_mul_backward) against PyTorch's autograd of the same
    function in fp64, on a strided input (every other row), eager and under torch.compile."""
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    base = torch.randn(2 * 77, 2 * 1408, device="cuda", dtype=dtype)
    x = base[::2].detach().requires_grad_(True)
    dy = torch.randn(77, 1408, device="cuda", dtype=dtype)
    xr = x.detach().double().requires_grad_(True)
    g, u = xr.chunk(2, -1)
    (fn(g) * u).backward(dy.double())
    torch._dynamo.reset()  # each parameter set compiles anew, not against the recompile limit
    for run in (kt.act_and_mul, torch.compile(kt.act_and_mul, fullgraph=True)):
        x.grad = None
        y = run(x, act)
        close(y, (fn(g) * u).detach(), dtype)
        y.backward(dy)
        grad_close(x.grad, xr.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_runs_a_family_by_its_problem_fields(dtype):
    """kiln.launch, with no typed op: the family by name, its fields by name, the buffers in the
    family's order; rows strided (every other row of a larger tensor) so the strides matter."""
    big = torch.randn(2 * 301, 2 * 1408, device="cuda", dtype=dtype)
    x = big[::2]
    y = torch.full((301, 1408), float("nan"), device="cuda", dtype=dtype)
    fields = {"rows": 301, "d": 1408, "x_row_stride": x.stride(0), "out_row_stride": y.stride(0),
              "activation": kiln.ACTIVATIONS["gelu_tanh"]}
    kiln.launch("act_and_mul", [x, y], fields, dtype=dtype)
    g, u = x.float().chunk(2, -1)
    close(y, F.gelu(g, approximate="tanh") * u, dtype)
    # The family checks the problem first: an x row stride below 2d launches nothing.
    y.fill_(float("nan"))
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.launch("act_and_mul", [x, y], dict(fields, x_row_stride=1408), dtype=dtype)
    assert torch.isnan(y).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_apply_rope_qk(dtype, layout, head_dim):
    tokens, max_pos = 40, 512
    q = torch.randn(tokens, 32, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(tokens, 8, head_dim, device="cuda", dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, device="cuda").float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.randint(0, max_pos, (tokens,), device="cuda")
    qo, ko = kt.apply_rope_qk(q, k, cos, sin, pos, layout)
    close(qo, ref_rope(q, cos, sin, pos, layout), dtype)
    close(ko, ref_rope(k, cos, sin, pos, layout), dtype)


def test_apply_rope_qk_on_a_fused_qkv_view():
    qkv = torch.randn(16, (8 + 2 + 2) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :8 * 128].view(16, 8, 128)
    k = qkv[:, 8 * 128:10 * 128].view(16, 2, 128)
    cos = torch.rand(64, 64, device="cuda")
    sin = torch.rand(64, 64, device="cuda")
    pos = torch.arange(16, device="cuda")
    q_ref, k_ref = ref_rope(q, cos, sin, pos, "neox"), ref_rope(k, cos, sin, pos, "neox")
    v_before = qkv[:, 10 * 128:].clone()
    qo, ko = kiln.apply_rope_qk(q, k, cos, sin, pos, q_out=q, k_out=k)  # in place into qkv
    assert qo is q and ko is k
    close(qkv[:, :8 * 128].view(16, 8, 128), q_ref, torch.bfloat16)
    close(qkv[:, 8 * 128:10 * 128].view(16, 2, 128), k_ref, torch.bfloat16)
    assert torch.equal(qkv[:, 10 * 128:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_4d", [False, True])
def test_fused_rmsnorm_rope_and_module(dtype, cos_4d):
    b, s, hidden, head_dim = 2, 128, 4096, 64
    x = torch.randn(b, s, hidden, device="cuda", dtype=dtype)
    mod = kt.FusedRMSNormRoPE(hidden, head_dim, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        mod.weight.copy_(torch.randn_like(mod.weight))
    cos = torch.randn(s, head_dim, device="cuda", dtype=dtype)
    sin = torch.randn(s, head_dim, device="cuda", dtype=dtype)
    if cos_4d:
        cos, sin = cos.view(1, s, 1, head_dim), sin.view(1, s, 1, head_dim)
    ref = ref_rms_norm_rope(x, mod.weight, cos, sin, 1e-6)
    close(kt.fused_rmsnorm_rope(x, mod.weight, cos, sin), ref, dtype)
    # Forward and backward of the module against autograd through the reference.
    xa = x.clone().requires_grad_()
    out = mod(xa, cos, sin)
    close(out, ref, dtype)
    xr = x.float().requires_grad_()
    wr = mod.weight.detach().float().requires_grad_()
    ref_out = ref_rms_norm_rope(xr, wr, cos.float(), sin.float(), 1e-6)
    dy = torch.randn_like(ref_out)
    out.backward(dy.to(dtype))
    ref_out.backward(dy)
    grad_close(xa.grad, xr.grad, dtype)
    grad_close(mod.weight.grad, wr.grad, dtype)


def test_fused_rmsnorm_rope_seed_errors():
    x = torch.randn(2, 8, 256, device="cuda", dtype=torch.float16)
    w = torch.ones(256, device="cuda", dtype=torch.float16)
    cos = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(kiln.DeviceError):
        kt.fused_rmsnorm_rope(x.cpu(), w.cpu(), cos.cpu(), cos.cpu())
    with pytest.raises(kiln.ShapeMismatchError):
        kt.fused_rmsnorm_rope(x, w, cos[:4], cos[:4])
    with pytest.raises(kiln.ShapeMismatchError):
        kt.fused_rmsnorm_rope(x, w, cos[:, :63], cos[:, :63])  # odd head_dim
    with pytest.raises(kiln.UnsupportedDtypeError):
        kt.fused_rmsnorm_rope(x.int(), w.int(), cos, cos)


def test_errors_before_launch_leave_outputs_untouched():
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(x, 3.0)
    with pytest.raises(kiln.DeviceError):
        kiln.rms_norm(x, w.cpu(), out=out)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.rms_norm(x, w[:512], out=out)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.rms_norm(x.double(), w.double(), out=out.double())
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.rms_norm(x, w.half(), out=out)
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.rms_norm(x, w, -1.0, out=out)
    torch.cuda.synchronize()
    assert (out == 3.0).all()


class CAIOnly:
    def __init__(self, t):
        self._t = t

    @property
    def __cuda_array_interface__(self):
        return self._t.__cuda_array_interface__


class DLPackOnly:
    def __init__(self, t):
        self._t = t

    def __dlpack__(self, stream=None):
        return self._t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_cuda_array_interface_and_dlpack_inputs():
    x = torch.randn(16, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    kiln.rms_norm(CAIOnly(x), DLPackOnly(w), out=CAIOnly(out))
    torch.cuda.synchronize()
    close(out, ref_rms_norm(x, w, 1e-6), torch.float16)
    out2 = torch.empty_like(x)
    kiln.rms_norm(DLPackOnly(x), DLPackOnly(w), out=DLPackOnly(out2))
    torch.cuda.synchronize()
    close(out2, ref_rms_norm(x, w, 1e-6), torch.float16)


def test_runs_on_the_callers_current_stream():
    # A long kernel on a side stream, then the copy that fills x: launched on the default stream
    # instead of the current one, kiln would read x before the copy and the result would differ.
    x = torch.zeros(64, 4096, device="cuda")
    src = torch.randn_like(x)
    w = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        kiln.rms_norm(x, w, out=out)
        y = kt.rms_norm(x, [4096], w, 1e-6)
    side.synchronize()
    close(out, ref_rms_norm(src, w, 1e-6), torch.float32)
    close(y, ref_rms_norm(src, w, 1e-6), torch.float32)
    # An explicit stream= overrides the current one (src2 is not a multiple of src: RMSNorm is
    # scale-invariant).
    src2 = torch.randn_like(x)
    out.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.copy_(src2)
    kiln.rms_norm(x, w, out=out, stream=side)
    side.synchronize()
    close(out, ref_rms_norm(src2, w, 1e-6), torch.float32)


def test_handle_is_cached_after_the_first_call():
    x = torch.randn(32, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    kiln.rms_norm(x, w, out=out)
    before = kiln.counters()
    for _ in range(200):
        kiln.rms_norm(x, w, out=out)
    after = kiln.counters()
    assert after["module_loads"] == before["module_loads"]
    assert after["from_daemon"] == before["from_daemon"] and after["from_embedded"] == before["from_embedded"]


_CHILD = textwrap.dedent("""
    import torch, kiln
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
    w = torch.randn(1024, device="cuda", dtype=torch.float16)
    y = kiln.rms_norm(x, w)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    print("resolver", kiln.resolver())
""")


def _child(env):
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)


def test_embedded_and_daemon_resolvers(tmp_path):
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "cache"), KILN_SOCKET=str(tmp_path / "kilnd.sock"))
    r = _child(dict(env, KILN_MODE="embedded"))
    assert r.returncode == 0, r.stderr
    assert "resolver embedded" in r.stdout
    kilnd = os.environ.get("KILN_KILND")
    if not kilnd:
        pytest.fail("set KILN_KILND to the kilnd binary to test daemon mode")
    log = open(tmp_path / "kilnd.log", "w")
    daemon = subprocess.Popen([kilnd, "--socket", env["KILN_SOCKET"], "--cache-dir", str(tmp_path / "dcache")],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if os.path.exists(env["KILN_SOCKET"]):
                break
            assert daemon.poll() is None, (tmp_path / "kilnd.log").read_text()
            time.sleep(0.05)
        r = _child(dict(env, KILN_MODE="daemon"))
        assert r.returncode == 0, r.stderr
        assert "resolver daemon" in r.stdout
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        log.close()
