"""End to end on the GPU: a tiny Llama-style model (2 layers, random weights with a planted copy
head, bench/python/serve_tiny_llama.py) served with continuous batching from kiln's ops alone
(RMSNorm and add+RMSNorm, RoPE, reshape_and_cache, copy_blocks, paged prefill and decode over the
KVCacheManager's block tables, act_and_mul; torch matmuls for the projections and the LM head):
every request's greedy tokens equal the float32 PyTorch reference's, its logits are within the
dtype's tolerance, the prefix cache hit, and at the end every block is free and the manager's
invariants hold (they are also checked after every step)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench", "python"))
import serve_tiny_llama as st  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_tiny_llama_serving_matches_the_reference(dtype):
    cfg = st.TinyLlamaConfig()
    requests = st.make_workload(cfg, 48, seed=1)
    num_blocks = 140  # too few for every request at once: some wait for others to finish
    server, served, report = st.serve_and_compare(requests, dtype, "cuda", num_blocks, max_running=24,
                                                  max_step_tokens=192, max_chunk=32)
    print(st.describe(report))
    print(server.counters)
    assert not report["token_mismatches"] and not report["logit_mismatches"], st.describe(report)
    # With every step's logits within max_logit_diff of the reference, an argmax can only flip where
    # the reference's top two logits are within twice that: none were.
    assert report["min_margin"] > 2 * report["max_logit_diff"], st.describe(report)
    assert len(served) == len(requests) + sum(len(r.forks) for r in requests)
    c = server.counters
    assert c["prefix_hit_tokens"] > 0 and any(r.cached > 0 for r in served.values()) and c["evictions"] > 0
    assert c["forks"] > 0 and c["cow_copies"] > 0 and c["copies_run"] > 0
    assert c["deferred_admissions"] > 0 and c["mixed_steps"] > 0 and c["decode_only_steps"] > 0
    assert c["blocked_on_prefix"] > 0  # a prefix hit waited for another request's chunks
    assert any(r.chunks > 1 for r in served.values())
    first_done = min(r.finished_step for r in served.values())
    assert any(r.admitted_step > first_done for r in served.values())
    stats = server.manager.stats()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == num_blocks and stats["num_requests"] == 0, stats
    server.manager.check()
    assert not server.unwritten


def test_a_prefix_hit_on_blocks_still_being_prefilled_waits_for_them():
    """A request hitting the full blocks of a prompt still being prefilled chunk by chunk waits for
    them, then joins in the step that writes the last of them (its attention, after every row's
    reshape_and_cache of the layer, reads them on the same stream)."""
    cfg = st.TinyLlamaConfig()
    base = st.make_workload(cfg, 1, seed=3, shared_prefix=0, prompt_len=(300, 300), new_tokens=(6, 6),
                            fork_every=0, duplicate_every=0)[0]
    requests = [base, st.Request(1, base.prompt + [7, 8, 9], 5, arrival=1)]
    # 32 tokens of a prompt a step, 128 in all: the second request would have room to run beside
    # the first from step 1 on, reading blocks the first writes up to step 8.
    server, served, report = st.serve_and_compare(requests, torch.bfloat16, "cuda", 64, max_step_tokens=128,
                                                  max_chunk=32)
    assert not report["token_mismatches"] and not report["logit_mismatches"], st.describe(report)
    assert server.manager.stats()["used_blocks"] == 0
    assert server.counters["blocked_on_prefix"] == 1
    assert served[1].cached == 288 and served[1].admitted_step == 1 and served[0].chunks == 10
    # The last hit block (tokens 272-287) is written in step 8, which the second request joins.
    assert served[1].prefill_started == 8 and served[1].chunks == 1
