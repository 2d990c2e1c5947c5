"""kiln's typed ops on any array kiln can read (see kiln._arrays).

Each op is the C++ op of the same name (include/kiln/ops.h): it validates every array and raises
DeviceError, ShapeMismatchError, UnsupportedDtypeError or InvalidArgumentError before anything
is compiled or launched. CUDA arrays launch on `stream` (default: the current stream of a torch
tensor, the stream of a __cuda_array_interface__, else the legacy default stream); host arrays
(NumPy) run the CPU fallback, except rms_norm_rope, which is CUDA only. Outputs that are not
passed are allocated like the first input (torch, NumPy, or an array-API namespace).
"""
import ctypes
import json

from . import _arrays as A
from . import _fast
from ._errors import InvalidArgumentError, ShapeMismatchError, UnsupportedDtypeError
from ._lib import check, lib, raise_for

_fast.init(ctypes.cast(lib.kiln_op_call, ctypes.c_void_p).value,
           ctypes.cast(lib.kiln_rms_norm_backward_workspace_elements, ctypes.c_void_p).value,
           A.describe, A.handler_for, A._torch, A.torch_dtype_table, A.torch_stream_function, A._TORCH_STREAM,
           A.as_stream, raise_for, ShapeMismatchError)
_call = _fast.call
_READ, _WORKSPACE_ELEMENTS = _fast.READ, _fast.WORKSPACE_ELEMENTS


# ---- ops from their declarations (include/kiln/op.h) ----


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("device_kind", ctypes.c_int32), ("device_index", ctypes.c_int32)]


class _Value(ctypes.Structure):
    _fields_ = [("f64", ctypes.c_double), ("i64", ctypes.c_int64)]


class _Shape(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * 8)]


_DTYPE_BY_NAME = {"float32": A.F32, "float16": A.F16, "bfloat16": A.BF16, "uint8": A.U8, "int32": A.I32,
                  "int64": A.I64, "f32": A.F32, "f16": A.F16, "bf16": A.BF16, "u8": A.U8, "i32": A.I32, "i64": A.I64}


def _dtype_code(a):
    name = str(getattr(a, "dtype", "")).replace("torch.", "")
    code = _DTYPE_BY_NAME.get(name)
    if code is None:
        raise UnsupportedDtypeError(f"kiln cannot read arrays of dtype {name or type(a).__name__}")
    return code


