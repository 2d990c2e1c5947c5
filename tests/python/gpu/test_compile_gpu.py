"""kiln.torch under torch.compile(fullgraph=True) (no graph breaks), with backward, and in CUDA
graphs (captured by hand and through mode="reduce-overhead")."""
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln.torch as kt  # noqa: E402


def block(x, residual, w_norm, w2, cos, sin, q, k, rope_cos, rope_sin, pos, gate_up):
    h = kt.rms_norm(x, [x.shape[-1]], w_norm, 1e-6)
    y, res = kt.add_rms_norm(h, residual, w2, 1e-6)
    r = kt.fused_rmsnorm_rope(y, w2, cos, sin, 1e-6)
    qo, ko = kt.apply_rope_qk(q, k, rope_cos, rope_sin, pos, "neox")
    a = kt.act_and_mul(gate_up, "silu")
    return r, res, qo, ko, a


def inputs(dtype=torch.bfloat16):
    b, s, hidden, head_dim = 2, 64, 2048, 128
    dev = "cuda"
    return (torch.randn(b, s, hidden, device=dev, dtype=dtype), torch.randn(b, s, hidden, device=dev, dtype=dtype),
            torch.randn(hidden, device=dev, dtype=dtype), torch.randn(hidden, device=dev, dtype=dtype),
            torch.randn(s, head_dim, device=dev, dtype=dtype), torch.randn(s, head_dim, device=dev, dtype=dtype),
            torch.randn(b * s, 16, head_dim, device=dev, dtype=dtype),
            torch.randn(b * s, 4, head_dim, device=dev, dtype=dtype),
            torch.rand(256, head_dim // 2, device=dev), torch.rand(256, head_dim // 2, device=dev),
            torch.randint(0, 256, (b * s,), device=dev), torch.randn(b * s, 2 * 2816, device=dev, dtype=dtype))


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    args = inputs()
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True)(*args)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_break_count == 0
    ops = " ".join(str(n.target) for g in explanation.graphs for n in g.graph.nodes)
    for name in ("kiln.rms_norm", "kiln.add_rms_norm", "kiln.rms_norm_rope", "kiln.apply_rope_qk", "kiln.act_and_mul"):
        assert name in ops, ops


def test_compile_training_step_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), kt.RMSNorm(512), torch.nn.Linear(512, 8)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.RMSNorm(512), torch.nn.Linear(512, 8)).cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(64, 512, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_cuda_graph_capture_and_replay():
    mod = kt.RMSNorm(4096, device="cuda", dtype=torch.float16)
    rope = kt.FusedRMSNormRoPE(4096, 128).to("cuda", torch.float16)
    static_x = torch.randn(8, 16, 4096, device="cuda", dtype=torch.float16)
    cos = torch.randn(16, 128, device="cuda", dtype=torch.float16)
    sin = torch.randn(16, 128, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: resolves and loads the kernels outside the capture
        for _ in range(3):
            rope(mod(static_x), cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = rope(mod(static_x), cos, sin)
    for _ in range(3):
        new_x = torch.randn_like(static_x)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_y, rope(mod(new_x), cos, sin), rtol=0, atol=0)


def test_cuda_graph_capture_of_backward():
    mod = kt.RMSNorm(2048, device="cuda")
    x = torch.randn(32, 2048, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            mod(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    mod.weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod(x).sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    xr = x.detach().clone().requires_grad_()
    ref = torch.nn.RMSNorm(2048, device="cuda")
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


def test_compile_reduce_overhead_uses_cuda_graphs():
    torch._dynamo.reset()
    mod = kt.RMSNorm(1024, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda t: kt.silu_and_mul(mod(t)), mode="reduce-overhead", fullgraph=True)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            out = fn(x)
        expected = kt.silu_and_mul(mod(x))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_opcheck_every_op_on_cuda():
    q = torch.randn(6, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(6, 2, 64, device="cuda", dtype=torch.float16)
    cos, sin = torch.rand(16, 32, device="cuda"), torch.rand(16, 32, device="cuda")
    pos = torch.randint(0, 16, (6,), device="cuda")
    x = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    rc, rs = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    cases = [
        (torch.ops.kiln.rms_norm.default, (x, w, 1e-6)),
        (torch.ops.kiln.rms_norm_fwd.default, (x.float().requires_grad_(), w.float().requires_grad_(), 1e-6)),
        (torch.ops.kiln.rms_norm_backward.default, (x, x, w, torch.rand(2, 8, device="cuda") + 0.5)),
        (torch.ops.kiln.add_rms_norm.default, (x, x.clone(), w, 1e-6)),
        (torch.ops.kiln.add_rms_norm_backward.default, (x, x.clone(), x.clone(), w, 1e-6)),
        (torch.ops.kiln.add_rms_norm_backward.default, (x, None, x.clone(), w, 1e-6)),
        (torch.ops.kiln.act_and_mul.default, (x, "silu")),
        (torch.ops.kiln.apply_rope_qk.default, (q, k, cos, sin, pos, "neox")),
        (torch.ops.kiln.rms_norm_rope.default, (x.float().requires_grad_(), w.float().requires_grad_(), rc, rs,
                                                1e-6, 0)),
        (torch.ops.kiln.rms_norm_rope_backward.default, (x, x.clone(), w, rc, rs, 1e-6, 4)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
