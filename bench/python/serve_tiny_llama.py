"""A tiny Llama-style decoder served with continuous batching from kiln's ops, against a PyTorch
reference, and its throughput.

The model: Llama's layer (RMSNorm, GQA attention with RoPE, SwiGLU MLP, residual adds, a final
RMSNorm and an LM head), 2 layers by default, random weights from a seeded generator. What runs
through kiln on the serving side: the RMSNorms (kiln.torch.rms_norm and add_rms_norm, the residual
add fused in), RoPE (RotaryEmbedding), writing K/V into the paged cache (reshape_and_cache), the
copy-on-write copies (copy_blocks), attention over the cache (BatchPrefillWithPagedKVCache for
steps with prompt chunks, BatchDecodeWithPagedKVCache for decode-only steps), SwiGLU's activation
(act_and_mul), and the cache's bookkeeping (kiln.serving.KVCacheManager: block tables, slots,
prefix caching, fork). The embedding lookup, the projections (QKV, O, gate/up, down) and the LM
head are torch matmuls in the serving dtype; the logits are computed in float32 from kiln's final
RMSNorm output.

The serving loop (Server) is a continuous-batching scheduler: requests arrive at given steps,
wait until the pool can hold them, are prefilled in chunks within a per-step token budget, mixed
with the running requests' decode tokens in one batch, decode greedily to their own lengths, free
their blocks when done, and let waiting requests join. Prompts share a long common prefix, so later
requests hit the prefix cache. Some requests fork after their first token (parallel sampling): the
child takes its first token from a seeded sampler, shares the parent's blocks and continues
greedily; the first of the two to grow copies the shared last block.

The reference (Reference) runs each request alone: the same weights (the serving dtype's values,
held in float32), float32 everywhere, a contiguous K/V per request and torch's
scaled_dot_product_attention, greedy.

Margins. Greedy tokens of a float16 / bfloat16 model can only match a float32 reference exactly
when no step's top two logits are closer than the two computations differ. With plain random
weights every step is a race between the vocabulary's largest logits, and over a few hundred greedy
steps some are close enough to flip. The weights are therefore random with a planted structure that
makes every choice clear while leaving it dependent on the context: every embedding carries a
shared direction that makes one attention head of layer 0 positional (its queries and keys are that
direction, rotated by RoPE so that position i attends to position i - copy_offset, with a score gap
that keeps the softmax one-hot), the head copies that token's code (a projection of its embedding)
into the residual stream, and the LM head reads the code back through a fixed permutation of the
vocabulary. The greedy next token is thus the t with perm[t] = the token at i - copy_offset: it
depends on the right key's position (RoPE, the paged cache's slots and block tables) and on that
key's value, and wrong attention gives a different token, not a near tie. Every other head, both
MLPs and part of the LM head are plain random weights that move the logits: the logits comparison
(a tolerance relative to the logits' scale) is what checks them. check_results reports the smallest
reference margin against the largest logit difference, so a run says how far it was from a flip.

  python3 bench/python/serve_tiny_llama.py [--quick] [--requests 512] [--concurrency 256] [--dtype bf16]
      [--step-tokens 2048] [--max-chunk N] [--check 16] [--json FILE]
"""
import argparse
import dataclasses
import json
import math
import random
import sys
import time
from typing import Dict, List, Optional

import torch

import kiln.torch as kt
from kiln.serving import KVCacheManager, SlotPlan

F = torch.nn.functional
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclasses.dataclass
class TinyLlamaConfig:
    vocab: int = 4096
    hidden: int = 512
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    eps: float = 1e-6
    rope_base: float = 10000.0
    max_positions: int = 2048
    # The planted copy head: position i attends to i - copy_offset.
    copy_offset: int = 5


# The RoPE frequency pairs the positional head's keys use and their weights: the highest
# frequencies, weighted so that the target key's score stands out from every other key's
# (make_weights checks the gap for the configuration's positions).
_COPY_PAIR_WEIGHTS = (0.324, 0.159, 0.185, 0.118, 0.045, 0.072, 0.031, 0.066)
_COPY_PEAK_SCORE = 60.0  # the target key's scaled score q.k / sqrt(head_dim)
_COPY_MAX_OTHER = 0.85  # the most any other key may score, as a fraction of the peak


