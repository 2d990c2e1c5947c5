"""kiln.torch on CPU tensors (kiln's CPU fallbacks), where PyTorch is installed: the custom ops'
schemas, fake implementations and autograd (torch.library.opcheck), the RMSNorm drop-in, and
torch.compile(fullgraph=True). CI has no PyTorch and skips this file; the GPU tests cover CUDA."""
import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_opcheck_every_op():
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    cos, sin, pos = torch.rand(16, 32), torch.rand(16, 32), torch.randint(0, 16, (6,))
    cases = [
        (torch.ops.kiln.rms_norm.default, (torch.randn(4, 64), torch.randn(64), 1e-6)),
        (torch.ops.kiln.rms_norm_fwd.default, (torch.randn(4, 64, requires_grad=True),
                                               torch.randn(64, requires_grad=True), 1e-6)),
        (torch.ops.kiln.rms_norm_backward.default, (torch.randn(4, 64), torch.randn(4, 64), torch.randn(64),
                                                    torch.rand(4) + 0.5)),
        (torch.ops.kiln.add_rms_norm.default, (torch.randn(4, 64), torch.randn(4, 64), torch.randn(64), 1e-6)),
        (torch.ops.kiln.add_rms_norm_backward.default, (torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 64),
                                                        torch.randn(64), 1e-6)),
        (torch.ops.kiln.add_rms_norm_backward.default, (torch.randn(4, 64), None, torch.randn(4, 64),
                                                        torch.randn(64), 1e-6)),
        (torch.ops.kiln.add_rms_norm.default, (torch.randn(4, 64, requires_grad=True), torch.randn(4, 64),
                                               torch.randn(64, requires_grad=True), 1e-6)),
        (torch.ops.kiln.act_and_mul.default, (torch.randn(4, 64), "gelu_tanh")),
        (torch.ops.kiln.act_and_mul.default, (torch.randn(4, 64, requires_grad=True), "gelu")),
        (torch.ops.kiln.act_and_mul_backward.default, (torch.randn(4, 64), torch.randn(4, 32), "silu")),
        (torch.ops.kiln.apply_rope_qk.default, (q, k, cos, sin, pos, "gptj")),
        (torch.ops.kiln.apply_rope_qk.default, (q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin, pos,
                                                "neox")),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@pytest.mark.parametrize("normalized", [256, (3, 256)])
def test_rmsnorm_is_a_drop_in(normalized):
    ref = torch.nn.RMSNorm(normalized, eps=1e-5)
    mod = kt.RMSNorm(normalized, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn_like(ref.weight))
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 256)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mod(xa), ref(xb)
    torch.testing.assert_close(ya, yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(mod.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
    assert repr(mod).endswith(repr(ref)[len("RMSNorm"):])


def test_compile_fullgraph_and_training():
    def f(x, w, r):
        y, h = kt.add_rms_norm(kt.rms_norm(x, [64], w, 1e-6), r, w)
        return kt.silu_and_mul(y), h

    args = (torch.randn(8, 64), torch.randn(64), torch.randn(8, 64))
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True)(*args)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch._dynamo.explain(f)(*args).graph_break_count == 0

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), kt.RMSNorm(64), torch.nn.Linear(64, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64), torch.nn.Linear(64, 4))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 64)
    torch.compile(model, fullgraph=True)(x).square().mean().backward()
    ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_errors_are_kiln_errors():
    with pytest.raises(kiln.DeviceError):
        kt.fused_rmsnorm_rope(torch.randn(1, 4, 128), torch.ones(128), torch.ones(4, 64), torch.ones(4, 64))
    with pytest.raises(kiln.ShapeMismatchError):
        kt.add_rms_norm(torch.randn(4, 64), torch.randn(4, 64), torch.randn(32))
    with pytest.raises(kiln.ShapeMismatchError):
        kt.RMSNorm(64)(torch.randn(4, 32))
    with pytest.raises(kiln.InvalidArgumentError):
        kt.act_and_mul(torch.randn(4, 64), "relu")


