"""Attention through kiln.torch (needs PyTorch; on CUDA when there is a GPU): flash_attn_func,
flash_attn_varlen_func and scaled_dot_product_attention against torch's own math
(F.scaled_dot_product_attention in fp64 with explicit boolean masks), their gradients against fp64
autograd of the same math, the typed errors, the backward's deterministic flag reaching the
backward op, and tracing under torch.compile(fullgraph=True) through the fake implementations,
gradients included."""
import math

import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")
import torch.nn.functional as F  # noqa: E402

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

# The CPU fallback in f32 and bf16; CUDA in bf16 and f16 (head dims the kernels take).
CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
if torch.cuda.is_available():
    CASES += [("cuda", torch.bfloat16), ("cuda", torch.float16)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def visible(lq, lk, causal, window):
    """[lq, lk] bool: query i sees key j (FlashAttention's end-aligned causal and window)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    m = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        m &= j <= i + right
    if left >= 0:
        m &= j >= i - left
    return m


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """out [b, lq, h, dv] and lse [b, h, lq] in fp64 from q [b, lq, h, d], k, v [b, lk, hk, d]."""
    q64, k64, v64 = (t.detach().double().cpu().transpose(1, 2) for t in (q, k, v))
    rep = q64.shape[1] // k64.shape[1]
    k64, v64 = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = visible(q.shape[1], k.shape[1], causal, window)
    s = q64 @ k64.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    seen = mask.any(-1)
    if softcap > 0:
        # SDPA takes the softcapped scores as a float mask on zero queries.
        out = F.scaled_dot_product_attention(torch.zeros_like(q64), k64, v64, attn_mask=s, scale=1.0)
    else:
        out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale)
    out = torch.where(seen[:, None], out, 0.0)  # rows that see no key: zeros (SDPA gives NaN)
    return out.transpose(1, 2), lse


def rel(got, want):
    got = got.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def close_lse(got, want):
    got = got.double().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    assert torch.all(got[~fin] == want[~fin])
    assert float((got[fin] - want[fin]).abs().max()) < 1e-3 if bool(fin.any()) else True


def randn(*shape, device, dtype, g):
    return torch.randn(*shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("causal,window,softcap,lq,lk,heads,kv_heads,d,dv", [
    (False, (-1, -1), 0.0, 65, 65, 4, 4, 64, 64),
    (True, (-1, -1), 0.0, 65, 65, 4, 2, 64, 64),
    (True, (-1, -1), 0.0, 100, 40, 8, 1, 128, 128),   # lq > lk: rows that see no key
    (True, (-1, -1), 0.0, 20, 150, 4, 4, 128, 128),   # lq < lk: the diagonal at the end
    (False, (16, 4), 0.0, 90, 90, 4, 1, 64, 64),
    (True, (32, -1), 30.0, 90, 120, 4, 2, 128, 128),
    (False, (-1, -1), 5.0, 33, 70, 2, 2, 192, 128),  # head_dim_v != head_dim
])
def test_flash_attn_func_matches_fp64(device, dtype, causal, window, softcap, lq, lk, heads, kv_heads, d, dv):
    g = torch.Generator().manual_seed(0)
    q = randn(2, lq, heads, d, device=device, dtype=dtype, g=g)
    k = randn(2, lk, kv_heads, d, device=device, dtype=dtype, g=g)
    v = randn(2, lk, kv_heads, dv, device=device, dtype=dtype, g=g)
    out, lse = kt.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, return_attn_probs=True)
    want, want_lse = reference(q, k, v, causal, window, softcap)
    assert out.shape == (2, lq, heads, dv) and out.dtype == dtype and lse.shape == (2, heads, lq)
    assert rel(out, want) < TOL[dtype]
    close_lse(lse, want_lse)
    assert torch.equal(kt.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap), out)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_matches_each_sequence(device, dtype, causal):
    g = torch.Generator().manual_seed(1)
    lens_q, lens_k = [7, 130, 0, 64], [30, 100, 9, 64]
    heads, kv_heads, d = 4, 2, 64
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = randn(sum(lens_q), heads, d, device=device, dtype=dtype, g=g)
    k = randn(sum(lens_k), kv_heads, d, device=device, dtype=dtype, g=g)
    v = randn(sum(lens_k), kv_heads, d, device=device, dtype=dtype, g=g)
    out, lse = kt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         return_attn_probs=True)
    assert out.shape == (sum(lens_q), heads, d) and lse.shape == (heads, sum(lens_q))
    for b in range(len(lens_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            continue
        want, want_lse = reference(q[None, qs], k[None, ks], v[None, ks], causal)
        assert rel(out[qs][None], want) < TOL[dtype], b
        close_lse(lse[:, qs][None], want_lse)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("is_causal,length,keys,heads,kv_heads", [
    (False, 40, 70, 4, 4), (True, 64, 64, 8, 2), (True, 90, 50, 4, 4)])
def test_sdpa_matches_torch(device, dtype, is_causal, length, keys, heads, kv_heads):
    g = torch.Generator().manual_seed(2)
    q = randn(2, heads, length, 64, device=device, dtype=dtype, g=g)
    k = randn(2, kv_heads, keys, 64, device=device, dtype=dtype, g=g)
    v = randn(2, kv_heads, keys, 64, device=device, dtype=dtype, g=g)
    got = kt.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.2, enable_gqa=kv_heads != heads)
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q.double().cpu(), k.double().cpu().repeat_interleave(rep, 1),
                                          v.double().cpu().repeat_interleave(rep, 1), is_causal=is_causal, scale=0.2)
    assert got.shape == (2, heads, length, 64)
    assert rel(got, want) < TOL[dtype]


def test_unsupported_arguments_are_typed_errors():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(kiln.InvalidArgumentError, match="dropout"):
        kt.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(kiln.InvalidArgumentError, match="alibi"):
        kt.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(kiln.InvalidArgumentError, match="window"):
        kt.flash_attn_func(q, q, q, window_size=(-2, -1))
    with pytest.raises(kiln.InvalidArgumentError, match="softcap"):
        kt.flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(kiln.ShapeMismatchError):
        kt.flash_attn_func(q, torch.randn(1, 8, 3, 64), torch.randn(1, 8, 3, 64))
    with pytest.raises(kiln.UnsupportedDtypeError):
        kt.flash_attn_func(q, q.bfloat16(), q)
    s = q.transpose(1, 2)
    with pytest.raises(kiln.InvalidArgumentError, match="attn_mask"):
        kt.scaled_dot_product_attention(s, s, s, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(kiln.ShapeMismatchError, match="enable_gqa"):
        kt.scaled_dot_product_attention(s, s[:, :1], s[:, :1])
    with pytest.raises(kiln.InvalidArgumentError, match="top-left"):
        kt.scaled_dot_product_attention(s[:, :, :4], s, s, is_causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU backward's limits need CUDA tensors")
def test_gpu_inputs_the_backward_cannot_take_are_refused():
    q = torch.randn(1, 8, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(kt.AttentionBackwardNotBuiltError, match="head dims"):
        kt.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError, match="head dims"):
        kt.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    with torch.no_grad():
        assert kt.flash_attn_func(q, q, q).shape == (1, 8, 2, 192)


def test_empty_keys_give_zeros_and_lse_minus_inf():
    q = torch.randn(1, 3, 2, 64)
    out, lse = kt.flash_attn_func(q, torch.randn(1, 0, 2, 64), torch.randn(1, 0, 2, 64), return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.all(lse == -math.inf))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiles_without_graph_breaks(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    q = randn(2, 64, 4, 64, device=device, dtype=dtype, g=g)
    k = randn(2, 64, 2, 64, device=device, dtype=dtype, g=g)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=device)

    def f(q, k):
        a = kt.flash_attn_func(q, k, k, causal=True)
        b = kt.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), cu, cu, 64, 64, causal=True)
        c = kt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True,
                                            enable_gqa=True)
        return a.float().sum() + b.float().sum() + c.float().sum()

    # aot_eager traces through the fake implementations (no inductor compile needed on the host).
    got = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(q, k)
    assert torch.allclose(got, f(q, k))


# --- gradients ---

def reference_autograd(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """out [b, lq, h, dv] in fp64 through plain torch ops (autograd follows them); rows that see no
    key give zeros and no NaN."""
    qt, kt_, vt = (t.transpose(1, 2) for t in (q, k, v))
    rep = qt.shape[1] // kt_.shape[1]
    kt_, vt = kt_.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = visible(q.shape[1], k.shape[1], causal, window)
    s = qt @ kt_.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    seen = mask.any(-1)
    lse = torch.where(seen, torch.logsumexp(s, -1), 0.0)
    p = torch.where(mask, torch.exp(s - lse[..., None]), 0.0)
    return (p @ vt).transpose(1, 2)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def grads_fp64(fn, tensors, dout):
    xs = [leaf(t.detach().double().cpu()) for t in tensors]
    fn(*xs).backward(dout.double().cpu())
    return [x.grad for x in xs]


GRAD_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
if torch.cuda.is_available():
    GRAD_CASES += [("cuda", torch.bfloat16), ("cuda", torch.float16)]
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device,dtype", GRAD_CASES)
@pytest.mark.parametrize("causal,window,softcap,lq,lk,heads,kv_heads,d,dv", [
    (False, (-1, -1), 0.0, 37, 37, 2, 2, 64, 64),
    (True, (-1, -1), 0.0, 40, 40, 4, 2, 64, 64),      # GQA 2
    (True, (-1, -1), 0.0, 50, 20, 4, 1, 64, 64),      # lq > lk: rows that see no key; GQA 4
    (True, (-1, -1), 0.0, 20, 70, 2, 2, 128, 128),    # lq < lk
    (False, (9, 3), 0.0, 45, 45, 4, 4, 96, 96),       # window
    (True, (16, -1), 20.0, 33, 48, 4, 2, 128, 128),   # softcap with a left window
    (False, (-1, -1), 0.0, 17, 30, 2, 1, 80, 80),
])
def test_flash_attn_func_gradients_match_fp64_autograd(device, dtype, causal, window, softcap, lq, lk, heads, kv_heads,
                                                       d, dv):
    g = torch.Generator().manual_seed(4)
    q = leaf(randn(2, lq, heads, d, device=device, dtype=dtype, g=g))
    k = leaf(randn(2, lk, kv_heads, d, device=device, dtype=dtype, g=g))
    v = leaf(randn(2, lk, kv_heads, dv, device=device, dtype=dtype, g=g))
    dout = randn(2, lq, heads, dv, device=device, dtype=dtype, g=g)
    out = kt.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    out.backward(dout)
    want = grads_fp64(lambda a, b, c: reference_autograd(a, b, c, causal, window, softcap), (q, k, v), dout)
    for got, w, name in zip((q.grad, k.grad, v.grad), want, "qkv"):
        assert got.dtype == dtype and got.shape == w.shape
        assert bool(torch.isfinite(got).all()), name
        assert rel(got, w) < GRAD_TOL[dtype], name


def test_dv_differs_from_d_on_the_host():
    g = torch.Generator().manual_seed(5)
    q = leaf(torch.randn(1, 9, 4, 24, generator=g))
    k = leaf(torch.randn(1, 11, 2, 24, generator=g))
    v = leaf(torch.randn(1, 11, 2, 8, generator=g))
    dout = torch.randn(1, 9, 4, 8, generator=g)
    kt.flash_attn_func(q, k, v, causal=True, window_size=(4, 0)).backward(dout)
    want = grads_fp64(lambda a, b, c: reference_autograd(a, b, c, True, (4, 0)), (q, k, v), dout)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel(got, w) < 1e-5


@pytest.mark.parametrize("device,dtype", GRAD_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_gradients_per_sequence(device, dtype, causal):
    g = torch.Generator().manual_seed(6)
    lens_q, lens_k = [7, 70, 0, 33, 5], [30, 50, 9, 33, 0]
    heads, kv_heads, d = 4, 2, 64
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = leaf(randn(sum(lens_q), heads, d, device=device, dtype=dtype, g=g))
    k = leaf(randn(sum(lens_k), kv_heads, d, device=device, dtype=dtype, g=g))
    v = leaf(randn(sum(lens_k), kv_heads, d, device=device, dtype=dtype, g=g))
    dout = randn(sum(lens_q), heads, d, device=device, dtype=dtype, g=g)
    out = kt.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    out.backward(dout)
    for got in (q.grad, k.grad, v.grad):
        assert bool(torch.isfinite(got).all())
    for b in range(len(lens_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0 or lens_k[b] == 0:
            # Nothing flows: the sequence's keys get zero gradients, and so do queries that see none.
            assert not bool(q.grad[qs].any()) and not bool(k.grad[ks].any()) and not bool(v.grad[ks].any())
            continue
        want = grads_fp64(lambda a, b_, c: reference_autograd(a[None], b_[None], c[None], causal)[0],
                          (q[qs], k[ks], v[ks]), dout[qs])
        for got, w, name in zip((q.grad[qs], k.grad[ks], v.grad[ks]), want, "qkv"):
            assert rel(got, w) < GRAD_TOL[dtype], (b, name)


@pytest.mark.parametrize("device,dtype", GRAD_CASES)
@pytest.mark.parametrize("is_causal,length,keys,heads,kv_heads", [(False, 40, 70, 4, 4), (True, 64, 64, 8, 2)])
def test_sdpa_gradients_match_torch(device, dtype, is_causal, length, keys, heads, kv_heads):
    g = torch.Generator().manual_seed(7)
    q = leaf(randn(2, heads, length, 64, device=device, dtype=dtype, g=g))
    k = leaf(randn(2, kv_heads, keys, 64, device=device, dtype=dtype, g=g))
    v = leaf(randn(2, kv_heads, keys, 64, device=device, dtype=dtype, g=g))
    dout = randn(2, heads, length, 64, device=device, dtype=dtype, g=g)
    kt.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.2, enable_gqa=kv_heads != heads).backward(dout)
    rep = heads // kv_heads
    want = grads_fp64(lambda a, b, c: F.scaled_dot_product_attention(a, b.repeat_interleave(rep, 1),
                                                                      c.repeat_interleave(rep, 1),
                                                                      is_causal=is_causal, scale=0.2),
                      (q, k, v), dout)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel(got, w) < GRAD_TOL[dtype]


def test_lse_is_returned_without_a_gradient():
    q = leaf(torch.randn(1, 6, 2, 16))
    out, lse = kt.flash_attn_func(q, q, q, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


def test_deterministic_reaches_the_backward():
    # Eager: the autograd node keeps the forward's scalars, which the backward op receives.
    q = leaf(torch.randn(1, 6, 2, 16))
    for flag in (False, True):
        out = kt.flash_attn_func(q, q, q, causal=True, deterministic=flag)
        assert out.grad_fn.scalars["deterministic"] is flag
        cu = torch.tensor([0, 6], dtype=torch.int32)
        out = kt.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 6, 6, deterministic=flag)
        assert out.grad_fn.scalars["deterministic"] is flag
    s = q.transpose(1, 2)
    assert kt.scaled_dot_product_attention(s, s, s).grad_fn.next_functions[0][0].scalars["deterministic"] is False
    torch.use_deterministic_algorithms(True)
    try:
        out = kt.scaled_dot_product_attention(s, s, s)
    finally:
        torch.use_deterministic_algorithms(False)
    assert out.grad_fn.next_functions[0][0].scalars["deterministic"] is True

    # Compiled: the backward graph calls kiln::attention_backward with the flag as given.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    for flag in (False, True):
        seen = []

        def backward_compiler(gm, example_inputs):
            for n in gm.graph.nodes:
                if n.op == "call_function" and "attention_backward" in str(n.target):
                    seen.append(n.args[-1])
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
        x = leaf(torch.randn(1, 6, 2, 16))
        f = torch.compile(lambda x: kt.flash_attn_func(x, x, x, deterministic=flag).sum(), fullgraph=True,
                          backend=backend)
        f(x).backward()
        assert seen == [flag]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_gradients_match_eager(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(8)
    q0 = randn(2, 32, 4, 64, device=device, dtype=dtype, g=g)
    k0 = randn(2, 32, 2, 64, device=device, dtype=dtype, g=g)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device=device)

    def f(q, k):
        a = kt.flash_attn_func(q, k, k, causal=True, softcap=3.0, deterministic=True)
        b = kt.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), cu, cu, 44, 44, causal=True,
                                      deterministic=True)
        c = kt.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True,
                                            enable_gqa=True)
        return (a.float() ** 2).sum() + (b.float() ** 2).sum() + (c.float() ** 2).sum()

    torch._dynamo.reset()
    # aot_eager traces through the fake implementations (no inductor compile needed on the host).
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    got, want = [], []
    for fn, sink in ((compiled, got), (f, want)):
        q, k = leaf(q0), leaf(k0)
        fn(q, k).backward()
        sink += [q.grad, k.grad]
    for a, b in zip(got, want):
        if device == "cpu":
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert rel(a, b.double().cpu()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU backward's modes need CUDA")
def test_gpu_deterministic_gradients_are_bitwise_identical():
    g = torch.Generator().manual_seed(9)
    q0 = randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16, g=g)
    k0 = randn(2, 900, 2, 128, device="cuda", dtype=torch.bfloat16, g=g)
    dout = randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16, g=g)
    first = None
    for _ in range(5):
        q, k, v = leaf(q0), leaf(k0), leaf(k0)
        kt.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)
        grads = [t.grad.clone() for t in (q, k, v)]
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(grads, first))


def _capture(fn):
    """fn() warmed up on a side stream, then captured into a CUDA graph: (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_on_the_split_path():
    """One query against 8k keys (the decode path: key splits, a workspace, a combine) captured
    and replayed on new inputs: the replay's output is bitwise the eager call's, which takes the
    split path (the one-pass kernel sums in another order), and matches fp64."""
    g = torch.Generator().manual_seed(11)
    static = [randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, g=g),
              randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, g=g),
              randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, g=g)]
    graph, out = _capture(lambda: kt.flash_attn_func(*static))
    for _ in range(2):
        new = [randn(*t.shape, device="cuda", dtype=t.dtype, g=g) for t in static]
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        eager = kt.flash_attn_func(*new)
        assert torch.equal(out, eager)
        want, _ = reference(*new)
        assert (out.double().cpu() - want).norm() / want.norm() < TOL[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_forward_and_backward_replay_in_a_cuda_graph():
    """A causal GQA forward and its backward (deterministic mode, whose workspace the graph owns)
    captured once and replayed on new inputs: the gradients are bitwise an eager step's."""
    g = torch.Generator().manual_seed(12)
    q = randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, g=g).requires_grad_()
    k = randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16, g=g).requires_grad_()
    v = randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16, g=g).requires_grad_()
    dout = randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, g=g)

    def step(q, k, v):
        out = kt.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    graph, grads = _capture(lambda: step(q, k, v))
    for _ in range(2):
        new = [randn(*t.shape, device="cuda", dtype=t.dtype, g=g) for t in (q, k, v, dout)]
        with torch.no_grad():
            for s, n in zip((q, k, v, dout), new):
                s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = step(*(leaf(t) for t in new[:3]))
        for a, b in zip(grads, want):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b)