def _rotate(x, angles):
    """neox RoPE of vectors x [..., head_dim] by angles [..., head_dim / 2] (float64)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = angles.cos(), angles.sin()
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def make_weights(cfg: TinyLlamaConfig, seed: int = 0, dtype=torch.bfloat16) -> Dict[str, torch.Tensor]:
    """The model's weights as float32 tensors holding values of `dtype` (rounded once, so the
    serving model and the reference use the same numbers). Random from `seed`, with the planted
    copy head described in the module's docstring."""
    g = torch.Generator().manual_seed(seed)
    H, D, V, I = cfg.hidden, cfg.head_dim, cfg.vocab, cfg.intermediate
    NH, KV = cfg.heads, cfg.kv_heads
    group = NH // KV
    half = D // 2

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    # A shared direction b and the copy subspace Q [H, D], orthonormal and orthogonal to b.
    basis = torch.linalg.qr(randn(H, D + 1)).Q
    b, Q = basis[:, 0], basis[:, 1:]
    codes = randn(V, H, std=1.0 / math.sqrt(H))
    codes -= (codes @ b)[:, None] * b[None, :]
    emb = 1.0 * b[None, :] + codes
    w = {"embed": emb}
    norm = lambda: 1.0 + randn(H, std=0.1)

    # What b reads after the first RMSNorm (its weight included), averaged over the vocabulary: the
    # positional head's projections divide by it so its queries and keys come out at their design size.
    n1_0 = norm()
    normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True)) * n1_0
    beta = float((normed @ b).mean())

    for layer in range(cfg.layers):
        n1 = n1_0 if layer == 0 else norm()
        wq = randn(NH * D, H, std=1.0 / math.sqrt(H))
        wk = randn(KV * D, H, std=1.0 / math.sqrt(H))
        wv = randn(KV * D, H, std=1.0 / math.sqrt(H))
        wo = randn(H, NH * D, std=1.0 / math.sqrt(NH * D))
        if layer == 0:
            # KV head 0's keys: a constant k0 on the high-frequency RoPE pairs (random phases);
            # query head 0's query: k0 rotated back by copy_offset positions, so the score is
            # sum_f |k0_f|^2 cos((i - j - copy_offset) theta_f), largest at j = i - copy_offset.
            theta = cfg.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            weights = torch.zeros(half, dtype=torch.float64)
            weights[:len(_COPY_PAIR_WEIGHTS)] = torch.tensor(_COPY_PAIR_WEIGHTS, dtype=torch.float64)
            amp = torch.sqrt(weights / weights.sum() * _COPY_PEAK_SCORE * math.sqrt(D))
            phase = torch.rand(half, generator=g, dtype=torch.float64) * 2 * math.pi
            k0 = torch.cat([amp * phase.cos(), amp * phase.sin()])
            q0 = _rotate(k0, -cfg.copy_offset * theta)
            # Every other key a query sees lies between max_positions before the target and
            # copy_offset after it: each must score well below the target (exp(-(1 - 0.85) * 60)
            # of its weight at most).
            offsets = torch.arange(-cfg.max_positions, cfg.copy_offset + 1, dtype=torch.float64)
            offsets = offsets[offsets != 0]
            other = float((torch.cos(offsets[:, None] * theta[None, :]) * amp.pow(2)).sum(1).max() / amp.pow(2).sum())
            if other > _COPY_MAX_OTHER:
                raise ValueError(f"make_weights: the copy head's keys score up to {other:.2f} of the target at "
                                 f"head_dim {D}, rope_base {cfg.rope_base}, {cfg.max_positions} positions")
            wk[:D] = torch.outer(k0, b) / beta + randn(D, H, std=0.02 / math.sqrt(H))
            wq[:D] = torch.outer(q0, b) / beta + randn(D, H, std=0.02 / math.sqrt(H))
            # Its value is the token's code (the copy subspace), written back into the residual
            # stream by query head 0's output columns; the group's other query heads write nothing.
            wv[:D] = Q.t()
            wo[:, :group * D] = 0
            wo[:, :D] = 4.0 * Q
        w[f"layers.{layer}.input_norm"] = n1
        w[f"layers.{layer}.qkv"] = torch.cat([wq, wk, wv])
        w[f"layers.{layer}.o"] = wo
        w[f"layers.{layer}.post_norm"] = norm()
        w[f"layers.{layer}.gate_up"] = randn(2 * I, H, std=1.0 / math.sqrt(H))
        w[f"layers.{layer}.down"] = randn(H, I, std=1.0 / math.sqrt(I))
    w["final_norm"] = norm()
    # The LM head: token t's row reads the code of perm[t] (normalized) from the copy subspace,
    # plus a random part.
    perm = torch.randperm(V, generator=g)
    read = codes[perm] @ Q
    read = read / read.norm(dim=-1, keepdim=True)
    w["lm_head"] = 2.0 * (read @ Q.t()) + randn(V, H, std=1.5 / math.sqrt(H))
    return {k: v.to(dtype).float() for k, v in w.items()}