class OpDecl:
    """One op as its family declares it: name, doc, tensors (inputs, then outputs), scalars and the
    op computing its gradients (kiln_op_describe)."""

    def __init__(self, handle, decl):
        self.handle = handle
        self.name = decl["name"]
        self.doc = decl["doc"]
        self.backward = decl["backward"] or None
        self.cpu = decl["cpu"]
        self.tensors = decl["tensors"]
        self.scalars = decl["scalars"]
        self.inputs = [t for t in self.tensors if not t["output"]]
        self.outputs = [t for t in self.tensors if t["output"]]
        self.id = _fast.register(handle, len(self.tensors),
                                 "".join("d" if s["kind"] == "f64" else "l" for s in self.scalars))
        self._shapes = {}
        self._prepare()

    def scalar_values(self, values, scalars=None):
        """The scalars as the C op takes them: choices by name to their index, None to the default."""
        out = []
        for s, v in zip(self.scalars if scalars is None else scalars, values):
            if v is None and "default" in s:
                v = s["default"]
            if s["kind"] == "choice":
                try:
                    v = s["choices"].index(v)
                except ValueError:
                    raise InvalidArgumentError(
                        f"{s['name']} must be one of {', '.join(s['choices'])} (got {v!r})") from None
            elif s["kind"] == "bool":
                v = 1 if v else 0
            elif v is None:
                raise InvalidArgumentError(f"{self.name}: {s['name']} is required")
            out.append(v)
        return out

    def infer(self, shapes, dtypes, scalars):
        """[(shape, dtype code)] of every output for inputs of these shapes and dtype codes (None: absent),
        and scalars as scalar_values gives them."""
        key = (tuple(shapes), tuple(dtypes), tuple(scalars))
        hit = self._shapes.get(key)
        if hit is not None:
            return hit
        n = len(self.tensors)
        tensors = (ctypes.POINTER(_Tensor) * n)()
        keep = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            if shape is None:
                continue
            dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
            t = _Tensor(None, dtype, len(shape), dims, None, 0, 0)
            keep += [dims, t]
            tensors[i] = ctypes.pointer(t)
        values = (_Value * max(1, len(scalars)))(*[_Value(float(v), 0) if s["kind"] == "f64" else _Value(0, int(v))
                                                  for s, v in zip(self.scalars, scalars)])
        outs = (_Shape * len(self.outputs))()
        check(lib.kiln_op_infer(self.handle, tensors, n, values, len(scalars), outs, len(self.outputs)))
        result = [(tuple(o.shape[:o.rank]), o.dtype) for o in outs]
        if len(self._shapes) < 1024:
            self._shapes[key] = result
        return result

    def _prepare(self):
        """The lookup tables bind() uses: every argument's slot, and the scalars' defaults as passed."""
        self._n_in, self._n_sc = len(self.inputs), len(self.scalars)
        names = [t["name"] for t in self.inputs] + [s["name"] for s in self.scalars] + [t["name"] for t in self.outputs]
        self._slot = {n: i for i, n in enumerate(names)}
        self._defaults = [None] * self._n_in
        for s in self.scalars:
            self._defaults.append(self.scalar_values([s["default"]], [s])[0] if "default" in s else None)
        self._defaults += [None] * len(self.outputs)
        self._required = [i for i, t in enumerate(self.inputs) if not t["optional"]]

    def scalar_value(self, i, v):
        """Scalar i as the C op takes it: a choice by name to its index, None to the default."""
        if v is None:
            v = self._defaults[self._n_in + i]
            if v is None:
                raise InvalidArgumentError(f"{self.name}: {self.scalars[i]['name']} is required")
            return v
        return self.scalar_values([v], [self.scalars[i]])[0]

    def bind(self, args, kwargs):
        """(inputs, outputs, scalars) from a call: inputs then scalars by position, any of them and the
        outputs by name; optional inputs and outputs default to None, scalars to their defaults."""
        n_in, n_sc = self._n_in, self._n_sc
        if len(args) > n_in + n_sc:
            raise TypeError(f"{self.name}() takes at most {n_in + n_sc} positional arguments ({len(args)} given)")
        slots = list(self._defaults)
        slots[:len(args)] = args
        given = set(range(len(args)))
        for k, v in kwargs.items():
            i = self._slot.get(k)
            if i is None:
                raise TypeError(f"{self.name}() got an unexpected keyword argument {k!r}")
            if i in given:
                raise TypeError(f"{self.name}() got multiple values for argument {k!r}")
            given.add(i)
            slots[i] = v
        for i in self._required:
            if slots[i] is None:
                raise TypeError(f"{self.name}() missing required input {self.inputs[i]['name']!r}")
        for i in range(n_sc):
            if n_in + i in given:
                slots[n_in + i] = self.scalar_value(i, slots[n_in + i])
            elif slots[n_in + i] is None:
                raise TypeError(f"{self.name}() missing required scalar {self.scalars[i]['name']!r}")
        return slots[:n_in], slots[n_in + n_sc:], slots[n_in:n_in + n_sc]

    def allocate(self, inputs, outputs, scalars):
        """outputs with every required one that is None allocated next to the first input."""
        if all(o is not None or t["optional"] for o, t in zip(outputs, self.outputs)):
            return outputs
        shapes = [None if a is None else _shape(a) for a in inputs] + [None] * len(outputs)
        dtypes = [None if a is None else _dtype_code(a) for a in inputs] + [None] * len(outputs)
        first = next(a for a in inputs if a is not None)
        inferred = self.infer(shapes, dtypes, scalars)
        return [A.empty(first, shape, dtype) if o is None and not t["optional"] else o
                for o, t, (shape, dtype) in zip(outputs, self.outputs, inferred)]

    def __call__(self, *args, stream=None, runtime=None, **kwargs):
        inputs, outputs, scalars = self.bind(args, kwargs)
        outputs = self.allocate(inputs, outputs, scalars)
        _call(self.id, runtime, stream, *inputs, *outputs, *scalars)
        ret = [o for o, t in zip(outputs, self.outputs) if not t["optional"]]
        return ret[0] if len(ret) == 1 else tuple(ret)

    def signature(self):
        """The Python call, as help() shows it."""
        parts = [t["name"] + ("=None" if t["optional"] else "") for t in self.inputs]
        for sc in self.scalars:
            parts.append(sc["name"] + (f"={sc['default']!r}" if "default" in sc else ""))
        parts.append("*")
        parts += [t["name"] + "=None" for t in self.outputs] + ["stream=None", "runtime=None"]
        return f"{self.name}({', '.join(parts)})"


def _function(decl):
    def op(*args, stream=None, runtime=None, **kwargs):
        return decl(*args, stream=stream, runtime=runtime, **kwargs)

    op.__name__ = op.__qualname__ = decl.name
    outs = ", ".join(t["name"] for t in decl.outputs if not t["optional"])
    op.__doc__ = f"{decl.signature()} -> {outs}\n\n{decl.doc}"
    op.decl = decl
    return op


def _load_declared():
    count = ctypes.c_int32()
    check(lib.kiln_op_count(ctypes.byref(count)))
    out = {}
    for i in range(count.value):
        handle = ctypes.c_void_p()
        check(lib.kiln_op_at(i, ctypes.byref(handle)))
        decl = OpDecl(handle.value, json.loads(lib.kiln_op_describe(handle.value).decode()))
        out[decl.name] = decl
    return out


OPS = _load_declared()
"""Every op the loaded libkiln declares (built-in families), by name: kiln.ops.OPS["layer_norm"](x, w, b)."""

# One module function per declared op; the functions below add what a declaration cannot say.
globals().update({name: _function(decl) for name, decl in OPS.items()})


