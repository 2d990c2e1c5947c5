"""kiln's typed ops on any array kiln can read (see kiln._arrays).

Each op is the C++ op of the same name (include/kiln/ops.h): it validates every array and raises
DeviceError, ShapeMismatchError, UnsupportedDtypeError or InvalidArgumentError before anything
is compiled or launched. CUDA arrays launch on `stream` (default: the current stream of a torch
tensor, the stream of a __cuda_array_interface__, else the legacy default stream); host arrays
(NumPy) run the CPU fallback, except rms_norm_rope, which is CUDA only. Outputs that are not
passed are allocated like the first input (torch, NumPy, or an array-API namespace).
"""
import ctypes

from . import _arrays as A
from . import _fast
from ._errors import InvalidArgumentError, ShapeMismatchError, UnsupportedDtypeError
from ._lib import check, lib, raise_for

# Every op is one _fast.call(op id, runtime, stream, *arrays, *scalars); the ids are the order of
# the C functions here (python/src/_fast.c has the same list and each op's arguments).
_OP_FUNCTIONS = (None, "kiln_rms_norm_inv", "kiln_add_rms_norm", "kiln_act_and_mul", "kiln_apply_rope_qk",
                 "kiln_rms_norm_rope", "kiln_rms_norm_backward", "kiln_rms_norm_backward_workspace_elements",
                 "kiln_quantize_fp8", "kiln_fp8_gemm", "kiln_fused_gated_mlp")
(_READ, _RMS_NORM, _ADD_RMS_NORM, _ACT_AND_MUL, _APPLY_ROPE_QK, _RMS_NORM_ROPE, _RMS_NORM_BACKWARD,
 _WORKSPACE_ELEMENTS, _QUANTIZE_FP8, _FP8_GEMM, _FUSED_GATED_MLP) = range(len(_OP_FUNCTIONS))
assert len(_OP_FUNCTIONS) == _fast.OP_COUNT, "kiln._fast does not match kiln.ops"
_fast.init(tuple(name and ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _OP_FUNCTIONS),
           A.describe, A.handler_for, A._torch, A.torch_dtype_table, A.torch_stream_function, A._TORCH_STREAM,
           A.as_stream, raise_for, ShapeMismatchError)
_call = _fast.call

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
ROPE_LAYOUTS = {"neox": 0, "gptj": 1}
FP8_GRANULARITIES = {"tensor": 0, "1x128": 1, "128x128": 2}
GATED_ACTIVATIONS = {"silu": 0, "gelu": 1}
FP8_SCALINGS = ("tensor", "block")


class Runtime:
    """A kiln runtime with its own resolver mode ("auto", "embedded" or "daemon") and handle table.

    Ops use the process-wide runtime (KILN_MODE, default auto) unless given runtime=.
    """

    def __init__(self, mode="auto"):
        handle = ctypes.c_void_p()
        check(lib.kiln_runtime_create(mode.encode(), ctypes.byref(handle)))
        self._handle = handle.value

    @property
    def handle(self):
        if self._handle is None:
            raise InvalidArgumentError("this kiln.Runtime is closed")
        return self._handle

    def close(self):
        if self._handle is not None:
            lib.kiln_runtime_destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def resolver(self):
        """"daemon" or "embedded": what resolved the last cubin ("" before the first)."""
        return lib.kiln_runtime_resolver(self.handle).decode()

    def counters(self):
        return counters(self)


class _Counters(ctypes.Structure):
    _fields_ = [("table_hits", ctypes.c_int64), ("from_daemon", ctypes.c_int64),
                ("from_embedded", ctypes.c_int64), ("module_loads", ctypes.c_int64)]


def counters(runtime=None):
    """The runtime's counters (default: the process-wide runtime) as a dict."""
    c = _Counters()
    check(lib.kiln_runtime_get_counters(_rt(runtime), ctypes.byref(c)))
    return {name: getattr(c, name) for name, _ in _Counters._fields_}


def resolver(runtime=None):
    """What resolved the last cubin of the runtime (default: the process-wide one)."""
    if runtime is not None:
        return runtime.resolver
    return lib.kiln_runtime_resolver_name(None).decode()


def _rt(runtime):
    return None if runtime is None else runtime.handle


def _shape(a):
    """The shape of an input whose output kiln allocates."""
    shape = getattr(a, "shape", None)
    if shape is None:
        A.cannot_allocate(a)
    return tuple(shape)


def _rows_shape(x):
    shape = _shape(x)
    return shape[:-1] if len(shape) > 1 else (1,)


def _choice(table, value, what):
    try:
        return table[value]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"{what} must be one of {', '.join(table)} (got {value!r})") from None


