"""The paged cache's ops from Python without PyTorch: kiln.serving.plan_paged_decode (split counts,
the tables' typed errors) and the declared ops on host arrays (reshape_and_cache, copy_blocks,
merge_state, paged_decode) against NumPy references written here. test_paged_attention_torch.py
covers kiln.torch."""
import math

import numpy as np
import pytest

import kiln
from kiln.serving import plan_paged_cascade_decode, plan_paged_decode


def attend(q, k, v, causal=False):
    """One request in fp64: q [lq, h, d], k and v [lk, hk, d] -> out [lq, h, d], lse [lq, h]."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    lq, lk = q.shape[0], k.shape[0]
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        i = np.arange(lq)[:, None] + lk - lq
        s = np.where(np.arange(lk)[None, :] <= i, s, -np.inf)
    m = s.max(-1, keepdims=True) if lk else np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    z = p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", np.divide(p, z, out=np.zeros_like(p), where=z > 0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(z) + m)[..., 0].T
    return out, lse


def paged_batch(rng, lens, page, hk=2, d=16, lq=None):
    """A shuffled pool holding each request's keys, its padded tables, and the contiguous keys."""
    blocks = [(n + page - 1) // page for n in lens]
    num_blocks = sum(blocks) + 2
    max_blocks = max(blocks + [1])
    kc = rng.standard_normal((num_blocks, page, hk, d)).astype(np.float32)
    vc = rng.standard_normal((num_blocks, page, hk, d)).astype(np.float32)
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    at = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = ids[at:at + nb]
        at += nb
    keys = []
    for b, n in enumerate(lens):
        slots = tables[b, np.arange(n) // page] * page + np.arange(n) % page
        keys.append((kc.reshape(-1, hk, d)[slots], vc.reshape(-1, hk, d)[slots]))
    return kc, vc, tables, np.asarray(lens, np.int32), keys


def test_plan_splits_and_errors():
    p = plan_paged_decode([32768], heads=32, kv_heads=8, head_dim=128, page_size=16, num_blocks=4096, max_blocks=2048,
                          sm_count=132)
    # 8 blocks on 396 slots: 47 splits are 376 blocks of 11 key tiles, one wave.
    assert p["splits"] == 47 and p["max_seq_len"] == 32768 and p["workspace_elements"] == 47 * 32 * 129
    p = plan_paged_decode([8192] * 64, heads=32, kv_heads=8, head_dim=128, page_size=16, num_blocks=40000,
                          max_blocks=512, sm_count=132)
    assert p["splits"] == 3  # 512 blocks are 1.3 waves of 396; 1536 are 3.9
    tables = np.array([[0, 1, 2], [3, 9, -1]], np.int32)
    p = plan_paged_decode([24, 9], heads=4, kv_heads=2, head_dim=64, page_size=8, num_blocks=10, block_tables=tables,
                          cu_seqlens_q=[0, 2, 5])
    assert p["max_seqlen_q"] == 3 and p["total_q"] == 5
    bad = tables.copy()
    bad[1, 1] = 10
    with pytest.raises(kiln.InvalidArgumentError):
        plan_paged_decode([24, 9], heads=4, kv_heads=2, head_dim=64, page_size=8, num_blocks=10, block_tables=bad)
    with pytest.raises(kiln.ShapeMismatchError):
        plan_paged_decode([24, 25], heads=4, kv_heads=2, head_dim=64, page_size=8, num_blocks=10, block_tables=tables)
    with pytest.raises(kiln.InvalidArgumentError):
        plan_paged_decode([24], heads=4, kv_heads=2, head_dim=64, page_size=4, num_blocks=10, max_blocks=8)


def test_reshape_and_cache_and_copy_blocks_on_host():
    rng = np.random.default_rng(1)
    kc = np.zeros((4, 8, 2, 16), np.float32)
    vc = np.zeros_like(kc)
    key = rng.standard_normal((5, 2, 16)).astype(np.float32)
    value = rng.standard_normal((5, 2, 16)).astype(np.float32)
    slots = np.array([3, 31, -1, 8, 0], np.int64)
    kiln.reshape_and_cache(key, value, slots, key_cache=kc, value_cache=vc)
    flat_k, flat_v = kc.reshape(-1, 2, 16), vc.reshape(-1, 2, 16)
    for t, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(flat_k[s], key[t])
            np.testing.assert_array_equal(flat_v[s], value[t])
    assert not flat_k[1].any()
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.reshape_and_cache(key, value, np.array([0, 1, 2, 3, 32], np.int32), key_cache=kc, value_cache=vc)
    before = kc.copy()
    kiln.copy_blocks(np.array([[0, 2]], np.int32), key_cache=kc, value_cache=vc)
    np.testing.assert_array_equal(kc[2], before[0])
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.copy_blocks(np.array([[0, 4]], np.int32), key_cache=kc, value_cache=vc)


def test_paged_decode_and_merge_on_host():
    rng = np.random.default_rng(2)
    for page in (1, 8, 16, 128):
        kc, vc, tables, lens, keys = paged_batch(rng, [1, 40, 130], page)
        q = rng.standard_normal((3, 4, 16)).astype(np.float32)
        out, lse = np.zeros_like(q), np.zeros((3, 4), np.float32)
        kiln.paged_decode(q, kc, vc, tables, lens, out=out, lse=lse)
        for b, (k, v) in enumerate(keys):
            want, want_lse = attend(q[b:b + 1], k, v)
            np.testing.assert_allclose(out[b:b + 1], want, atol=1e-5)
            np.testing.assert_allclose(lse[b:b + 1], want_lse, atol=1e-5)
    # Several causal queries per request (packed), and a context past its table: a typed error.
    kc, vc, tables, lens, keys = paged_batch(rng, [20, 9], 8)
    cu = np.array([0, 3, 5], np.int32)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    out = np.zeros_like(q)
    kiln.paged_decode(q, kc, vc, tables, lens, cu, None, 3, 0, 0, 0.0, True, out=out)
    for b, (k, v) in enumerate(keys):
        want, _ = attend(q[cu[b]:cu[b + 1]], k, v, causal=True)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], want, atol=1e-5)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.paged_decode(q[:2], kc, vc, tables, np.array([20, 25], np.int32), out=out[:2])
    # merge_state: two halves of one softmax make the whole.
    k, v = keys[0]
    q1 = q[:1]
    a, sa = attend(q1, k[:7], v[:7])
    b, sb = attend(q1, k[7:], v[7:])
    whole, s_whole = attend(q1, k, v)
    vo, so = kiln.merge_state(a.astype(np.float32), sa.astype(np.float32), b.astype(np.float32), sb.astype(np.float32))
    np.testing.assert_allclose(vo, whole, atol=1e-5)
    np.testing.assert_allclose(so, s_whole, atol=1e-5)