# --- the PyTorch reference ---


class Reference:
    """Greedy decoding of one request at a time in float32: contiguous K/V, torch SDPA."""

    def __init__(self, cfg: TinyLlamaConfig, weights, device="cpu"):
        self.cfg = cfg
        self.w = {k: v.to(device, torch.float32) for k, v in weights.items()}
        self.device = torch.device(device)
        half = cfg.head_dim // 2
        inv = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)
        assert self.cos.shape[1] == half

    def _rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * weight

    def _rope(self, x, pos):
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def _forward(self, tokens, start, cache):
        """Logits of the last of `tokens` (positions start ..), writing their K/V into cache
        (per layer, K and V buffers [max_positions, kv_heads, head_dim])."""
        cfg, w = self.cfg, self.w
        NH, KV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        n, end = len(tokens), start + len(tokens)
        pos = torch.arange(start, end, device=self.device)
        x = w["embed"][torch.tensor(tokens, device=self.device)]
        # Query t (position start + t) sees keys 0 .. start + t.
        mask = None if n == 1 else torch.arange(end, device=self.device)[None, :] <= pos[:, None]
        for layer in range(cfg.layers):
            p = f"layers.{layer}."
            h = self._rms(x, w[p + "input_norm"])
            q, k, v = (h @ w[p + "qkv"].t()).split([NH * D, KV * D, KV * D], -1)
            q = self._rope(q.view(n, NH, D), pos)
            kbuf, vbuf = cache[layer]
            kbuf[start:end] = self._rope(k.reshape(n, KV, D), pos)
            vbuf[start:end] = v.reshape(n, KV, D)
            kk = kbuf[:end].repeat_interleave(NH // KV, 1)
            vv = vbuf[:end].repeat_interleave(NH // KV, 1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               attn_mask=mask)
            x = x + a.transpose(0, 1).reshape(n, NH * D) @ w[p + "o"].t()
            h = self._rms(x, w[p + "post_norm"])
            g, u = (h @ w[p + "gate_up"].t()).chunk(2, -1)
            x = x + (F.silu(g) * u) @ w[p + "down"].t()
        return self._rms(x[-1:], w["final_norm"]) @ w["lm_head"].t()

    @torch.inference_mode()
    def generate(self, prompt: List[int], max_new_tokens: int, first_token: Optional[int] = None):
        """(tokens, logits): greedy continuation of prompt; with first_token, that token is taken as
        the first (sampled, no logits: None) and the rest continue greedily from it."""
        cfg = self.cfg
        length = len(prompt) + max_new_tokens
        cache = [tuple(torch.empty(length, cfg.kv_heads, cfg.head_dim, device=self.device) for _ in range(2))
                 for _ in range(cfg.layers)]
        out, logits = [], []
        feed, start = list(prompt), 0
        if first_token is not None:
            feed.append(first_token)
            out.append(first_token)
            logits.append(None)
        while len(out) < max_new_tokens:
            row = self._forward(feed, start, cache)[0]
            start += len(feed)
            tok = int(row.argmax())
            out.append(tok)
            logits.append(row.cpu())
            feed = [tok]
        return out, logits


# --- the model on kiln's ops ---


class KilnLlama:
    """The model's forward over a packed batch of new tokens, with per-layer paged K/V caches."""

    def __init__(self, cfg: TinyLlamaConfig, weights, num_blocks: int, page_size: int, device, dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.num_blocks, self.page_size = num_blocks, page_size
        self.w = {k: v.to(self.device, dtype) for k, v in weights.items()}
        self.lm_head = weights["lm_head"].to(self.device, torch.float32)  # logits in float32
        shape = (num_blocks, page_size, cfg.kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, device=self.device, dtype=dtype),
                        torch.zeros(shape, device=self.device, dtype=dtype)) for _ in range(cfg.layers)]
        self.rope = kt.RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_base, "neox")
        self.decode = kt.BatchDecodeWithPagedKVCache(cfg.heads, cfg.kv_heads, cfg.head_dim, page_size=page_size)
        self.prefill = kt.BatchPrefillWithPagedKVCache(cfg.heads, cfg.kv_heads, cfg.head_dim, page_size=page_size)

    @torch.inference_mode()
    def forward(self, tokens, positions, slots, copies, tables, seq_lens, q_lens, logit_rows, check_tables=True):
        """Float32 logits [len(logit_rows), vocab]. tokens, positions, slots: per packed row (host
        lists); copies: (src, dst) block pairs to run first; tables [batch, max_blocks], seq_lens
        and q_lens per request, in the rows' order (host int32 tensors)."""
        cfg, w, dev = self.cfg, self.w, self.device
        NH, KV, D, H = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
        n = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        slot = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        decode_only = int(q_lens.max()) == 1 and n == q_lens.shape[0]
        if decode_only:
            attn = self.decode.plan(tables, seq_lens, self.num_blocks, device=dev, check_tables=check_tables)
        else:
            cu = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32)
            torch.cumsum(q_lens, 0, out=cu[1:])
            attn = self.prefill.plan(tables, seq_lens, self.num_blocks, cu_seqlens_q=cu, device=dev,
                                     check_tables=check_tables)
        if copies:
            pairs = torch.tensor(copies, dtype=torch.int32).to(dev)
            for kc, vc in self.caches:
                kt.copy_blocks(kc, vc, pairs)
        x = w["embed"][tok]
        residual = None
        for layer, (kc, vc) in enumerate(self.caches):
            p = f"layers.{layer}."
            if residual is None:
                h, residual = kt.rms_norm(x, [H], w[p + "input_norm"], cfg.eps), x
            else:
                h, residual = kt.add_rms_norm(x, residual, w[p + "input_norm"], cfg.eps)
            qkv = h @ w[p + "qkv"].t()
            q = qkv[:, :NH * D].view(n, NH, D)
            k = qkv[:, NH * D:(NH + KV) * D].view(n, KV, D)
            v = qkv[:, (NH + KV) * D:].view(n, KV, D)
            q, k = self.rope(q, k, pos)
            kt.reshape_and_cache(k, v, kc, vc, slot)
            a = attn(q, kc, vc)
            h, residual = kt.add_rms_norm(a.reshape(n, NH * D) @ w[p + "o"].t(), residual, w[p + "post_norm"], cfg.eps)
            x = kt.act_and_mul(h @ w[p + "gate_up"].t(), "silu") @ w[p + "down"].t()
        rows = torch.tensor(logit_rows, dtype=torch.int64).to(dev, non_blocking=True)
        h, _ = kt.add_rms_norm(x[rows], residual[rows], w["final_norm"], cfg.eps)
        return h.float() @ self.lm_head.t()