def rms_norm(x, weight, eps=1e-6, *, out=None, inv_rms=None, stream=None, runtime=None):
    """out = x * rsqrt(mean(x^2, last dim) + eps) * weight; also fills inv_rms (f32, one value per row) if given."""
    if out is None:
        out = A.empty(x, _shape(x))
    _call(_RMS_NORM, runtime, stream, x, weight, out, inv_rms, eps)
    return out


def rms_norm_with_inv_rms(x, weight, eps=1e-6, *, stream=None, runtime=None):
    """(out, inv_rms): rms_norm that also returns the f32 inverse RMS per row, for rms_norm_backward."""
    inv_rms = A.empty(x, _rows_shape(x), A.F32)
    return rms_norm(x, weight, eps, inv_rms=inv_rms, stream=stream, runtime=runtime), inv_rms


def rms_norm_backward(dy, x, weight, inv_rms, *, dx=None, dw=None, workspace=None, stream=None, runtime=None):
    """(dx, dw) of RMSNorm from the forward's inv_rms. workspace: f32 scratch for the partial dw rows
    (at least rms_norm_backward_workspace_elements(x)); None uses one cached per stream."""
    if dx is None:
        dx = A.empty(x, _shape(x))
    if dw is None:
        dw = A.empty(weight, _shape(weight))
    _call(_RMS_NORM_BACKWARD, runtime, stream, dy, x, weight, inv_rms, dx, dw, workspace)
    return dx, dw


def rms_norm_backward_workspace_elements(x):
    """The f32 elements rms_norm_backward needs as workspace for arrays like x (0 on the CPU)."""
    return _call(_WORKSPACE_ELEMENTS, None, None, x)


def add_rms_norm(x, residual, weight, eps=1e-6, *, out=None, residual_out=None, stream=None, runtime=None):
    """(out, residual_out): h = x + residual, residual_out = h, out = rms_norm(h) * weight.
    residual_out may be residual and out may be x (in place)."""
    if out is None:
        out = A.empty(x, _shape(x))
    if residual_out is None:
        residual_out = A.empty(x, _shape(x))
    _call(_ADD_RMS_NORM, runtime, stream, x, residual, weight, out, residual_out, eps)
    return out, residual_out


