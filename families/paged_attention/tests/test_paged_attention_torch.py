"""kiln.torch's paged cache (needs PyTorch): BatchDecodeWithPagedKVCache and the cascade wrapper
against the fp64 references of test_paged_attention.py, the plan's typed errors, the in-place torch
ops, and on a GPU bf16 and a planned call replayed in a CUDA graph."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_paged_attention import attend, paged_batch  # noqa: E402


DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # the reference reads q and k unrounded


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_batch_decode_module(device, dtype, page):
    rng = np.random.default_rng(3)
    kc, vc, tables, lens, keys = paged_batch(rng, [5, 100, 300, 1], page, hk=2, d=64)
    q = torch.randn(4, 8, 64, dtype=torch.float32)
    dec = kt.BatchDecodeWithPagedKVCache(8, 2, 64, page_size=page)
    dec.plan(torch.from_numpy(tables).to(device), torch.from_numpy(lens).to(device), num_blocks=kc.shape[0])
    out, lse = dec(q.to(device, dtype), torch.from_numpy(kc).to(device, dtype), torch.from_numpy(vc).to(device, dtype),
                   return_lse=True)
    for b, (k, v) in enumerate(keys):
        want, want_lse = attend(q[b:b + 1].numpy(), k, v)
        np.testing.assert_allclose(out[b:b + 1].float().cpu().numpy(), want, atol=TOL[dtype])
        np.testing.assert_allclose(lse[b:b + 1].cpu().numpy(), want_lse, atol=LSE_TOL[dtype])


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_cascade_module_equals_the_whole_context(device, dtype):
    torch.manual_seed(4)
    page, batch, prefix, h, hk, d = 8, 6, 32, 8, 2, 64
    own = [1, 5, 9, 16, 3, 12]
    pb, ob = prefix // page, 2
    blocks = pb + batch * ob
    kc = torch.randn(blocks, page, hk, d)
    vc = torch.randn(blocks, page, hk, d)
    shared = torch.arange(pb, dtype=torch.int32)
    mine = torch.tensor([[pb + b * ob + j for j in range(ob)] for b in range(batch)], dtype=torch.int32)
    full = torch.cat([shared.expand(batch, pb), mine], 1)
    q = torch.randn(batch, h, d)
    to = lambda t: t.to(device, dtype)
    cascade = kt.BatchDecodeWithSharedPrefixPagedKVCache(h, hk, d, page_size=page)
    cascade.plan(shared.to(device), prefix, mine.to(device), torch.tensor(own, dtype=torch.int32).to(device),
                 num_blocks=blocks)
    got = cascade(to(q), to(kc), to(vc))
    whole = kt.BatchDecodeWithPagedKVCache(h, hk, d, page_size=page)
    whole.plan(full.to(device), torch.tensor([prefix + n for n in own], dtype=torch.int32).to(device), num_blocks=blocks)
    want = whole(to(q), to(kc), to(vc))
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_plan_errors_and_forward_checks():
    dec = kt.BatchDecodeWithPagedKVCache(8, 2, 64, page_size=16)
    with pytest.raises(kiln.InvalidArgumentError):
        dec(torch.zeros(1, 8, 64), torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64))
    with pytest.raises(kiln.InvalidArgumentError):
        dec.plan(torch.tensor([[0, 7]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), num_blocks=4)
    with pytest.raises(kiln.ShapeMismatchError):
        dec.plan(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([33], dtype=torch.int32), num_blocks=4)
    dec.plan(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), num_blocks=4)
    with pytest.raises(kiln.ShapeMismatchError):
        dec(torch.zeros(2, 8, 64), torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64))


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_in_place_torch_ops(device, dtype):
    torch.manual_seed(5)
    kc = torch.zeros(4, 16, 2, 64, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(3, 3 * 128, device=device, dtype=dtype)
    k = qkv[:, 128:256].view(3, 2, 64)  # rows at a stride
    v = qkv[:, 256:].view(3, 2, 64)
    kt.reshape_and_cache(k, v, kc, vc, torch.tensor([5, -1, 40], device=device))
    torch.testing.assert_close(kc.view(-1, 2, 64)[5], k[0])
    torch.testing.assert_close(vc.view(-1, 2, 64)[40], v[2])
    assert kc.view(-1, 2, 64)[0].abs().sum() == 0
    kt.copy_blocks(kc, vc, torch.tensor([[0, 3]], device=device))
    torch.testing.assert_close(kc[3], kc[0])
    va, vb = torch.randn(2, 4, 64, device=device, dtype=dtype), torch.randn(2, 4, 64, device=device, dtype=dtype)
    sa, sb = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device)
    w_a = torch.sigmoid(sa - sb)[..., None]
    want = (w_a * va.float() + (1 - w_a) * vb.float()).to(dtype)
    s_want = torch.logaddexp(sa, sb)
    kt.merge_state_in_place(va, sa, vb, sb)
    torch.testing.assert_close(va.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(sa, s_want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_planned_decode_replays_in_a_cuda_graph():
    rng = np.random.default_rng(6)
    kc, vc, tables, lens, keys = paged_batch(rng, [1000, 4000], 16, hk=8, d=128)
    dev = torch.device("cuda")
    kc, vc = (torch.from_numpy(x).to(dev, torch.bfloat16) for x in (kc, vc))
    dec = kt.BatchDecodeWithPagedKVCache(32, 8, 128, page_size=16)
    dec.plan(torch.from_numpy(tables).to(dev), torch.from_numpy(lens).to(dev), num_blocks=kc.shape[0])
    q = torch.randn(2, 32, 128, device=dev, dtype=torch.bfloat16)
    eager = dec(q, kc, vc)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dec(q, kc, vc)  # warm: kernels compiled and loaded before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec(q, kc, vc)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, dec(q, kc, vc), atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_prefill_module_appends_causally(device, dtype):
    rng = np.random.default_rng(7)
    lens, lq = [60, 33], [20, 33]
    kc, vc, tables, seq_lens, keys = paged_batch(rng, lens, 16, hk=2, d=64)
    cu = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = torch.randn(int(cu[-1]), 8, 64)
    pre = kt.BatchPrefillWithPagedKVCache(8, 2, 64, page_size=16)
    with pytest.raises(kiln.InvalidArgumentError):
        pre.plan(torch.from_numpy(tables), torch.from_numpy(seq_lens), num_blocks=kc.shape[0])
    pre.plan(torch.from_numpy(tables).to(device), torch.from_numpy(seq_lens).to(device), num_blocks=kc.shape[0],
             cu_seqlens_q=torch.from_numpy(cu).to(device))
    out = pre(q.to(device, dtype), torch.from_numpy(kc).to(device, dtype), torch.from_numpy(vc).to(device, dtype))
    for b, (k, v) in enumerate(keys):
        want, _ = attend(q[cu[b]:cu[b + 1]].numpy(), k, v, causal=True)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]].float().cpu().numpy(), want, atol=TOL[dtype])


def test_swap_errors_before_any_launch():
    kc = torch.zeros(4, 16, 2, 64)
    with pytest.raises(kiln.InvalidArgumentError):
        kt.swap_blocks_to_cpu([(kc, kc)], [(kc.clone(), kc.clone())], [(0, 1)])  # no GPU side
    assert kt.swap_blocks_to_cpu([(kc, kc)], [(kc, kc)], []) is None  # nothing to copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_swap_a_request_out_and_back_with_the_manager():
    from kiln.serving import KVCacheManager, SlotPlan
    torch.manual_seed(9)
    dev = torch.device("cuda")
    layers, blocks, page, hk, d = 3, 12, 16, 2, 64
    m = KVCacheManager(blocks, page_size=page, num_layers=layers, num_kv_heads=hk, head_dim=d, prefix_caching=False,
                       num_host_blocks=8)
    gpu = [(torch.zeros(blocks, page, hk, d, device=dev, dtype=torch.bfloat16),
            torch.zeros(blocks, page, hk, d, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
    cpu = [(torch.zeros(8, page, hk, d, dtype=torch.bfloat16).pin_memory(),
            torch.zeros(8, page, hk, d, dtype=torch.bfloat16).pin_memory()) for _ in range(layers)]
    plan = SlotPlan()
    m.allocate(1, range(50), plan)
    slots = torch.tensor(plan.slot_mapping, device=dev)
    rows = [(torch.randn(50, hk, d, device=dev, dtype=torch.bfloat16),
             torch.randn(50, hk, d, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
    for (k, v), (kc, vc) in zip(rows, gpu):
        kt.reshape_and_cache(k, v, kc, vc, slots)
    event = kt.swap_blocks_to_cpu(gpu, cpu, m.swap_out(1))
    # The freed blocks are written by another request after the event: the host copy must be whole.
    torch.cuda.current_stream().wait_event(event)
    plan2 = SlotPlan()
    m.allocate(2, range(16 * blocks), plan2)
    for kc, vc in gpu:
        kc.fill_(7.0)
        vc.fill_(7.0)
    m.free(2)
    event = kt.swap_blocks_from_cpu(cpu, gpu, m.swap_in(1))
    torch.cuda.current_stream().wait_event(event)
    table = m.block_table(1)
    for (k, v), (kc, vc) in zip(rows, gpu):
        got_k = torch.stack([kc[table[i // page], i % page] for i in range(50)])
        got_v = torch.stack([vc[table[i // page], i % page] for i in range(50)])
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    with pytest.raises(kiln.InvalidArgumentError):  # pageable host memory
        kt.swap_blocks_to_cpu(gpu, [(torch.zeros(8, page, hk, d, dtype=torch.bfloat16),) * 2] * layers, [(0, 0)])
    m.check()
