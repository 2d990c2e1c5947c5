"""kiln for PyTorch: custom ops (torch.library.custom_op with fake implementations, so
torch.compile(fullgraph=True) traces them without graph breaks and CUDA graphs capture them),
autograd for RMSNorm, the fused RMSNorm + RoPE and attention (flash_attn_func,
flash_attn_varlen_func, scaled_dot_product_attention), and modules:

- RMSNorm: a drop-in for torch.nn.RMSNorm (same constructor, state_dict keys and results).
- FusedRMSNormRoPE(hidden_dim, head_dim, eps): owns the RMSNorm weight, forward(x, cos, sin).
- FusedGatedMLP(hidden_dim, intermediate_dim, activation): act(x Wg^T) * (x Wu^T) in one kernel,
  with autograd.
- FP8Linear(in_features, out_features, bias): nn.Linear through kiln's FP8 GEMM; the weight is
  quantized on first use and again whenever it changes.

Ops launch on the current CUDA stream. CPU tensors run kiln's CPU fallbacks (the fused RMSNorm +
RoPE is CUDA only: DeviceError). Errors are kiln's exceptions, raised before any launch.
"""
import math
import os
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops as _ops
from ._errors import InvalidArgumentError, KilnError, ShapeMismatchError, UnsupportedDtypeError

__all__ = ["rms_norm", "add_rms_norm", "act_and_mul", "silu_and_mul", "apply_rope_qk", "fused_rmsnorm_rope",
           "quantize_fp8", "fp8_gemm", "fused_gated_mlp", "RMSNorm", "SwiGLU", "RotaryEmbedding", "FusedRMSNormRoPE",
           "FusedGatedMLP", "FP8Linear", "flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention",
           "AttentionBackwardNotBuiltError"]

_KILN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows_contiguous(t):
    """t itself where kiln can read it as rows (a contiguous last dimension, leading dimensions
    that collapse into one row index: a slice of a wider tensor, say), else a contiguous copy."""
    if t.is_contiguous():
        return t
    if t.dim() == 0 or t.stride(-1) != 1:
        return t.contiguous()
    for i in range(t.dim() - 2):
        if t.size(i) > 1 and t.stride(i) != t.stride(i + 1) * t.size(i + 1):
            return t.contiguous()
    return t


def _new(like, shape, dtype=None):
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _rows_shape(x):
    return x.shape[:-1] if x.dim() > 1 else (1,)


# --- custom ops ---


# Each op is a plain function (what eager calls directly: the custom op dispatcher costs several
# microseconds a call) wrapped as a custom op (what torch.compile traces, and autograd uses).


def _rms_norm_impl(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = _rows_contiguous(x)
    if x.numel() == 0:  # PyTorch gives empty tensors a null pointer, which kiln rejects
        return torch.empty_like(x)
    return _ops.rms_norm(x, weight.contiguous(), eps, out=torch.empty_like(x))


_rms_norm = torch.library.custom_op("kiln::rms_norm", _rms_norm_impl, mutates_args=())


@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


# The training path calls the declared ops straight through kiln._fast (inputs, outputs, then
# scalars, in declaration order): the autograd step runs it twice per call of a norm, and the
# Python binding of kiln.ops (keywords, defaults, allocation) would be most of its host time.
_RMS_NORM = _ops.OPS["rms_norm"].id
_RMS_NORM_BACKWARD = _ops.OPS["rms_norm_backward"].id


def _rms_norm_fwd_impl(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x = _rows_contiguous(x)
    inv = _new(x, _rows_shape(x), torch.float32)
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out, inv
    _ops._call(_RMS_NORM, None, None, x, weight.contiguous(), out, inv, eps)
    return out, inv


_rms_norm_fwd = torch.library.custom_op("kiln::rms_norm_fwd", _rms_norm_fwd_impl, mutates_args=())


@_rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(_rows_shape(x), dtype=torch.float32)


# rms_norm_backward_workspace_elements by (shape, dtype, device): the size depends on nothing else,
# and asking kiln on every training step costs more host time than the launch.
_NORM_WORKSPACE_ELEMENTS = {}


def _norm_backward_workspace(x):
    """The f32 scratch of the rmsnorm_bwd launches for rows like x (None on the host), allocated by
    PyTorch rather than kiln's per-stream cache: no cuMemAlloc during a CUDA-graph capture."""
    if not x.is_cuda:
        return None
    key = (x.shape, x.dtype, x.device)
    elements = _NORM_WORKSPACE_ELEMENTS.get(key)
    if elements is None:
        elements = max(_ops.rms_norm_backward_workspace_elements(x), 1)
        if len(_NORM_WORKSPACE_ELEMENTS) >= 4096:
            _NORM_WORKSPACE_ELEMENTS.clear()
        _NORM_WORKSPACE_ELEMENTS[key] = elements
    return torch.empty(elements, dtype=torch.float32, device=x.device)


def _rms_norm_backward_impl(dy: Tensor, x: Tensor, weight: Tensor, inv_rms: Tensor) -> Tuple[Tensor, Tensor]:
    dy, x = _rows_contiguous(dy), _rows_contiguous(x)  # dy of a sum() is an expanded (stride 0) tensor
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros_like(weight)
    dx, dw = torch.empty_like(x), torch.empty_like(weight)
    _ops._call(_RMS_NORM_BACKWARD, None, None, dy, x, weight.contiguous(), inv_rms, _norm_backward_workspace(x), dx,
               dw)
    return dx, dw


_rms_norm_backward = torch.library.custom_op("kiln::rms_norm_backward", _rms_norm_backward_impl, mutates_args=())


@_rms_norm_backward.register_fake
def _(dy, x, weight, inv_rms):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad_with(backward):
    """rms_norm's gradient through `backward`: the custom op where it may be traced, its
    implementation for the eager path (no dispatcher)."""

    def grad(ctx, dy, _d_inv_rms):
        x, weight, inv_rms = ctx.saved_tensors
        if dy is None:  # the eager Function does not materialize the gradients of unused outputs
            dy = torch.zeros_like(x)
        dx, dw = backward(dy, x, weight, inv_rms)
        return dx, dw, None

    return grad


_rms_norm_fwd.register_autograd(_rms_norm_grad_with(lambda *a: torch.ops.kiln.rms_norm_backward(*a)),
                                setup_context=_rms_norm_setup)


def _eager_function(name, impl, setup_context, backward, materialize_grads=True):
    """An autograd.Function running a custom op's implementation with its setup_context and a
    backward of the same formula (the one its register_autograd got, or one that calls the backward
    op's implementation directly): the eager training path, without the dispatcher and
    torch.library's autograd wrapper (host time that exceeds small kernels'); torch.compile traces
    the custom op itself. materialize_grads=False passes None, not a tensor of zeros made on every
    step, for outputs nothing used (an output only the backward reads, as rms_norm's inv_rms)."""

    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        return output

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_RmsNormFunction = _eager_function("_RmsNormFunction", _rms_norm_fwd_impl, _rms_norm_setup,
                                   _rms_norm_grad_with(_rms_norm_backward_impl), materialize_grads=False)


def _add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x, residual = _rows_contiguous(x), _rows_contiguous(residual)
    if x.numel() == 0:
        return torch.empty_like(x), torch.empty_like(x)
    return _ops.add_rms_norm(x, residual, weight.contiguous(), eps, out=_new(x, x.shape),
                             residual_out=_new(x, x.shape))


_add_rms_norm = torch.library.custom_op("kiln::add_rms_norm", _add_rms_norm_impl, mutates_args=())


@_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps


_ADD_RMS_NORM_BACKWARD = _ops.OPS["add_rms_norm_backward"].id


def _add_rms_norm_backward_impl(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Tensor,
                                eps: float) -> Tuple[Tensor, Tensor]:
    dy, h = dy.contiguous(), _rows_contiguous(h)
    if dh is not None:
        dh = dh.contiguous()
    if h.numel() == 0:
        return torch.empty_like(h), torch.zeros_like(weight)
    dx, dw = torch.empty_like(h), torch.empty_like(weight)
    _ops._call(_ADD_RMS_NORM_BACKWARD, None, None, dy, dh, h, weight.contiguous(), _norm_backward_workspace(h), dx, dw,
               eps)
    return dx, dw


_add_rms_norm_backward = torch.library.custom_op("kiln::add_rms_norm_backward", _add_rms_norm_backward_impl,
                                                 mutates_args=())


@_add_rms_norm_backward.register_fake
def _(dy, dh, h, weight, eps):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _add_rms_norm_grad_with(backward):
    """add_rms_norm's gradient through `backward` (the custom op where it may be traced, its
    implementation for the eager path): y = rms_norm(h) * weight with h = x + residual, and h is
    an output too, so its gradient dh joins the norm's in dx, which is both x's and residual's.
    One kiln pass: inv_rms is recomputed from the saved h and dh added where dx is written."""

    def grad(ctx, dy, dh):
        h, weight = ctx.saved_tensors
        if dy is None:  # the eager Function does not materialize the gradients of unused outputs
            dy = torch.zeros_like(h)
        dx, dw = backward(dy, dh, h, weight, ctx.eps)
        return dx, dx, dw, None

    return grad


_add_rms_norm_grad = _add_rms_norm_grad_with(lambda *a: torch.ops.kiln.add_rms_norm_backward(*a))
_add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)
_AddRmsNormFunction = _eager_function("_AddRmsNormFunction", _add_rms_norm_impl, _add_rms_norm_setup,
                                      _add_rms_norm_grad_with(_add_rms_norm_backward_impl), materialize_grads=False)


def _act_and_mul_impl(x: Tensor, activation: str) -> Tensor:
    x = _rows_contiguous(x)
    out = _new(x, (*x.shape[:-1], x.shape[-1] // 2))
    if x.numel() == 0:
        return out
    return _ops.act_and_mul(x, activation, out=out)


_act_and_mul = torch.library.custom_op("kiln::act_and_mul", _act_and_mul_impl, mutates_args=())


@_act_and_mul.register_fake
def _(x, activation):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _apply_rope_qk_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor,
                        layout: str) -> Tuple[Tensor, Tensor]:
    return _ops.apply_rope_qk(q, k, cos, sin, position_ids, layout, q_out=_new(q, q.shape), k_out=_new(k, k.shape))


_apply_rope_qk = torch.library.custom_op("kiln::apply_rope_qk", _apply_rope_qk_impl, mutates_args=())


@_apply_rope_qk.register_fake
def _(q, k, cos, sin, position_ids, layout):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rope_qk_setup(ctx, inputs, output):
    q, k, cos, sin, position_ids, layout = inputs
    if cos.requires_grad or sin.requires_grad:
        raise InvalidArgumentError("kiln.torch.apply_rope_qk computes no gradient for cos and sin: pass them detached")
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.layout = layout
    ctx.meta = ((q.shape, q.dtype), (k.shape, k.dtype))


# -sin of each sin table the eager RoPE backward has seen, while the table lives and is unchanged:
# negating it on every step was a launch and an allocation as long as a small step's rotation.
_NEGATED_SIN = torch.utils.weak.WeakIdKeyDictionary()


def _negated_sin(sin):
    hit = _NEGATED_SIN.get(sin)
    if hit is None or hit[0] != sin._version:
        hit = (sin._version, -sin)
        _NEGATED_SIN[sin] = hit
    return hit[1]


def _rope_qk_grad_with(rotate, negate):
    """apply_rope_qk's gradient: the rotation's transpose is the rotation by the opposite angle,
    the same kernel with -sin. The custom op's formula (traced by torch.compile) rotates with the
    op and negates sin in the graph; the eager one calls the implementation and caches -sin."""

    def grad(ctx, dq_out, dk_out):
        cos, sin, position_ids = ctx.saved_tensors
        grads = [_rows_contiguous(g) if g is not None else torch.zeros(s, dtype=t, device=cos.device)
                 for g, (s, t) in zip((dq_out, dk_out), ctx.meta)]
        dq, dk = rotate(grads[0], grads[1], cos, negate(sin), position_ids, ctx.layout)
        return dq, dk, None, None, None, None

    return grad


_apply_rope_qk.register_autograd(_rope_qk_grad_with(lambda *a: torch.ops.kiln.apply_rope_qk(*a), torch.neg),
                                 setup_context=_rope_qk_setup)
_RopeQkFunction = _eager_function("_RopeQkFunction", _apply_rope_qk_impl, _rope_qk_setup,
                                  _rope_qk_grad_with(_apply_rope_qk_impl, _negated_sin))


def _rms_norm_rope_impl(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, num_heads: int) -> Tensor:
    return _ops.rms_norm_rope(x, weight, cos, sin, eps, num_heads, out=_new(x, x.shape))


_rms_norm_rope = torch.library.custom_op("kiln::rms_norm_rope", _rms_norm_rope_impl, mutates_args=())


@_rms_norm_rope.register_fake
def _(x, weight, cos, sin, eps, num_heads):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    x, weight, cos, sin, eps, num_heads = inputs
    ctx.eps, ctx.num_heads = eps, num_heads
    ctx.save_for_backward(x, weight, cos, sin)


_RMS_NORM_ROPE_BACKWARD = _ops.OPS["rms_norm_rope_backward"].id


def _rms_norm_rope_backward_impl(dout: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
                                 num_heads: int) -> Tuple[Tensor, Tensor]:
    dout = dout.contiguous()  # dout of a sum() is an expanded (stride 0) tensor
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros_like(weight)
    dx, dw = torch.empty_like(x), torch.empty_like(weight)
    _ops._call(_RMS_NORM_ROPE_BACKWARD, None, None, dout, x, weight, cos, sin, _norm_backward_workspace(x), dx, dw, eps,
               num_heads)
    return dx, dw


_rms_norm_rope_backward = torch.library.custom_op("kiln::rms_norm_rope_backward", _rms_norm_rope_backward_impl,
                                                  mutates_args=())


@_rms_norm_rope_backward.register_fake
def _(dout, x, weight, cos, sin, eps, num_heads):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rope_grad_with(backward):
    """rms_norm_rope's gradient through `backward` (the custom op where it may be traced, its
    implementation for the eager path): out = rope(n), n = rms_norm(x) * weight. Two kiln passes:
    the rotation's transpose takes dout to dn, then the RMSNorm backward, with inv_rms recomputed
    from the saved x, takes dn to (dx, dw). cos and sin get no gradient."""

    def grad(ctx, dout):
        x, weight, cos, sin = ctx.saved_tensors
        dx, dw = backward(dout, x, weight, cos, sin, ctx.eps, ctx.num_heads)
        return dx, dw, None, None, None, None

    return grad


_rope_grad = _rope_grad_with(lambda *a: torch.ops.kiln.rms_norm_rope_backward(*a))
_rms_norm_rope.register_autograd(_rope_grad, setup_context=_rope_setup)
_RmsNormRopeFunction = _eager_function("_RmsNormRopeFunction", _rms_norm_rope_impl, _rope_setup,
                                       _rope_grad_with(_rms_norm_rope_backward_impl))


def _fused_gated_mlp_impl(x: Tensor, gate_weight: Tensor, up_weight: Tensor, activation: str) -> Tensor:
    x = x.contiguous()
    out = _new(x, (*x.shape[:-1], gate_weight.shape[0]))
    if out.numel() == 0 or x.shape[-1] == 0:  # empty tensors have null pointers, which kiln rejects
        return out.zero_()
    return _ops.fused_gated_mlp(x, gate_weight.contiguous(), up_weight.contiguous(), activation, out=out)


_fused_gated_mlp = torch.library.custom_op("kiln::fused_gated_mlp", _fused_gated_mlp_impl, mutates_args=())


@_fused_gated_mlp.register_fake
def _(x, gate_weight, up_weight, activation):
    return x.new_empty((*x.shape[:-1], gate_weight.shape[0]))


def _gated_setup(ctx, inputs, output):
    x, gate_weight, up_weight, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, gate_weight, up_weight)


def _gated_grad(ctx, dout):
    # The forward never keeps x Wg^T or x Wu^T; the backward recomputes them with cuBLAS, then
    # dg = dout * u * act'(g), du = dout * act(g), dx = dg Wg + du Wu, dWg = dg^T x, dWu = du^T x.
    x, wg, wu = ctx.saved_tensors
    x2 = x.reshape(-1, x.shape[-1])
    g = (x2 @ wg.t()).float()
    u = (x2 @ wu.t()).float()
    d = dout.reshape(-1, dout.shape[-1]).float()
    if ctx.activation == "silu":
        sig = torch.sigmoid(g)
        act, dact = g * sig, sig * (1 + g * (1 - sig))
    else:
        # Phi(g) as erfc(-g / sqrt 2) / 2: 1 + erf(g / sqrt 2) cancels to 0 below g of about -5.5
        # in fp32, which zeroes act(g) and act'(g) where they are merely small.
        cdf = 0.5 * torch.erfc(-g * 0.7071067811865476)
        act, dact = g * cdf, cdf + g * torch.exp(-0.5 * g * g) * 0.3989422804014327
    dg = (d * u * dact).to(x.dtype)
    du = (d * act).to(x.dtype)
    dx = (dg @ wg + du @ wu).reshape(x.shape)
    return dx, dg.t() @ x2, du.t() @ x2, None


_fused_gated_mlp.register_autograd(_gated_grad, setup_context=_gated_setup)


def _check_gated(x, gate_weight, up_weight, activation):
    """fused_gated_mlp's argument checks, for the training path that never reaches the fused op."""
    if activation not in _ops.GATED_ACTIVATIONS:
        raise InvalidArgumentError(f"fused_gated_mlp: activation must be one of {', '.join(_ops.GATED_ACTIVATIONS)} "
                                   f"(got {activation!r})")
    if x.dtype not in (torch.float16, torch.bfloat16) or gate_weight.dtype != x.dtype or up_weight.dtype != x.dtype:
        raise UnsupportedDtypeError(f"fused_gated_mlp takes f16 or bf16 x and weights of its dtype (got {x.dtype}, "
                                    f"{gate_weight.dtype}, {up_weight.dtype})")
    if (gate_weight.dim() != 2 or up_weight.shape != gate_weight.shape or x.dim() < 1
            or gate_weight.shape[1] != x.shape[-1]):
        raise ShapeMismatchError(f"fused_gated_mlp: x {tuple(x.shape)}, gate_weight {tuple(gate_weight.shape)} and "
                                 f"up_weight {tuple(up_weight.shape)} do not match ([..., hidden], [inter, hidden] twice)")
    if x.device != gate_weight.device or x.device != up_weight.device:
        raise InvalidArgumentError("fused_gated_mlp: x and the weights are on different devices")


def _gated_mlp_train_impl(x: Tensor, gate_weight: Tensor, up_weight: Tensor, activation: str) -> Tuple[Tensor, Tensor]:
    """The gated MLP's training forward: (act(g) * u, [g | u]) with g = x Wg^T and u = x Wu^T written
    side by side by two cuBLAS GEMMs into one [rows, 2 * inter] tensor, then kiln's act_and_mul. The
    backward needs g and u: keeping them costs what recomputing them would save, two GEMMs."""
    _check_gated(x, gate_weight, up_weight, activation)
    inter, hidden = gate_weight.shape
    x2 = x.reshape(-1, hidden)
    gate_up = torch.empty((x2.shape[0], 2 * inter), dtype=x.dtype, device=x.device)
    torch.mm(x2, gate_weight.t(), out=gate_up[:, :inter])
    torch.mm(x2, up_weight.t(), out=gate_up[:, inter:])
    return _act_and_mul_impl(gate_up, activation).reshape(*x.shape[:-1], inter), gate_up


_gated_mlp_train = torch.library.custom_op("kiln::gated_mlp_train", _gated_mlp_train_impl, mutates_args=())


@_gated_mlp_train.register_fake
def _(x, gate_weight, up_weight, activation):
    inter = gate_weight.shape[0]
    rows = math.prod(x.shape[:-1])
    return x.new_empty((*x.shape[:-1], inter)), x.new_empty((rows, 2 * inter))


def _gated_train_setup(ctx, inputs, output):
    x, gate_weight, up_weight, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, gate_weight, up_weight, output[1])


