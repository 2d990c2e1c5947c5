"""kiln's shape sweep: every op of bench/sweep/models.py, forward and backward, at every distinct
size of the public models it lists, against the best of PyTorch eager, torch.compile, Liger and
cuBLAS measured in the same process.

  python3 bench/sweep/run.py [--ops a,b,...] [--models m,...] [--rows t1,...] [--kernels] [--shard I/N]
                             [--budget-s S] [--quick] [--plan]
                             [--done EARLIER.json,...] [--device cuda|cpu] --json OUT.json

Each distinct size is measured once and lists the models it stands for. At every point kiln's
outputs (and gradients) are first checked against an fp32 eager reference on fresh random inputs
(GEMMs: on up to CHECK_ROWS rows, the first, the last and some between); a kiln that raises or
disagrees makes the point an error. Then each contender is timed on the
device: R back-to-back calls captured in one CUDA graph, each call on another of S input sets
(together over 3x the L2, so no call finds its inputs in cache), replayed several times with CUDA
events around each replay; the time per call is the median replay over R. Backward ops time
torch.autograd.grad over a forward built beforehand, the same way for every contender. A contender
whose capture fails is timed with events around a loop of calls instead ("events"). A peer that
cannot run a point is recorded absent, with the reason. Memory-bound ops also time a device copy
of the bytes the op must move (each input read once, each output written once) the same way:
copy_fraction = copy time / kiln's time.

The JSON is rewritten after every op (and every WRITE_EVERY_S seconds), so a timeout leaves what
was measured. --budget-s stops before the next point once that many seconds have passed since
start; the points left are recorded as not run, and a later call with --done (the earlier JSON)
measures only those. --shard I/N (I from 1) runs the I-th of N parts
of the point list, cut in contiguous runs of points of about equal estimated time, so that a
shard compiles few torch.compile graphs. --plan prints the points and the estimated time per op
and shard without measuring. --quick keeps a few points per op. --device cpu is a smoke mode:
tiny sizes, kiln and eager only, wall-clock timing, and the ops kiln runs on CUDA only skipped.
report.py turns the JSON into the tables.
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

_START = time.monotonic()  # the budget counts the imports too


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


models = _load("sweep_models", "models.py")
report = _load("sweep_report", "report.py")

import torch  # noqa: E402

import kiln  # noqa: E402
import kiln.torch as kt  # noqa: E402

F = torch.nn.functional
DTYPE = torch.bfloat16
EPS = 1e-6
LN_EPS = 1e-5
TOL = 2e-2
ACTIVATIONS = ("silu", "gelu_tanh")
FP8_SCALINGS = ("tensor", "block")
GATED_ACTIVATION = "silu"

WARMUP = 3
REPLAYS = 7  # timed, after one untimed replay
MIN_REPLAY_US = 200.0
MAX_CALLS = 256
MAX_SETS = 64
SET_MEMORY = 8 << 30
L2_FALLBACK = 50 << 20
CHECK_ROWS = 512  # GEMM rows checked against the fp32 product
WRITE_EVERY_S = 30.0
CPU_MIN_LOOP_US = 2000.0

# --compile dynamic: one torch.compile graph per op with every size symbolic (what dynamo
# settles on by default once it has seen a second width), instead of one per width and stride.
COMPILE_MODE = {"dynamic": False}

QUICK_MODELS = ("llama3-8b", "qwen2.5-0.5b", "odd-k")
QUICK_ROWS = ("t3", "b3x1337")


# --- the ops: inputs, contenders, reference, bytes ---


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_err(actual, ref):
    actual, ref = actual.float(), ref.float()
    den = ref.norm().item()
    num = (actual - ref).norm().item()
    return num / den if den > 0 else num


class Contender:
    """One way of running an op: fn(*set[args]); `prepare` adds tensors derived from a set
    (outside the timing), `grads` names the inputs a backward differentiates, `dynamic` the dims
    torch.compile treats as dynamic."""

    def __init__(self, fn, args, grads=(), prepare=None, dynamic=None):
        self.fn, self.args, self.grads, self.prepare, self.dynamic = fn, args, grads, prepare, dynamic or {}


class Op:
    """An op of the sweep (forward, or its backward), at one variant."""

    name = ""
    args = ()  # kiln's inputs, from the set
    eager_args = None  # eager's and torch.compile's, when not kiln's
    grads = ()
    eager = None  # the natural PyTorch code, on eager_args
    dynamic = {}  # the set's tensors and their token dims, for torch.compile
    memory_bound = True
    variant = ""

    def __init__(self, backward=False, variant=""):
        self.backward = backward
        self.variant = variant
        self.cuda_only = not kiln.ops.OPS[self.name].cpu  # kiln has no CPU fallback for it
        self.op_name = self.name + ("_backward" if backward else "")
        self.label = self.op_name + (f"[{variant}]" if variant else "")

    def kiln_contender(self):
        return Contender(self.kiln, self.args, self.grads)

    def torch_contenders(self, compiled):
        """Eager and, where compiled is given, torch.compile of the eager code: {} where the op has
        no eager peer (cuBLAS is its peer)."""
        if self.eager is None:
            return {}
        args = self.eager_args or self.args
        out = {"eager": Contender(self.eager, args, self.grads)}
        if compiled is not None:
            out["compile"] = Contender(compiled(self), args, self.grads,
                                       dynamic=None if COMPILE_MODE["dynamic"] else self.dynamic)
        return out

    def peers(self, liger):
        """The peers beside eager and torch.compile: {name: Contender, or why that peer is absent}."""
        return {}

    def check(self, s):
        """kiln's largest relative error (outputs, then gradients) against the fp32 reference."""
        c = self.kiln_contender()
        d = dict(s)
        if self.backward:
            for k in c.grads:
                d[k] = d[k].detach().requires_grad_()
        outs = as_tuple(c.fn(*(d[k] for k in c.args)))
        ref_in = {}
        for k in c.args:
            v = s[k].detach()
            if self.backward and k in c.grads:
                ref_in[k] = v.to(torch.float32, copy=True).requires_grad_()
            else:
                ref_in[k] = v.float() if v.is_floating_point() else v
        refs = as_tuple(self.reference(*(ref_in[k] for k in c.args)))
        errs = [rel_err(o, r) for o, r in zip(outs, refs)]
        if self.backward:
            dys = [torch.randn_like(o) for o in outs]
            got = torch.autograd.grad(outs, [d[k] for k in c.grads], dys)
            want = torch.autograd.grad(refs, [ref_in[k] for k in c.grads], [g.float() for g in dys])
            errs += [rel_err(g, w) for g, w in zip(got, want)]
        return max(errs)

    def check_peer(self, name, contender, s):
        """A peer's relative error where its results need checking (cuBLAS's scale layouts), else None."""
        return None


