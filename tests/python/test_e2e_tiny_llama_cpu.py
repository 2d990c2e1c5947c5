"""The tiny Llama served with continuous batching (bench/python/serve_tiny_llama.py) on host
tensors: every kiln op it uses runs its CPU fallback, so the serving loop's logic (slots, block
tables, chunked prefill, prefix hits, forks and their copy-on-write, freeing) is checked against
the float32 reference without a GPU. float32 compares the logits at 1e-5; float16 rounds the
activations as the GPU run does. The GPU test is tests/python/gpu/test_e2e_tiny_llama.py."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="kiln.torch needs PyTorch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python"))
import serve_tiny_llama as st  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    # Small matmuls on a shared machine: one thread, not two spinning against other processes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check_served(server, served, report, requests, num_blocks):
    """Every request's tokens and logits match the reference; the manager ends with every block free."""
    assert not report["token_mismatches"] and not report["logit_mismatches"], st.describe(report)
    # No step was close to a flip: with logits within max_logit_diff of the reference, the argmax
    # cannot change while the reference's top two logits are further apart than twice that.
    assert report["min_margin"] > 2 * report["max_logit_diff"], st.describe(report)
    forks = sum(len(r.forks) for r in requests)
    assert len(served) == len(requests) + forks
    stats = server.manager.stats()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == num_blocks and stats["num_requests"] == 0, stats
    server.manager.check()
    assert not server.unwritten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiny_llama_continuous_batching_matches_the_reference(dtype):
    cfg = st.TinyLlamaConfig()
    requests = st.make_workload(cfg, 24, seed=1)
    num_blocks = 120  # too few for every request at once: some wait for others to finish
    server, served, report = st.serve_and_compare(requests, dtype, "cpu", num_blocks, max_running=12,
                                                  max_step_tokens=96, max_chunk=32)
    check_served(server, served, report, requests, num_blocks)
    c = server.counters
    assert c["prefix_hit_tokens"] > 0 and any(r.cached > 0 for r in served.values()) and c["evictions"] > 0
    assert c["forks"] == sum(len(r.forks) for r in requests) > 0 and c["cow_copies"] > 0 and c["copies_run"] > 0
    assert c["deferred_admissions"] > 0
    assert c["mixed_steps"] > 0 and c["decode_only_steps"] > 0
    assert c["blocked_on_prefix"] > 0  # a prefix hit waited for another request's chunks
    assert any(r.chunks > 1 for r in served.values())  # chunked prefill
    first_done = min(r.finished_step for r in served.values())
    assert any(r.admitted_step > first_done for r in served.values())  # joined a running batch later


def test_a_prefix_hit_on_blocks_still_being_prefilled_waits_for_them():
    """The manager registers a prompt's full blocks when it lays them out: a request that hits them
    while the first one is still being prefilled chunk by chunk waits until they are written."""
    cfg = st.TinyLlamaConfig()
    base = st.make_workload(cfg, 1, seed=3, shared_prefix=0, prompt_len=(300, 300), new_tokens=(6, 6),
                            fork_every=0, duplicate_every=0)[0]
    requests = [base, st.Request(1, base.prompt + [7, 8, 9], 5, arrival=1)]
    # 32 tokens of a prompt a step, 128 in all: the second request would have room to run beside
    # the first from step 1 on, reading blocks the first writes up to step 8.
    server, served, report = st.serve_and_compare(requests, torch.float32, "cpu", 64, max_step_tokens=128,
                                                  max_chunk=32)
    check_served(server, served, report, requests, 64)
    assert server.counters["blocked_on_prefix"] == 1
    assert served[1].cached == 288 and served[1].admitted_step == 1 and served[0].chunks == 10
    # The last hit block (tokens 272-287) is written in step 8, which the second request joins.
    assert served[1].prefill_started == 8 and served[1].chunks == 1