def _ref_rms_norm_rope(x, w, cos, sin, eps):
    n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
    d = cos.shape[-1]
    n = n.view(*x.shape[:-1], -1, d)
    rotated = torch.cat([-n[..., d // 2:], n[..., :d // 2]], -1)
    return (n * cos[:, None] + rotated * sin[:, None]).view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_backward_on_host_tensors(dtype):
    """The fused RMSNorm + RoPE backward (the rotation's transpose, then the RMSNorm backward) on
    the CPU fallback, eager and through the custom op, against autograd through an fp64 forward."""
    from kiln.torch import _rms_norm_rope_backward_impl

    torch.manual_seed(0)
    b, s, heads, d = 2, 5, 3, 64
    x = torch.randn(b, s, heads * d).to(dtype)
    w = (1 + 0.3 * torch.randn(heads * d)).to(dtype)
    angle = torch.rand(s, d) * 6 - 3  # the halves' tables differ
    cos, sin = angle.cos(), angle.sin()
    dout = torch.randn(b, s, heads * d).to(dtype)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    _ref_rms_norm_rope(x64, w64, cos.double(), sin.double(), 1e-5).backward(dout.double())
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for dx, dw in (_rms_norm_rope_backward_impl(dout, x, w, cos, sin, 1e-5, heads),
                   torch.ops.kiln.rms_norm_rope_backward(dout, x, w, cos, sin, 1e-5, 0)):
        torch.testing.assert_close(dx.double(), x64.grad, **tol)
        torch.testing.assert_close(dw.double(), w64.grad, **tol)
    with pytest.raises(kiln.ShapeMismatchError):
        _rms_norm_rope_backward_impl(dout, x, w, cos[:4], sin[:4], 1e-5, 0)


def _ref_rms_norm(x, w, eps=1e-6):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


def test_torch_tensors_read_in_c():
    """kiln._fast reads torch tensors itself (python/src/_fast.c): parameters, strided rows,
    mixed with NumPy, and the same errors as every other array."""
    from kiln import _fast, ops

    x, w = torch.randn(4, 64), torch.randn(64)
    out = torch.full_like(x, 7.0)
    kiln.rms_norm(x, torch.nn.Parameter(w), out=out)
    torch.testing.assert_close(out, _ref_rms_norm(x, w))
    wide = torch.randn(4, 128)
    kiln.rms_norm(wide[:, 32:96], w, out=out)  # strided rows, an offset data pointer
    torch.testing.assert_close(out, _ref_rms_norm(wide[:, 32:96], w))
    half = torch.randn(3, 2, 64).half()
    h_out = torch.empty_like(half)
    kiln.rms_norm(half, w.half(), out=h_out)
    torch.testing.assert_close(h_out, _ref_rms_norm(half, w.half()), rtol=2e-3, atol=2e-3)
    np = pytest.importorskip("numpy")
    kiln.rms_norm(x, w.numpy(), out=out)
    torch.testing.assert_close(out, _ref_rms_norm(x, w))
    assert _fast.call(ops._READ, None, None, x, w, out) == 0  # CPU tensors: no stream
    out.fill_(7.0)
    with pytest.raises(kiln.UnsupportedDtypeError, match="torch.float64"):
        kiln.rms_norm(x.double(), w, out=out)
    with pytest.raises(kiln.ShapeMismatchError, match="0-d"):
        kiln.rms_norm(torch.tensor(1.0), w, out=out)
    with pytest.raises(kiln.ShapeMismatchError, match="not 9"):
        kiln.rms_norm(torch.zeros((1,) * 8 + (64,)), w, out=torch.zeros((1,) * 8 + (64,)))
    with pytest.raises(kiln.ShapeMismatchError, match="weight must have shape"):
        kiln.rms_norm(x, w[:32], out=out)
    with pytest.raises(kiln.ShapeMismatchError, match="contiguous"):
        kiln.rms_norm(torch.randn(64, 4).t(), w, out=out)  # column-major
    assert torch.equal(out, torch.full_like(x, 7.0))
    assert kiln.rms_norm_backward_workspace_elements(x) == 0


def _act64(g, act):
    # GELU as x * Phi(x) with Phi = erfc(-x / sqrt 2) / 2: exact in the far negative tail, where
    # 1 + erf(x / sqrt 2) cancels to 0 even in fp64 (x < -8.3).
    if act == "silu":
        return torch.nn.functional.silu(g)
    return 0.5 * g * torch.special.erfc(-g * 0.7071067811865476)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_fused_gated_mlp_gradients(act):
    """The gated MLP's backward (recomputed x Wg^T and x Wu^T) against autograd through the fp64
    composition, on random inputs; then one token whose first 8 gate values are about -9, where
    GELU(g) is about -1e-18: the up projection's gradient there is that small and must keep its
    relative accuracy."""
    x = torch.randn(3, 5, 40).to(torch.bfloat16)
    wg = (torch.randn(72, 40) * 0.3).to(torch.bfloat16)
    wg[:8] = -9.0 / 40
    wu = (torch.randn(72, 40) * 0.2).to(torch.bfloat16)

    def grads(xs, dout):
        xa, wga, wua = (t.clone().requires_grad_() for t in (xs, wg, wu))
        torch.ops.kiln.fused_gated_mlp(xa, wga, wua, act).backward(dout)
        xr, wgr, wur = (t.double().requires_grad_() for t in (xs, wg, wu))
        (_act64(xr @ wgr.t(), act) * (xr @ wur.t())).backward(dout.double())
        return (xa.grad, wga.grad, wua.grad), (xr.grad, wgr.grad, wur.grad)

    dout = torch.randn(3, 5, 72).to(torch.bfloat16)
    for name, got, want in zip(("x", "wg", "wu"), *grads(x, dout)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)
    one = torch.ones(1, 40, dtype=torch.bfloat16)  # its gate values: 40 x -9/40, about -9
    (_, _, wu_got), (_, _, wu_want) = grads(one, dout[0, :1])
    tail = wu_want[:8].abs()
    if act == "gelu":
        assert (tail > 0).all() and (tail < 1e-15).all()
    # The backward's g is x Wg^T rounded to bf16 (-9.0 against -8.984 in fp64), which alone moves
    # Phi(g) by 13% this far out; 1 + erf gives 0 here.
    torch.testing.assert_close(wu_got[:8].double(), wu_want[:8], rtol=0.25, atol=0.0, msg="wu rows where g ~ -9")


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_gradients(act):
    """kt.act_and_mul's autograd (from the declared backward) against fp64 PyTorch autograd, on a
    strided input, eager and traced whole (fullgraph, aot_eager)."""
    fn = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
          "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act]
    x = torch.randn(2 * 5, 2 * 24)[::2].detach().requires_grad_(True)
    dy = torch.randn(5, 24)
    x64 = x.detach().double().requires_grad_(True)
    g, u = x64.chunk(2, -1)
    (fn(g) * u).backward(dy.double())
    torch._dynamo.reset()
    for run in (kt.act_and_mul, torch.compile(kt.act_and_mul, fullgraph=True, backend="aot_eager")):
        x.grad = None
        y = run(x, act)
        torch.testing.assert_close(y.double(), (fn(g) * u).detach(), rtol=1e-5, atol=1e-5)
        y.backward(dy)
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


def _rope_ref(x, cos, sin, pos, layout):
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    if layout == "neox":
        a, b = x.chunk(2, -1)
        return torch.cat([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_apply_rope_qk_gradients(layout):
    """kt.apply_rope_qk's autograd (the inverse rotation) against fp64 PyTorch autograd of the same
    rotation, with a gradient for q only (k's is None), eager and traced whole."""
    q = torch.randn(7, 4, 64, requires_grad=True)
    k = torch.randn(7, 2, 64, requires_grad=True)
    angles = torch.rand(32, 32) * 6.28
    cos, sin, pos = angles.cos(), angles.sin(), torch.randint(0, 32, (7,))
    dq, dk = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    ((_rope_ref(q64, cos.double(), sin.double(), pos, layout) * dq.double()).sum() +
     (_rope_ref(k64, cos.double(), sin.double(), pos, layout) * dk.double()).sum()).backward()
    torch._dynamo.reset()
    for run in (kt.apply_rope_qk, torch.compile(kt.apply_rope_qk, fullgraph=True, backend="aot_eager")):
        q.grad = k.grad = None
        qo, ko = run(q, k, cos, sin, pos, layout)
        ((qo * dq).sum() + (ko * dk).sum()).backward()
        torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k.grad.double(), k64.grad, rtol=1e-5, atol=1e-5)
    # Only q's output used: k's gradient is the rotation of zeros.
    q.grad = k.grad = None
    qo, ko = kt.apply_rope_qk(q, k, cos, sin, pos, layout)
    (qo * dq).sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(k.grad) == 0
    with pytest.raises(kiln.InvalidArgumentError, match="no gradient for cos and sin"):
        kt.apply_rope_qk(q, k, cos.requires_grad_(True), sin, pos, layout)


def test_rotary_embedding_module():
    """kt.RotaryEmbedding against the textbook rotate-half formula in float64: its cache, out of
    place with gradients, in place, and extend() for a position past the cache (an error on host
    tensors, which kiln can read; NaN on CUDA, where the kernel cannot report it)."""
    rope = kt.RotaryEmbedding(64, max_positions=16, base=500000.0)
    q, k = torch.randn(5, 4, 64, requires_grad=True), torch.randn(5, 2, 64, requires_grad=True)
    pos = torch.tensor([0, 3, 15, 7, 1])
    inv = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = pos.double()[:, None] * inv[None, :]
    c, s = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]

    def ref(x):
        a, b = x.double().chunk(2, -1)
        return x.double() * c + torch.cat([-b, a], -1) * s

    qo, ko = rope(q, k, pos)
    torch.testing.assert_close(qo.double(), ref(q.detach()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko.double(), ref(k.detach()), rtol=1e-5, atol=1e-5)
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None
    qi, ki = q.detach().clone(), k.detach().clone()
    out = rope(qi, ki, pos, inplace=True)
    assert out[0] is qi and out[1] is ki
    torch.testing.assert_close(qi, qo.detach())
    with pytest.raises(kiln.InvalidArgumentError, match="inplace"):
        rope(q, k, pos, inplace=True)
    far = torch.tensor([0, 3, 16, 7, 1])
    with pytest.raises(kiln.InvalidArgumentError, match="outside"):
        rope(q.detach(), k.detach(), far)
    rope.extend(17)
    assert rope.max_positions == 32 and rope.cos_sin("cpu")[0].shape == (32, 32)
    assert not torch.isnan(rope(q.detach(), k.detach(), far)[0]).any()


def test_add_rms_norm_gradients():
    """kt.add_rms_norm's autograd against fp64 PyTorch autograd: both outputs used (y and the new
    residual h = x + residual), gradients for x, residual and weight, eager and traced whole."""
    x = torch.randn(3, 5, 96, requires_grad=True)
    r = torch.randn(3, 5, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    dy, dh = torch.randn(3, 5, 96), torch.randn(3, 5, 96)
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    h64 = x64 + r64
    y64 = h64 * torch.rsqrt(h64.square().mean(-1, keepdim=True) + 1e-6) * w64
    ((y64 * dy.double()).sum() + (h64 * dh.double()).sum()).backward()
    torch._dynamo.reset()
    for run in (kt.add_rms_norm, torch.compile(kt.add_rms_norm, fullgraph=True, backend="aot_eager")):
        x.grad = r.grad = w.grad = None
        y, h = run(x, r, w, 1e-6)
        torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-5)
        ((y * dy).sum() + (h * dh).sum()).backward()
        for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # Only y used: h's gradient is None and the norm's gradient alone reaches x and residual.
    x.grad = r.grad = None
    y, _ = kt.add_rms_norm(x, r, w, 1e-6)
    (y * dy).sum().backward()
    x64.grad = None
    h64 = x64 + r64
    ((h64 * torch.rsqrt(h64.square().mean(-1, keepdim=True) + 1e-6) * w64) * dy.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)


def test_a_training_block_compiles_whole_with_gradients():
    """The block a user tried (add_rms_norm, the gated MLP, the down projection), compiled with
    fullgraph=True while its parameters require grad, trains: every parameter and input gets the
    same gradient as in eager mode."""
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_weight = torch.nn.Parameter(torch.randn(32))
            self.mlp = kt.FusedGatedMLP(32, 48, dtype=torch.bfloat16)
            self.down = torch.nn.Linear(48, 32, bias=False, dtype=torch.bfloat16)

        def forward(self, x, residual):
            y, h = kt.add_rms_norm(x, residual, self.norm_weight.to(x.dtype), 1e-6)
            return self.down(self.mlp(y)) + h

    block = Block()
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(2, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    grads = []
    for run in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        block.zero_grad()
        x.grad = r.grad = None
        run(x, r).float().square().sum().backward()
        grads.append([t.grad.clone() for t in (x, r, block.norm_weight, block.mlp.gate_weight, block.down.weight)])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_fp8_linear_trains_with_straight_through_gradients(scaling):
    """FP8Linear in training: the forward is the FP8 product (close to x W^T + b), and x, weight and
    bias get the unquantized product's gradients (dy W, dy^T x, sum dy), eager and traced whole.
    f32 inputs get a bf16 product cast back, so the GEMM's gradient is dy rounded to bf16."""
    lin = kt.FP8Linear(256, 128, bias=True, scaling=scaling)
    x = torch.randn(3, 5, 256, requires_grad=True)
    dy = torch.randn(3, 5, 128)
    torch._dynamo.reset()
    for run in (lin, torch.compile(lin, fullgraph=True, backend="aot_eager")):
        lin.zero_grad()
        x.grad = None
        y = run(x)
        want = x.detach() @ lin.weight.detach().t() + lin.bias.detach()
        assert ((y.detach() - want).norm() / want.norm()) < 0.1
        y.backward(dy)
        g = dy.bfloat16().float()
        torch.testing.assert_close(x.grad, g @ lin.weight.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lin.weight.grad, g.reshape(-1, 128).t() @ x.detach().reshape(-1, 256),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lin.bias.grad, dy.reshape(-1, 128).sum(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_swiglu_module_matches_the_llama_mlp(act):
    """kt.SwiGLU with gate and up weights loaded from separate projections equals
    down(act(gate(x)) * up(x)), forward and every parameter's gradient."""
    fn = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act]
    gate, up, down = torch.nn.Linear(32, 80, bias=False), torch.nn.Linear(32, 80, bias=False), torch.nn.Linear(80, 32, bias=False)
    mlp = kt.SwiGLU(32, 80, act)
    mlp.load_gate_up(gate.weight, up.weight)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(down.weight)
    x = torch.randn(3, 7, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mlp(xa), down(fn(gate(xb)) * up(xb))
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mlp.gate_up_proj.weight.grad, torch.cat([gate.weight.grad, up.weight.grad]),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mlp.down_proj.weight.grad, down.weight.grad, rtol=1e-4, atol=1e-5)


def test_declared_ops_take_strided_rows_where_declared(monkeypatch):
    """A declared op marked strided_rows gets a slice of a wider tensor as it is (no copy) and
    computes what it computes on a contiguous copy; an unmarked one (quantize_fp8) gets a copy."""
    base = torch.randn(6, 2 * 48 + 16)
    x = base[:, :96]
    dy = torch.randn(6, 48)
    copies = []
    real = torch.Tensor.contiguous

    def counting(t, *args, **kwargs):
        if not t.is_contiguous():
            copies.append(tuple(t.shape))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    got = kt.act_and_mul_backward(x, dy, "silu")
    assert copies == []
    monkeypatch.undo()
    torch.testing.assert_close(got, kt.act_and_mul_backward(x.contiguous(), dy, "silu"), rtol=0, atol=0)
    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    kt.quantize_fp8(x)
    assert copies == [(6, 96)]


@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_gradients_on_host_tensors(top_k):
    # The CPU fallbacks of every MoE op (routing, permute, grouped GEMM and its weight-gradient form,
    # combine) against fp64 autograd of the same layer written with torch ops.
    tokens, hidden, inter, experts = 13, 16, 8, 4
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts)
    wgu = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 0.3
    wd = torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.3
    leaves = [t.clone().requires_grad_() for t in (x, logits, wgu, wd)]
    out = kt.fused_moe(*leaves, top_k)
    ref_leaves = [t.double().requires_grad_() for t in (x, logits, wgu, wd)]
    rx, rl, rgu, rd = ref_leaves
    p = torch.softmax(rl, -1)
    w, ids = torch.topk(p, top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(rx)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            h = rgu[e] @ rx[t]
            ref[t] = ref[t] + w[t, j] * (rd[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
    dout = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    out.backward(dout)
    ref.backward(dout.double())
    for got, want in zip(leaves, ref_leaves):
        if top_k == 1 and got is leaves[1]:
            continue  # renormalized single expert: weight 1, no router gradient
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 3e-2


def test_moe_custom_ops_opcheck_and_the_module_compiles():
    tokens, hidden, inter, experts, k = 7, 16, 8, 4, 2
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts)
    w, ids = torch.ops.kiln.moe_topk(logits, None, k, "softmax", True, 1, 1, 1.0)
    wgu = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 0.3
    wd = torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.3
    offs = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
    cases = [
        (torch.ops.kiln.moe_topk.default, (logits, None, k, "softmax", True, 1, 1, 1.0)),
        (torch.ops.kiln.moe_permute.default, (x, ids, experts)),
        (torch.ops.kiln.grouped_gemm.default, (torch.randn(10, hidden, dtype=torch.bfloat16), wgu, offs)),
        (torch.ops.kiln.grouped_gemm_dgrad.default, (torch.randn(10, 2 * inter, dtype=torch.bfloat16), wgu, offs)),
        (torch.ops.kiln.grouped_gemm_wgrad.default, (torch.randn(10, 16, dtype=torch.bfloat16),
                                                      torch.randn(10, 8, dtype=torch.bfloat16), offs)),
        (torch.ops.kiln.moe_experts.default, (x.clone().requires_grad_(), w.clone().requires_grad_(), ids,
                                              wgu.clone().requires_grad_(), wd.clone().requires_grad_(), "silu",
                                              experts)),
        (torch.ops.kiln.fused_moe.default, (x, logits, wgu, wd, k, "silu", True)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
    moe = kt.MoE(hidden, inter, num_experts=experts, top_k=k, dtype=torch.bfloat16)
    xx = torch.randn(2, 5, hidden, dtype=torch.bfloat16, requires_grad=True)
    eager = moe(xx)
    compiled = torch.compile(moe, fullgraph=True)(xx)
    assert torch.equal(eager, compiled)
    compiled.float().square().mean().backward()
    assert xx.grad is not None and moe.w_gate_up.grad is not None and moe.router.weight.grad is not None
    # A sigmoid_group module cast to bf16 keeps routing: the bias is read as f32.
    deepseek = kt.MoE(hidden, inter, num_experts=8, top_k=2, scoring="sigmoid_group", n_group=4, topk_group=2,
                      routed_scaling=2.5).bfloat16()
    assert deepseek(xx).shape == xx.shape


def _lora_ref(x, w, a, b, s, bias=None):
    out = torch.nn.functional.linear(x, w) + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * s
    return out if bias is None else out + bias


@pytest.mark.parametrize("rank", [1, 8, 64])
def test_lora_linear_grads_match_fp64(rank):
    """kiln.torch.lora_linear on host tensors (kiln's CPU fallbacks for the forward and the fused
    dgrad) against fp64 autograd of the PEFT form; k and n not multiples of any tile."""
    m, n, k, s = 9, 72, 136, 2.0
    x = torch.randn(m, k, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(n, k) / k ** 0.5).half()
    a = (torch.randn(rank, k) / k ** 0.5).half().requires_grad_()
    b = (torch.randn(n, rank) / rank ** 0.5).half().requires_grad_()
    bias = torch.randn(n, dtype=torch.float16, requires_grad=True)
    out = kt.lora_linear(x, w, a, b, bias, s)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (x, a, b, bias)]
    ref = _lora_ref(leaves[0], w.double(), leaves[1], leaves[2], s, leaves[3])
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, rtol=5e-3, atol=5e-3)
    # Relative L2 per gradient: the f16 intermediates (dy B, x A^T) the PEFT form also rounds make
    # single elements near zero land 1e-2 away, while the whole tensor is within f16 accuracy.
    for name, got, want in zip(("x", "a", "b", "bias"), (x.grad, a.grad, b.grad, bias.grad), leaves):
        err = ((got.double() - want.grad).norm() / want.grad.norm()).item()
        assert err < 5e-3, f"d{name}: relative L2 error {err:.2e}"


def test_lora_sliced_opcheck():
    x = torch.randn(5, 64, dtype=torch.float16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.float16) / 8
    a = (torch.randn(3 * 8, 64, dtype=torch.float16) / 8).requires_grad_()
    b = (torch.randn(48, 8, dtype=torch.float16) / 4).requires_grad_()
    torch.library.opcheck(torch.ops.kiln.lora_sliced.default, (x, w, a, b, None, 0.5, 3, 24, 40),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_lora_mlp_and_qkv_train_on_host():
    """LoRA_MLP and LoRA_QKV forward + backward on host tensors against the modules written in
    fp64 eager, and the compiled LoRA_MLP (fullgraph) giving the same output."""
    mlp = kt.LoRA_MLP(64, 96, r=8, alpha=16, activation="gelu", dtype=torch.float16)
    for p in (mlp.lora_B_gate, mlp.lora_B_up, mlp.lora_B_down):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 64, dtype=torch.float16, requires_grad=True)
    out = mlp(x)
    out.float().sum().backward()
    ps = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters() if p.requires_grad}
    xd = x.detach().double().requires_grad_()
    g, u = mlp.gate_up_weight.double()[:96], mlp.gate_up_weight.double()[96:]
    h = torch.nn.functional.gelu(_lora_ref(xd, g, ps["lora_A_gate"], ps["lora_B_gate"], mlp.scale)) * \
        _lora_ref(xd, u, ps["lora_A_up"], ps["lora_B_up"], mlp.scale)
    ref = _lora_ref(h, mlp.down_weight.double(), ps["lora_A_down"], ps["lora_B_down"], mlp.scale)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=2e-2, atol=2e-2)
    for n, p in mlp.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.double(), ps[n].grad, rtol=2e-2, atol=2e-2)
    compiled = torch.compile(mlp, fullgraph=True)
    torch.testing.assert_close(compiled(x), out)

    qkv = kt.LoRA_QKV(64, 64, 16, r=4, bias=True, dtype=torch.float16)
    for p in qkv.lora_B:
        torch.nn.init.normal_(p, std=0.1)
    q, k, v = qkv(x)
    assert q.shape == (2, 5, 64) and k.shape == (2, 5, 16) and v.shape == (2, 5, 16)
    (q.float().sum() + 2 * k.float().sum() + 3 * v.float().sum()).backward()
    assert all(p.grad is not None for p in qkv.lora_A) and all(p.grad is not None for p in qkv.lora_B)