class RowOp(Op):
    """An op over rows of `cols` (the point's width; inputs are `width` wide), as strided views
    into wider rows when the point's row_stride says so (the padding is row_stride - cols)."""

    width = 1  # input width / cols

    def rows_input(self, p, dev):
        w = p["cols"] * self.width
        pad = p["row_stride"] - p["cols"]
        base = torch.randn(p["rows"], w + pad, device=dev, dtype=DTYPE)
        return base[:, :w] if pad else base

    def row_bytes(self, p):
        return p["rows"] * p["cols"] * 2


class RmsNorm(RowOp):
    name = "rms_norm"
    args = ("x", "w")
    grads = ("x", "w")
    dynamic = {"x": (0,)}

    def make_set(self, p, dev):
        return {"x": self.rows_input(p, dev), "w": torch.randn(p["cols"], device=dev, dtype=DTYPE)}

    @staticmethod
    def kiln(x, w):
        return kt.rms_norm(x, [x.shape[-1]], w, EPS)

    @staticmethod
    def eager(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    @staticmethod
    def reference(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def peers(self, liger):
        if isinstance(liger, str):
            return {"liger": liger}
        return {"liger": Contender(lambda x, w: liger.rms_norm(x, w, EPS, 0.0, "llama", True), self.args, self.grads)}

    def moved_bytes(self, p):
        rc, c = self.row_bytes(p), p["cols"] * 2
        return 3 * rc + 2 * c if self.backward else 2 * rc + c  # backward: dy, x in, dx out; w in, dw out


class AddRmsNorm(RowOp):
    name = "add_rms_norm"
    args = ("x", "r", "w")
    grads = ("x", "r", "w")
    dynamic = {"x": (0,), "r": (0,)}

    def make_set(self, p, dev):
        return {"x": self.rows_input(p, dev), "r": self.rows_input(p, dev),
                "w": torch.randn(p["cols"], device=dev, dtype=DTYPE)}

    @staticmethod
    def kiln(x, r, w):
        return kt.add_rms_norm(x, r, w, EPS)

    @staticmethod
    def eager(x, r, w):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), w, EPS), h

    @staticmethod
    def reference(x, r, w):
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w, h

    def peers(self, liger):
        if isinstance(liger, str):
            return {"liger": liger}
        return {"liger": Contender(lambda x, r, w: liger.add_rms_norm(x, r, w, EPS, 0.0, "llama", True),
                                   self.args, self.grads)}

    def moved_bytes(self, p):
        # forward: x, r in, y, h out; backward: dy, dh, h in, dx (= dr) out.
        rc, c = self.row_bytes(p), p["cols"] * 2
        return 4 * rc + (2 * c if self.backward else c)


class LayerNorm(RowOp):
    name = "layer_norm"
    args = ("x", "w", "b")
    grads = ("x", "w", "b")
    dynamic = {"x": (0,)}

    def make_set(self, p, dev):
        return {"x": self.rows_input(p, dev), "w": torch.randn(p["cols"], device=dev, dtype=DTYPE),
                "b": torch.randn(p["cols"], device=dev, dtype=DTYPE)}

    @staticmethod
    def kiln(x, w, b):
        return kt.layer_norm(x, w, b, LN_EPS)

    @staticmethod
    def eager(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)

    @staticmethod
    def reference(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)

    def peers(self, liger):
        if isinstance(liger, str):
            return {"liger": liger}
        return {"liger": Contender(lambda x, w, b: liger.layer_norm(x, w, b, LN_EPS), self.args, self.grads)}

    def moved_bytes(self, p):
        # backward: dy, x in, dx out; w in, dw and db out.
        rc, c = self.row_bytes(p), p["cols"] * 2
        return 3 * rc + 3 * c if self.backward else 2 * rc + 2 * c


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


class ActAndMul(RowOp):
    """act(x[:, :cols]) * x[:, cols:]. Liger takes the gate and the up halves as two tensors (its
    MLP computes them with two projections): they are split off before its timing."""

    name = "act_and_mul"
    width = 2
    args = ("x",)
    grads = ("x",)
    dynamic = {"x": (0,)}

    def __init__(self, backward=False, variant="silu"):
        super().__init__(backward, variant)
        act, name = _ACTS[variant], variant
        self.kiln = lambda x: kt.act_and_mul(x, name)

        def eager(x):
            g, u = x.chunk(2, dim=-1)
            return act(g) * u

        self.eager = eager
        self.reference = eager

    def make_set(self, p, dev):
        return {"x": self.rows_input(p, dev)}

    def peers(self, liger):
        if self.variant not in ("silu", "gelu_tanh"):
            return {}
        if isinstance(liger, str):
            return {"liger": liger}
        fn = liger.silu_mul if self.variant == "silu" else liger.gelu_tanh_mul

        def halves(d):
            half = d["x"].shape[-1] // 2
            return {"a": d["x"][:, :half].contiguous(), "b": d["x"][:, half:].contiguous()}

        return {"liger": Contender(fn, ("a", "b"), ("a", "b"), prepare=halves)}

    def moved_bytes(self, p):
        # forward: x (2 halves) in, out; backward: x, dy in, dx out.
        return (5 if self.backward else 3) * self.row_bytes(p)