# --- requests and the serving loop ---


@dataclasses.dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    arrival: int = 0
    # Parallel sampling: (child id, child's max_new_tokens, child's first token) per fork, made
    # when this request's first token is out.
    forks: List[tuple] = dataclasses.field(default_factory=list)
    first_token: Optional[int] = None  # a fork child's sampled first token
    # runtime state
    computed: int = 0  # tokens whose K/V are in the cache
    cached: int = 0  # prompt tokens found in the prefix cache at admission
    out: List[int] = dataclasses.field(default_factory=list)
    logits: List[Optional[torch.Tensor]] = dataclasses.field(default_factory=list)
    chunks: int = 0  # forward steps its prompt took
    prefill_started: int = -1  # the step of its first chunk
    admitted_step: int = -1
    finished_step: int = -1

    def fresh(self):
        """This request as submitted, without any serving state."""
        return Request(self.rid, list(self.prompt), self.max_new_tokens, self.arrival, list(self.forks))

    @property
    def prefilling(self):
        return self.computed < len(self.prompt)


def make_workload(cfg: TinyLlamaConfig, num_requests: int, seed: int = 0, shared_prefix: int = 64,
                  prompt_len=(8, 160), new_tokens=(4, 40), arrival_every: float = 0.5, fork_every: int = 6,
                  duplicate_every: int = 9):
    """Requests with different prompt lengths arriving over time: most start with one shared
    prefix of shared_prefix tokens (a system prompt), every duplicate_every-th repeats an earlier
    prompt exactly, every fork_every-th forks one child after its first token. Every prompt is
    longer than the copy head's offset."""
    rng = random.Random(seed)
    system = [rng.randrange(cfg.vocab) for _ in range(shared_prefix)]
    reqs, child = [], num_requests
    lo = max(prompt_len[0], cfg.copy_offset + 1)
    for i in range(num_requests):
        if duplicate_every and i % duplicate_every == duplicate_every - 1 and reqs:
            prompt = list(reqs[rng.randrange(len(reqs))].prompt)
        else:
            own = [rng.randrange(cfg.vocab) for _ in range(rng.randint(lo, prompt_len[1]))]
            prompt = system + own if rng.random() < 0.75 else own
        r = Request(i, prompt, rng.randint(*new_tokens), arrival=int(i * arrival_every))
        if fork_every and i % fork_every == fork_every - 1:
            r.forks.append((child, rng.randint(*new_tokens), rng.randrange(cfg.vocab)))
            child += 1
        reqs.append(r)
    return reqs


