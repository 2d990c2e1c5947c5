"""kiln.serving: the KV cache manager and radix cache through the C ABI (CPU only)."""
import random

import pytest

import kiln
from kiln.serving import KVCacheManager, RadixCache, SlotPlan, validate_block_table


def test_allocate_append_fork_free():
    m = KVCacheManager(16, page_size=8, dtype="fp8_e4m3", num_layers=2, num_kv_heads=4, head_dim=64,
                       prefix_caching=False)
    assert m.stats()["bytes_per_block"] == 2 * 2 * 4 * 64 * 8 * 1
    plan = SlotPlan()
    assert m.allocate(1, range(13), plan) == 0
    table = m.block_table(1)
    assert len(table) == 2 and m.num_tokens(1) == 13
    assert plan.slot_mapping == [table[i // 8] * 8 + i % 8 for i in range(13)]
    assert plan.copies == []
    m.fork(1, 2)
    assert m.block_info(table[1])["ref_count"] == 2
    plan.clear()
    m.append_slots(2, [99], plan)
    child = m.block_table(2)
    assert plan.copies == [(table[1], child[1])]
    assert plan.slot_mapping == [child[1] * 8 + 5]
    assert m.stats()["cow_copies"] == 1
    m.check()
    m.free(1)
    m.free(2)
    assert m.stats()["free_blocks"] == 16
    m.check()


def test_typed_errors():
    m = KVCacheManager(4, page_size=16)
    plan = SlotPlan()
    m.allocate(1, range(20), plan)
    with pytest.raises(kiln.InvalidArgumentError):
        m.allocate(1, range(4), plan)  # id in use
    m.free(1)
    with pytest.raises(kiln.NotFoundError):
        m.free(1)  # freed twice
    with pytest.raises(kiln.NotFoundError):
        m.append_slots(1, [1], plan)  # finished
    with pytest.raises(kiln.NotFoundError):
        m.fork(1, 2)
    with pytest.raises(kiln.UnavailableError):
        m.allocate(3, range(1000, 1080), plan)  # 5 blocks, 4 in the pool
    with pytest.raises(kiln.InvalidArgumentError):
        m.allocate(3, range(20), plan, prefix_blocks=[4])  # past the pool
    with pytest.raises(kiln.InvalidArgumentError):
        m.release([0])  # nothing to release
    with pytest.raises(kiln.InvalidArgumentError):
        m.block_info(4)
    with pytest.raises(kiln.InvalidArgumentError):
        KVCacheManager(4, page_size=12)
    with pytest.raises(ValueError):
        KVCacheManager(4, dtype="f32")
    validate_block_table([0, 3], 32, 4, 16)
    with pytest.raises(kiln.ShapeMismatchError):
        validate_block_table([0, 3], 33, 4, 16)
    with pytest.raises(kiln.InvalidArgumentError):
        validate_block_table([0, 4], 20, 4, 16)


def test_admission_and_prefix_caching():
    m = KVCacheManager(8, page_size=8)
    plan = SlotPlan()
    prompt = list(range(20))
    assert m.can_allocate_prompt(prompt) == "now"
    assert m.can_allocate(7, 8 * 9) == "never"
    assert m.allocate(1, prompt, plan) == 0
    plan.clear()
    assert m.allocate(2, prompt, plan) == 16  # two full blocks shared
    assert len(plan.slot_mapping) == 4
    assert m.allocate(3, prompt, plan, adapter="lora-1") == 0  # another adapter shares nothing
    assert m.can_allocate(4, 17) == "later"
    s = m.stats()
    assert s["prefix_hit_tokens"] == 16 and s["used_blocks"] == 7
    for r in (1, 2, 3):
        m.free(r)
    assert m.stats()["cached_free_blocks"] > 0
    m.check()


def test_swap_out_and_in():
    m = KVCacheManager(8, page_size=16, num_layers=2, num_kv_heads=8, head_dim=128, prefix_caching=False,
                       num_host_blocks=4)
    assert m.host_blocks() == (4, 4)
    plan = SlotPlan()
    m.allocate(1, range(40), plan)
    device_table = m.block_table(1)
    pairs = m.swap_out(1)
    assert [p[0] for p in pairs] == device_table
    assert [p[1] for p in pairs] == m.block_table(1)
    assert m.is_swapped(1) and m.host_blocks() == (4, 1)
    assert m.stats()["free_blocks"] == 8
    with pytest.raises(kiln.InvalidArgumentError):
        m.append_slots(1, [5], plan)
    with pytest.raises(kiln.InvalidArgumentError):
        m.swap_out(1)
    with pytest.raises(kiln.InvalidArgumentError):
        m.enable_swap(16)
    m.allocate(2, range(16 * 6), plan)  # 6 of 8 blocks: 2 free, 3 needed
    assert m.can_swap_in(1) == "later"
    with pytest.raises(kiln.UnavailableError):
        m.swap_in(1)
    m.free(2)
    back = m.swap_in(1)
    assert [p[0] for p in back] == [p[1] for p in pairs]
    assert [p[1] for p in back] == m.block_table(1)
    assert not m.is_swapped(1) and m.host_blocks() == (4, 4)
    m.append_slots(1, [5], plan)
    assert m.num_tokens(1) == 41
    m.check()
    with pytest.raises(kiln.NotFoundError):
        m.swap_out(99)


def test_radix_cache():
    m = KVCacheManager(32, page_size=1, prefix_caching=False)
    tree = RadixCache(m)
    plan = SlotPlan()
    a = [1, 2, 3, 4, 5]
    m.allocate(1, a, plan)
    node, cached = tree.insert(a, m.block_table(1))
    assert cached == 0
    blocks, n2 = tree.match([1, 2, 3, 9])
    assert blocks == m.block_table(1)[:3]
    tree.lock(n2)
    assert tree.stats()["protected_blocks"] == 3
    m.free(1)
    assert tree.evict(10) == 2  # the unlocked tail [4 5]
    tree.unlock(n2)
    with pytest.raises(kiln.InvalidArgumentError):
        tree.unlock(n2)
    assert tree.evict(10) == 3
    with pytest.raises(kiln.NotFoundError):
        tree.lock(n2)
    tree.check()
    m.check()
    assert m.stats()["free_blocks"] == 32
    m.close()


def test_randomized_simulation():
    """Requests arrive with shared prefixes, grow, fork and finish; the radix tree caches finished
    ones. After each step the invariants hold, and the blocks replayed from the plans hold each
    request's tokens."""
    rnd = random.Random(5)
    page = 8
    m = KVCacheManager(64, page_size=page, prefix_caching=False)
    tree = RadixCache(m)
    pool = [None] * (64 * page)
    live = {}  # id -> (tokens, locked node)
    prefixes = [[rnd.randrange(30) for _ in range(rnd.randrange(3 * page))] for _ in range(4)]
    next_id = 0
    plan = SlotPlan()

    def replay(written):
        for src, dst in plan.copies:
            pool[dst * page:(dst + 1) * page] = pool[src * page:(src + 1) * page]
        assert len(plan.slot_mapping) == len(written)
        for slot, tok in zip(plan.slot_mapping, written):
            pool[slot] = tok

    def contents(rid):
        table = m.block_table(rid)
        return [pool[table[p // page] * page + p % page] for p in range(m.num_tokens(rid))]

    def finish(rid):
        tokens, node = live.pop(rid)
        full = len(tokens) // page
        tree.insert(tokens[:full * page], m.block_table(rid)[:full])
        tree.unlock(node)
        m.free(rid)

    for _ in range(1500):
        plan.clear()
        op = rnd.randrange(100)
        if not live or op < 30:
            prompt = rnd.choice(prefixes) + [rnd.randrange(30) for _ in range(1 + rnd.randrange(2 * page))]
            blocks, node = tree.match(prompt[:-1])
            tree.lock(node)
            need = -(-len(prompt) // page) - len(blocks)
            if m.stats()["free_blocks"] < need:
                tree.evict(need - m.stats()["free_blocks"])
            try:
                cached = m.allocate(next_id, prompt, plan, prefix_blocks=blocks)
            except kiln.UnavailableError:
                tree.unlock(node)
                if live:
                    finish(rnd.choice(list(live)))
            else:
                replay(prompt[cached:])
                live[next_id] = (list(prompt), node)
                assert contents(next_id) == prompt
            next_id += 1
        elif op < 70:
            rid = rnd.choice(list(live))
            toks = [rnd.randrange(30) for _ in range(1 + rnd.randrange(3))]
            try:
                m.append_slots(rid, toks, plan)
            except kiln.UnavailableError:
                continue
            replay(toks)
            live[rid][0].extend(toks)
            assert contents(rid) == live[rid][0]
        elif op < 80:
            rid = rnd.choice(list(live))
            m.fork(rid, next_id)
            tree.lock(live[rid][1])
            live[next_id] = (list(live[rid][0]), live[rid][1])
            next_id += 1
        else:
            finish(rnd.choice(list(live)))
        m.check()
        tree.check()
    for rid in list(live):
        assert contents(rid) == live[rid][0]
        finish(rid)
    tree.evict(1 << 30)
    assert m.stats()["free_blocks"] == 64
    assert next_id > 300
