"""The MoE ops from Python on CUDA tensors: routing against torch.topk, the grouped GEMM against
torch._grouped_mm and an fp64 loop over experts (experts without tokens, one expert taking every
token, Zipf-skewed routing), and kiln.torch.fused_moe / kt.MoE forward and backward against fp64
autograd of an eager layer (top-k 1, 2 and 8, softmax and sigmoid_group scoring), and under
torch.compile(fullgraph=True)."""
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kiln.torch as kt  # noqa: E402

F = torch.nn.functional
DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def route_counts(experts, rows, pattern):
    if pattern == "balanced":
        c = [rows // experts] * experts
    elif pattern == "zipf":
        h = sum(1.0 / (e + 1) for e in range(experts))
        c = [int(rows / h / (e + 1)) for e in range(experts)]
    elif pattern == "one":
        c = [0] * experts
        c[experts // 2] = rows
    else:  # every other expert empty
        c = [rows // (experts // 2) if e % 2 == 0 else 0 for e in range(experts)]
    c[0] += rows - sum(c)
    return c


@pytest.mark.parametrize("pattern", ["balanced", "zipf", "one", "sparse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_gemm_matches_an_fp64_loop_and_grouped_mm(pattern, dtype):
    experts, rows, n, k = 8, 1003, 392, 264
    counts = route_counts(experts, rows, pattern)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    w = torch.randn(experts, n, k, device=DEV, dtype=dtype) * k ** -0.5
    out = kt.grouped_gemm(x, w, offs)
    want = torch.empty(rows, n, device=DEV, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want[start:start + c] = x[start:start + c].double() @ w[e].double().t()
        start += c
    assert rel(out, want) < 1e-2
    if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        try:
            ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        except RuntimeError as e:  # needs sm_90 and a recent torch
            pytest.skip(f"torch._grouped_mm unavailable: {e}")
        assert rel(out, ref) < 1e-2


def test_grouped_gemm_masked_and_wgrad():
    experts, max_t, n, k = 6, 40, 136, 72
    counts = torch.tensor([0, 40, 3, 17, 0, 1], device=DEV, dtype=torch.int32)
    a = torch.randn(experts, max_t, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
    out = kt.grouped_gemm_masked(a, w, counts)
    for e in range(experts):
        c = int(counts[e])
        if c:
            assert rel(out[e, :c], a[e, :c].double() @ w[e].double().t()) < 1e-2
    offs = counts.cumsum(0).to(torch.int32)
    rows = int(offs[-1])
    dy = torch.randn(rows, n, device=DEV, dtype=torch.bfloat16)
    xx = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    dw = kt.grouped_gemm_wgrad(dy, xx, offs)
    dx = kt.grouped_gemm_dgrad(dy, w, offs)  # w [experts, n, k] read as [experts, k', n']: dy_e w[e]
    start = 0
    for e in range(experts):
        c = int(counts[e])
        want = dy[start:start + c].double().t() @ xx[start:start + c].double()
        if c:
            assert rel(dw[e], want) < 1e-2
            assert rel(dx[start:start + c], dy[start:start + c].double() @ w[e].double()) < 1e-2
        else:
            assert torch.count_nonzero(dw[e]) == 0
        start += c


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_topk_and_permute(top_k):
    tokens, experts, hidden = 333, 16, 64
    logits = torch.randn(tokens, experts, device=DEV)
    weights, ids = kt.moe_topk(logits, None, top_k, "softmax", True)
    p = torch.softmax(logits.double(), -1)
    want_w, want_ids = torch.topk(p, top_k, -1)
    assert torch.equal(ids.long(), want_ids)
    assert torch.allclose(weights.double(), want_w / want_w.sum(-1, keepdim=True), atol=1e-6)
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    xs, offsets, row_of, src_of = kt.moe_permute(x, ids, experts)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(src_of.long(), order)
    assert torch.equal(xs, x[order // top_k])
    assert torch.equal(offsets[1:].long(), torch.bincount(ids.reshape(-1), minlength=experts).cumsum(0))
    back = kt.moe_combine(xs, row_of, weights)
    want = (x.float().unsqueeze(1) * weights.unsqueeze(-1)).sum(1)
    assert rel(back, want) < 1e-2


def eager_layer(x, logits, wgu, wd, top_k, scoring="softmax", bias=None, n_group=1, topk_group=1, scale=1.0):
    """The reference layer in x's dtype (use float64 inputs for an fp64 reference): the same
    routing rules, experts as plain matmuls."""
    inter = wd.shape[2]
    if scoring == "softmax":
        s = torch.softmax(logits, -1)
        _, ids = torch.topk(s, top_k, -1)
    else:
        s = torch.sigmoid(logits)
        choice = s + bias
        g = choice.reshape(choice.shape[0], n_group, -1).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, -1).indices, 1.0)
        mask = keep.repeat_interleave(choice.shape[1] // n_group, 1)
        _, ids = torch.topk(choice.masked_fill(mask == 0, float("-inf")), top_k, -1)
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * (scale if scoring != "softmax" else 1.0)
    out = torch.zeros_like(x)
    for j in range(top_k):
        for e in ids[:, j].unique().tolist():
            sel = ids[:, j] == e
            h = x[sel] @ wgu[e].t()
            a = F.silu(h[:, :inter]) * h[:, inter:]
            out[sel] += w[sel, j:j + 1] * (a @ wd[e].t())
    return out


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid_group"])
def test_fused_moe_forward_and_backward_against_fp64(top_k, scoring):
    torch.manual_seed(top_k)
    tokens, hidden, inter, experts = 203, 128, 72, 16
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device=DEV, dtype=torch.float32)
    if scoring == "sigmoid_group":
        logits[:, 0] += 4.0  # skew: expert 0 wins most tokens
    wgu = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=torch.bfloat16) * hidden ** -0.5
    wd = torch.randn(experts, hidden, inter, device=DEV, dtype=torch.bfloat16) * inter ** -0.5
    bias = torch.randn(experts, device=DEV) * 0.01 if scoring == "sigmoid_group" else None
    group = dict(n_group=4, topk_group=2, scale=2.5) if scoring == "sigmoid_group" else {}
    leaves = [t.clone().requires_grad_() for t in (x, logits, wgu, wd)]
    out = kt.fused_moe(*leaves, top_k, "silu", True, scoring, bias, group.get("n_group", 1),
                       group.get("topk_group", 1), group.get("scale", 1.0))
    ref_leaves = [t.double().requires_grad_() for t in (x, logits, wgu, wd)]
    ref = eager_layer(*ref_leaves, top_k, scoring, None if bias is None else bias.double(), **group)
    assert rel(out, ref) < 2e-2
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    for name, got, want in zip(("x", "logits", "w_gate_up", "w_down"), leaves, ref_leaves):
        if top_k == 1 and name == "logits":
            # One expert, renormalized: the weight is exactly 1 and the router gets no gradient.
            assert got.grad is None or got.grad.abs().max() < 1e-4
            continue
        assert rel(got.grad, want.grad) < 3e-2, name


def test_moe_module_compiles_whole_and_trains():
    moe = kt.MoE(128, 64, num_experts=8, top_k=2, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2, 50, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=True)(x)
    assert (compiled.float() - eager.float()).norm() <= 1e-2 * eager.float().norm()
    compiled.float().square().mean().backward()
    assert x.grad is not None and moe.w_gate_up.grad is not None and moe.w_down.grad is not None
    assert moe.router.weight.grad is not None


@pytest.mark.parametrize("pattern", ["balanced", "zipf", "one"])
def test_grouped_gemm_fp8_rowwise_matches_the_dequantized_product(pattern):
    experts, rows, n, k = 8, 777, 264, 272
    counts = route_counts(experts, rows, pattern)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    a8 = (torch.randn(rows, k, device=DEV) * 2).to(torch.float8_e4m3fn)
    w8 = (torch.randn(experts, n, k, device=DEV) * 0.5).to(torch.float8_e4m3fn)
    sa = torch.rand(rows, device=DEV) + 0.5
    sb = (torch.rand(experts, n, device=DEV) + 0.5) / 16
    out = kt.grouped_gemm_fp8(a8.view(torch.uint8), w8.view(torch.uint8), offs, sa, sb, "bf16")
    want = torch.empty(rows, n, device=DEV, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want[start:start + c] = (a8[start:start + c].double() @ w8[e].double().t()) * sa[start:start + c, None].double() \
            * sb[e].double()
        start += c
    assert rel(out, want) < 1e-2