class Rope(Op):
    """apply_rope_qk (neox) on q [tokens, q_heads, d] and k [tokens, kv_heads, d]: kiln from its
    float32 [seq, d/2] tables and positions; eager and Liger from full-width bf16 cos/sin
    [seq, d], as Hugging Face models pass them (Liger on [batch, heads, seq, d] views)."""

    name = "apply_rope_qk"
    args = ("q", "k", "cos", "sin", "pos")
    eager_args = ("q", "k", "cos_f", "sin_f")
    grads = ("q", "k")
    dynamic = {"q": (0,), "k": (0,), "cos_f": (0,), "sin_f": (0,)}

    def make_set(self, p, dev):
        d, seq = p["head_dim"], p["seq"]
        cos, sin = rope_tables(seq, d, dev)
        return {"q": torch.randn(p["tokens"], p["q_heads"], d, device=dev, dtype=DTYPE),
                "k": torch.randn(p["tokens"], p["kv_heads"], d, device=dev, dtype=DTYPE),
                "cos": cos, "sin": sin, "pos": torch.arange(seq, device=dev).repeat(p["batch"]),
                "cos_f": torch.cat((cos, cos), -1).to(DTYPE), "sin_f": torch.cat((sin, sin), -1).to(DTYPE)}

    @staticmethod
    def kiln(q, k, cos, sin, pos):
        return kt.apply_rope_qk(q, k, cos, sin, pos, "neox")

    @staticmethod
    def eager(q, k, cos, sin):
        seq = cos.shape[0]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        q4 = q.view(-1, seq, q.shape[1], q.shape[2])
        k4 = k.view(-1, seq, k.shape[1], k.shape[2])
        return (q4 * c + rotate_half(q4) * s).view(q.shape), (k4 * c + rotate_half(k4) * s).view(k.shape)

    @staticmethod
    def reference(q, k, cos, sin, pos):
        c = torch.cat((cos[pos], cos[pos]), -1)[:, None, :]
        s = torch.cat((sin[pos], sin[pos]), -1)[:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    def peers(self, liger):
        if isinstance(liger, str):
            return {"liger": liger}

        def fn(q, k, cos, sin):
            seq = cos.shape[0]
            q4 = q.view(-1, seq, q.shape[1], q.shape[2]).transpose(1, 2)
            k4 = k.view(-1, seq, k.shape[1], k.shape[2]).transpose(1, 2)
            return liger.rope(q4, k4, cos[None], sin[None])

        return {"liger": Contender(fn, self.eager_args, self.grads)}

    def moved_bytes(self, p):
        qk = p["tokens"] * (p["q_heads"] + p["kv_heads"]) * p["head_dim"] * 2
        return 2 * qk + p["seq"] * p["head_dim"] * 4 + p["tokens"] * 8  # both tables, positions


def rope_tables(seq, d, dev):
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
    angles = torch.arange(seq, device=dev, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


class RmsNormRope(Op):
    """RMSNorm over x [batch, seq, q_heads * d], then RoPE (neox) on each head, with cos/sin
    [seq, d] in bf16."""

    name = "rms_norm_rope"
    args = ("x", "w", "cos_f", "sin_f")
    grads = ("x", "w")
    dynamic = {"x": (0, 1), "cos_f": (0,), "sin_f": (0,)}

    def make_set(self, p, dev):
        d, seq = p["head_dim"], p["seq"]
        hidden = p["q_heads"] * d
        cos, sin = rope_tables(seq, d, dev)
        return {"x": torch.randn(p["batch"], seq, hidden, device=dev, dtype=DTYPE),
                "w": torch.randn(hidden, device=dev, dtype=DTYPE),
                "cos_f": torch.cat((cos, cos), -1).to(DTYPE), "sin_f": torch.cat((sin, sin), -1).to(DTYPE)}

    @staticmethod
    def kiln(x, w, cos, sin):
        return kt.fused_rmsnorm_rope(x, w, cos, sin, EPS, x.shape[-1] // cos.shape[-1])

    @staticmethod
    def eager(x, w, cos, sin):
        d = cos.shape[-1]
        n = F.rms_norm(x, (x.shape[-1],), w, EPS)
        n4 = n.view(x.shape[0], x.shape[1], -1, d)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return (n4 * c + rotate_half(n4) * s).view(x.shape)

    @staticmethod
    def reference(x, w, cos, sin):
        d = cos.shape[-1]
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
        n4 = n.view(x.shape[0], x.shape[1], -1, d)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return (n4 * c + rotate_half(n4) * s).view(x.shape)

    def moved_bytes(self, p):
        hidden = p["q_heads"] * p["head_dim"]
        tables = 2 * p["seq"] * p["head_dim"] * 2
        if self.backward:  # dout, x in, dx out; w in, dw out; both tables
            return 3 * p["tokens"] * hidden * 2 + 2 * hidden * 2 + tables
        return 2 * p["tokens"] * hidden * 2 + hidden * 2 + tables


def check_rows(m, dev):
    """The rows a GEMM's output is checked on: the first and last 128 and 256 spread between."""
    idx = torch.cat((torch.arange(min(m, 128)), torch.arange(max(0, m - 128), m),
                     torch.linspace(0, m - 1, CHECK_ROWS // 2).long()))
    return torch.unique(idx).to(dev)


def dequantize(q, scale, granularity):
    """fp32 values of e4m3 codes q [R, C] with kiln's scales ("tensor", "1x128", "128x128")."""
    f = q.view(torch.float8_e4m3fn).float()
    if granularity == "tensor":
        return f * scale.reshape(())
    s = scale.repeat_interleave(128, dim=-1)[:, :q.shape[1]]
    if granularity == "128x128":
        s = s.repeat_interleave(128, dim=0)[:q.shape[0]]
    return f * s


class Fp8Gemm(Op):
    """out [M, N] bf16 = a [M, K] x w [N, K]^T in e4m3, both quantized by kiln beforehand (the
    GEMM alone is timed): tensorwise scales against cuBLAS's tensorwise torch._scaled_mm,
    block scales (1x128 for a, 128x128 for w) against cuBLAS's block-scaled one."""

    name = "fp8_gemm"
    args = ("qa", "qw", "sa", "sw")
    memory_bound = False

    def __init__(self, backward=False, variant="tensor"):
        super().__init__(backward, variant)
        self.granularity = ("1x128", "128x128") if variant == "block" else ("tensor", "tensor")

    def make_set(self, p, dev):
        a = torch.randn(p["m"], p["k"], device=dev, dtype=DTYPE)
        w = torch.randn(p["n"], p["k"], device=dev, dtype=DTYPE)
        qa, sa = kt.quantize_fp8(a, self.granularity[0])
        qw, sw = kt.quantize_fp8(w, self.granularity[1])
        return {"qa": qa, "sa": sa, "qw": qw, "sw": sw}

    @staticmethod
    def kiln(qa, qw, sa, sw):
        return kt.fp8_gemm(qa, qw.t(), sa, sw, torch.bfloat16)

    def peers(self, liger):
        block = self.variant == "block"

        def cublas_operands(d):
            # cuBLAS's block scales: a's as an M-major [M, K/128] tensor, w's as [K/128, N/128].
            return {"a8": d["qa"].view(torch.float8_e4m3fn), "w8": d["qw"].view(torch.float8_e4m3fn).t(),
                    "sa8": d["sa"].t().contiguous().t() if block else d["sa"].reshape(()),
                    "sw8": d["sw"].t() if block else d["sw"].reshape(())}

        def scaled_mm(a8, w8, sa8, sw8):
            return torch._scaled_mm(a8, w8, scale_a=sa8, scale_b=sw8, out_dtype=torch.bfloat16)

        return {"cublas": Contender(scaled_mm, ("a8", "w8", "sa8", "sw8"), prepare=cublas_operands)}

    def _reference_rows(self, s, idx):
        a = dequantize(s["qa"][idx], s["sa"][idx] if self.variant == "block" else s["sa"], self.granularity[0])
        return a @ dequantize(s["qw"], s["sw"], self.granularity[1]).t()

    def check(self, s):
        idx = check_rows(s["qa"].shape[0], s["qa"].device)
        return rel_err(self.kiln(s["qa"], s["qw"], s["sa"], s["sw"])[idx], self._reference_rows(s, idx))

    def check_peer(self, name, contender, s):
        d = dict(s)
        d.update(contender.prepare(d))
        idx = check_rows(s["qa"].shape[0], s["qa"].device)
        return rel_err(contender.fn(*(d[k] for k in contender.args))[idx], self._reference_rows(s, idx))

    def flops(self, p):
        return 2 * p["m"] * p["n"] * p["k"]


class GatedMlp(Op):
    """act(x wg^T) * (x wu^T), x [M, K], wg and wu [N, K] bf16: kiln's one kernel against eager
    (two cuBLAS GEMMs and the elementwise ops) and torch.compile of it."""

    name = "fused_gated_mlp"
    args = ("x", "wg", "wu")
    dynamic = {"x": (0,)}
    memory_bound = False

    def make_set(self, p, dev):
        scale = p["k"] ** -0.5
        return {"x": torch.randn(p["m"], p["k"], device=dev, dtype=DTYPE),
                "wg": torch.randn(p["n"], p["k"], device=dev, dtype=DTYPE) * scale,
                "wu": torch.randn(p["n"], p["k"], device=dev, dtype=DTYPE) * scale}

    @staticmethod
    def kiln(x, wg, wu):
        return kt.fused_gated_mlp(x, wg, wu, GATED_ACTIVATION)

    @staticmethod
    def eager(x, wg, wu):
        return F.silu(x @ wg.t()) * (x @ wu.t())

    def check(self, s):
        idx = check_rows(s["x"].shape[0], s["x"].device)
        x = s["x"][idx].float()
        want = F.silu(x @ s["wg"].float().t()) * (x @ s["wu"].float().t())
        return rel_err(self.kiln(s["x"], s["wg"], s["wu"])[idx], want)

    def flops(self, p):
        return 4 * p["m"] * p["n"] * p["k"]


OP_CLASSES = {"rms_norm": RmsNorm, "add_rms_norm": AddRmsNorm, "layer_norm": LayerNorm, "act_and_mul": ActAndMul,
              "apply_rope_qk": Rope, "rms_norm_rope": RmsNormRope, "fp8_gemm": Fp8Gemm, "fused_gated_mlp": GatedMlp}
VARIANTS = {"act_and_mul": ACTIVATIONS, "fp8_gemm": FP8_SCALINGS}


def make_ops(name):
    """The Op objects of a models.py op name: one per variant."""
    backward = name.endswith("_backward")
    base = name[:-len("_backward")] if backward else name
    cls = OP_CLASSES[base]
    return [cls(backward, v) for v in VARIANTS[base]] if base in VARIANTS else [cls(backward)]


class Liger:
    """Liger's autograd functions, as the sweep calls them."""

    def __init__(self):
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        self.rms_norm = LigerRMSNormFunction.apply
        self.add_rms_norm = LigerFusedAddRMSNormFunction.apply
        self.layer_norm = LigerLayerNormFunction.apply
        self.silu_mul = LigerSiLUMulFunction.apply
        self.gelu_tanh_mul = LigerGELUMulFunction.apply
        self.rope = LigerRopeFunction.apply


def load_liger():
    """(Liger, version) or (the reason it is absent, None)."""
    try:
        liger = Liger()
    except Exception as e:  # not installed, or fails to import here
        return f"liger_kernel unavailable: {type(e).__name__}: {e}".splitlines()[0], None
    try:
        from importlib.metadata import version

        return liger, version("liger_kernel")
    except Exception:
        return liger, "unknown"


# --- timing ---


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def set_count(set_bytes, l2_bytes, cuda):
    """How many input sets rotate: together over 3x the L2, at most MAX_SETS and SET_MEMORY."""
    if not cuda:
        return 2
    n = max(1, math.ceil(3 * l2_bytes / max(set_bytes, 1)))
    return max(1, min(n, MAX_SETS, SET_MEMORY // max(set_bytes, 1)))


def mark_dynamic(t, dim):
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(t, dim)  # a dim of size 1 is specialized rather than refused
    elif t.shape[dim] > 1:
        torch._dynamo.mark_dynamic(t, dim)


def make_call(c, s, backward):
    """The call to time on one input set: the forward, or for a backward op the gradients of a
    forward built here (on the current stream, which its backward then uses too)."""
    d = dict(s)
    if c.prepare is not None:
        d.update(c.prepare(d))
    if backward:
        for k in c.grads:
            d[k] = d[k].detach().requires_grad_()
    for k, dims in c.dynamic.items():
        for dim in dims:
            mark_dynamic(d[k], dim)
    args = tuple(d[k] for k in c.args)
    if not backward:
        return lambda: c.fn(*args)
    outs = as_tuple(c.fn(*args))
    dys = tuple(torch.randn_like(o) for o in outs)
    leaves = tuple(d[k] for k in c.grads)
    return lambda: torch.autograd.grad(outs, leaves, dys, retain_graph=True)


class Timer:
    """Device time per call of a contender over rotating input sets (see the module's note);
    wall-clock time on the CPU."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else None

    def time(self, build):
        """{"us", "timing", "calls", "warm_s"} for the calls build() returns (one per set)."""
        return self._cuda(build) if self.cuda else self._cpu(build)

    def _cpu(self, build):
        t0 = time.perf_counter()
        calls = build()
        for _ in range(WARMUP):
            calls[0]()
        warm_s = time.perf_counter() - t0
        t = time.perf_counter()
        for c in calls:
            c()
        est = (time.perf_counter() - t) * 1e6 / len(calls)
        r = max(len(calls), min(MAX_CALLS, math.ceil(CPU_MIN_LOOP_US / max(est, 1e-3))))
        times = []
        for _ in range(REPLAYS):
            t = time.perf_counter()
            for i in range(r):
                calls[i % len(calls)]()
            times.append((time.perf_counter() - t) * 1e6)
        return {"us": statistics.median(times) / r, "timing": "wall", "calls": r, "warm_s": warm_s}

    def _loop_us(self, calls, n):
        s = self.stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s)
        for i in range(n):
            calls[i % len(calls)]()
        end.record(s)
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    def _replays_us(self, graph):
        start = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS)]
        graph.replay()
        for a, b in zip(start, end):
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(start, end))

    def _cuda(self, build):
        s = self.stream
        caller = torch.cuda.current_stream()
        t0 = time.perf_counter()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            calls = build()  # a backward op's forward runs on s, so its backward does too
            for _ in range(WARMUP):
                calls[0]()  # compiles (Triton, Inductor, kiln) outside the capture
            s.synchronize()
            warm_s = time.perf_counter() - t0
            est = self._loop_us(calls, max(len(calls), 3))
        r = max(len(calls), min(MAX_CALLS, math.ceil(MIN_REPLAY_US / max(est, 0.1))))
        try:
            for attempt in range(2):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=s):
                    for i in range(r):
                        calls[i % len(calls)]()
                torch.cuda.current_stream().wait_stream(s)
                replay = self._replays_us(graph)
                graph.reset()
                del graph
                # The loop's estimate includes launch gaps that a replay does not have.
                if replay >= MIN_REPLAY_US * 0.75 or r >= MAX_CALLS or attempt:
                    break
                r = max(len(calls), min(MAX_CALLS, math.ceil(r * MIN_REPLAY_US * 1.2 / max(replay, 0.1))))
            return {"us": replay / r, "timing": "graph", "calls": r, "warm_s": warm_s}
        except Exception as e:
            # A failed capture can leave the capture stream current: back to the caller's.
            torch.cuda.set_stream(caller)
            torch.cuda.synchronize()
            reason = reason_of(e)
        with torch.cuda.stream(s):
            us = statistics.median(self._loop_us(calls, r) for _ in range(REPLAYS))
        return {"us": us, "timing": "events", "calls": r, "warm_s": warm_s, "capture_error": reason}


    def kernels(self, build, calls_per_graph=8):
        """The kernels one call launches, from torch.profiler around one replay of a graph of
        calls_per_graph calls: [(name, launches per call, mean µs per launch)], longest first."""
        from torch.profiler import ProfilerActivity, profile

        s = self.stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            calls = build()
            for _ in range(WARMUP):
                calls[0]()
        n = max(len(calls), calls_per_graph)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for i in range(n):
                calls[i % len(calls)]()
        torch.cuda.current_stream().wait_stream(s)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        per_name = {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            count, total = per_name.get(e.name, (0, 0.0))
            per_name[e.name] = (count + 1, total + e.device_time)
        graph.reset()
        out = [(name, count / n, total / count) for name, (count, total) in per_name.items()]
        return sorted(out, key=lambda k: -k[1] * k[2])


# --- points ---


def shrink(p):
    """A CPU-sized copy of a point: a few rows and narrow rows, the same layout kinds."""
    q = dict(p)
    batch, seq = (2, 5) if p["batch"] > 1 else (1, min(p["seq"], 7))
    q.update(batch=batch, seq=seq)
    if "cols" in p:
        cols = max(16, p["cols"] // 32 // 8 * 8)
        q.update(rows=batch * seq, cols=cols, row_stride=cols + (8 if p["row_stride"] != p["cols"] else 0))
    elif "head_dim" in p:
        q.update(tokens=batch * seq, q_heads=min(p["q_heads"], 4), kv_heads=min(p["kv_heads"], 2))
    else:
        q.update(m=batch * seq, n=max(64, p["n"] // 32 // 16 * 16), k=max(64, p["k"] // 32 // 16 * 16))
    return q


def quick_point(p):
    if p["model"] not in QUICK_MODELS or p["rows_label"] not in QUICK_ROWS:
        return False
    if p["model"] == "odd-k" and (p["n"], p["k"]) != models.ODD_K[0]:
        return False
    return p.get("row_stride", 0) == p.get("cols", 0) or p["rows_label"] == QUICK_ROWS[-1]


def group_key(op, p):
    """Points torch.compile builds one graph for: a width and stride, the token dims dynamic
    (size 1 is specialized). The RoPE ops' tokens equal their sequence length for one sequence,
    which dynamo's duck sizing turns into one symbol: batches need a graph of their own."""
    tokens = p.get("rows", p.get("tokens", p.get("m")))
    widths = tuple((k, v) for k, v in sorted(p.items()) if k in ("cols", "row_stride", "q_heads", "kv_heads",
                                                                 "head_dim", "n", "k"))
    if COMPILE_MODE["dynamic"]:
        widths = p.get("row_stride", 0) != p.get("cols", 0)  # contiguous and strided rows
    return op.label, widths, tokens == 1, p["batch"] == 1 if op.name in ("apply_rope_qk", "rms_norm_rope") else None


# Guesses for an H100, to be replaced by what a run reports (each op's "seconds" and
# "compile_s" in the JSON): a contender's fixed cost per point (building the calls, the capture,
# the instantiation; twice that for a backward) and a cold torch.compile of one graph (twice that
# for a backward, whose graph AOTAutograd compiles too).
PER_CONTENDER_S = 0.05
COMPILE_S = 4.0


def estimate_s(op, p):
    """A rough time for one point on an H100, from guessed constants: per contender a fixed cost
    (building the calls, capture, instantiation) and its calls (warm-up, the estimate loop, the
    replays of at least MIN_REPLAY_US), plus the check; a call moves its bytes at 2.5 TB/s (less
    for the contenders that take several passes) or runs its FLOPs at a GEMM's typical rate."""
    if op.memory_bound:
        contenders = 5  # kiln, eager, compile, Liger or not, the copy
        call = 1.5 * op.moved_bytes(p) / 2.5e12
    else:
        contenders = 2 if op.name == "fp8_gemm" else 3
        call = max(op.flops(p) / (6e14 if op.name == "fp8_gemm" else 4e14), p["n"] * p["k"] * 2 / 3e12)
    fixed = PER_CONTENDER_S * (2 if op.backward else 1)
    per_contender = fixed + (WARMUP + 3) * call + (REPLAYS + 1) * max(MIN_REPLAY_US * 1e-6, call)
    return contenders * per_contender + 5 * call + 0.02


def plan(op_names, args):
    """[(op, points)] in run order, deduplicated, for the whole sweep or its --quick subset."""
    out = []
    for name in op_names:
        pts = models.points(name)
        if args.quick or args.device == "cpu":
            pts = [p for p in pts if quick_point(p)]
        if args.rows:
            pts = [p for p in pts if p["rows_label"] in args.rows.split(",")]
        if args.models:
            pts = [p for p in pts if p["model"] in args.models.split(",")]
        if args.device == "cpu":
            pts = [shrink(p) for p in pts]
        pts = models.dedupe(pts)
        for op in make_ops(name):
            ordered = sorted(pts, key=lambda p: (repr(group_key(op, p)), p.get("rows", p.get("tokens", p.get("m")))))
            out.append((op, ordered))
    return out


def with_costs(work):
    """[(op, point, estimated seconds)], a point's cost carrying the compile of a new graph."""
    out = []
    for op, pts in work:
        seen = set()
        for p in pts:
            cost = estimate_s(op, p)
            key = group_key(op, p)
            if key not in seen and op.eager is not None:
                seen.add(key)
                cost += COMPILE_S * (2 if op.backward else 1)
            out.append((op, p, cost))
    return out


def shard(items, index, count):
    """The index-th (1-based) of count contiguous runs of items of about equal summed cost."""
    total = sum(c for _, _, c in items) or 1.0
    lo, hi = total * (index - 1) / count, total * index / count
    out, acc = [], 0.0
    for item in items:
        mid = acc + item[2] / 2
        if lo <= mid < hi or (index == count and mid >= hi):
            out.append(item)
        acc += item[2]
    return out


# --- the run ---


def header(args, dev, liger_version, l2):
    h = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or 'host'})",
         "torch": torch.__version__, "liger": liger_version, "kiln": getattr(kiln, "__version__", "?"),
         "python": platform.python_version(), "argv": sys.argv[1:], "shard": args.shard, "quick": args.quick,
         "budget_s": args.budget_s, "l2_bytes": l2, "dtype": "bfloat16", "compile": args.compile,
         "rows": args.rows}
    try:
        import triton

        h["triton"] = triton.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        h["cuda"] = torch.version.cuda
    return h


def record(op, p):
    sizes = {k: v for k, v in p.items() if k != "models"}
    return {"op": op.op_name, "label": op.label, "variant": op.variant,
            "direction": "backward" if op.backward else "forward", "memory_bound": op.memory_bound,
            "models": p["models"], "sizes": sizes, "status": "not_run"}


def reason_of(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def measure_point(op, p, dev, timer, liger, compiled, compile_failures, l2, totals, kernels=False):
    """Fills a record for one point: kiln's check, every contender's time, the copy's.
    compile_failures maps the compile groups whose torch.compile failed to the reason. With
    kernels, each contender's kernels per call too (Timer.kernels)."""
    rec = record(op, p)
    t0 = time.perf_counter()
    sets = []
    try:
        first = op.make_set(p, dev)
        sets.append(first)
        err = op.check(first)
        rec["rel_err"] = err
        if not err <= TOL:  # NaN included
            rec.update(status="error", error=f"kiln disagrees with the fp32 reference: relative error {err:.3g}")
            return rec
    except Exception as e:
        rec.update(status="error", error=f"kiln: {reason_of(e)}")
        return rec
    n = set_count(storage_bytes(first.values()), l2, timer.cuda)
    sets += [op.make_set(p, dev) for _ in range(n - 1)]
    rec["sets"] = n
    contenders = {"kiln": op.kiln_contender()}
    contenders.update(op.torch_contenders(compiled if timer.cuda else None))
    if timer.cuda:
        contenders.update(op.peers(liger))
    rec["us"], rec["timing"], rec["calls"], rec["absent"] = {}, {}, {}, {}
    for name, c in contenders.items():
        if isinstance(c, str):
            rec["absent"][name] = c
            continue
        if name == "compile" and group_key(op, p) in compile_failures:
            rec["absent"][name] = compile_failures[group_key(op, p)]
            continue
        try:
            if name not in ("kiln", "eager", "compile"):
                err = op.check_peer(name, c, first)
                if err is not None and not err <= TOL:
                    rec["absent"][name] = f"disagrees with the fp32 reference: relative error {err:.3g}"
                    continue
            t = timer.time(lambda: [make_call(c, s, op.backward) for s in sets])
        except Exception as e:
            if name == "kiln":
                rec.update(status="error", error=f"kiln: {reason_of(e)}")
                return rec
            rec["absent"][name] = reason_of(e)
            if name == "compile":  # the graph this point needs fails to build: not again for its group
                compile_failures[group_key(op, p)] = rec["absent"][name]
            continue
        rec["us"][name] = t["us"]
        rec["timing"][name] = t["timing"]
        if kernels and timer.cuda:
            try:
                rec.setdefault("kernels", {})[name] = timer.kernels(
                    lambda: [make_call(c, s, op.backward) for s in sets])
            except Exception as e:
                rec.setdefault("kernels", {})[name] = reason_of(e)
        rec["calls"][name] = t["calls"]
        if "capture_error" in t:
            rec.setdefault("capture_errors", {})[name] = t["capture_error"]
        if name == "compile":
            totals["compile_s"] += t["warm_s"]
        if name == "kiln":
            totals["kiln_warm_s"] += t["warm_s"]
    peers = {k: v for k, v in rec["us"].items() if k != "kiln"}
    if peers:
        best = min(peers, key=peers.get)
        rec.update(best_peer=best, best_peer_us=peers[best], ratio=peers[best] / rec["us"]["kiln"])
    if op.memory_bound:
        moved = op.moved_bytes(p)
        half = max(1, moved // 2)
        sets.clear()
        first = None
        n = set_count(2 * half, l2, timer.cuda)
        bufs = [(torch.empty(half, dtype=torch.uint8, device=dev), torch.empty(half, dtype=torch.uint8, device=dev))
                for _ in range(n)]
        t = timer.time(lambda: [(lambda dst, src: lambda: dst.copy_(src))(*b) for b in bufs])
        rec.update(moved_bytes=moved, copy_us=t["us"], copy_fraction=t["us"] / rec["us"]["kiln"])
    rec["status"] = "ok"
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def progress_line(elapsed, rec):
    text = f"[{elapsed:6.1f}s] {rec['label']} {report.shape_text(rec['sizes'])}: "
    if rec["status"] != "ok":
        return text + f"{rec['status'].upper()} {rec.get('error', '')}"
    parts = [f"{k} {v:.2f}" for k, v in rec["us"].items()]
    text += " | ".join(parts) + " us"
    if rec.get("ratio") is not None:
        text += f"; ratio {rec['ratio']:.3f} ({rec['best_peer']})"
    if rec.get("copy_fraction") is not None:
        text += f"; copy {rec['copy_fraction']:.2f}"
    if rec["absent"]:
        text += "; absent " + ", ".join(f"{k}: {v[:80]}" for k, v in rec["absent"].items())
    for name, ks in rec.get("kernels", {}).items():
        if isinstance(ks, str):
            text += f"\n    {name}: no kernel list: {ks}"
            continue
        for kname, per_call, us in ks:
            text += f"\n    {name}: {per_call:4.2f} x {us:8.2f} us  {kname[:110]}"
    return text


def write_json(path, head, points, ops):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"header": head, "ops": ops, "points": points}, f, indent=1)
    os.replace(tmp, path)


def configure_compile():
    settings = [
        # One graph per width and stride: far beyond dynamo's default limit, past which it would
        # silently run eager code under torch.compile's name; a hit raises instead.
        (torch._dynamo.config, ("recompile_limit", "cache_size_limit"), 4096),
        (torch._dynamo.config, ("accumulated_recompile_limit", "accumulated_cache_size_limit"), 1 << 20),
        (torch._dynamo.config, ("fail_on_recompile_limit_hit",), True),
        # Only the marked token dims are dynamic: once dynamo has seen two widths it would make
        # the width dynamic too, and Inductor would generate code for any width.
        (torch._dynamo.config, ("automatic_dynamic_shapes",), False),
        # The timed backward keeps its graph (retain_graph), which donated buffers forbid.
        (torch._functorch.config, ("donated_buffer",), False),
    ]
    for cfg, names, value in settings:
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            setattr(cfg, name, value)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", help="comma-separated op names of bench/sweep/models.py (default: all)")
    ap.add_argument("--shard", default="1/1",
                    help="I/N: the I-th (from 1) of N parts of the points; every shard needs the same --ops and --quick")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting points after this many seconds")
    ap.add_argument("--quick", action="store_true", help="a few points per op")
    ap.add_argument("--plan", action="store_true", help="print the points and estimated times, measure nothing")
    ap.add_argument("--done", help="comma-separated JSON files of earlier runs: the points they measured are "
                                   "left out (the rest of a shard that ran out of time)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--compile", default="static", choices=("static", "dynamic"),
                    help="static: one torch.compile graph per width, token dims dynamic; dynamic: every size "
                         "symbolic, one graph per op and row layout")
    ap.add_argument("--rows", help="comma-separated row layouts to keep (t1, t16, b4x2047, ...; default: all)")
    ap.add_argument("--models", help="comma-separated model names of bench/sweep/models.py to keep (default: all)")
    ap.add_argument("--kernels", action="store_true",
                    help="also list each contender's kernels per call and their device times (torch.profiler "
                         "around a graph replay), in the log and the JSON")
    ap.add_argument("--rows-first", action="store_true",
                    help="run every op at each layout of --rows in turn, in the order given (with --compile dynamic)")
    ap.add_argument("--json", help="the output file")
    args = ap.parse_args(argv)
    try:
        index, count = (int(v) for v in args.shard.split("/"))
        assert 1 <= index <= count
    except (ValueError, AssertionError):
        ap.error(f"--shard takes I/N with 1 <= I <= N, not {args.shard!r}")
    args.shard_index, args.shard_count = index, count
    names = args.ops.split(",") if args.ops else models.all_ops()
    unknown = [n for n in names if n not in models.all_ops()]
    if unknown:
        ap.error(f"unknown ops {unknown}; the sweep has {models.all_ops()}")
    args.op_names = names
    if args.rows_first and not (args.rows and args.compile == "dynamic"):
        ap.error("--rows-first needs --rows and --compile dynamic (static graphs are grouped by width)")
    COMPILE_MODE["dynamic"] = args.compile == "dynamic"
    if not args.plan and not args.json:
        ap.error("--json is required")
    return args


def print_plan(items):
    per_op = {}
    for op, _, cost in items:
        n, c = per_op.get(op.label, (0, 0.0))
        per_op[op.label] = (n + 1, c + cost)
    for label, (n, c) in per_op.items():
        print(f"{label:<30} {n:5d} points  ~{c:7.0f} s")
    print(f"{'total':<30} {len(items):5d} points  ~{sum(c for _, _, c in items):7.0f} s")


def main(argv=None):
    start = _START
    args = parse_args(argv)
    dev = torch.device(args.device)
    items = with_costs(plan(args.op_names, args))
    mine = shard(items, args.shard_index, args.shard_count)
    if args.done:
        _, earlier = report.load(args.done.split(","))
        done = {report.point_key(p) for p in earlier if p["status"] != "not_run"}
        mine = [(op, p, c) for op, p, c in mine if report.point_key(record(op, p)) not in done]
    if args.rows_first:
        # Every op at the first row layout, then every op at the next: a budget that runs out
        # loses layouts, not whole ops.
        order = args.rows.split(",")
        mine.sort(key=lambda item: order.index(item[1]["rows_label"]) if item[1]["rows_label"] in order else len(order))
    if args.plan:
        print_plan(mine)
        return 0
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for the smoke mode")
    torch.manual_seed(0)
    l2 = L2_FALLBACK
    liger, liger_version = "liger runs on CUDA only", None
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or L2_FALLBACK
        liger, liger_version = load_liger()
        configure_compile()
    head = header(args, dev, liger_version, l2)
    print(f"sweep on {head['device']}: torch {head['torch']}, Liger {liger_version or 'absent'}, kiln {head['kiln']}; "
          f"{len(mine)} of {len(items)} points (shard {args.shard}), budget {args.budget_s:.0f} s", flush=True)
    if isinstance(liger, str):
        print(liger, flush=True)
    timer = Timer(dev)
    compiled_fns, compile_failures = {}, {}

    def compiled(op):
        if op.label not in compiled_fns:
            compiled_fns[op.label] = torch.compile(op.eager, dynamic=True if args.compile == "dynamic" else None)
        return compiled_fns[op.label]

    points, ops_meta = [], {}
    last_write = time.monotonic()
    current = None
    for op, p, _ in mine:
        if op.label != current:
            if current is not None:
                write_json(args.json, head, points, ops_meta)
            current = op.label
            if op.label not in ops_meta:
                ops_meta[op.label] = {"compile_s": 0.0, "kiln_warm_s": 0.0, "seconds": 0.0}
                print(f"== {op.label}: {sum(1 for o, _, _ in mine if o is op)} points", flush=True)
        meta = ops_meta[op.label]
        if time.monotonic() - start >= args.budget_s:
            points.append(record(op, p))
            continue
        if op.cuda_only and dev.type != "cuda":
            rec = record(op, p)
            rec.update(status="skipped", error="kiln runs it on CUDA only")
            points.append(rec)
            continue
        t = time.perf_counter()
        try:
            rec = measure_point(op, p, dev, timer, liger, compiled, compile_failures, l2, meta, args.kernels)
        except Exception as e:  # the runner's own failure (out of memory, say): the point fails
            rec = record(op, p)
            rec.update(status="error", error=f"runner: {reason_of(e)}")
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        meta["seconds"] += time.perf_counter() - t
        points.append(rec)
        print(progress_line(time.monotonic() - start, rec), flush=True)
        if dev.type == "cuda" and torch.cuda.memory_reserved(dev) > (24 << 30):
            torch.cuda.empty_cache()
        if time.monotonic() - last_write > WRITE_EVERY_S:
            write_json(args.json, head, points, ops_meta)
            last_write = time.monotonic()
    head["elapsed_s"] = round(time.monotonic() - start, 1)
    write_json(args.json, head, points, ops_meta)
    print()
    print(report.text_table(report.summarize(points)))
    not_run = sum(p["status"] == "not_run" for p in points)
    errors = sum(p["status"] == "error" for p in points)
    print(f"\n{len(points)} points, {errors} kiln errors, {not_run} not run (budget); "
          f"compile {sum(m['compile_s'] for m in ops_meta.values()):.0f} s; {head['elapsed_s']:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