def _gated_train_grad(ctx, dout, _d_gate_up):
    # d[g | u] = act_and_mul_backward([g | u], dout) in one kiln kernel; then dx = dg Wg + du Wu and
    # dWg = dg^T x, dWu = du^T x, reading dg and du in place as the column halves of d[g | u].
    x, wg, wu, gate_up = ctx.saved_tensors
    inter, hidden = wg.shape
    if dout is None:
        return None, None, None, None
    d_gate_up = torch.ops.kiln.act_and_mul_backward(gate_up, dout.reshape(-1, inter), ctx.activation)
    dg, du = d_gate_up[:, :inter], d_gate_up[:, inter:]
    x2 = x.reshape(-1, hidden)
    dx = torch.addmm(torch.mm(dg, wg), du, wu).reshape(x.shape)
    return dx, dg.t() @ x2, du.t() @ x2, None


_gated_mlp_train.register_autograd(_gated_train_grad, setup_context=_gated_train_setup)
_GatedMlpTrainFunction = _eager_function("_GatedMlpTrainFunction", _gated_mlp_train_impl, _gated_train_setup,
                                         _gated_train_grad, materialize_grads=False)


def _quantize_fp8_impl(x: Tensor, granularity: str, transpose: bool) -> Tuple[Tensor, Tensor]:
    return _ops.quantize_fp8(x.contiguous(), granularity, transpose=transpose)


_quantize_fp8 = torch.library.custom_op("kiln::quantize_fp8", _quantize_fp8_impl, mutates_args=())