def act_and_mul(x, activation="silu", *, out=None, stream=None, runtime=None):
    """out = act(x[..., :d]) * x[..., d:]; activation: "silu", "gelu" (erf) or "gelu_tanh"."""
    act = _choice(ACTIVATIONS, activation, "activation")
    if out is None:
        shape = _shape(x)
        out = A.empty(x, shape[:-1] + (shape[-1] // 2,) if shape else shape)
    _call(_ACT_AND_MUL, runtime, stream, x, out, act)
    return out


def apply_rope_qk(q, k, cos, sin, position_ids, layout="neox", *, q_out=None, k_out=None, stream=None, runtime=None):
    """(q_out, k_out): rotary embedding of q [tokens, q_heads, head_dim] and k [tokens, kv_heads,
    head_dim] at position_ids (i64 [tokens]) from f32 cos/sin [max_pos, head_dim/2]; layout "neox"
    or "gptj". q_out may be q and k_out may be k (in place)."""
    lay = _choice(ROPE_LAYOUTS, layout, "layout")
    if q_out is None:
        q_out = A.empty(q, _shape(q))
    if k_out is None:
        k_out = A.empty(k, _shape(k))
    _call(_APPLY_ROPE_QK, runtime, stream, q, k, cos, sin, position_ids, q_out, k_out, lay)
    return q_out, k_out


def rms_norm_rope(x, weight, cos, sin, eps=1e-6, num_heads=None, *, out=None, stream=None, runtime=None):
    """RMSNorm then neox RoPE per head, in one kernel (CUDA only). x [batch, seq, hidden], cos/sin
    [seq, head_dim] or [1, seq, 1, head_dim]; num_heads None infers hidden / head_dim."""
    if out is None:
        out = A.empty(x, _shape(x))
    _call(_RMS_NORM_ROPE, runtime, stream, x, weight, cos, sin, out, eps, num_heads or 0)
    return out


# --- tensor-core GEMMs ---


def _ceil128(n):
    return -(-n // 128)


def _dtype_name(a):
    """The element type of an array as kiln names it ("uint8", "float16", ...), from .dtype."""
    return str(getattr(a, "dtype", "")).replace("torch.", "")


_OUTPUT_DTYPES = {"float16": A.F16, "f16": A.F16, "half": A.F16, "bfloat16": A.BF16, "bf16": A.BF16}


def quantize_fp8(x, granularity="tensor", *, transpose=False, q=None, scale=None, stream=None, runtime=None):
    """(q, scale): x (f32/f16/bf16, contiguous) as e4m3 codes (uint8) and f32 scales, one per
    granularity group: "tensor" (one scale), "1x128" (per 128 values of a row, for activations)
    or "128x128" (per block, for weights). Dequantize as e4m3_value(q) * scale. transpose (rank-2
    x; "tensor" and "128x128") writes q as [cols, rows]: a [K, N] weight becomes the K-major operand
    fp8_gemm takes (pass q.T)."""
    g = _choice(FP8_GRANULARITIES, granularity, "granularity")
    shape = _shape(x)
    cols = shape[-1] if shape else 0
    rows = 1
    for n in shape[:-1]:
        rows *= n
    if q is None:
        q = A.empty(x, (shape[1], shape[0]) if transpose and len(shape) == 2 else shape, A.U8)
    if scale is None:
        if g == 0:
            scale_shape = (1,)
        elif g == 1:
            scale_shape = (rows, _ceil128(cols))
        else:
            scale_shape = (_ceil128(cols), _ceil128(rows)) if transpose else (_ceil128(rows), _ceil128(cols))
        scale = A.empty(x, scale_shape, A.F32)
    _call(_QUANTIZE_FP8, runtime, stream, x, q, scale, g, 1 if transpose else 0)
    return q, scale


def fp8_gemm(a, b, a_scale=None, b_scale=None, output_dtype="float16", *, scaling="tensor", out=None, stream=None,
             runtime=None):
    """out [M, N] = a [M, K] x b [K, N] in e4m3 with fp32 accumulation, f16 or bf16 out.

    Floating a or b are quantized first (scaling "tensor": one scale each; "block": 1x128 blocks
    for a, 128x128 for b, as DeepSeek-V3). Pre-quantized operands are uint8 e4m3 codes and need
    their scales (f32: one element, or [M, ceil(K/128)] for a and [ceil(N/128), ceil(K/128)] for b);
    a pre-quantized b must be K-major, i.e. the transposed view of a contiguous [N, K] array
    (quantize_fp8(w, transpose=True) gives one). K must be a multiple of 16."""
    if scaling not in FP8_SCALINGS:
        raise InvalidArgumentError(f"scaling must be one of {', '.join(FP8_SCALINGS)} (got {scaling!r})")
    name = output_dtype if isinstance(output_dtype, str) else (getattr(output_dtype, "__name__", None)
                                                                or str(output_dtype).replace("torch.", ""))
    out_code = _OUTPUT_DTYPES.get(name)
    if out_code is None:
        raise UnsupportedDtypeError(f"fp8_gemm: output_dtype must be float16 or bfloat16 (got {output_dtype!r})")
    block = scaling == "block"
    keep = []
    if _dtype_name(a) == "uint8":
        if a_scale is None:
            raise InvalidArgumentError("fp8_gemm: a is pre-quantized (uint8) and needs a_scale")
    else:
        a, a_scale = quantize_fp8(a, "1x128" if block else "tensor", stream=stream, runtime=runtime)
    if _dtype_name(b) == "uint8":
        if b_scale is None:
            raise InvalidArgumentError("fp8_gemm: b is pre-quantized (uint8) and needs b_scale")
    else:
        bq, b_scale = quantize_fp8(b, "128x128" if block else "tensor", transpose=True, stream=stream,
                                   runtime=runtime)
        keep.append(bq)
        b = bq.T
    if out is None:
        ashape, bshape = _shape(a), _shape(b)
        if len(ashape) != 2 or len(bshape) != 2:
            raise ShapeMismatchError(f"fp8_gemm: a and b must be matrices (got {ashape} and {bshape})")
        out = A.empty(a, (ashape[0], bshape[1]), out_code)
    _call(_FP8_GEMM, runtime, stream, a, b, a_scale, b_scale, out)
    return out


def fused_gated_mlp(x, gate_weight, up_weight, activation="silu", *, out=None, stream=None, runtime=None):
    """out = act(x gate_weight^T) * (x up_weight^T), both projections in one kernel and the
    intermediate never written. x [..., hidden] f16/bf16 contiguous; gate_weight, up_weight
    [intermediate, hidden]; activation "silu" or "gelu"; out [..., intermediate]."""
    act = _choice(GATED_ACTIVATIONS, activation, "activation")
    if out is None:
        shape, wshape = _shape(x), _shape(gate_weight)
        if not shape or len(wshape) != 2:
            raise ShapeMismatchError(f"fused_gated_mlp: x must be [..., hidden] and the weights [intermediate, hidden] "
                                     f"(got {shape} and {wshape})")
        out = A.empty(x, shape[:-1] + (wshape[0],))
    _call(_FUSED_GATED_MLP, runtime, stream, x, gate_weight, up_weight, out, act)
    return out
