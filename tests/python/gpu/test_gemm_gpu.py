"""The GEMM ops from Python on CUDA tensors against PyTorch on random inputs: quantize_fp8,
fp8_gemm (per tensor and block-scaled, against the dequantized product and torch._scaled_mm),
fused_gated_mlp and the FusedGatedMLP and FP8Linear modules (forward, backward, torch.compile)."""
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

F = torch.nn.functional
DEV = "cuda"


def expand(scale, granularity, shape):
    """Each element's scale, from quantize_fp8's scale tensor."""
    if granularity == "tensor":
        return scale.reshape(()).expand(shape)
    s = scale.repeat_interleave(128, dim=-1)
    if granularity == "128x128":
        s = s.repeat_interleave(128, dim=0)
    return s[:shape[0], :shape[1]]


def dequantize(q, scale, granularity):
    return q.view(torch.float8_e4m3fn).float() * expand(scale, granularity, q.shape)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("granularity", ["tensor", "1x128", "128x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_matches_torch_e4m3(granularity, dtype):
    x = (torch.randn(300, 520, device=DEV) * 4).to(dtype)
    q, scale = kt.quantize_fp8(x, granularity)
    assert q.dtype == torch.uint8 and scale.dtype == torch.float32
    # torch's own e4m3 conversion (round to nearest even, saturate by clamping first) of x / scale.
    want = (x.float() / expand(scale, granularity, x.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    if granularity == "tensor":
        torch.testing.assert_close(scale.reshape(()), x.float().abs().max() / 448)
    want = want.view(torch.uint8)
    assert torch.equal(q, want)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(128, 4096, 7168), (333, 520, 272), (4096, 2112, 1024)])
def test_fp8_gemm_matches_the_dequantized_product(scaling, out_dtype, mnk):
    m, n, k = mnk
    a = torch.randn(m, k, device=DEV)
    b = torch.randn(k, n, device=DEV)
    out = kt.fp8_gemm(a, b, output_dtype=out_dtype, scaling=scaling)
    assert out.shape == (m, n) and out.dtype == out_dtype
    ga, gb = ("1x128", "128x128") if scaling == "block" else ("tensor", "tensor")
    qa, sa = kt.quantize_fp8(a, ga)
    qb, sb = kt.quantize_fp8(b, gb, True)
    want = dequantize(qa, sa, ga).double() @ dequantize(qb, sb, gb).double().t()
    assert rel(out, want) < 5e-3
    assert rel(out, a.double() @ b.double()) < 0.06


def test_fp8_gemm_against_torch_scaled_mm():
    m, n, k = 256, 1024, 512
    a, w = torch.randn(m, k, device=DEV), torch.randn(n, k, device=DEV)
    qa, sa = kt.quantize_fp8(a)
    qw, sw = kt.quantize_fp8(w)
    ours = kt.fp8_gemm(qa, qw.t(), sa, sw, torch.bfloat16)
    theirs = torch._scaled_mm(qa.view(torch.float8_e4m3fn), qw.view(torch.float8_e4m3fn).t(), scale_a=sa.reshape(()),
                              scale_b=sw.reshape(()), out_dtype=torch.bfloat16)
    assert rel(ours, theirs) < 5e-3


def test_fp8_gemm_errors_before_launch():
    a = torch.randn(16, 32, device=DEV)
    qa, sa = kt.quantize_fp8(a)
    with pytest.raises(kiln.InvalidArgumentError, match="a_scale"):
        kt.fp8_gemm(qa, qa.t())
    with pytest.raises(kiln.ShapeMismatchError):
        kt.fp8_gemm(torch.randn(16, 24, device=DEV), torch.randn(24, 16, device=DEV))
    with pytest.raises(kiln.DeviceError):
        kiln.fp8_gemm(qa, qa.t(), sa.cpu(), sa)


def ref_gated(x, wg, wu, act):
    g, u = x.float() @ wg.float().t(), x.float() @ wu.float().t()
    return (F.silu(g) if act == "silu" else F.gelu(g)) * u


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 512, 1376), (1, 7, 200, 72)])
def test_fused_gated_mlp_module_forward_and_backward(act, dtype, shape):
    b, s, hidden, inter = shape
    mod = kt.FusedGatedMLP(hidden, inter, activation=act).to(DEV, dtype)
    x = torch.randn(b, s, hidden, device=DEV, dtype=dtype, requires_grad=True)
    y = mod(x)
    want = ref_gated(x, mod.gate_weight, mod.up_weight, act)
    assert y.shape == (b, s, inter) and y.dtype == dtype
    assert rel(y, want) < 1e-2
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    wg = mod.gate_weight.detach().clone().requires_grad_()
    wu = mod.up_weight.detach().clone().requires_grad_()
    ref_gated(xr, wg, wu, act).backward(dy.float())
    assert rel(x.grad, xr.grad) < 2e-2
    assert rel(mod.gate_weight.grad, wg.grad) < 2e-2
    assert rel(mod.up_weight.grad, wu.grad) < 2e-2


def test_fused_gated_mlp_under_compile_fullgraph():
    mod = kt.FusedGatedMLP(256, 688).to(DEV, torch.bfloat16)
    x = torch.randn(4, 32, 256, device=DEV, dtype=torch.bfloat16)
    eager = mod(x)
    compiled = torch.compile(mod, fullgraph=True)(x)
    assert torch.equal(eager, compiled)


def test_fp8_linear_matches_linear_and_requantizes_after_an_update():
    torch.manual_seed(0)
    for scaling in ("tensor", "block"):
        layer = kt.FP8Linear(512, 384, bias=True, scaling=scaling).to(DEV, torch.float16)
        x = torch.randn(2, 64, 512, device=DEV, dtype=torch.float16)
        y = layer(x)
        assert y.shape == (2, 64, 384) and y.dtype == torch.float16
        assert rel(y, F.linear(x.float(), layer.weight.float(), layer.bias.float())) < 0.06
        with torch.no_grad():
            layer.weight.mul_(-2)  # an in-place update: the cached FP8 weight must not be reused
        assert rel(layer(x), F.linear(x.float(), layer.weight.float(), layer.bias.float())) < 0.06


def test_opcheck_gemm_ops():
    x = torch.randn(32, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(48, 64, device=DEV, dtype=torch.bfloat16)
    qa, sa = kt.quantize_fp8(x.float())
    qw, sw = kt.quantize_fp8(w.float())
    for op, args in [(torch.ops.kiln.fused_gated_mlp.default, (x, w, w.clone(), "silu")),
                     (torch.ops.kiln.quantize_fp8.default, (x, "1x128", False)),
                     (torch.ops.kiln.fp8_gemm.default, (qa, qw.t(), sa, sw, torch.bfloat16))]:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