@_quantize_fp8.register_fake
def _(x, granularity, transpose):
    rows = math.prod(x.shape[:-1]) if x.dim() > 1 else 1
    cols = x.shape[-1]
    q_shape = (x.shape[1], x.shape[0]) if transpose and x.dim() == 2 else x.shape
    if granularity == "tensor":
        s_shape = (1,)
    elif granularity == "1x128":
        s_shape = (rows, -(-cols // 128))
    else:
        s_shape = (-(-cols // 128), -(-rows // 128)) if transpose else (-(-rows // 128), -(-cols // 128))
    return x.new_empty(q_shape, dtype=torch.uint8), x.new_empty(s_shape, dtype=torch.float32)


def _fp8_gemm_impl(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, output_dtype: torch.dtype) -> Tensor:
    return _ops.fp8_gemm(a, b, a_scale, b_scale, output_dtype,
                         out=torch.empty((a.shape[0], b.shape[1]), dtype=output_dtype, device=a.device))


_fp8_gemm = torch.library.custom_op("kiln::fp8_gemm", _fp8_gemm_impl, mutates_args=())


@_fp8_gemm.register_fake
def _(a, b, a_scale, b_scale, output_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=output_dtype)


# --- functions ---


def _eager():
    """True outside torch.compile's tracing: the plain functions run, without the dispatcher."""
    return not _is_compiling()


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# torch.nn.RMSNorm's default eps (the dtype's machine epsilon) for kiln's dtypes, looked up once.
_DEFAULT_EPS = {t: torch.finfo(t).eps for t in _KILN_DTYPES}


def _kiln_can_take(x, weight):
    return x.dtype in _KILN_DTYPES and (weight is None or weight.dtype == x.dtype) and (x.is_cuda or x.is_cpu)


def rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """torch.nn.functional.rms_norm through kiln: over the last len(normalized_shape) dimensions.

    Where kiln does not apply (a dtype other than f32/f16/bf16, weight and x of different dtypes,
    a device other than CUDA or CPU) it calls torch.nn.functional.rms_norm instead.
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    elif not isinstance(normalized_shape, tuple):
        normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k:]) != normalized_shape:
        raise ShapeMismatchError(f"rms_norm: input of shape {tuple(x.shape)} does not end in {normalized_shape}")
    if eps is None:
        eps = _DEFAULT_EPS.get(x.dtype)
        if eps is None:
            eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 1e-6
    if not _kiln_can_take(x, weight):
        return torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
    n = normalized_shape[0] if k == 1 else math.prod(normalized_shape)
    rows = x if k == 1 else x.reshape(*x.shape[:x.dim() - k], n)
    if weight is None:
        w = torch.ones(n, dtype=x.dtype, device=x.device)
    else:
        w = weight if k == 1 else weight.reshape(n)
    if _needs_grad(x, weight):
        fwd = _RmsNormFunction.apply if _eager() else torch.ops.kiln.rms_norm_fwd
        y = fwd(rows, w, eps)[0]
    elif _eager():
        y = _rms_norm_impl(rows, w, eps)
    else:
        y = torch.ops.kiln.rms_norm(rows, w, eps)
    return y if k == 1 else y.reshape(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), vLLM's fused residual add. Differentiable in
    x, residual and weight: the backward is one add_rms_norm_backward pass over the saved
    x + residual (inv_rms recomputed in the kernel, the residual stream's gradient added to dx)."""
    if _eager():
        if _needs_grad(x, residual, weight):
            return _AddRmsNormFunction.apply(x, residual, weight, eps)
        return _add_rms_norm_impl(x, residual, weight, eps)
    return torch.ops.kiln.add_rms_norm(x, residual, weight, eps)


def act_and_mul(x: Tensor, activation: str = "silu") -> Tensor:
    """act(x[..., :d]) * x[..., d:]; activation "silu", "gelu" or "gelu_tanh". Differentiable: the
    backward (kiln::act_and_mul_backward) recomputes act from x, which is all it saves."""
    if _eager():
        if _needs_grad(x):
            return _EAGER_FROM_DECLARATION["act_and_mul"].apply(x, activation)
        return _act_and_mul_impl(x, activation)
    return torch.ops.kiln.act_and_mul(x, activation)


def silu_and_mul(x: Tensor) -> Tensor:
    return act_and_mul(x, "silu")


def apply_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor,
                  layout: str = "neox") -> Tuple[Tensor, Tensor]:
    """Rotary embedding of q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] at
    position_ids (int64 [tokens]), cos/sin float32 [max_pos, head_dim / 2]. Differentiable in q and
    k: the backward rotates the gradients by the opposite angle (the same kernel with -sin); cos and
    sin get no gradient (an error if they require one)."""
    if _eager():
        if _needs_grad(q, k, cos, sin):
            return _RopeQkFunction.apply(q, k, cos, sin, position_ids, layout)
        return _apply_rope_qk_impl(q, k, cos, sin, position_ids, layout)
    return torch.ops.kiln.apply_rope_qk(q, k, cos, sin, position_ids, layout)


def fused_rmsnorm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float = 1e-6,
                       num_heads: Optional[int] = None) -> Tensor:
    """RMSNorm then RoPE (neox) per head in one kernel. x: contiguous CUDA [batch, seq, hidden];
    weight [hidden]; cos, sin: [seq, head_dim] or [1, seq, 1, head_dim], float32 or x's dtype;
    num_heads None infers hidden / head_dim. Differentiable in x and weight."""
    heads = 0 if num_heads is None else num_heads
    if _eager():
        if _needs_grad(x, weight):
            return _RmsNormRopeFunction.apply(x, weight, cos, sin, eps, heads)
        return _rms_norm_rope_impl(x, weight, cos, sin, eps, heads)
    return torch.ops.kiln.rms_norm_rope(x, weight, cos, sin, eps, heads)


def fused_gated_mlp(x: Tensor, gate_weight: Tensor, up_weight: Tensor, activation: str = "silu") -> Tensor:
    """act(x gate_weight^T) * (x up_weight^T), x [..., hidden] f16/bf16, weights [intermediate,
    hidden], activation "silu" or "gelu". Without gradients both projections run in one kernel.
    When an input requires grad, the forward keeps g = x Wg^T and u = x Wu^T for the backward (two
    cuBLAS GEMMs into one buffer, then kiln's act_and_mul), and the backward is kiln's
    act_and_mul_backward and four GEMMs: fewer GEMMs than recomputing g and u."""
    if _needs_grad(x, gate_weight, up_weight):
        if _eager():
            return _GatedMlpTrainFunction.apply(x, gate_weight, up_weight, activation)[0]
        return torch.ops.kiln.gated_mlp_train(x, gate_weight, up_weight, activation)[0]
    if _eager():
        return _fused_gated_mlp_impl(x, gate_weight, up_weight, activation)
    return torch.ops.kiln.fused_gated_mlp(x, gate_weight, up_weight, activation)


def quantize_fp8(x: Tensor, granularity: str = "tensor", transpose: bool = False) -> Tuple[Tensor, Tensor]:
    """(q uint8 e4m3 codes, f32 scale): see kiln.quantize_fp8 (no autograd)."""
    if _eager():
        return _quantize_fp8_impl(x, granularity, transpose)
    return torch.ops.kiln.quantize_fp8(x, granularity, transpose)


def fp8_gemm(a: Tensor, b: Tensor, a_scale: Optional[Tensor] = None, b_scale: Optional[Tensor] = None,
             output_dtype: torch.dtype = torch.float16, scaling: str = "tensor") -> Tensor:
    """a [M, K] x b [K, N] in e4m3 (fp32 accumulation) -> output_dtype (f16 or bf16). Floating
    operands are quantized first (scaling "tensor" or "block"); uint8 operands are e4m3 codes and
    need their scales, b K-major (q.t() of a contiguous [N, K] q). No autograd."""
    block = scaling == "block"
    if a.dtype != torch.uint8:
        a, a_scale = quantize_fp8(a, "1x128" if block else "tensor")
    elif a_scale is None:
        raise InvalidArgumentError("fp8_gemm: a is pre-quantized (uint8) and needs a_scale")
    if b.dtype != torch.uint8:
        bq, b_scale = quantize_fp8(b, "128x128" if block else "tensor", True)
        b = bq.t()
    elif b_scale is None:
        raise InvalidArgumentError("fp8_gemm: b is pre-quantized (uint8) and needs b_scale")
    if _eager():
        return _fp8_gemm_impl(a, b, a_scale, b_scale, output_dtype)
    return torch.ops.kiln.fp8_gemm(a, b, a_scale, b_scale, output_dtype)


@torch.library.custom_op("kiln::fp8_linear", mutates_args=())
def _fp8_linear(x: Tensor, weight: Tensor, q: Tensor, scale: Tensor, scaling: str,
                output_dtype: torch.dtype) -> Tensor:
    """x [M, K] (floating) times the weight [N, K] through its e4m3 codes q [N, K] and scale:
    FP8Linear's differentiable forward."""
    return fp8_gemm(x, q.t(), None, scale, output_dtype, scaling)


@_fp8_linear.register_fake
def _(x, weight, q, scale, scaling, output_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=output_dtype)


def _fp8_linear_setup(ctx, inputs, output):
    x, weight = inputs[0], inputs[1]
    ctx.save_for_backward(x, weight)


def _fp8_linear_grad(ctx, dy):
    # The quantization is passed straight through: dgrad and wgrad are the unquantized product's,
    # computed in the weight's floating dtype (bf16 for a bf16 model), not in FP8.
    x, weight = ctx.saved_tensors
    g = dy.to(weight.dtype)
    dx = (g @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
    dw = (g.t() @ x.to(weight.dtype)) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None, None


_fp8_linear.register_autograd(_fp8_linear_grad, setup_context=_fp8_linear_setup)


# --- modules ---


class RMSNorm(torch.nn.Module):
    """Drop-in for torch.nn.RMSNorm: the same arguments, parameter ("weight") and results."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


class SwiGLU(torch.nn.Module):
    """A gated transformer MLP: down_proj(act(x Wg^T) * (x Wu^T)), with the gate and up
    projections stacked in one Linear, gate_up_proj ([2 * intermediate, hidden]: the gate's rows
    first, as Phi-3 stores them), so one GEMM feeds kiln's act_and_mul (differentiable) and no
    concatenation is needed. activation "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ("silu", "gelu", "gelu_tanh"):
            raise InvalidArgumentError(f"SwiGLU: activation must be silu, gelu or gelu_tanh (got {activation!r})")
        self.activation = activation
        self.gate_up_proj = torch.nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    @torch.no_grad()
    def load_gate_up(self, gate_weight: Tensor, up_weight: Tensor):
        """Copies separate gate and up weights ([intermediate, hidden] each, as Llama stores them)."""
        n = self.gate_up_proj.out_features // 2
        self.gate_up_proj.weight[:n].copy_(gate_weight)
        self.gate_up_proj.weight[n:].copy_(up_weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.activation))


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding of q and k with its cos/sin cache (kiln's apply_rope_qk).

    The cache holds cos and sin of position * base^(-2i / head_dim) for i < head_dim / 2 as float32
    [max_positions, head_dim / 2], computed in float64. It is built once per device on first use
    and grows (to the next power of two) only through extend(): forward never reads CUDA positions
    on the host, so on CUDA a position at or beyond max_positions gives NaN outputs for its token
    (the kernel cannot report it) instead of a device-to-host sync every step; host tensors get an
    InvalidArgumentError.

    forward(q, k, position_ids, inplace=False) -> (q_out, k_out): q [tokens, q_heads, head_dim],
    k [tokens, kv_heads, head_dim], position_ids int64 [tokens]. Differentiable in q and k.
    inplace=True rotates q and k themselves and returns them; it saves the outputs' memory and is
    for inference (it refuses tensors that require grad).
    """

    def __init__(self, head_dim: int, max_positions: int = 4096, base: float = 10000.0, layout: str = "neox"):
        super().__init__()
        if head_dim % 2 or head_dim <= 0:
            raise InvalidArgumentError(f"RotaryEmbedding: head_dim must be even and positive, not {head_dim}")
        if layout not in ("neox", "gptj"):
            raise InvalidArgumentError(f"RotaryEmbedding: layout must be neox or gptj, not {layout!r}")
        self.head_dim, self.base, self.layout = head_dim, float(base), layout
        self.max_positions = int(max_positions)
        self._tables = {}

    def extend(self, max_positions: int):
        """Makes the cache cover positions below max_positions (rounded up to a power of two)."""
        if max_positions > self.max_positions:
            self.max_positions = 1 << (int(max_positions) - 1).bit_length()
            self._tables.clear()

    def cos_sin(self, device):
        """The cache on `device`: (cos, sin), float32 [max_positions, head_dim / 2]."""
        device = torch.device(device)
        table = self._tables.get(device)
        if table is None or table[0].shape[0] != self.max_positions:
            inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
            angles = torch.arange(self.max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
            table = (angles.cos().float().to(device), angles.sin().float().to(device))
            self._tables[device] = table
        return table

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor, inplace: bool = False) -> Tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(q.device)
        if not inplace:
            return apply_rope_qk(q, k, cos, sin, position_ids, self.layout)
        if _needs_grad(q, k):
            raise InvalidArgumentError("RotaryEmbedding: inplace=True is for tensors that do not require grad")
        return _ops.apply_rope_qk(q, k, cos, sin, position_ids, self.layout, q_out=q, k_out=k)

    def extra_repr(self):
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, base={self.base}, layout={self.layout}"


class FusedRMSNormRoPE(torch.nn.Module):
    """RMSNorm (owning its weight) then RoPE over heads of head_dim, in one kernel; cos and sin
    come with each call: forward(x, cos, sin). Not a drop-in for a plain norm module."""

    def __init__(self, hidden_dim: int, head_dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if head_dim <= 0 or head_dim % 2 or hidden_dim % head_dim:
            raise ShapeMismatchError(f"FusedRMSNormRoPE: head_dim {head_dim} must be even and divide hidden_dim "
                                     f"{hidden_dim}")
        self.hidden_dim, self.head_dim, self.eps = hidden_dim, head_dim, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if cos.shape[-1] != self.head_dim:
            raise ShapeMismatchError(f"FusedRMSNormRoPE: cos has head_dim {cos.shape[-1]}, the module {self.head_dim}")
        return fused_rmsnorm_rope(x, self.weight, cos, sin, self.eps, self.hidden_dim // self.head_dim)

    def extra_repr(self):
        return f"{self.hidden_dim}, head_dim={self.head_dim}, eps={self.eps}"


class FusedGatedMLP(torch.nn.Module):
    """The gated expansion of a transformer MLP, act(x Wg^T) * (x Wu^T), in one kernel: owns
    gate_weight and up_weight ([intermediate_dim, hidden_dim]); the down projection stays outside."""

    def __init__(self, hidden_dim: int, intermediate_dim: int, activation: str = "silu", device=None, dtype=None):
        super().__init__()
        if activation not in _ops.GATED_ACTIVATIONS:
            raise InvalidArgumentError(f"FusedGatedMLP: activation must be silu or gelu (got {activation!r})")
        self.hidden_dim, self.intermediate_dim, self.activation = hidden_dim, intermediate_dim, activation
        self.gate_weight = torch.nn.Parameter(torch.empty(intermediate_dim, hidden_dim, device=device, dtype=dtype))
        self.up_weight = torch.nn.Parameter(torch.empty(intermediate_dim, hidden_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Linear's default initialisation for each projection.
        torch.nn.init.kaiming_uniform_(self.gate_weight, a=math.sqrt(5))
        torch.nn.init.kaiming_uniform_(self.up_weight, a=math.sqrt(5))

    def forward(self, x: Tensor) -> Tensor:
        return fused_gated_mlp(x, self.gate_weight, self.up_weight, self.activation)

    def extra_repr(self):
        return f"{self.hidden_dim}, {self.intermediate_dim}, activation={self.activation}"


class FP8Linear(torch.nn.Module):
    """nn.Linear (y = x W^T + b) through kiln's FP8 GEMM: the weight stays a floating-point
    parameter and is quantized (e4m3 with its scale, "tensor" or "block" scaling) on first use and
    again whenever it changes (its version counter moves, or its device or dtype). Activations are
    quantized on every call. f16/bf16 inputs give outputs of their dtype, f32 inputs bf16 results
    cast back to f32.

    Training: the forward runs in FP8 and the backward passes the quantization straight through,
    computing dgrad (dy W) and wgrad (dy^T x) in the weight's floating dtype with PyTorch's
    matmul, so x, weight and bias all get gradients; none is silently dropped."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, scaling: str = "tensor",
                 device=None, dtype=None):
        super().__init__()
        if scaling not in _ops.FP8_SCALINGS:
            raise InvalidArgumentError(f"FP8Linear: scaling must be tensor or block (got {scaling!r})")
        self.in_features, self.out_features, self.scaling = in_features, out_features, scaling
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self._cache = None  # ((weight version, device, dtype, address), q [out, in] uint8, scale)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)
        self._cache = None

    def quantized_weight(self) -> Tuple[Tensor, Tensor]:
        """(q, scale) of the current weight: q [out_features, in_features] uint8, whose q.t() is the
        K-major operand of fp8_gemm."""
        w = self.weight
        key = (w._version, w.device, w.dtype, w.data_ptr())
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                q, scale = quantize_fp8(w.detach(), "128x128" if self.scaling == "block" else "tensor")
            self._cache = (key, q, scale)
        return self._cache[1], self._cache[2]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeMismatchError(f"FP8Linear: input ends in {x.shape[-1]}, expected {self.in_features}")
        if _eager():
            q, scale = self.quantized_weight()
        else:
            # A traced graph cannot key a cache on the weight's address: it quantizes every call.
            q, scale = quantize_fp8(self.weight.detach(), "128x128" if self.scaling == "block" else "tensor")
        out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        x2 = x.reshape(-1, self.in_features)
        if _needs_grad(x, self.weight):
            y = torch.ops.kiln.fp8_linear(x2, self.weight, q, scale, self.scaling, out_dtype)
        else:
            y = fp8_gemm(x2, q.t(), None, scale, out_dtype, self.scaling)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        # The bias in the input's dtype: f32 inputs add (and sum its gradient) in f32.
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"scaling={self.scaling}"


# --- attention ---
#
# kiln::attention and kiln::attention_varlen are written here rather than generated from their
# declarations (empty inputs get lse -inf: no key seen); their signatures are their declarations',
# so their autograd comes from the declared backward ops (kiln::attention_backward,
# kiln::attention_varlen_backward; _AUTOGRAD_FROM_DECLARATION below), which save q, k, v, out and
# lse. `deterministic` is a forward argument only so that it reaches the backward.


class AttentionBackwardNotBuiltError(KilnError, NotImplementedError):
    """Raised when attention is called on tensors that require grad where kiln has no backward for
    them: CUDA tensors of head dims the GPU backward lacks."""


_ATTENTION_BWD_HEAD_DIMS = {(64, 64), (80, 80), (96, 96), (128, 128)}


def _attention_outputs(q, v, rows_shape, lse_shape):
    return _new(q, (*rows_shape, q.shape[-2], v.shape[-1])), _new(q, lse_shape, torch.float32)


def _attention_impl(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = _attention_outputs(q, v, q.shape[:2], (q.shape[0], q.shape[2], q.shape[1]))
    if out.numel() == 0 or k.shape[1] == 0:  # PyTorch gives empty tensors a null pointer, which kiln rejects
        return out.zero_(), lse.fill_(-math.inf)
    _ops.attention(q, k, v, scale, causal, window_left, window_right, softcap, out=out, lse=lse)
    return out, lse


_attention = torch.library.custom_op("kiln::attention", _attention_impl, mutates_args=())


@_attention.register_fake
def _(q, k, v, scale, causal, window_left, window_right, softcap, deterministic):
    return (q.new_empty((*q.shape[:3], v.shape[-1])),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


def _attention_varlen_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, window_left: int,
                           window_right: int, softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = _attention_outputs(q, v, q.shape[:1], (q.shape[1], q.shape[0]))
    if out.numel() == 0 or k.shape[0] == 0:
        return out.zero_(), lse.fill_(-math.inf)
    _ops.attention_varlen(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                          scale, causal, window_left, window_right, softcap, out=out, lse=lse)
    return out, lse


_attention_varlen = torch.library.custom_op("kiln::attention_varlen", _attention_varlen_impl, mutates_args=())


@_attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window_left, window_right,
      softcap, deterministic):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[-1])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _attention_args(name, q, k, v, dropout_p, scale, alibi_slopes=None):
    """The checks FlashAttention's and SDPA's arguments get before kiln's own, and the scale kiln
    takes (0: 1/sqrt(head_dim))."""
    if _needs_grad(q, k, v) and q.is_cuda:
        dims = (q.shape[-1], v.shape[-1])
        if dims not in _ATTENTION_BWD_HEAD_DIMS:
            raise AttentionBackwardNotBuiltError(
                f"kiln.torch.{name}: the GPU attention backward takes head dims 64, 80, 96 and 128 (q/k and v "
                f"alike), not {dims[0]}/{dims[1]}; call it under torch.no_grad() or on tensors that do not require "
                "grad")
    if dropout_p != 0:
        raise InvalidArgumentError(f"kiln.torch.{name}: dropout is not supported (dropout_p must be 0)")
    if alibi_slopes is not None:
        raise InvalidArgumentError(f"kiln.torch.{name}: alibi_slopes is not supported")
    if scale is None:
        return 0.0
    if scale == 0:
        raise InvalidArgumentError(f"kiln.torch.{name}: a softmax scale of 0 is not supported")
    return float(scale)


def _run_attention(name, impl, args):
    """out and lse of kiln::<name>: the custom op where torch.compile traces; in eager mode its
    implementation, through an autograd.Function with the declared backward when an input requires
    grad. lse is returned detached: the backward takes no gradient of it."""
    if not _eager():
        out, lse = getattr(torch.ops.kiln, name)(*args)
    elif _needs_grad(*args[:3]):
        out, lse = _EAGER_FROM_DECLARATION[name].apply(*args)
    else:
        out, lse = impl(*args)
    return out, lse.detach()


def _window(name, window_size):
    left, right = (int(w) for w in window_size)
    return left, right


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's flash_attn_func on kiln's kernels, with autograd: q [batch, seqlen_q, heads,
    head_dim], k and v [batch, seqlen_k, kv_heads, head_dim(_v)]; causal and window_size aligned to
    the end of the keys. Returns out, or (out, lse) with return_attn_probs (lse f32 [batch, heads,
    seqlen_q], detached: no gradient flows through it; kiln never returns the attention
    probabilities). `deterministic` picks the backward's mode (dq summed in a fixed order, bitwise
    reproducible; the forward is deterministic either way). dropout_p != 0 and alibi_slopes are
    InvalidArgumentError; CUDA inputs that require grad where the GPU backward is not available are
    AttentionBackwardNotBuiltError."""
    scale = _attention_args("flash_attn_func", q, k, v, dropout_p, softmax_scale, alibi_slopes)
    left, right = _window("flash_attn_func", window_size)
    args = (q, k, v, scale, bool(causal), left, right, float(softcap), bool(deterministic))
    out, lse = _run_attention("attention", _attention_impl, args)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention's flash_attn_varlen_func on kiln's kernels, with autograd: q [total_q, heads,
    head_dim], k and v [total_k, kv_heads, head_dim(_v)], cu_seqlens_q / cu_seqlens_k int32 [batch +
    1]. Returns out, or (out, lse) with return_attn_probs (lse f32 [heads, total_q], detached).
    block_table (paged KV) is not supported; otherwise as flash_attn_func."""
    scale = _attention_args("flash_attn_varlen_func", q, k, v, dropout_p, softmax_scale, alibi_slopes)
    if block_table is not None:
        raise InvalidArgumentError("kiln.torch.flash_attn_varlen_func: block_table (paged KV) is not supported")
    left, right = _window("flash_attn_varlen_func", window_size)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal), left,
            right, float(softcap), bool(deterministic))
    out, lse = _run_attention("attention_varlen", _attention_varlen_impl, args)
    return (out, lse) if return_attn_probs else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on kiln's kernels, with autograd: query
    [batch, heads, L, E], key [batch, kv_heads, S, E], value [batch, kv_heads, S, Ev] (4-D only);
    kv_heads < heads needs enable_gqa, as in torch. is_causal is torch's top-left-aligned mask
    (query i sees keys j <= i); with L < S that mask is not one kiln's end-aligned windows express,
    and is InvalidArgumentError. attn_mask must be None; dropout_p must be 0. The backward is
    deterministic when torch.are_deterministic_algorithms_enabled()."""
    s = _attention_args("scaled_dot_product_attention", query, key, value, dropout_p, scale)
    if attn_mask is not None:
        raise InvalidArgumentError("kiln.torch.scaled_dot_product_attention: attn_mask is not supported (only None)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ShapeMismatchError("kiln.torch.scaled_dot_product_attention: query, key and value must be 4-D "
                                 "[batch, heads, seq, head_dim]")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ShapeMismatchError(f"kiln.torch.scaled_dot_product_attention: query has {query.shape[1]} heads and key "
                                 f"{key.shape[1]}; pass enable_gqa=True for grouped-query attention")
    length, keys = query.shape[2], key.shape[2]
    right = -1
    if is_causal:
        if length < keys:
            raise InvalidArgumentError(
                "kiln.torch.scaled_dot_product_attention: is_causal with fewer queries than keys is torch's "
                "top-left-aligned mask, which kiln does not build (kiln.torch.flash_attn_func aligns it to the end)")
        right = length - keys  # query i sees keys j <= i
    args = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), s, False, -1, right, 0.0,
            torch.are_deterministic_algorithms_enabled())
    out, _ = _run_attention("attention", _attention_impl, args)
    return out.transpose(1, 2)


# --- every other declared op, from its declaration (include/kiln/op.h) ---
#
# Each op of kiln.ops.OPS that the hand-written ops above do not cover becomes the custom op
# kiln::<name>, returning every output (optional ones included, so a backward can use them), with
# a fake implementation from the declaration's shape inference and, when the declaration names a
# backward op, an autograd formula built from the backward's grad_of marks. kiln.torch.<name> runs
# the custom op where torch.compile traces; in eager mode it calls the op's implementation, through
# an autograd.Function with the same formulas when an input requires grad; it returns the required
# outputs.

_TORCH_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.uint8, 4: torch.int32, 5: torch.int64}
_KIND_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3, torch.int32: 4, torch.int64: 5}
_SCALAR_TYPES = {"f64": "float", "i64": "int", "bool": "bool", "choice": "str"}


def _schema(decl):
    args = [("Tensor? " if t["optional"] else "Tensor ") + t["name"] for t in decl.inputs]
    args += [f"{_SCALAR_TYPES[s['kind']]} {s['name']}" for s in decl.scalars]
    outs = ", ".join("Tensor" for _ in decl.outputs)
    return f"({', '.join(args)}) -> ({outs})" if len(decl.outputs) > 1 else f"({', '.join(args)}) -> Tensor"


def _output_shapes(decl, inputs, values, concrete=False):
    """The outputs' (shape, dtype) from the declaration's shape inference, for scalars as
    decl.scalar_values gives them. Inference takes concrete sizes: a symbolic size (torch.compile
    with dynamic shapes) is specialized to its current value (int() installs the guard), so the
    graph is correct and recompiles for another size. concrete: the inputs are real tensors, whose
    torch.Size already holds ints."""
    if concrete:
        shapes = [None if t is None else t.shape for t in inputs]
    else:
        shapes = [None if t is None else tuple(int(d) for d in t.shape) for t in inputs]
    dtypes = [None if t is None else _KIND_CODE.get(t.dtype, -1) for t in inputs]
    if -1 in dtypes:
        bad = next(t.dtype for t in inputs if t is not None and t.dtype not in _KIND_CODE)
        raise _ops.UnsupportedDtypeError(f"{decl.name}: kiln does not take {bad} tensors")
    return [(shape, _TORCH_DTYPES[dtype])
            for shape, dtype in decl.infer(shapes + [None] * len(decl.outputs), dtypes + [None] * len(decl.outputs),
                                           values)]


def _declared_impl(decl):
    # Inputs the op reads at any row stride (the declaration's strided_rows) are passed as they are
    # where their rows collapse to one stride; the others are made contiguous.
    strided = [t.get("strided_rows", False) for t in decl.inputs]
    n_in, op_id = len(decl.inputs), decl.id

    def impl(*args):
        inputs = [None if t is None else _rows_contiguous(t) if rows else t.contiguous()
                  for t, rows in zip(args[:n_in], strided)]
        values = decl.scalar_values(args[n_in:])
        first = next(t for t in inputs if t is not None)
        shapes = _output_shapes(decl, inputs, values, concrete=True)
        if any(t is not None and t.numel() == 0 for t in inputs):
            # PyTorch gives empty tensors a null pointer, which kiln rejects: sums of nothing are 0.
            outs = [torch.zeros(s, dtype=d, device=first.device) for s, d in shapes]
        else:
            outs = [torch.empty(s, dtype=d, device=first.device) for s, d in shapes]
            # Straight to the C op, which checks every tensor and scalar: the arguments are already
            # bound (the schema, or kiln.torch's function, named them).
            _ops._call(op_id, None, None, *inputs, *outs, *values)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def fake(*args):
        inputs = list(args[:len(decl.inputs)])
        first = next(t for t in inputs if t is not None)
        values = decl.scalar_values(args[len(decl.inputs):])
        outs = [first.new_empty(s, dtype=d) for s, d in _output_shapes(decl, inputs, values)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return impl, fake


def _register_autograd(decl):
    bwd = _ops.OPS[decl.backward]
    names_in = [t["name"] for t in decl.inputs]
    names_out = [t["name"] for t in decl.outputs]
    scalar_names = [s["name"] for s in decl.scalars]
    # What the backward reads besides gradients: forward inputs and outputs, by name.
    saved = [t["name"] for t in bwd.inputs if not t["grad_of"] and (t["name"] in names_in or t["name"] in names_out)]
    bwd_op = getattr(torch.ops.kiln, bwd.name)

    n_in, n_sc = len(names_in), len(scalar_names)
    # Where each of the saved tensors comes from: ("in", i) or ("out", i), inputs first by name.
    sources = [("in", names_in.index(n)) if n in names_in else ("out", names_out.index(n)) for n in saved]
    # Each argument of the backward op: ("grad", output index), ("saved", index) or None (an input
    # neither saved nor a gradient: absent), then its scalars by the forward's scalar index.
    plan = [("grad", names_out.index(t["grad_of"])) if t["grad_of"] else
            ("saved", saved.index(t["name"])) if t["name"] in saved else None for t in bwd.inputs]
    bwd_scalars = [s["name"] for s in bwd.scalars]
    # The gradient each output of the backward op is: the forward input's index, or None.
    result_index = [names_in.index(t["grad_of"]) if t["grad_of"] in names_in else None for t in bwd.outputs]

    def setup_context(ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*[inputs[i] if kind == "in" else outs[i] for kind, i in sources])
        ctx.scalars = dict(zip(scalar_names, inputs[n_in:]))
        ctx.present = [t is not None for t in inputs[:n_in]]
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]

    def backward_with(run_backward):
        return lambda ctx, *grads: backward(ctx, grads, run_backward)

    def backward(ctx, grads, run_backward):
        saved_tensors = ctx.saved_tensors
        args = []
        for step in plan:
            if step is None:
                args.append(None)
            elif step[0] == "saved":
                args.append(saved_tensors[step[1]])
            else:
                g = grads[step[1]]
                if g is None:
                    shape, dtype = ctx.out_meta[step[1]]
                    g = torch.zeros(shape, dtype=dtype, device=saved_tensors[0].device)
                args.append(g)
        args += [ctx.scalars[n] for n in bwd_scalars]
        outs = run_backward(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        result = [None] * (n_in + n_sc)
        for i, g in zip(result_index, outs):
            if i is not None and ctx.present[i]:
                result[i] = g
        return tuple(result)

    torch.library.register_autograd(f"kiln::{decl.name}", backward_with(bwd_op), setup_context=setup_context)
    # The eager Function's backward runs the backward op's implementation without the dispatcher.
    return setup_context, backward_with(_DECLARED_IMPLS.get(bwd.name, bwd_op))


def _python_function(decl):
    def fn(*args, **kwargs):
        inputs, outputs, _ = decl.bind(args, kwargs)
        if any(o is not None for o in outputs):
            raise InvalidArgumentError(f"kiln.torch.{decl.name} allocates its outputs; use kiln.{decl.name} to pass them")
        names = [s["name"] for s in decl.scalars]
        bound = dict(zip([t["name"] for t in decl.inputs] + names, args))
        bound.update(kwargs)
        scalars = []
        for s in decl.scalars:
            v = bound.get(s["name"], s.get("default"))
            if v is None:
                v = s.get("default")
            scalars.append(v)
        outs = _run_declared(decl.name, inputs, scalars)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ret = [o for o, t in zip(outs, decl.outputs) if not t["optional"]]
        return ret[0] if len(ret) == 1 else tuple(ret)

    fn.__name__ = fn.__qualname__ = decl.name
    fn.__doc__ = f"kiln.torch.{decl.name}: {decl.doc} (custom op kiln::{decl.name}, with autograd where the " \
                 f"declaration names a backward)"
    return fn


def _run_declared(name, inputs, scalars):
    """A declared op's outputs: in eager mode its implementation directly, or with gradients its
    autograd.Function (the same formulas as the custom op's autograd, without the dispatcher and
    torch.library's wrapper); the custom op where torch.compile traces."""
    if _eager():
        if _needs_grad(*inputs):
            function = _EAGER_FROM_DECLARATION.get(name)
            if function is not None:
                return function.apply(*inputs, *scalars)
        else:
            return _DECLARED_IMPLS[name](*inputs, *scalars)
    return getattr(torch.ops.kiln, name)(*inputs, *scalars)


# ---- the paged KV cache (families/paged_attention) ----
# reshape_and_cache, copy_blocks and merge_state_in_place write into tensors they are given, and
# paged_decode into its workspace: torch learns that from mutates_args, which the ops registered
# from their declarations (mutating nothing) cannot say.


def _as_cache(t):
    """An fp8 cache (torch.float8_e4m3fn) as the u8 bytes kiln's ops take; other caches as they are."""
    return t.view(torch.uint8) if t.dtype == getattr(torch, "float8_e4m3fn", None) else t


@torch.library.custom_op("kiln::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def _reshape_and_cache(key: Tensor, value: Tensor, slot_mapping: Tensor, key_cache: Tensor, value_cache: Tensor,
                       k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    if key.shape[0] == 0:
        return
    _ops.reshape_and_cache(key, value, slot_mapping.contiguous(), k_scale, v_scale, key_cache=_as_cache(key_cache),
                           value_cache=_as_cache(value_cache))


@_reshape_and_cache.register_fake
def _(key, value, slot_mapping, key_cache, value_cache, k_scale=None, v_scale=None):
    return None


@torch.library.custom_op("kiln::copy_blocks", mutates_args=("key_cache", "value_cache"))
def _copy_blocks(key_cache: Tensor, value_cache: Tensor, pairs: Tensor) -> None:
    if pairs.shape[0] == 0:
        return
    _ops.copy_blocks(pairs.contiguous(), key_cache=_as_cache(key_cache), value_cache=_as_cache(value_cache))


@_copy_blocks.register_fake
def _(key_cache, value_cache, pairs):
    return None


@torch.library.custom_op("kiln::swap_blocks", mutates_args=("dst_key", "dst_value"))
def _swap_blocks(src_key: Tensor, src_value: Tensor, dst_key: Tensor, dst_value: Tensor, pairs: Tensor) -> None:
    if pairs.shape[0] == 0:
        return
    _ops.swap_blocks(pairs.contiguous(), _as_cache(src_key), _as_cache(src_value), dst_key=_as_cache(dst_key),
                     dst_value=_as_cache(dst_value))


@_swap_blocks.register_fake
def _(src_key, src_value, dst_key, dst_value, pairs):
    return None


@torch.library.custom_op("kiln::merge_state_in_place", mutates_args=("v", "s"))
def _merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor) -> None:
    if v.numel() == 0:
        return
    _ops.merge_state_in_place(v_other.contiguous(), s_other.contiguous(), v=v, s=s)


@_merge_state_in_place.register_fake
def _(v, s, v_other, s_other):
    return None


@torch.library.custom_op("kiln::paged_decode", mutates_args=("workspace",))
def _paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                  cu_seqlens_q: Optional[Tensor], workspace: Tensor, max_seqlen_q: int, max_seq_len: int, splits: int,
                  scale: float, causal: bool, window_left: int, softcap: float) -> Tuple[Tensor, Tensor]:
    q = q.contiguous()
    out = _new(q, q.shape)
    lse = _new(q, q.shape[:2], torch.float32)
    if q.shape[0] == 0:
        return out, lse
    _ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, workspace, max_seqlen_q, max_seq_len,
                      splits, scale, causal, window_left, softcap, out=out, lse=lse)
    return out, lse


