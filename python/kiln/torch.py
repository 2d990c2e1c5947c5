"""kiln for PyTorch: custom ops (torch.library.custom_op with fake implementations, so
torch.compile(fullgraph=True) traces them without graph breaks and CUDA graphs capture them),
autograd for RMSNorm and the fused RMSNorm + RoPE, and modules:

- RMSNorm: a drop-in for torch.nn.RMSNorm (same constructor, state_dict keys and results).
- FusedRMSNormRoPE(hidden_dim, head_dim, eps): owns the RMSNorm weight, forward(x, cos, sin).

Ops launch on the current CUDA stream. CPU tensors run kiln's CPU fallbacks (the fused RMSNorm +
RoPE is CUDA only: DeviceError). Errors are kiln's exceptions, raised before any launch.
"""
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import ops as _ops
from ._errors import ShapeMismatchError

__all__ = ["rms_norm", "add_rms_norm", "act_and_mul", "silu_and_mul", "apply_rope_qk", "fused_rmsnorm_rope",
           "RMSNorm", "FusedRMSNormRoPE"]

_KILN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows_contiguous(t):
    # kiln takes strided rows, but not a strided last dimension or uncollapsible leading ones.
    return t if t.is_contiguous() else t.contiguous()


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


@torch.library.custom_op("kiln::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    x = _rows_contiguous(x)
    inv = _new(x, _rows_shape(x), torch.float32)
    if x.numel() == 0:
        return torch.empty_like(x), inv
    return _ops.rms_norm(x, weight.contiguous(), eps, out=_new(x, x.shape), inv_rms=inv), inv


@_rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(_rows_shape(x), dtype=torch.float32)


@torch.library.custom_op("kiln::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, inv_rms: Tensor) -> Tuple[Tensor, Tensor]:
    dy, x = dy.contiguous(), _rows_contiguous(x)  # dy of a sum() is an expanded (stride 0) tensor
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros_like(weight)
    workspace = None
    if x.is_cuda:
        # Allocated by PyTorch rather than kiln's per-stream cache: no cuMemAlloc during capture.
        workspace = _new(x, (max(_ops.rms_norm_backward_workspace_elements(x), 1),), torch.float32)
    return _ops.rms_norm_backward(dy, x, weight.contiguous(), inv_rms, dx=_new(x, x.shape),
                                  dw=_new(weight, weight.shape), workspace=workspace)


@_rms_norm_backward.register_fake
def _(dy, x, weight, inv_rms):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, dy, _d_inv_rms):
    x, weight, inv_rms = ctx.saved_tensors
    dx, dw = torch.ops.kiln.rms_norm_backward(dy, x, weight, inv_rms)
    return dx, dw, None


_rms_norm_fwd.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


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


def _rope_grad(ctx, dout):
    # out = rope(n), n = rms_norm(x) * weight; the rotation's transpose takes dout back to dn, and
    # kiln's RMSNorm backward takes dn to (dx, dw). cos and sin get no gradient.
    x, weight, cos, sin = ctx.saved_tensors
    head_dim = cos.shape[-1]
    half = head_dim // 2
    c = cos.reshape(1, -1, 1, head_dim).float()
    s = sin.reshape(1, -1, 1, head_dim).float()
    d = dout.float().reshape(x.shape[0], x.shape[1], -1, head_dim)
    d1, d2 = d[..., :half], d[..., half:]
    dn = torch.cat([d1 * c[..., :half] + d2 * s[..., half:], d2 * c[..., half:] - d1 * s[..., :half]], -1)
    dn = dn.reshape(x.shape).to(x.dtype)
    inv_rms = torch.rsqrt(x.float().pow(2).mean(-1) + ctx.eps)
    dx, dw = torch.ops.kiln.rms_norm_backward(dn, x, weight, inv_rms)
    return dx, dw, None, None, None, None


_rms_norm_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


# --- functions ---


def _eager():
    """True outside torch.compile's tracing: the plain functions run, without the dispatcher."""
    return not _is_compiling()


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k:]) != normalized_shape:
        raise ShapeMismatchError(f"rms_norm: input of shape {tuple(x.shape)} does not end in {normalized_shape}")
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
        y = torch.ops.kiln.rms_norm_fwd(rows, w, eps)[0]
    elif _eager():
        y = _rms_norm_impl(rows, w, eps)
    else:
        y = torch.ops.kiln.rms_norm(rows, w, eps)
    return y if k == 1 else y.reshape(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), vLLM's fused residual add (no autograd)."""
    if _eager() and not _needs_grad(x, residual, weight):
        return _add_rms_norm_impl(x, residual, weight, eps)
    return torch.ops.kiln.add_rms_norm(x, residual, weight, eps)


def act_and_mul(x: Tensor, activation: str = "silu") -> Tensor:
    """act(x[..., :d]) * x[..., d:]; activation "silu", "gelu" or "gelu_tanh" (no autograd)."""
    if _eager() and not _needs_grad(x):
        return _act_and_mul_impl(x, activation)
    return torch.ops.kiln.act_and_mul(x, activation)


def silu_and_mul(x: Tensor) -> Tensor:
    return act_and_mul(x, "silu")


def apply_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor,
                  layout: str = "neox") -> Tuple[Tensor, Tensor]:
    """Rotary embedding of q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] at
    position_ids (int64 [tokens]), cos/sin float32 [max_pos, head_dim / 2] (no autograd)."""
    if _eager() and not _needs_grad(q, k):
        return _apply_rope_qk_impl(q, k, cos, sin, position_ids, layout)
    return torch.ops.kiln.apply_rope_qk(q, k, cos, sin, position_ids, layout)


def fused_rmsnorm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float = 1e-6,
                       num_heads: Optional[int] = None) -> Tensor:
    """RMSNorm then RoPE (neox) per head in one kernel. x: contiguous CUDA [batch, seq, hidden];
    weight [hidden]; cos, sin: [seq, head_dim] or [1, seq, 1, head_dim], float32 or x's dtype;
    num_heads None infers hidden / head_dim. Differentiable in x and weight."""
    heads = 0 if num_heads is None else num_heads
    if _eager() and not _needs_grad(x, weight):
        return _rms_norm_rope_impl(x, weight, cos, sin, eps, heads)
    return torch.ops.kiln.rms_norm_rope(x, weight, cos, sin, eps, heads)


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