def test_cascade_on_host_and_its_plan():
    rng = np.random.default_rng(8)
    page, prefix, own = 8, 21, [9, 1, 16]
    kc, vc, tables, lens, keys = paged_batch(rng, own, page)
    shared = np.array([kc.shape[0] - 1, kc.shape[0] - 2, 0], np.int32)  # any blocks; block 0 is shared with a request
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    out = kiln.paged_cascade_decode(q, kc, vc, shared, np.array([prefix], np.int32), tables, lens)
    pre_slots = shared[np.arange(prefix) // page] * page + np.arange(prefix) % page
    pk, pv = kc.reshape(-1, 2, 16)[pre_slots], vc.reshape(-1, 2, 16)[pre_slots]
    for b, (k, v) in enumerate(keys):
        want, _ = attend(q[b:b + 1], np.concatenate([pk, k]), np.concatenate([pv, v]))
        np.testing.assert_allclose(out[b:b + 1], want, atol=1e-5)
    p = plan_paged_cascade_decode(list(range(256)), 4096, [256] * 32, heads=32, kv_heads=8, head_dim=128, page_size=16,
                                  num_blocks=1000, max_blocks=16, sm_count=132)
    assert p["shared_splits"] == 16 and p["splits"] == 1 and p["workspace_elements"] == 17 * 32 * 32 * 129
    with pytest.raises(kiln.ShapeMismatchError):
        plan_paged_cascade_decode(list(range(256)), 4097, [256] * 32, heads=32, kv_heads=8, head_dim=128,
                                  page_size=16, num_blocks=1000, max_blocks=16)