@_paged_decode.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, workspace, max_seqlen_q, max_seq_len, splits, scale,
      causal, window_left, softcap):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("kiln::paged_cascade_decode", mutates_args=("workspace",))
def _paged_cascade_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, shared_block_table: Tensor,
                          shared_seq_len: Tensor, block_tables: Tensor, seq_lens: Tensor, workspace: Tensor,
                          max_shared_len: int, max_seq_len: int, shared_splits: int, splits: int, scale: float,
                          softcap: float) -> Tuple[Tensor, Tensor]:
    q = q.contiguous()
    out = _new(q, q.shape)
    lse = _new(q, q.shape[:2], torch.float32)
    if q.shape[0] == 0:
        return out, lse
    _ops.paged_cascade_decode(q, k_cache, v_cache, shared_block_table, shared_seq_len, block_tables, seq_lens,
                              workspace, max_shared_len, max_seq_len, shared_splits, splits, scale, softcap, out=out,
                              lse=lse)
    return out, lse


@_paged_cascade_decode.register_fake
def _(q, k_cache, v_cache, shared_block_table, shared_seq_len, block_tables, seq_lens, workspace, max_shared_len,
      max_seq_len, shared_splits, splits, scale, softcap):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                      k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    """vLLM's reshape_and_cache_flash: key and value [tokens, kv_heads, head_dim] (rows at any stride) go to
    slots slot_mapping[t] (int32 or int64; -1: skipped) of the caches [num_blocks, page_size, kv_heads,
    head_dim], in place. fp8 caches (float8_e4m3fn or uint8) store e4m3(x / scale) with k_scale, v_scale
    f32 [1] tensors."""
    torch.ops.kiln.reshape_and_cache(key, value, slot_mapping, key_cache, value_cache, k_scale, v_scale)


