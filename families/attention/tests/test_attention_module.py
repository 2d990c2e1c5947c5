"""kiln.torch.FlashInferAttention (needs PyTorch; on CUDA when there is a GPU): planned packed
sequences and padded batches against a per-sequence fp64 reference written here, gradients against
autograd through that reference, the plan's checks and its typed errors, and a CUDA graph
replaying a planned call."""
import math

import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

CASES = [("cpu", torch.float32)]
if torch.cuda.is_available():
    CASES += [("cuda", torch.bfloat16)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def attend(q, k, v, causal, window, softcap):
    """One sequence in fp64: q [lq, h, d], k and v [lk, hk, d(v)] -> out [lq, h, dv], lse [h, lq]."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    lq, lk = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    seen = torch.ones(lq, lk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(seen, torch.exp(s - lse[..., None]), 0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (5, 3), 0.0),
                                                   (True, (-1, -1), 8.0)])
def test_planned_packed_sequences_match_the_reference(device, dtype, causal, window, softcap):
    torch.manual_seed(0)
    lens_q, lens_k = [3, 1, 17, 8], [5, 1, 17, 20]  # lq <= lk: end-aligned causal sees a key every row
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    h, hk, d = 4, 2, 64
    q = torch.randn(sum(lens_q), h, d, device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, device=device, dtype=dtype)
    attn = kt.FlashInferAttention(h, hk, causal=causal, window_size=window, softcap=softcap).plan(cu_q, cu_k)
    with torch.no_grad():
        out, lse = attn(q, k, v, return_lse=True)
        again = attn(q, k, v)  # the plan serves every call of the batch
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    assert torch.equal(out, again)
    for b in range(len(lens_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want, want_lse = attend(q[qs], k[ks], v[ks], causal, window, softcap)
        assert rel(out[qs], want) <= TOL[dtype], b
        assert rel(lse[:, qs], want_lse) <= TOL[dtype], b


@pytest.mark.parametrize("device,dtype", CASES)
def test_without_a_plan_it_takes_padded_batches(device, dtype):
    torch.manual_seed(1)
    q = torch.randn(2, 9, 4, 64, device=device, dtype=dtype)
    k = torch.randn(2, 9, 1, 64, device=device, dtype=dtype)
    v = torch.randn(2, 9, 1, 64, device=device, dtype=dtype)
    attn = kt.FlashInferAttention(4, 1)
    with torch.no_grad():
        out = attn(q, k, v)
        ref = kt.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    for b in range(2):
        want, _ = attend(q[b], k[b], v[b], True, (-1, -1), 0.0)
        assert rel(out[b], want) <= TOL[dtype]
    # A plan switches it to packed tensors; reset() switches it back.
    attn.plan(torch.tensor([0, 9, 18], dtype=torch.int32, device=device))
    with torch.no_grad():
        packed = attn(q.reshape(18, 4, 64), k.reshape(18, 1, 64), v.reshape(18, 1, 64))
    assert rel(packed.reshape(2, 9, 4, 64), out) <= TOL[dtype]
    attn.reset()
    with torch.no_grad():
        assert torch.equal(attn(q, k, v), out)


def test_plan_and_shapes_are_checked():
    with pytest.raises(kiln.InvalidArgumentError):
        kt.FlashInferAttention(6, 4)
    attn = kt.FlashInferAttention(4, 2)
    with pytest.raises(kiln.InvalidArgumentError):
        attn.plan(torch.tensor([0, 3, 5], dtype=torch.int64))  # not int32
    with pytest.raises(kiln.InvalidArgumentError):
        attn.plan(torch.tensor([0, 3, 2], dtype=torch.int32))  # decreasing
    with pytest.raises(kiln.InvalidArgumentError):
        attn.plan(torch.tensor([1, 3], dtype=torch.int32))  # not from 0
    with pytest.raises(kiln.InvalidArgumentError):
        attn.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32))
    attn.plan(torch.tensor([0, 3, 5], dtype=torch.int32))
    q, kv = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    with pytest.raises(kiln.ShapeMismatchError):
        attn(torch.randn(6, 4, 64), kv, kv)  # more tokens than the plan
    with pytest.raises(kiln.ShapeMismatchError):
        attn(torch.randn(5, 2, 64), kv, kv)  # wrong head count
    with pytest.raises(kiln.ShapeMismatchError):
        attn(q.reshape(1, 5, 4, 64), kv, kv)  # padded tensors while planned
    with torch.no_grad():
        assert attn(q, kv, kv).shape == (5, 4, 64)


def test_planned_gradients_match_fp64_autograd():
    """A planned call on host tensors carries gradients: dq, dk, dv against autograd through the
    fp64 reference, sequence by sequence."""
    torch.manual_seed(3)
    lens_q, lens_k = [3, 9], [6, 9]
    cu_q = torch.tensor([0, 3, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 15], dtype=torch.int32)
    h, hk, d = 4, 2, 32
    q = torch.randn(12, h, d, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(15, hk, d, dtype=torch.float64).float().requires_grad_()
    v = torch.randn(15, hk, d, dtype=torch.float64).float().requires_grad_()
    attn = kt.FlashInferAttention(h, hk, causal=True)
    attn.plan(cu_q, cu_k)
    dout = torch.randn(12, h, d)
    attn(q, k, v).backward(dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = [attend(qd[cu_q[i]:cu_q[i + 1]], kd[cu_k[i]:cu_k[i + 1]], vd[cu_k[i]:cu_k[i + 1]], True, (-1, -1), 0.0)[0]
            for i in range(2)]
    torch.cat(outs).backward(dout.double())
    for got, want, name in ((q.grad, qd.grad, "q"), (k.grad, kd.grad, "k"), (v.grad, vd.grad, "v")):
        assert rel(got, want) < 1e-5, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_planned_call_replays_in_a_cuda_graph():
    torch.manual_seed(2)
    cu = torch.tensor([0, 7, 40, 41], dtype=torch.int32, device="cuda")
    q = torch.randn(41, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(41, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(41, 2, 128, device="cuda", dtype=torch.bfloat16)
    attn = kt.FlashInferAttention(8, 2).plan(cu)
    with torch.no_grad():
        attn(q, k, v)  # compiles and loads the kernel outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(q, k, v)
        for _ in range(2):
            q.copy_(torch.randn_like(q))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, attn(q, k, v))
