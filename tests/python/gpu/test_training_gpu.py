"""Training on CUDA: every kiln.torch op with a backward against PyTorch's autograd of the same
function in fp64 (f32, f16 and bf16 inputs; odd shapes; strided rows), the training block a user
compiled with fullgraph=True while its parameters required grad, and a CUDA-graph capture of a
whole forward + backward step of a decoder-style block."""
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

F = torch.nn.functional
DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative L2 error of outputs and gradients against fp64: f32 arithmetic, and the rounding of one
# 16-bit result (f16 keeps 11 bits, bf16 8).
REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def strided(rows, cols, dtype, pad=64):
    """A [rows, cols] view with a row stride of cols + pad (a slice of a wider tensor)."""
    return torch.randn(rows, cols + pad, device=DEV, dtype=dtype)[:, :cols]


def leaf(t):
    return t.detach().requires_grad_(True)


def check_against_fp64(fn, ref, inputs, dtype, label):
    """fn(*inputs) and its gradients for random upstream gradients against ref on fp64 copies of the
    same inputs (the strides of the inputs kept: strided views stay strided for fn)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, inputs, grads)
    ref_in = [leaf(t.double()) for t in inputs]
    want_outs = ref(*ref_in)
    want_outs = want_outs if isinstance(want_outs, tuple) else (want_outs,)
    want = torch.autograd.grad(want_outs, ref_in, [g.double() for g in grads])
    bound = REL[dtype]
    for i, (o, w) in enumerate(zip(outs, want_outs)):
        assert o.dtype == dtype and o.shape == w.shape, (label, i)
        e = rel_err(o, w)
        assert e < bound, f"{label}: output {i} relative error {e:.3g} >= {bound}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and g.shape == w.shape, (label, i)
        assert torch.isfinite(g).all(), (label, i)
        e = rel_err(g, w)
        assert e < bound, f"{label}: gradient of input {i} relative error {e:.3g} >= {bound}"


def ref_rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,pad", [(77, 4096, 64), (3, 5120, 0), (1000, 2880, 32), (1, 896, 8)])
def test_rms_norm_gradients(dtype, rows, cols, pad):
    x, w = leaf(strided(rows, cols, dtype, pad)), leaf(torch.randn(cols, device=DEV, dtype=dtype))
    check_against_fp64(lambda x, w: kt.rms_norm(x, [cols], w, 1e-6), ref_rms, [x, w], dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
# 16384 with pad 8: in f16 and bf16 the backward's dh takes the clustered bulk-copy kernel on sm_90.
@pytest.mark.parametrize("rows,cols,pad", [(77, 4096, 64), (1000, 2880, 0), (5, 7168, 16), (9, 16384, 8)])
def test_add_rms_norm_gradients(dtype, rows, cols, pad):
    x, r = leaf(strided(rows, cols, dtype, pad)), leaf(strided(rows, cols, dtype, pad))
    w = leaf(torch.randn(cols, device=DEV, dtype=dtype))

    def ref(x, r, w):
        h = x + r
        return ref_rms(h, w), h

    check_against_fp64(lambda x, r, w: kt.add_rms_norm(x, r, w, 1e-6), ref, [x, r, w], dtype, "add_rms_norm")


def test_add_rms_norm_gradient_of_one_output_only():
    """Only the normed output used (the residual stream dropped), and only the residual used."""
    x, r = leaf(torch.randn(33, 1024, device=DEV)), leaf(torch.randn(33, 1024, device=DEV))
    w = leaf(torch.randn(1024, device=DEV))
    for pick in (0, 1):
        out = kt.add_rms_norm(x, r, w, 1e-6)[pick]
        dy = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, r, w], dy, allow_unused=True)
        xr, rr, wr = (leaf(t.double()) for t in (x, r, w))
        h = xr + rr
        want = torch.autograd.grad((ref_rms(h, wr), h)[pick], [xr, rr, wr], dy.double(), allow_unused=True)
        for g, e in zip(got, want):
            if e is None:
                assert g is None or g.abs().max() == 0
            else:
                assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_gradients_odd_sizes(dtype, act):
    fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    x = leaf(strided(1001, 2 * 1000, dtype, 16))

    def ref(x):
        g, u = x.chunk(2, -1)
        return fn(g) * u

    check_against_fp64(lambda x: kt.act_and_mul(x, act), ref, [x], dtype, f"act_and_mul {act}")


def ref_rope(x, cos, sin, pos, layout):
    c, s = cos[pos][:, None, :].double(), sin[pos][:, None, :].double()
    if layout == "neox":
        a, b = x.chunk(2, -1)
        return torch.cat([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(77, 14, 2, 64), (1000, 32, 8, 128), (3, 16, 8, 256)])
def test_apply_rope_qk_gradients_on_a_fused_qkv_view(dtype, layout, tokens, heads, kv_heads, head_dim):
    """q and k are slices of a fused QKV projection (strided tokens), positions are shuffled."""
    rope = kt.RotaryEmbedding(head_dim, max_positions=2048, layout=layout)
    cos, sin = rope.cos_sin(DEV)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEV, dtype=dtype)
    q, k = qkv[:, :heads].detach().requires_grad_(), qkv[:, heads:heads + kv_heads].detach().requires_grad_()
    pos = torch.randperm(2048, device=DEV)[:tokens]
    check_against_fp64(lambda q, k: rope(q, k, pos),
                       lambda q, k: (ref_rope(q, cos, sin, pos, layout), ref_rope(k, cos, sin, pos, layout)),
                       [q, k], dtype, f"rope {layout}")


def test_rotary_embedding_inplace_and_extend():
    rope = kt.RotaryEmbedding(128, max_positions=100)
    q, k = torch.randn(50, 8, 128, device=DEV, dtype=torch.bfloat16), torch.randn(50, 2, 128, device=DEV,
                                                                                  dtype=torch.bfloat16)
    rope.extend(3000)
    assert rope.max_positions == 4096 and rope.cos_sin(DEV)[0].shape == (4096, 64)
    pos = torch.randint(0, 4096, (50,), device=DEV)
    q_out, k_out = rope(q, k, pos)
    q2, k2 = q.clone(), k.clone()
    qi, ki = rope(q2, k2, pos, inplace=True)
    assert qi.data_ptr() == q2.data_ptr() and ki.data_ptr() == k2.data_ptr()
    torch.testing.assert_close(qi, q_out, rtol=0, atol=0)
    torch.testing.assert_close(ki, k_out, rtol=0, atol=0)
    with pytest.raises(kiln.InvalidArgumentError):
        rope(q.clone().requires_grad_(), k, pos, inplace=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,heads,head_dim", [(4, 77, 28, 128), (1, 16, 8, 64)])
def test_fused_rmsnorm_rope_gradients(dtype, b, s, heads, head_dim):
    h = heads * head_dim
    x, w = leaf(torch.randn(b, s, h, device=DEV, dtype=dtype)), leaf(torch.randn(h, device=DEV, dtype=dtype))
    ang = torch.rand(s, head_dim // 2, device=DEV) * 6.0
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def ref(x, w):
        n = ref_rms(x, w).reshape(b, s, heads, head_dim)
        a, bb = n.chunk(2, -1)
        c, sn = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
        return (n * c + torch.cat([-bb, a], -1) * sn).reshape(b, s, h)

    check_against_fp64(lambda x, w: kt.fused_rmsnorm_rope(x, w, cos, sin, 1e-6, heads), ref, [x, w], dtype,
                       "rms_norm_rope")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_gradients(dtype):
    x = leaf(strided(333, 2880, dtype, 32))
    w, bias = leaf(torch.randn(2880, device=DEV, dtype=dtype)), leaf(torch.randn(2880, device=DEV, dtype=dtype))
    check_against_fp64(lambda x, w, bias: kt.layer_norm(x, w, bias, 1e-5),
                       lambda x, w, bias: F.layer_norm(x, (2880,), w, bias, 1e-5), [x, w, bias], dtype, "layer_norm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_fused_gated_mlp_gradients(dtype, act):
    fn = {"silu": F.silu, "gelu": F.gelu}[act]
    x = leaf(torch.randn(77, 1000, device=DEV, dtype=dtype))
    wg, wu = (leaf(torch.randn(1408, 1000, device=DEV, dtype=dtype) * 0.03) for _ in range(2))
    # The products round to 16 bits before the activation: the bound is the 16-bit one, twice.
    REL_GEMM = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
    outs = kt.fused_gated_mlp(x, wg, wu, act)
    dy = torch.randn_like(outs)
    got = torch.autograd.grad(outs, [x, wg, wu], dy)
    xr, gr, ur = (leaf(t.double()) for t in (x, wg, wu))
    ref = fn(xr @ gr.t()) * (xr @ ur.t())
    want = torch.autograd.grad(ref, [xr, gr, ur], dy.double())
    assert rel_err(outs, ref) < REL_GEMM[dtype]
    for g, e in zip(got, want):
        assert rel_err(g, e) < REL_GEMM[dtype]


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_fp8_linear_backward_on_cuda(scaling):
    """FP8Linear's straight-through backward: dx = dy W, dW = dy^T x, db = sum dy, in bf16."""
    lin = kt.FP8Linear(4160, 1000, bias=True, scaling=scaling, device=DEV, dtype=torch.bfloat16)
    x = leaf(torch.randn(3, 77, 4160, device=DEV, dtype=torch.bfloat16))
    y = lin(x)
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    assert rel_err(y, ref) < 6e-2  # e4m3 operands
    dy = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, [x, lin.weight, lin.bias], dy)
    d = dy.double().reshape(-1, 1000)
    assert rel_err(dx, (d @ lin.weight.double()).reshape(x.shape)) < 1.5e-2
    assert rel_err(dw, d.t() @ x.double().reshape(-1, 4160)) < 1.5e-2
    assert rel_err(db, d.sum(0)) < 1.5e-2