def copy_blocks(key_cache: Tensor, value_cache: Tensor, pairs: Tensor) -> None:
    """Block dst of both caches becomes a copy of block src for each (src, dst) row of pairs [n, 2] (int32 or
    int64), in place: KVCacheManager's copy list (SlotPlan.copies). Pairs must not chain or repeat a dst."""
    torch.ops.kiln.copy_blocks(key_cache, value_cache, pairs)


def merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor) -> None:
    """(v, s) becomes the merge of itself with (v_other, s_other): v [tokens, heads, head_dim], s [tokens,
    heads] f32 lse (natural log) over disjoint keys; FlashInfer's merge_state_in_place."""
    torch.ops.kiln.merge_state_in_place(v, s, v_other, s_other)


def swap_blocks(src_key: Tensor, src_value: Tensor, dst_key: Tensor, dst_value: Tensor, pairs: Tensor) -> None:
    """For each (src, dst) row of pairs (int32 or int64 [n, 2]), block dst of (dst_key, dst_value)
    becomes a copy of block src of (src_key, src_value), in one launch on the current stream: a GPU
    pool to a pinned host pool, back, or between GPU pools. Host pools must be pinned
    (pin_memory()); the first dimensions (block counts) may differ."""
    torch.ops.kiln.swap_blocks(src_key, src_value, dst_key, dst_value, pairs)


_SWAP_STREAMS = {}


def _swap_layers(src_caches, dst_caches, pairs, stream):
    src_caches, dst_caches = list(src_caches), list(dst_caches)
    if len(src_caches) != len(dst_caches):
        raise ShapeMismatchError(f"swap: {len(src_caches)} source layers, {len(dst_caches)} destination layers")
    pairs_host = torch.as_tensor(pairs, dtype=torch.int32).reshape(-1, 2)
    if not src_caches or pairs_host.shape[0] == 0:
        return None
    device = next((t.device for layer in src_caches + dst_caches for t in layer if t.is_cuda), None)
    if device is None:
        raise InvalidArgumentError("swap: one of the pools must be on a GPU")
    # Every layer is checked before the first launch, so a bad one leaves nothing half copied.
    for i, ((sk, sv), (dk, dv)) in enumerate(zip(src_caches, dst_caches)):
        if sk.shape != sv.shape or dk.shape != dv.shape or sk.shape[1:] != dk.shape[1:] or \
                len({sk.dtype, sv.dtype, dk.dtype, dv.dtype}) != 1:
            raise ShapeMismatchError(f"swap: layer {i}: the pools' K and V must have one block shape and dtype, got "
                                     f"{tuple(sk.shape)} {sk.dtype} -> {tuple(dk.shape)} {dk.dtype}")
        for name, t in (("source", sk), ("source", sv), ("destination", dk), ("destination", dv)):
            if t.is_cuda and t.device != device:
                raise InvalidArgumentError(f"swap: layer {i}: the {name} pool is on {t.device}, not {device}")
            if not t.is_cuda and not t.is_pinned():
                raise InvalidArgumentError(f"swap: layer {i}: the {name} pool is pageable host memory; allocate it "
                                           "with pin_memory=True")
    side = stream if stream is not None else _SWAP_STREAMS.get(device.index)
    if side is None:
        side = _SWAP_STREAMS[device.index] = torch.cuda.Stream(device)
    # The copies read what earlier work on the current stream wrote.
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        # Checked on the host (ids inside their pools, no destination twice), then read by the
        # kernels from the GPU.
        sk0, dk0 = src_caches[0][0], dst_caches[0][0]
        if int(pairs_host[:, 0].min()) < 0 or int(pairs_host[:, 0].max()) >= sk0.shape[0] or \
                int(pairs_host[:, 1].min()) < 0 or int(pairs_host[:, 1].max()) >= dk0.shape[0]:
            raise InvalidArgumentError(f"swap: a pair names a block outside its pool ({sk0.shape[0]} source, "
                                       f"{dk0.shape[0]} destination blocks)")
        if torch.unique(pairs_host[:, 1]).numel() != pairs_host.shape[0]:
            raise InvalidArgumentError("swap: a destination block appears twice")
        pairs_dev = pairs_host.to(device)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            torch.ops.kiln.swap_blocks(sk, sv, dk, dv, pairs_dev)
        pairs_dev.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return event


def swap_blocks_to_cpu(gpu_caches, cpu_caches, pairs, stream=None):
    """Swap out (KVCacheManager.swap_out's pairs: (device block, host block)): for every layer's
    (key_cache, value_cache) in gpu_caches, the listed blocks are copied into the same layer of
    cpu_caches (pinned host tensors of the same block shape). The copies run on a side stream
    (`stream`, or one kiln keeps per device) after the work queued so far on the current stream;
    returns the torch.cuda.Event recorded after them (None when there is nothing to copy): wait on
    it (current_stream().wait_event) before the freed device blocks are written again, and
    synchronize it before the host reads the copies."""
    return _swap_layers(gpu_caches, cpu_caches, pairs, stream)