def _address(b):
    """The device address of a launch buffer: an int, or an array kiln can read."""
    if isinstance(b, int):
        return b
    if hasattr(b, "data_ptr"):
        return b.data_ptr()
    cai = getattr(b, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    raise InvalidArgumentError(f"kiln.launch takes device addresses or CUDA arrays, not {type(b).__name__}")


def describe_family(family):
    """The registered kernel family `family` (built in or from a plugin) as a dict: its name,
    version, plugin, problem fields (name, slot, type "i64" or "f64", key, bucketed, doc) and
    parameter schema (kiln_family_describe)."""
    text = lib.kiln_family_describe(str(family).encode())
    if text is None:
        raise_for(5)  # KILN_NOT_FOUND, with kiln_last_error's message
    return json.loads(text)


def launch(family, buffers, fields, dtype="f32", alignment=16, *, stream=None, runtime=None):
    """Launches the kernel family `family` (built in or from a plugin) on CUDA buffers, with no typed
    op in between (kiln_launch): `fields` maps every problem field of the family to its value
    (describe_family lists them), `dtype` is its element type, and the buffers (device addresses or
    CUDA arrays) go in the family's order. The variant is the tuned or heuristic one; the family
    checks the problem before anything is compiled or launched."""
    code = _DTYPE_BY_NAME.get(str(dtype).replace("torch.", ""))
    if code is None:
        raise UnsupportedDtypeError(f"kiln.launch: unknown dtype {dtype!r}")
    decl = describe_family(family)["fields"]
    names = {f["name"] for f in decl}
    unknown = sorted(set(fields) - names)
    missing = sorted(names - set(fields))
    if unknown or missing:
        raise InvalidArgumentError(f"kiln.launch: {family} has problem fields {sorted(names)}; "
                                   f"unknown {unknown}, missing {missing}")
    values = (_Value * max(1, len(decl)))()
    for f in decl:
        v = fields[f["name"]]
        if f["type"] == "f64":
            values[f["slot"]].f64 = float(v)
        else:
            if isinstance(v, float) and not v.is_integer():
                raise InvalidArgumentError(f"kiln.launch: field {f['name']} is an integer, not {v!r}")
            values[f["slot"]].i64 = int(v)
    addrs = (ctypes.c_void_p * max(1, len(buffers)))(*[_address(b) for b in buffers])
    handle = 0 if stream is None else A.as_stream(stream)
    check(lib.kiln_launch(_rt(runtime), str(family).encode(), code, values, len(decl), alignment, addrs, len(buffers),
                          handle))


def _choices(op, scalar):
    return {name: i for i, name in enumerate(next(s for s in OPS[op].scalars if s["name"] == scalar)["choices"])}


ACTIVATIONS = _choices("act_and_mul", "activation")
ROPE_LAYOUTS = _choices("apply_rope_qk", "layout")
FP8_GRANULARITIES = _choices("quantize_fp8", "granularity")
GATED_ACTIVATIONS = _choices("fused_gated_mlp", "activation")
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


def rms_norm_with_inv_rms(x, weight, eps=1e-6, *, stream=None, runtime=None):
    """(out, inv_rms): rms_norm that also returns the f32 inverse RMS per row, for rms_norm_backward."""
    inv_rms = A.empty(x, _rows_shape(x), A.F32)
    return OPS["rms_norm"](x, weight, eps, inv_rms=inv_rms, stream=stream, runtime=runtime), inv_rms


def rms_norm_backward_workspace_elements(x):
    """The f32 elements rms_norm_backward needs as workspace for arrays like x (0 on the CPU)."""
    return _call(_WORKSPACE_ELEMENTS, None, None, x)


# --- tensor-core GEMMs ---


def _dtype_name(a):
    """The element type of an array as kiln names it ("uint8", "float16", ...), from .dtype."""
    return str(getattr(a, "dtype", "")).replace("torch.", "")


_OUTPUT_DTYPES = {"float16": A.F16, "f16": A.F16, "half": A.F16, "bfloat16": A.BF16, "bf16": A.BF16}


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
        a, a_scale = OPS["quantize_fp8"](a, "1x128" if block else "tensor", stream=stream, runtime=runtime)
    if _dtype_name(b) == "uint8":
        if b_scale is None:
            raise InvalidArgumentError("fp8_gemm: b is pre-quantized (uint8) and needs b_scale")
    else:
        bq, b_scale = OPS["quantize_fp8"](b, "128x128" if block else "tensor", transpose=True, stream=stream,
                                          runtime=runtime)
        keep.append(bq)
        b = bq.T
    if out is None:
        ashape, bshape = _shape(a), _shape(b)
        if len(ashape) != 2 or len(bshape) != 2:
            raise ShapeMismatchError(f"fp8_gemm: a and b must be matrices (got {ashape} and {bshape})")
    return OPS["fp8_gemm"](a, b, a_scale, b_scale, "f16" if out_code == A.F16 else "bf16", out=out, stream=stream,
                           runtime=runtime)