class DecoderBlock(torch.nn.Module):
    """A Llama-style block without attention: RMSNorm, QKV projection and RoPE, then the residual
    add + RMSNorm and the SwiGLU MLP, all through kiln.torch."""

    def __init__(self, hidden=1024, heads=8, kv_heads=2, head_dim=128, inter=2816, dtype=torch.bfloat16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = kt.RMSNorm(hidden, eps=1e-6, device=DEV, dtype=dtype)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False, device=DEV, dtype=dtype)
        self.o = torch.nn.Linear(heads * head_dim, hidden, bias=False, device=DEV, dtype=dtype)
        self.rope = kt.RotaryEmbedding(head_dim, max_positions=4096)
        self.norm2_weight = torch.nn.Parameter(torch.ones(hidden, device=DEV, dtype=dtype))
        self.mlp = kt.SwiGLU(hidden, inter, device=DEV, dtype=dtype)

    def forward(self, x, pos):
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(t, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k = self.rope(qkv[:, :self.heads], qkv[:, self.heads:self.heads + self.kv_heads], pos)
        v = qkv[:, self.heads + self.kv_heads:]
        # A stand-in for attention that uses q, k and v: each head of q scaled by its group's k . v.
        kv = (k * v).sum(-1, keepdim=True).repeat_interleave(self.heads // self.kv_heads, 1)
        attn = self.o((q * kv).reshape(t, -1))
        y, h = kt.add_rms_norm(attn, x, self.norm2_weight, 1e-6)
        return self.mlp(y) + h


def test_a_training_block_compiles_fullgraph_with_gradients_on_cuda():
    """The failure a user met: add_rms_norm and FusedGatedMLP in a block compiled with
    fullgraph=True while its parameters require grad; plus the decoder block's every op."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = DecoderBlock()
    gated = kt.FusedGatedMLP(1024, 1408, device=DEV, dtype=torch.bfloat16)

    def step(x, pos):
        y = block(x, pos)
        y2, _ = kt.add_rms_norm(y, x, block.norm2_weight, 1e-6)
        return gated(y2)

    x = leaf(torch.randn(77, 1024, device=DEV, dtype=torch.bfloat16))
    pos = torch.arange(77, device=DEV)
    params = [x] + list(block.parameters()) + list(gated.parameters())
    results = []
    for run in (step, torch.compile(step, fullgraph=True)):
        out = run(x, pos)
        results.append((out, torch.autograd.grad(out, params, torch.ones_like(out) / 77)))
    (eager, eager_g), (compiled, compiled_g) = results
    assert rel_err(compiled, eager) < 1e-2
    for a, b in zip(compiled_g, eager_g):
        assert rel_err(a, b) < 2e-2
    graph_ops = torch._dynamo.explain(step)(x, pos)
    assert graph_ops.graph_break_count == 0


def test_cuda_graph_capture_of_a_whole_training_step():
    """Forward and backward of the decoder block captured once in a CUDA graph and replayed on new
    inputs: the gradients equal an eager step's on the same inputs."""
    torch.manual_seed(1)
    block = DecoderBlock()
    params = list(block.parameters())
    static_x = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(256, device=DEV)

    def step():
        out = block(static_x, pos)
        return torch.autograd.grad(out, [static_x] + params, static_dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels resolved and loaded, cuBLAS handles created
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()
    for _ in range(3):
        new_x, new_dy = torch.randn_like(static_x), torch.randn_like(static_dy)
        with torch.no_grad():
            static_x.copy_(new_x)
        static_dy.copy_(new_dy)
        graph.replay()
        torch.cuda.synchronize()
        x = leaf(new_x)
        want = torch.autograd.grad(block(x, pos), [x] + params, new_dy)
        for g, w in zip(static_grads, want):
            assert torch.isfinite(g).all()
            assert rel_err(g, w) < 1e-3