def swap_blocks_from_cpu(cpu_caches, gpu_caches, pairs, stream=None):
    """Swap in (KVCacheManager.swap_in's pairs: (host block, device block)), as swap_blocks_to_cpu
    the other way: wait on the returned event before attention reads the blocks."""
    return _swap_layers(cpu_caches, gpu_caches, pairs, stream)


__all__ += ["reshape_and_cache", "copy_blocks", "merge_state_in_place", "swap_blocks", "swap_blocks_to_cpu",
            "swap_blocks_from_cpu"]


# Hand-written ops whose torch signature is their declaration's (inputs, scalars and outputs in
# declaration order), by name, with their implementations: they take their autograd from the
# declaration, and their eager training path is an autograd.Function with the same formulas.
_AUTOGRAD_FROM_DECLARATION = {"act_and_mul": _act_and_mul_impl, "attention": _attention_impl,
                              "attention_varlen": _attention_varlen_impl}
_EAGER_FROM_DECLARATION = {}
_DECLARED_IMPLS = {}


def _register_declared():
    ops = {}
    for name, decl in _ops.OPS.items():
        if hasattr(torch.ops.kiln, name):
            continue  # a hand-written op above
        impl, fake = _declared_impl(decl)
        op = torch.library.custom_op(f"kiln::{name}", impl, mutates_args=(), schema=_schema(decl))
        op.register_fake(fake)
        ops[name] = (decl, op)
        _DECLARED_IMPLS[name] = impl
    for name, (decl, op) in ops.items():
        if decl.backward and decl.backward in _ops.OPS and hasattr(torch.ops.kiln, decl.backward):
            setup_context, backward = _register_autograd(decl)
            # The backward makes zeros only for a gradient its op reads (an unused output's): the
            # others (layer_norm's mean and rstd, say) stay None rather than tensors filled every step.
            _EAGER_FROM_DECLARATION[name] = _eager_function(f"_{name}_function", _DECLARED_IMPLS[name],
                                                            setup_context, backward, materialize_grads=False)
        if name not in globals():
            globals()[name] = _python_function(decl)
            __all__.append(name)
    for name, impl in _AUTOGRAD_FROM_DECLARATION.items():
        setup_context, backward = _register_autograd(_ops.OPS[name])
        _EAGER_FROM_DECLARATION[name] = _eager_function(f"_{name}_function", impl, setup_context, backward,
                                                        materialize_grads=False)
    return sorted(ops)


DECLARED = _register_declared()
"""The ops registered here from their declarations (kiln::<name>), e.g. layer_norm and its backward."""


class FlashInferAttention(torch.nn.Module):
    """Prefill attention with FlashInfer's plan/run split, on kiln's attention kernels.

    plan(cu_seqlens_q, cu_seqlens_k=None) takes a batch of packed sequences (int32 offsets [batch +
    1]; keys default to the queries' offsets) and reads their lengths to the host once: one device
    sync per batch, where calling flash_attn_varlen_func without known maximum lengths would need
    one per layer. forward(q, k, v) then launches without touching the host, so every layer of a
    batch reuses the plan and the call can be captured in a CUDA graph. Without a plan (or after
    reset()), forward takes padded [batch, seq, heads, head_dim] tensors.

    forward(q, k, v, return_lse=False): packed q [total_q, num_heads, head_dim], k and v [total_k,
    num_kv_heads, head_dim(_v)]; returns out [total_q, num_heads, head_dim_v], and with return_lse
    also lse f32 ([num_heads, total_q] packed, [batch, num_heads, seq_q] padded). causal and
    window_size are aligned to the end of each sequence's keys, as flash_attn_varlen_func aligns
    them. Gradients flow to q, k and v as through flash_attn_varlen_func.
    """

    def __init__(self, num_heads: int, num_kv_heads: Optional[int] = None, causal: bool = True,
                 window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 softmax_scale: Optional[float] = None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise InvalidArgumentError(f"FlashInferAttention: num_heads ({num_heads}) must be a positive multiple of "
                                       f"num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads)
        self.causal, self.window_size = bool(causal), (int(window_size[0]), int(window_size[1]))
        self.softcap, self.softmax_scale = float(softcap), softmax_scale
        self._plan = None

    @staticmethod
    def _offsets(name, cu):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
            raise InvalidArgumentError(f"FlashInferAttention.plan: {name} must be an int32 tensor [batch + 1]")
        host = cu.cpu()
        lengths = host[1:] - host[:-1]
        if int(host[0]) != 0 or bool((lengths < 0).any()):
            raise InvalidArgumentError(f"FlashInferAttention.plan: {name} must start at 0 and never decrease")
        return cu.contiguous(), int(lengths.max()), int(host[-1])

    def plan(self, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor] = None):
        """Fixes the batch's packed sequences for the following forward calls; returns self."""
        cu_q, max_q, total_q = self._offsets("cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_k is None:
            cu_k, max_k, total_k = cu_q, max_q, total_q
        else:
            cu_k, max_k, total_k = self._offsets("cu_seqlens_k", cu_seqlens_k)
            if cu_k.numel() != cu_q.numel():
                raise InvalidArgumentError("FlashInferAttention.plan: cu_seqlens_q and cu_seqlens_k hold different "
                                           "batch sizes")
        self._plan = (cu_q, cu_k, max_q, max_k, total_q, total_k)
        return self

    def reset(self):
        """Drops the plan: forward takes padded tensors again."""
        self._plan = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, return_lse: bool = False):
        rows = 1 if self._plan is not None else 2
        if q.dim() != rows + 2 or k.dim() != rows + 2 or v.dim() != rows + 2:
            layout = "packed [tokens, heads, head_dim] (a plan is set)" if rows == 1 else \
                "padded [batch, seq, heads, head_dim] (no plan is set)"
            raise ShapeMismatchError(f"FlashInferAttention: q, k and v must be {layout}")
        if q.shape[-2] != self.num_heads or k.shape[-2] != self.num_kv_heads or v.shape[-2] != self.num_kv_heads:
            raise ShapeMismatchError(f"FlashInferAttention: expected {self.num_heads} query heads and "
                                     f"{self.num_kv_heads} key/value heads, got {q.shape[-2]}, {k.shape[-2]} and "
                                     f"{v.shape[-2]}")
        common = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                      softcap=self.softcap, return_attn_probs=True)
        if self._plan is None:
            out, lse = flash_attn_func(q, k, v, **common)
        else:
            cu_q, cu_k, max_q, max_k, total_q, total_k = self._plan
            if q.shape[0] != total_q or k.shape[0] != total_k or v.shape[0] != total_k:
                raise ShapeMismatchError(f"FlashInferAttention: the plan holds {total_q} query and {total_k} key "
                                         f"tokens; q has {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
            if cu_q.device != q.device:
                cu_q, cu_k = cu_q.to(q.device), cu_k.to(q.device)
                self._plan = (cu_q, cu_k, max_q, max_k, total_q, total_k)
            out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **common)
        return (out, lse) if return_lse else out

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, causal={self.causal}, "
                f"window_size={self.window_size}, softcap={self.softcap}")


__all__.append("FlashInferAttention")


def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


class BatchDecodeWithPagedKVCache(torch.nn.Module):
    """Paged decode with FlashInfer's plan/run split (BatchDecodeWithPagedKVCacheWrapper), on kiln's
    paged decode kernels (families/paged_attention).

    plan(block_tables, seq_lens, num_blocks, cu_seqlens_q=None) takes a batch's padded block tables
    (int32 [batch, max_blocks]) and key counts (int32 [batch]), on the device or the host: it reads
    them to the host once (one sync per batch), checks every request's table against the pool
    (InvalidArgumentError for an entry outside it, ShapeMismatchError for keys past the table),
    picks the key split for the device and allocates the workspace. forward(q, k_cache, v_cache)
    then touches nothing on the host: every layer of the batch reuses the plan, and the call can be
    captured in a CUDA graph.

    q [total_q, num_heads, head_dim] (one query per request without cu_seqlens_q; with it, request
    b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its last tokens); k_cache and
    v_cache [num_blocks, page_size, num_kv_heads, head_dim] (vLLM's flash layout). Returns out
    [total_q, num_heads, head_dim] and, with return_lse, lse f32 [total_q, num_heads].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16, causal: bool = False,
                 window_left: int = -1, softcap: float = 0.0, softmax_scale: Optional[float] = None):
        super().__init__()
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise InvalidArgumentError(f"BatchDecodeWithPagedKVCache: num_heads ({num_heads}) must be a positive "
                                       f"multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.page_size, self.causal, self.window_left = int(page_size), bool(causal), int(window_left)
        self.softcap, self.softmax_scale = float(softcap), softmax_scale
        self._plan = None

    def plan(self, block_tables: Tensor, seq_lens: Tensor, num_blocks: int, cu_seqlens_q: Optional[Tensor] = None,
             device=None, check_tables: bool = True):
        """Fixes the batch for the following forward calls; returns self. check_tables=False skips
        reading the tables to the host and checking them (tables a KVCacheManager built are valid)."""
        from .serving import plan_paged_decode
        device = torch.device(device) if device is not None else block_tables.device
        if block_tables.dim() != 2:
            raise ShapeMismatchError("BatchDecodeWithPagedKVCache.plan: block_tables must be [batch, max_blocks]")
        tables_host = block_tables.to("cpu", torch.int32) if check_tables else None
        lens_host = seq_lens.to("cpu", torch.int32).reshape(-1)
        cu_host = None if cu_seqlens_q is None else cu_seqlens_q.to("cpu", torch.int32).reshape(-1)
        p = plan_paged_decode(lens_host, heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              page_size=self.page_size, num_blocks=int(num_blocks), block_tables=tables_host,
                              max_blocks=block_tables.shape[1], cu_seqlens_q=cu_host, sm_count=_sm_count(device))
        dev = lambda t: None if t is None else t.to(device, torch.int32).contiguous()
        self._plan = dict(p, tables=dev(block_tables), lens=dev(seq_lens.reshape(-1)), cu=dev(cu_seqlens_q),
                          workspace=torch.empty(max(p["workspace_elements"], 1), dtype=torch.float32, device=device),
                          num_blocks=int(num_blocks))
        return self

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, return_lse: bool = False):
        p = self._plan
        if p is None:
            raise InvalidArgumentError("BatchDecodeWithPagedKVCache: call plan() before forward()")
        if q.dim() != 3 or q.shape[0] != p["total_q"] or q.shape[1] != self.num_heads:
            raise ShapeMismatchError(f"BatchDecodeWithPagedKVCache: q must be [{p['total_q']}, {self.num_heads}, "
                                     f"head_dim] for the planned batch, got {list(q.shape)}")
        if k_cache.dim() != 4 or k_cache.shape[0] != p["num_blocks"] or k_cache.shape[1] != self.page_size:
            raise ShapeMismatchError(f"BatchDecodeWithPagedKVCache: the caches must be [{p['num_blocks']}, "
                                     f"{self.page_size}, num_kv_heads, head_dim] as planned, got {list(k_cache.shape)}")
        out, lse = torch.ops.kiln.paged_decode(q, k_cache, v_cache, p["tables"], p["lens"], p["cu"], p["workspace"],
                                               p["max_seqlen_q"], p["max_seq_len"], p["splits"],
                                               float(self.softmax_scale or 0.0), self.causal, self.window_left,
                                               self.softcap)
        return (out, lse) if return_lse else out

    def extra_repr(self):
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"page_size={self.page_size}, causal={self.causal}, window_left={self.window_left}, "
                f"softcap={self.softcap}")


class BatchPrefillWithPagedKVCache(BatchDecodeWithPagedKVCache):
    """Chunked prefill / append over a paged cache, FlashInfer's BatchPrefillWithPagedKVCacheWrapper
    in shape: BatchDecodeWithPagedKVCache with causal on by default and cu_seqlens_q (the queries'
    offsets, int32 [batch + 1]) required by plan. Request b's queries are the last of its seq_lens[b]
    keys (its new tokens, already written to the cache by reshape_and_cache). It runs the decode's
    split kernel, whose tiles are sized for short query runs: correct for any length, not tuned for
    long prompts."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16, causal: bool = True,
                 window_left: int = -1, softcap: float = 0.0, softmax_scale: Optional[float] = None):
        super().__init__(num_heads, num_kv_heads, head_dim, page_size, causal, window_left, softcap, softmax_scale)

    def plan(self, block_tables: Tensor, seq_lens: Tensor, num_blocks: int, cu_seqlens_q: Optional[Tensor] = None,
             device=None, check_tables: bool = True):
        if cu_seqlens_q is None:
            raise InvalidArgumentError("BatchPrefillWithPagedKVCache.plan: cu_seqlens_q (int32 [batch + 1]) is required")
        return super().plan(block_tables, seq_lens, num_blocks, cu_seqlens_q, device, check_tables)


