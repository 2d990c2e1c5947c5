"""Attention through kiln.torch (needs PyTorch; on CUDA when there is a GPU): flash_attn_func,
flash_attn_varlen_func and scaled_dot_product_attention against torch's own math
(F.scaled_dot_product_attention in fp64 with explicit boolean masks), the typed errors, and tracing
under torch.compile(fullgraph=True) through the fake implementations."""
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


def test_inputs_that_require_grad_are_refused():
    q = torch.randn(1, 8, 2, 64, requires_grad=True)
    with pytest.raises(kt.AttentionBackwardNotBuiltError, match="backward"):
        kt.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError):
        kt.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    with torch.no_grad():
        assert kt.flash_attn_func(q, q, q).shape == (1, 8, 2, 64)


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