class Server:
    """Continuous batching over one KVCacheManager: each step packs the running requests' decode
    tokens and prompt chunks (up to max_step_tokens tokens, max_running requests, at most max_chunk
    tokens of one prompt) into one forward.

    Admission reserves, for every running request, the blocks it can still grow by (to its last
    token, plus a copy-on-write block), so decodes never run out of blocks; a request that does
    not fit waits at the head of the queue. The manager registers a prompt's full blocks in the
    prefix cache when it lays them out, before their K/V are written; a request whose prefix hit
    lands on blocks that another request's chunked prefill has not written yet waits until they
    are (or until the step that writes them: in a step, every layer writes all new K/V before its
    attention reads)."""

    def __init__(self, model: KilnLlama, max_running: int = 64, max_step_tokens: int = 256,
                 max_chunk: Optional[int] = None, keep_logits: bool = True, check: bool = True):
        self.model = model
        cfg = model.cfg
        self.page = model.page_size
        # (The manager's dtype only sizes bytes_per_block; a float32 model is labelled f16.)
        self.manager = KVCacheManager(model.num_blocks, page_size=self.page, num_layers=cfg.layers,
                                      num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, prefix_caching=True,
                                      dtype="bf16" if model.dtype == torch.bfloat16 else "f16")
        self.max_running, self.max_step_tokens = max_running, max_step_tokens
        self.max_chunk = max_chunk or max_step_tokens
        self.keep_logits, self.check = keep_logits, check
        self.plan = SlotPlan()
        self.unwritten = set()  # laid-out blocks whose K/V are not all written yet
        self.counters = dict(steps=0, decode_only_steps=0, mixed_steps=0, prefill_tokens=0, decode_tokens=0,
                             deferred_admissions=0, blocked_on_prefix=0, cow_copies=0, copies_run=0, forks=0,
                             max_batch=0)

    # A request's blocks: how many it needs at its end, and how many it may still take.
    def _final_blocks(self, r, max_new=None):
        return -(-(len(r.prompt) + (max_new or r.max_new_tokens) - 1) // self.page)

    def _growth(self, r):
        """Blocks r may still take: to its last token, a copy-on-write block, and its forks' own."""
        have = len(self.manager.block_table(r.rid)) if r.admitted_step >= 0 else 0
        g = max(self._final_blocks(r) - have, 0) + 1
        if not r.out:  # not forked yet
            g += sum(self._final_blocks(r, m) - len(r.prompt) // self.page + 1 for _, m, _ in r.forks)
        return g

    def _slots(self, rid, start, end):
        table = self.manager.block_table(rid)
        return [table[p // self.page] * self.page + p % self.page for p in range(start, end)]

    def _ready(self, r, written_now):
        """Whether the prefix-hit blocks r reads are written, or will be by this step's writes."""
        table = self.manager.block_table(r.rid)
        return not any(b in self.unwritten and b not in written_now for b in table[:r.cached // self.page])

    def run(self, requests: List[Request], max_steps: int = 100000):
        """Serves the requests; returns {rid: Request} (fork children included), each with its
        tokens (out) and, with keep_logits, the float32 logits that chose them."""
        m, page = self.manager, self.page
        pending = sorted((r.fresh() for r in requests), key=lambda r: (r.arrival, r.rid))
        waiting, running, done = [], [], {}
        step = 0
        while pending or waiting or running:
            if step >= max_steps:
                raise RuntimeError(f"serving did not finish in {max_steps} steps")
            while pending and pending[0].arrival <= step:
                waiting.append(pending.pop(0))
            batch = []  # (request, new tokens, first position, slots)
            written_now = set()  # blocks this step's writes complete
            # 1. Every running request past its prompt decodes one token: its slot (and a copy of a
            #    shared last block) from append_slots.
            self.plan.clear()
            decoding = [r for r in running if not r.prefilling]
            for r in decoding:
                m.append_slots(r.rid, [r.out[-1]], self.plan)
            copies = self.plan.copies
            for r, s in zip(decoding, self.plan.slot_mapping):
                assert not self.check or s == self._slots(r.rid, r.computed, r.computed + 1)[0]
                batch.append((r, [r.out[-1]], r.computed, [s]))
                if (r.computed + 1) % page == 0:
                    written_now.add(m.block_table(r.rid)[r.computed // page])
            budget = self.max_step_tokens - len(decoding)

            def take_chunk(r):
                nonlocal budget
                if budget <= 0 or not self._ready(r, written_now):
                    return
                n = min(budget, self.max_chunk, len(r.prompt) - r.computed)
                batch.append((r, r.prompt[r.computed:r.computed + n], r.computed,
                              self._slots(r.rid, r.computed, r.computed + n)))
                r.chunks += 1
                if r.prefill_started < 0:
                    r.prefill_started = step
                budget -= n
                written_now.update(m.block_table(r.rid)[r.computed // page:(r.computed + n) // page])

            # 2. Prompts being prefilled go on, oldest first.
            for r in running:
                if r.prefilling:
                    take_chunk(r)
            # 3. Waiting requests join while the batch and the pool have room.
            reserved = sum(self._growth(r) for r in running) if waiting else 0
            while waiting and len(running) < self.max_running:
                r = waiting[0]
                need = self._final_blocks(r) + 1 + sum(self._final_blocks(r, mn) + 1 for _, mn, _ in r.forks)
                admission = m.can_allocate_prompt(r.prompt)
                if admission == "never" or need > m.num_blocks:
                    raise RuntimeError(f"request {r.rid} can never fit the pool of {m.num_blocks} blocks")
                if admission != "now" or m.stats()["free_blocks"] - reserved < need:
                    self.counters["deferred_admissions"] += 1
                    break
                waiting.pop(0)
                plan = SlotPlan()
                r.cached = r.computed = m.allocate(r.rid, r.prompt, plan)
                r.admitted_step = step
                assert not self.check or (plan.slot_mapping == self._slots(r.rid, r.cached, len(r.prompt))
                                          and not plan.copies)
                self.unwritten.update(m.block_table(r.rid)[r.cached // page:])
                reserved += self._growth(r)
                running.append(r)
                if not self._ready(r, written_now):
                    self.counters["blocked_on_prefix"] += 1
                take_chunk(r)
            if batch:
                self._forward(batch, copies, step, running, done)
                self.counters["copies_run"] += len(copies)
            elif copies:
                raise RuntimeError("block copies planned for an empty step")
            self.unwritten -= written_now
            if self.check:
                m.check()
            step += 1
        self.counters["steps"] = step
        stats = m.stats()
        self.counters.update(prefix_hit_tokens=stats["prefix_hit_tokens"],
                             prefix_queried_tokens=stats["prefix_queried_tokens"], cow_copies=stats["cow_copies"],
                             evictions=stats["evictions"])
        return done

    def _forward(self, batch, copies, step, running, done):
        m = self.manager
        tokens, positions, slots, logit_rows, emits = [], [], [], [], []
        tables = []
        for r, toks, p0, s in batch:
            tokens += toks
            positions += range(p0, p0 + len(toks))
            slots += s
            tables.append(m.block_table(r.rid))
            if p0 + len(toks) >= len(r.prompt):  # a decode token, or a prompt's last chunk
                logit_rows.append(len(tokens) - 1)
                emits.append(r)
        width = max(len(t) for t in tables)
        table_t = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table_t[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        q_lens = torch.tensor([len(toks) for _, toks, _, _ in batch], dtype=torch.int32)
        seq_lens = torch.tensor([p0 + len(toks) for _, toks, p0, _ in batch], dtype=torch.int32)
        self.counters["max_batch"] = max(self.counters["max_batch"], len(batch))
        decode_only = all(len(toks) == 1 for _, toks, _, _ in batch)  # what KilnLlama runs as a decode
        self.counters["decode_only_steps" if decode_only else "mixed_steps"] += 1
        logits = self.model.forward(tokens, positions, slots, copies, table_t, seq_lens, q_lens, logit_rows,
                                    check_tables=self.check)
        next_tokens = logits.argmax(-1).tolist()
        if self.keep_logits:
            logits = logits.cpu()
        for r, toks, p0, _ in batch:
            if p0 >= len(r.prompt):
                self.counters["decode_tokens"] += 1
            else:
                self.counters["prefill_tokens"] += len(toks)
            r.computed = p0 + len(toks)
        for i, (r, tok) in enumerate(zip(emits, next_tokens)):
            r.out.append(tok)
            r.logits.append(logits[i] if self.keep_logits else None)
            if len(r.out) == 1:
                for child_id, max_new, first in r.forks:  # parallel sampling: the child's first token is sampled
                    m.fork(r.rid, child_id)
                    c = Request(child_id, r.prompt, max_new, first_token=first, computed=r.computed, cached=r.cached,
                                out=[first], logits=[None], admitted_step=step)
                    self.counters["forks"] += 1
                    running.append(c)
                    if len(c.out) >= c.max_new_tokens:
                        self._finish(c, step, running, done)
            if len(r.out) >= r.max_new_tokens:
                self._finish(r, step, running, done)

    def _finish(self, r, step, running, done):
        # Its last block may be partly written: it is not in the prefix cache, and leaves the set.
        self.unwritten.difference_update(self.manager.block_table(r.rid))
        self.manager.free(r.rid)
        r.finished_step = step
        running.remove(r)
        done[r.rid] = r


# --- checking against the reference ---


def reference_results(cfg, weights, requests, device="cpu"):
    """{rid: (tokens, logits)} from the reference, for the requests and their fork children."""
    ref = Reference(cfg, weights, device)
    out = {}
    for r in requests:
        out[r.rid] = ref.generate(r.prompt, r.max_new_tokens)
        for child_id, max_new, first in r.forks:
            out[child_id] = ref.generate(r.prompt, max_new, first_token=first)
    return out


# The logits tolerance, relative to the largest logit of the step: what the serving dtype's
# rounding of activations leaves (both sides use the same weights).
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check_results(served, expected, rtol):
    """Compares every request's tokens (exactly) and logits (within rtol of the logits' largest
    magnitude) with the reference. Returns a report: the smallest reference margin (top logit minus
    the second) over all compared steps, the largest logit difference, and the mismatches found
    (each with its step's margin and logit difference, so a flip between near-equal logits reads as
    one)."""
    report = dict(requests=len(expected), tokens=0, min_margin=math.inf, max_logit_diff=0.0, max_abs_logit=0.0,
                  token_mismatches=[], logit_mismatches=[])
    for rid, (want_tokens, want_logits) in sorted(expected.items()):
        got = served[rid]
        for i, want in enumerate(want_tokens):
            report["tokens"] += 1
            got_tok = got.out[i] if i < len(got.out) else None
            wl, gl = want_logits[i], (got.logits[i] if i < len(got.logits) else None)
            if wl is not None and gl is not None:
                top2 = wl.topk(2).values
                margin = float(top2[0] - top2[1])
                diff = float((gl - wl).abs().max())
                scale = float(wl.abs().max())
                report["min_margin"] = min(report["min_margin"], margin)
                report["max_logit_diff"] = max(report["max_logit_diff"], diff)
                report["max_abs_logit"] = max(report["max_abs_logit"], scale)
                if diff > rtol * scale:
                    report["logit_mismatches"].append(dict(rid=rid, step=i, diff=diff, scale=scale))
            else:
                margin = diff = None
            if got_tok != want:
                report["token_mismatches"].append(dict(rid=rid, step=i, got=got_tok, want=want, margin=margin,
                                                        logit_diff=diff))
                break  # the contexts differ from here on
        if len(got.out) != len(want_tokens):
            report["token_mismatches"].append(dict(rid=rid, step=len(want_tokens), got=len(got.out),
                                                   want=len(want_tokens), margin=None, logit_diff=None))
    return report


def serve_and_compare(requests, dtype, device, num_blocks, page=16, max_running=16, max_step_tokens=128,
                      max_chunk=None, seed=0, cfg=None, reference_device="cpu"):
    """Serves the requests on kiln (checking the manager's invariants every step) and compares
    them with the reference: (server, {rid: Request}, check_results' report)."""
    cfg = cfg or TinyLlamaConfig()
    weights = make_weights(cfg, seed, torch.bfloat16 if dtype == torch.float32 else dtype)
    model = KilnLlama(cfg, weights, num_blocks, page, device, dtype)
    server = Server(model, max_running=max_running, max_step_tokens=max_step_tokens, max_chunk=max_chunk,
                    keep_logits=True, check=True)
    served = server.run(requests)
    expected = reference_results(cfg, weights, requests, reference_device)
    return server, served, check_results(served, expected, RTOL[dtype])


def describe(report):
    """check_results' report in a few lines (for assertion messages)."""
    lines = [f"{report['tokens']} tokens of {report['requests']} requests: smallest reference margin "
             f"{report['min_margin']:.4g}, largest logit difference {report['max_logit_diff']:.4g} (logits up to "
             f"{report['max_abs_logit']:.4g})"]
    for m in report["token_mismatches"][:8]:
        lines.append(f"  request {m['rid']} token {m['step']}: got {m['got']}, want {m['want']} (reference margin "
                     f"{m['margin']}, logit difference {m['logit_diff']})")
    for m in report["logit_mismatches"][:8]:
        lines.append(f"  request {m['rid']} token {m['step']}: logits differ by {m['diff']:.4g} "
                     f"(scale {m['scale']:.4g})")
    return "\n".join(lines)


# --- the benchmark ---


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 requests, at most 64 running")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256, help="most requests running at once")
    ap.add_argument("--step-tokens", type=int, default=2048, help="tokens per step (decode + prompt chunks)")
    ap.add_argument("--max-chunk", type=int, help="most tokens of one prompt per step (default: --step-tokens)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, nargs=2, default=(64, 192))
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check", type=int, default=16, help="compare the first N requests with the reference (0: none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrency = min(args.requests, 128), min(args.concurrency, 64)
    cfg = TinyLlamaConfig()
    dtype = DTYPES[args.dtype]
    weights = make_weights(cfg, seed=0, dtype=dtype)
    reqs = make_workload(cfg, args.requests, seed=1, shared_prefix=256, prompt_len=tuple(args.prompt_len),
                         new_tokens=tuple(args.new_tokens), arrival_every=0.0, fork_every=8, duplicate_every=0)
    tokens_max = max(len(r.prompt) for r in reqs) + args.new_tokens[1]
    if tokens_max > cfg.max_positions:
        sys.exit(f"requests reach {tokens_max} tokens, past the model's {cfg.max_positions} positions")
    num_blocks = args.concurrency * (-(-tokens_max // args.page) + 2) + 64
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def serve(requests):
        model = KilnLlama(cfg, weights, num_blocks, args.page, args.device, dtype)
        server = Server(model, max_running=args.concurrency, max_step_tokens=args.step_tokens,
                        max_chunk=args.max_chunk, keep_logits=False, check=False)
        sync()
        t0 = time.perf_counter()
        done = server.run(requests)
        sync()
        return done, time.perf_counter() - t0, server.counters

    # Warm-up: the kernel variants the run takes (decode, prompt chunks, copies) compiled and loaded
    # before the timed run.
    serve(make_workload(cfg, 32, seed=2, shared_prefix=32, prompt_len=tuple(args.prompt_len), new_tokens=(2, 8),
                        arrival_every=0.0, fork_every=4))
    done, seconds, counters = serve(reqs)
    generated = sum(len(r.out) for r in done.values())
    computed = counters["prefill_tokens"] + counters["decode_tokens"]
    result = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  torch=torch.__version__, dtype=args.dtype, config=dataclasses.asdict(cfg), page=args.page,
                  requests=len(done), concurrency=args.concurrency, step_tokens=args.step_tokens, seconds=seconds,
                  generated_tokens=generated, computed_tokens=computed, decode_tokens_per_s=generated / seconds,
                  total_tokens_per_s=(computed + counters["prefix_hit_tokens"]) / seconds,
                  computed_tokens_per_s=computed / seconds, counters=counters)
    print(f"{result['device']} {args.dtype}: {len(done)} requests ({len(reqs)} + forks), at most {args.concurrency} "
          f"running, {counters['steps']} steps in {seconds:.2f} s")
    print(f"  generated {generated} tokens: {result['decode_tokens_per_s']:.0f} tokens/s")
    print(f"  computed {computed} tokens (prefill {counters['prefill_tokens']} + decode {counters['decode_tokens']}): "
          f"{result['computed_tokens_per_s']:.0f} tokens/s; with the {counters['prefix_hit_tokens']} prefix-cache hits "
          f"{result['total_tokens_per_s']:.0f} tokens/s")
    if args.check:
        sub = reqs[:args.check]
        ref_device = args.device
        t0 = time.perf_counter()
        expected = reference_results(cfg, weights, sub, ref_device)
        sync()
        ref_seconds = time.perf_counter() - t0
        ref_tokens = sum(len(t) for t, _ in expected.values())
        # The compared requests again, served by themselves with their logits kept.
        model = KilnLlama(cfg, weights, num_blocks, args.page, args.device, dtype)
        served = Server(model, max_running=args.concurrency, max_step_tokens=args.step_tokens,
                        max_chunk=args.max_chunk, check=True).run(sub)
        report = check_results(served, expected, RTOL[dtype])
        result.update(reference_seconds=ref_seconds, reference_tokens=ref_tokens,
                      reference_tokens_per_s=ref_tokens / ref_seconds, check=report)
        print(f"  reference (float32, one request at a time, {ref_device}): {len(expected)} requests, {ref_tokens} "
              f"tokens in {ref_seconds:.2f} s = {ref_tokens / ref_seconds:.0f} tokens/s")
        print(f"  check: {report['tokens']} tokens, {len(report['token_mismatches'])} token mismatches, "
              f"{len(report['logit_mismatches'])} logit mismatches; smallest margin {report['min_margin']:.3g}, "
              f"largest logit difference {report['max_logit_diff']:.3g} (logits up to {report['max_abs_logit']:.3g})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    if args.check and (report["token_mismatches"] or report["logit_mismatches"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