class BatchDecodeWithSharedPrefixPagedKVCache(torch.nn.Module):
    """Cascade decode: every request of the batch continues one shared prefix (a system prompt, the
    prompt of parallel samples) held in blocks shared_block_table of the cache, then keys of its
    own. The prefix is attended once per batch, as one request whose queries are every request's
    (its K and V read once instead of once per request, the requests' GQA rows filling its tiles),
    each request's own keys apart, and one combine merges the two passes' partial states by their
    lse (three launches: kiln's paged_cascade_decode op). FlashInfer's MultiLevelCascadeAttention
    with two levels, for one query per request.

    plan(shared_block_table [prefix_blocks], shared_len, block_tables [batch, max_blocks], seq_lens
    [batch] (own keys, after the prefix), num_blocks) reads the tables to the host once and checks
    them; forward(q [batch, num_heads, head_dim], k_cache, v_cache, return_lse=False) -> out (and lse
    [batch, num_heads]), attention over prefix + own keys, touching nothing on the host.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16, softcap: float = 0.0,
                 softmax_scale: Optional[float] = None):
        super().__init__()
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise InvalidArgumentError(f"BatchDecodeWithSharedPrefixPagedKVCache: num_heads ({num_heads}) must be a "
                                       f"positive multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.page_size, self.softcap, self.softmax_scale = int(page_size), float(softcap), softmax_scale
        self._plan = None

    def plan(self, shared_block_table: Tensor, shared_len: int, block_tables: Tensor, seq_lens: Tensor,
             num_blocks: int, device=None):
        """Fixes the batch for the following forward calls; returns self."""
        from .serving import plan_paged_cascade_decode
        device = torch.device(device) if device is not None else block_tables.device
        shared_host = shared_block_table.to("cpu", torch.int32).reshape(-1)
        tables_host = block_tables.to("cpu", torch.int32)
        if tables_host.dim() != 2:
            raise ShapeMismatchError("BatchDecodeWithSharedPrefixPagedKVCache.plan: block_tables must be "
                                     "[batch, max_blocks]")
        p = plan_paged_cascade_decode(shared_host, int(shared_len), seq_lens.to("cpu", torch.int32).reshape(-1),
                                      heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                      page_size=self.page_size, num_blocks=int(num_blocks), block_tables=tables_host,
                                      max_blocks=tables_host.shape[1], sm_count=_sm_count(device))
        dev = lambda t: t.to(device, torch.int32).contiguous()
        self._plan = dict(p, shared=dev(shared_host), shared_len_t=dev(torch.tensor([int(shared_len)])),
                          tables=dev(block_tables), lens=dev(seq_lens.reshape(-1)), num_blocks=int(num_blocks),
                          workspace=torch.empty(max(p["workspace_elements"], 1), dtype=torch.float32, device=device))
        return self

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, return_lse: bool = False):
        p = self._plan
        if p is None:
            raise InvalidArgumentError("BatchDecodeWithSharedPrefixPagedKVCache: call plan() before forward()")
        if q.dim() != 3 or q.shape[0] != p["batch"] or q.shape[1] != self.num_heads:
            raise ShapeMismatchError(f"BatchDecodeWithSharedPrefixPagedKVCache: q must be [{p['batch']}, "
                                     f"{self.num_heads}, head_dim] for the planned batch, got {list(q.shape)}")
        if k_cache.dim() != 4 or k_cache.shape[0] != p["num_blocks"] or k_cache.shape[1] != self.page_size:
            raise ShapeMismatchError(f"BatchDecodeWithSharedPrefixPagedKVCache: the caches must be "
                                     f"[{p['num_blocks']}, {self.page_size}, num_kv_heads, head_dim] as planned, got "
                                     f"{list(k_cache.shape)}")
        out, lse = torch.ops.kiln.paged_cascade_decode(q, k_cache, v_cache, p["shared"], p["shared_len_t"],
                                                       p["tables"], p["lens"], p["workspace"], p["shared_len"],
                                                       p["max_seq_len"], p["shared_splits"], p["splits"],
                                                       float(self.softmax_scale or 0.0), self.softcap)
        return (out, lse) if return_lse else out


__all__ += ["BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache", "BatchDecodeWithSharedPrefixPagedKVCache"]


# --- mixture of experts ---

MOE_SCORINGS = ("softmax", "sigmoid_group")


def _moe_experts_impl(x: Tensor, weights: Tensor, ids: Tensor, w_gate_up: Tensor, w_down: Tensor, activation: str,
                      num_experts: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The experts of an MoE layer: (out, x_sorted, h, a, y_sorted, offsets, row_of, src_of), out the
    routing-weighted sum of every token's experts. Permute by expert, gate_up = x_sorted W_gu[e]^T
    (grouped GEMM), a = act_and_mul(gate_up), y_sorted = a W_d[e]^T (grouped GEMM), combine. The
    intermediates are what the backward reads."""
    x_sorted, offsets, row_of, src_of = _DECLARED_IMPLS["moe_permute"](x, ids, num_experts)
    offs = offsets[1:]
    h = _DECLARED_IMPLS["grouped_gemm"](x_sorted, w_gate_up, offs)
    a = _act_and_mul_impl(h, activation)
    y_sorted = _DECLARED_IMPLS["grouped_gemm"](a, w_down, offs)
    out = _DECLARED_IMPLS["moe_combine"](y_sorted, row_of, weights)
    return out, x_sorted, h, a, y_sorted, offsets, row_of, src_of


_moe_experts = torch.library.custom_op("kiln::moe_experts", _moe_experts_impl, mutates_args=())


@_moe_experts.register_fake
def _(x, weights, ids, w_gate_up, w_down, activation, num_experts):
    tokens, hidden = x.shape
    n = tokens * ids.shape[1]
    two_inter = w_gate_up.shape[1]
    i32 = torch.int32
    return (x.new_empty((tokens, hidden)), x.new_empty((n, hidden)), x.new_empty((n, two_inter)),
            x.new_empty((n, two_inter // 2)), x.new_empty((n, hidden)), x.new_empty((num_experts + 1,), dtype=i32),
            x.new_empty(ids.shape, dtype=i32), x.new_empty((n,), dtype=i32))


def _moe_setup(ctx, inputs, output):
    x, weights, ids, w_gate_up, w_down, activation, num_experts = inputs
    ctx.activation = activation
    ctx.save_for_backward(weights, w_gate_up, w_down, *output[1:])


def _moe_grad_with(op):
    """The experts' backward, calling the declared ops through op(name): the custom ops where
    autograd traces (torch.compile), their implementations in the eager Function."""

    def grad(ctx, dout, *_unused):
        # out = combine(y, w): dw[t, j] = <dout[t], y[row_of[t, j]]>, dy = gather(dout, w). Then
        # through the down projection (dgrad dy_e W_d[e], the weight read as stored; wgrad
        # dW_d[e] = dy_e^T a_e),
        # act_and_mul, the gate_up projection (dW_gu[e] = dh_e^T x_e), and dx = the unweighted
        # combine of dx_sorted.
        weights, w_gate_up, w_down, x_sorted, h, a, y_sorted, offsets, row_of, src_of = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None, None, None
        dout = dout.contiguous()
        offs = offsets[1:]
        dw = torch.einsum("tc,tjc->tj", dout.float(), y_sorted[row_of.long()].float())
        dy = op("moe_gather")(dout, src_of, weights, row_of.shape[1])
        da = op("grouped_gemm_dgrad")(dy, w_down, offs)
        dh = torch.ops.kiln.act_and_mul_backward(h, da, ctx.activation)
        dxs = op("grouped_gemm_dgrad")(dh, w_gate_up, offs)
        dx = op("moe_combine")(dxs, row_of, None)
        d_w_down = op("grouped_gemm_wgrad")(dy, a, offs)
        d_w_gate_up = op("grouped_gemm_wgrad")(dh, x_sorted, offs)
        return dx, dw, None, d_w_gate_up, d_w_down, None, None

    return grad


_moe_experts.register_autograd(_moe_grad_with(lambda name: getattr(torch.ops.kiln, name)), setup_context=_moe_setup)
_MoeExpertsFunction = _eager_function("_MoeExpertsFunction", _moe_experts_impl, _moe_setup,
                                     _moe_grad_with(lambda name: _DECLARED_IMPLS[name]), materialize_grads=False)


def _moe_route(router_logits, top_k, renormalize, scoring, bias, n_group, topk_group, routed_scaling):
    """(weights f32, ids i32) [tokens, top_k]: kiln's top-k picks the experts; where the logits
    need a gradient the weights are recomputed from them with torch (a [tokens, top_k] gather, the
    same formula), so autograd reaches the router."""
    logits = router_logits.contiguous()
    weights, ids = torch.ops.kiln.moe_topk(logits, bias, top_k, scoring, renormalize, n_group, topk_group,
                                           routed_scaling) if not _eager() else \
        _DECLARED_IMPLS["moe_topk"](logits, bias, top_k, scoring, renormalize, n_group, topk_group, routed_scaling)
    if not _needs_grad(router_logits):
        return weights, ids
    idx = ids.long()
    if scoring == "softmax":
        w = torch.softmax(router_logits.float(), dim=-1).gather(1, idx)
    else:
        w = torch.sigmoid(router_logits.float()).gather(1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if scoring != "softmax":
        w = w * routed_scaling
    return w, ids


def fused_moe(x: Tensor, router_logits: Tensor, w_gate_up: Tensor, w_down: Tensor, top_k: int,
              activation: str = "silu", renormalize: bool = True, scoring: str = "softmax",
              bias: Optional[Tensor] = None, n_group: int = 1, topk_group: int = 1,
              routed_scaling: float = 1.0) -> Tensor:
    """A mixture-of-experts layer: route (kiln's top-k: softmax, or DeepSeek-V3's sigmoid + bias with
    group-limited top-k), permute tokens by expert, grouped gate_up GEMM, act_and_mul, grouped down
    GEMM, weighted combine back to token order. x [..., hidden] f16/bf16; router_logits [tokens,
    experts]; w_gate_up [experts, 2 inter, hidden] (gate rows, then up rows); w_down [experts,
    hidden, inter]. Differentiable in x, router_logits (through the routing weights) and both
    weights; experts with no tokens and skewed routing are ordinary inputs."""
    if activation not in _ops.ACTIVATIONS:
        raise InvalidArgumentError(f"fused_moe: activation must be one of {', '.join(_ops.ACTIVATIONS)} "
                                   f"(got {activation!r})")
    if scoring not in MOE_SCORINGS:
        raise InvalidArgumentError(f"fused_moe: scoring must be softmax or sigmoid_group (got {scoring!r})")
    if x.dtype not in (torch.float16, torch.bfloat16) or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise UnsupportedDtypeError(f"fused_moe takes f16 or bf16 x and weights of its dtype (got {x.dtype}, "
                                    f"{w_gate_up.dtype}, {w_down.dtype})")
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    experts = router_logits.shape[-1]
    if (w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.shape[0] != experts or w_down.shape[0] != experts
            or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2 or w_down.shape[1] != hidden
            or w_down.shape[2] * 2 != w_gate_up.shape[1] or router_logits.reshape(-1, experts).shape[0] != x2.shape[0]):
        raise ShapeMismatchError(f"fused_moe: x {tuple(x.shape)}, router_logits {tuple(router_logits.shape)}, w_gate_up "
                                 f"{tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not match ([tokens, "
                                 f"hidden], [tokens, experts], [experts, 2 inter, hidden], [experts, hidden, inter])")
    if bias is not None:
        bias = bias.float()  # kept f32 even where a module cast its buffers to the weights' dtype
    weights, ids = _moe_route(router_logits.reshape(-1, experts), top_k, renormalize, scoring, bias, n_group,
                              topk_group, routed_scaling)
    args = (x2.contiguous(), weights, ids, w_gate_up.contiguous(), w_down.contiguous(), activation, experts)
    if _eager():
        out = _MoeExpertsFunction.apply(*args)[0] if _needs_grad(x, weights, w_gate_up, w_down) else \
            _moe_experts_impl(*args)[0]
    else:
        out = torch.ops.kiln.moe_experts(*args)[0]
    return out.reshape(x.shape)


class MoE(torch.nn.Module):
    """A mixture-of-experts MLP on kiln's kernels: a router (nn.Linear(hidden, experts) without bias),
    experts' gate_up [experts, 2 intermediate, hidden] and down [experts, hidden, intermediate]
    weights, top-k routing (softmax, or DeepSeek-V3's sigmoid with the e_score_correction_bias
    buffer and group-limited top-k) and fused_moe for the rest, with autograd."""

    def __init__(self, hidden_dim: int, intermediate_dim: int, num_experts: int, top_k: int,
                 activation: str = "silu", renormalize: bool = True, scoring: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, routed_scaling: float = 1.0, device=None, dtype=None):
        super().__init__()
        if scoring not in MOE_SCORINGS:
            raise InvalidArgumentError(f"MoE: scoring must be softmax or sigmoid_group (got {scoring!r})")
        self.hidden_dim, self.intermediate_dim, self.num_experts, self.top_k = hidden_dim, intermediate_dim, num_experts, top_k
        self.activation, self.renormalize, self.scoring = activation, renormalize, scoring
        self.n_group, self.topk_group, self.routed_scaling = n_group, topk_group, routed_scaling
        self.router = torch.nn.Linear(hidden_dim, num_experts, bias=False, device=device, dtype=dtype)
        self.w_gate_up = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, device=device,
                                                        dtype=dtype))
        self.w_down = torch.nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, device=device,
                                                     dtype=dtype))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(num_experts, device=device, dtype=torch.float32)
                             if scoring == "sigmoid_group" else None)
        self.reset_parameters()

    def reset_parameters(self):
        # Each expert's projections as nn.Linear initialises them.
        for w in (self.w_gate_up, self.w_down):
            bound = 1.0 / math.sqrt(w.shape[2])
            torch.nn.init.uniform_(w, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.router(x.reshape(-1, self.hidden_dim))
        return fused_moe(x, logits, self.w_gate_up, self.w_down, self.top_k, self.activation, self.renormalize,
                         self.scoring, self.e_score_correction_bias, self.n_group, self.topk_group, self.routed_scaling)

    def extra_repr(self):
        return (f"{self.hidden_dim}, {self.intermediate_dim}, experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation}, scoring={self.scoring}")


__all__ += [n for n in ("fused_moe", "MoE") if n not in __all__]


# --- LoRA ---
# lora_linear: x W^T + scale (x A^T) B^T + bias with the low-rank product accumulated in the base
# GEMM (kiln's lora_linear op). The sliced form covers merged projections whose output columns
# split into slices (gate_up: 2, QKV: 3), each with its own adapter: A stacks the slices' A rows,
# B the slices' B rows in output order; one shrink computes x A^T for every slice at once. The
# backward (frozen base weight unless it requires grad): dx = dy W + scale sum_s (dy_s B_s) A_s
# (cuBLAS over W as it is, the rank-sized term added in place), dA_s = scale (dy_s B_s)^T x, dB_s = scale dy_s^T (x A_s^T), dbias = sum of dy (torch matmuls:
# the adapters' products are rank-sized).

def _slice_bounds(n, slices, end0, end1):
    if slices == 1:
        return [0, n]
    if slices == 2:
        return [0, end0 or n // 2, n]
    if end0 == 0 and end1 == 0:
        end0, end1 = n // 3, 2 * n // 3
    return [0, end0, end1, n]


def _lora_sliced_impl(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, bias: Optional[Tensor],
                      scale: float, slices: int, end0: int, end1: int) -> Tensor:
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    out = _DECLARED_IMPLS["lora_linear"](x2, weight.contiguous(), lora_a.contiguous(), lora_b.contiguous(),
                                        None if bias is None else bias.contiguous(), scale,
                                        end0 if slices > 1 else 0, end1 if slices > 2 else 0)
    return out.reshape(*x.shape[:-1], n)


_lora_sliced = torch.library.custom_op("kiln::lora_sliced", _lora_sliced_impl, mutates_args=())


@_lora_sliced.register_fake
def _(x, weight, lora_a, lora_b, bias, scale, slices, end0, end1):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _lora_setup(ctx, inputs, output):
    x, weight, lora_a, lora_b, bias, scale, slices, end0, end1 = inputs
    ctx.scale, ctx.slices, ctx.ends = scale, slices, (end0, end1)
    ctx.needs = (x.requires_grad, weight.requires_grad, lora_a.requires_grad, lora_b.requires_grad,
                 bias is not None and bias.requires_grad)
    ctx.save_for_backward(x, weight, lora_a, lora_b)


def _lora_grad(ctx, dout):
    """The sliced LoRA's backward (torch matmuls: cuBLAS for dy W and the dense weight gradient, the
    rest rank-sized)."""
    x, weight, lora_a, lora_b = ctx.saved_tensors
    s, slices = ctx.scale, ctx.slices
    k, n, r = x.shape[-1], weight.shape[0], lora_b.shape[-1]
    x2 = x.reshape(-1, k)
    dy = dout.reshape(-1, n).contiguous()
    bounds = _slice_bounds(n, slices, *ctx.ends)
    # blk [slices r, n]: slice j's B_j^T in rows [j r, j r + r) and its own columns, so dy blk^T
    # holds every slice's dy_j B_j side by side.
    blk = torch.zeros(slices * r, n, dtype=lora_b.dtype, device=lora_b.device)
    for j in range(slices):
        blk[j * r:(j + 1) * r, bounds[j]:bounds[j + 1]] = lora_b[bounds[j]:bounds[j + 1]].t()
    dyb = dy @ blk.t() if ctx.needs[0] or ctx.needs[2] else None
    # cuBLAS reads W as it is (no transposed copy of a frozen weight is kept); the rank-sized term
    # is added in place.
    dx = (dy @ weight).addmm_(dyb, lora_a, alpha=s).reshape(x.shape) if ctx.needs[0] else None
    da = s * (dyb.t() @ x2) if ctx.needs[2] else None
    db = None
    if ctx.needs[3]:
        xa = x2 @ lora_a.t()
        db = torch.cat([s * (dy[:, bounds[j]:bounds[j + 1]].t() @ xa[:, j * r:(j + 1) * r]) for j in range(slices)])
    dw = dy.t() @ x2 if ctx.needs[1] else None
    dbias = dy.sum(0) if ctx.needs[4] else None
    return dx, dw, da, db, dbias, None, None, None, None


_lora_sliced.register_autograd(_lora_grad, setup_context=_lora_setup)
_LoraSlicedFunction = _eager_function("_LoraSlicedFunction", _lora_sliced_impl, _lora_setup, _lora_grad)


def _lora_apply(x, weight, lora_a, lora_b, bias, scale, slices=1, end0=0, end1=0):
    if x.dtype not in (torch.float16, torch.bfloat16) or any(
            t is not None and t.dtype != x.dtype for t in (weight, lora_a, lora_b, bias)):
        raise UnsupportedDtypeError(f"lora_linear takes f16 or bf16 x and weights, adapters and bias of its dtype "
                                    f"(got {x.dtype}, {weight.dtype}, {lora_a.dtype}, {lora_b.dtype})")
    args = (x, weight, lora_a, lora_b, bias, float(scale), int(slices), int(end0), int(end1))
    if _eager():
        if _needs_grad(x, weight, lora_a, lora_b, bias):
            return _LoraSlicedFunction.apply(*args)
        return _lora_sliced_impl(*args)
    return torch.ops.kiln.lora_sliced(*args)


def lora_linear(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, bias: Optional[Tensor] = None,
                scale: float = 1.0) -> Tensor:
    """x W^T + scale (x A^T) B^T + bias (PEFT's LoRA Linear: weight [out, in], lora_a [r, in],
    lora_b [out, r], scale = alpha / r) in one GEMM whose accumulators take the low-rank product;
    differentiable in x, the adapters, the bias (and the weight when it requires grad)."""
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
        raise ShapeMismatchError(f"lora_linear: lora_a must be [r, in] and lora_b [out, r] (got "
                                 f"{tuple(lora_a.shape)}, {tuple(lora_b.shape)})")
    return _lora_apply(x, weight, lora_a, lora_b, bias, scale)


def lora_linear_sliced(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, slice_ends: List[int],
                       bias: Optional[Tensor] = None, scale: float = 1.0) -> Tensor:
    """A merged projection (weight [n, in]) whose output columns split at slice_ends (1 or 2 ends:
    gate_up, QKV) into slices with their own adapters: lora_a [slices r, in] (slice j's A in rows
    [j r, j r + r)), lora_b [n, r] (slice j's B in its columns' rows). x A^T is computed once for
    every slice; differentiable as lora_linear."""
    slices = len(slice_ends) + 1
    if slices not in (2, 3) or lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != slices * lora_b.shape[1]:
        raise ShapeMismatchError(f"lora_linear_sliced: 1 or 2 slice ends, lora_a [slices r, in], lora_b [n, r] (got "
                                 f"{list(slice_ends)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)})")
    ends = list(slice_ends) + [0]
    return _lora_apply(x, weight, lora_a, lora_b, bias, scale, slices, ends[0], ends[1])


def _lora_init(a, b):
    # PEFT's default: A as nn.Linear's weight (Kaiming uniform, a = sqrt(5)), B zeros.
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    torch.nn.init.zeros_(b)


class LoRALinear(torch.nn.Module):
    """nn.Linear with a frozen weight and a trainable LoRA adapter (rank r, scale alpha / r)
    through lora_linear."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float = 1.0, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.in_features, self.out_features, self.r, self.scale = in_features, out_features, r, alpha / r
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        self.lora_A = torch.nn.Parameter(torch.empty(r, in_features, **kw))
        self.lora_B = torch.nn.Parameter(torch.empty(out_features, r, **kw))
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        _lora_init(self.lora_A, self.lora_B)

    def forward(self, x: Tensor) -> Tensor:
        return lora_linear(x, self.weight, self.lora_A, self.lora_B, self.bias, self.scale)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, r={self.r}, scale={self.scale}"


class LoRA_MLP(torch.nn.Module):
    """A gated MLP (SwiGLU with activation "silu", GeGLU with "gelu" or "gelu_tanh") with frozen
    gate, up and down weights and a LoRA adapter on each: gate and up are one merged projection
    (gate_up_weight [2 inter, hidden], gate rows first) whose adapters share one x A^T pass, then
    kiln's act_and_mul, then the down projection. Differentiable (adapters, x) with kiln's kernels
    forward and the fused lora_linear for the input gradients."""

    def __init__(self, hidden_dim: int, intermediate_dim: int, r: int, alpha: float = 1.0, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        if activation not in _ops.ACTIVATIONS:
            raise InvalidArgumentError(f"LoRA_MLP: activation must be one of {', '.join(_ops.ACTIVATIONS)}")
        kw = dict(device=device, dtype=dtype)
        self.hidden_dim, self.intermediate_dim, self.r, self.scale = hidden_dim, intermediate_dim, r, alpha / r
        self.activation = activation
        self.gate_up_weight = torch.nn.Parameter(torch.empty(2 * intermediate_dim, hidden_dim, **kw),
                                                 requires_grad=False)
        self.down_weight = torch.nn.Parameter(torch.empty(hidden_dim, intermediate_dim, **kw), requires_grad=False)
        self.lora_A_gate = torch.nn.Parameter(torch.empty(r, hidden_dim, **kw))
        self.lora_A_up = torch.nn.Parameter(torch.empty(r, hidden_dim, **kw))
        self.lora_B_gate = torch.nn.Parameter(torch.empty(intermediate_dim, r, **kw))
        self.lora_B_up = torch.nn.Parameter(torch.empty(intermediate_dim, r, **kw))
        self.lora_A_down = torch.nn.Parameter(torch.empty(r, intermediate_dim, **kw))
        self.lora_B_down = torch.nn.Parameter(torch.empty(hidden_dim, r, **kw))
        for w in (self.gate_up_weight, self.down_weight):
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        for a, b in ((self.lora_A_gate, self.lora_B_gate), (self.lora_A_up, self.lora_B_up),
                     (self.lora_A_down, self.lora_B_down)):
            _lora_init(a, b)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.cat([self.lora_A_gate, self.lora_A_up])
        b = torch.cat([self.lora_B_gate, self.lora_B_up])
        h = lora_linear_sliced(x, self.gate_up_weight, a, b, [self.intermediate_dim], None, self.scale)
        return lora_linear(act_and_mul(h, self.activation), self.down_weight, self.lora_A_down, self.lora_B_down,
                           None, self.scale)

    def extra_repr(self):
        return f"{self.hidden_dim}, {self.intermediate_dim}, r={self.r}, activation={self.activation}"


class LoRA_QKV(torch.nn.Module):
    """A merged QKV projection (qkv_weight [q + 2 kv, hidden], frozen) with one LoRA adapter per
    slice: forward(x) -> (q, k, v), one shrink for the three x A^T and one fused GEMM."""

    def __init__(self, hidden_dim: int, q_dim: int, kv_dim: int, r: int, alpha: float = 1.0, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.hidden_dim, self.q_dim, self.kv_dim, self.r, self.scale = hidden_dim, q_dim, kv_dim, r, alpha / r
        n = q_dim + 2 * kv_dim
        self.qkv_weight = torch.nn.Parameter(torch.empty(n, hidden_dim, **kw), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(n, **kw)) if bias else None
        self.lora_A = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(r, hidden_dim, **kw)) for _ in range(3)])
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(d, r, **kw))
                                              for d in (q_dim, kv_dim, kv_dim)])
        torch.nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))
        for a, b in zip(self.lora_A, self.lora_B):
            _lora_init(a, b)

    def forward(self, x: Tensor):
        out = lora_linear_sliced(x, self.qkv_weight, torch.cat(list(self.lora_A)), torch.cat(list(self.lora_B)),
                                 [self.q_dim, self.q_dim + self.kv_dim], self.bias, self.scale)
        return out.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)

    def extra_repr(self):
        return f"{self.hidden_dim}, q={self.q_dim}, kv={self.kv_dim}, r={self.r}"


__all__ += [n for n in ("lora_linear", "lora_linear_sliced", "LoRALinear", "LoRA_MLP", "LoRA_QKV")
            if n not in __all__]
