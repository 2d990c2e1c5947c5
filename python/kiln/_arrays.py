"""Arrays in, kiln_tensor descriptions out.

kiln._fast (python/src/_fast.c) reads the arrays of every op call. Torch tensors it reads itself;
every other array it describes through describe() here, as (data, dtype code, shape, strides in
elements, device kind, device index, stream hint, keep-alive), with a handler picked once per
Python type: NumPy arrays, __cuda_array_interface__ producers (CuPy, Numba, JAX on a GPU), DLPack
producers, and anything with __array_interface__. The handler of torch tensors (_torch) is here
too: _fast uses it to know torch's types, and falls back to it for a dtype kiln does not take.
"""
import ctypes
import sys

from ._errors import DeviceError, InvalidArgumentError, ShapeMismatchError, UnsupportedDtypeError
from ._lib import check, lib

F32, F16, BF16, U8, I32, I64 = range(6)
CPU, CUDA = 0, 1
DTYPE_NAMES = ("float32", "float16", "bfloat16", "uint8", "int32", "int64")
ITEMSIZE = (4, 2, 2, 1, 4, 8)
_BY_NAME = {name: code for code, name in enumerate(DTYPE_NAMES)}

MAX_RANK = 8


# --- streams ---

_TORCH_STREAM = object()  # the hint of a torch tensor: its device's current stream


def as_stream(stream):
    """A CUstream handle from an int, a torch.cuda.Stream, a CuPy stream or a __cuda_stream__ object."""
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "ptr", None)
    if handle is None and hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()[1]
    if handle is None:
        raise InvalidArgumentError(f"stream must be an int handle or a CUDA stream object, not {type(stream).__name__}")
    return int(handle)


def torch_stream_function():
    """f(device index) -> the raw handle of torch's current stream on that device (for _fast)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


# --- handlers, one per kind of array ---

_torch_dtypes = None


def torch_dtype_table():
    """{torch dtype: kiln dtype code} (for _fast, which compares dtypes by identity)."""
    global _torch_dtypes
    import torch

    _torch_dtypes = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16, torch.uint8: U8,
                     torch.int32: I32, torch.int64: I64}
    return _torch_dtypes


def _torch(t, stream):
    table = _torch_dtypes or torch_dtype_table()
    code = table.get(t.dtype)
    if code is None:
        raise UnsupportedDtypeError(f"kiln does not take {t.dtype} tensors (float32, float16, bfloat16, uint8, int32, int64)")
    index = t.get_device()
    if index >= 0:
        return (t.data_ptr(), code, t.shape, t.stride(), CUDA, index, _TORCH_STREAM, None)
    return (t.data_ptr(), code, t.shape, t.stride(), CPU, 0, None, None)


def _dtype_code(dtype_name, typestr):
    code = _BY_NAME.get(dtype_name)
    if code is None:
        raise UnsupportedDtypeError(
            f"kiln does not take {dtype_name or typestr} arrays (float32, float16, bfloat16, uint8, int32, int64)")
    return code


def _element_strides(byte_strides, itemsize, shape):
    if byte_strides is None:
        out, step = [], 1
        for n in reversed(shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))
    for s in byte_strides:
        if s % itemsize:
            raise ShapeMismatchError("kiln needs strides that are whole multiples of the element size")
    return tuple(s // itemsize for s in byte_strides)


_numpy_codes = {}


def _numpy(a, stream):
    dt = a.dtype
    code = _numpy_codes.get(dt)
    if code is None:
        code = _numpy_codes[dt] = _dtype_code(dt.name, dt.str)
    ptr = a.__array_interface__["data"][0]
    return (ptr, code, a.shape, _element_strides(a.strides, a.itemsize, a.shape), CPU, 0, None, a)


def _array_interface(a, stream):
    ai = a.__array_interface__
    name = getattr(getattr(a, "dtype", None), "name", None)
    typestr = ai["typestr"]
    code = _dtype_code(name or _TYPESTR.get(typestr[1:]), typestr)
    shape = tuple(ai["shape"])
    return (ai["data"][0], code, shape, _element_strides(ai.get("strides"), ITEMSIZE[code], shape), CPU, 0, None, a)


_TYPESTR = {"f4": "float32", "f2": "float16", "u1": "uint8", "i4": "int32", "i8": "int64"}


def _pointer_device(ptr):
    kind, index = ctypes.c_int32(), ctypes.c_int32()
    check(lib.kiln_pointer_device(ptr, ctypes.byref(kind), ctypes.byref(index)))
    return kind.value, index.value


def _cuda_array_interface(a, stream):
    try:
        cai = a.__cuda_array_interface__
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return _dlpack(a, stream)  # JAX on the CPU offers the attribute but raises
    typestr = cai["typestr"]
    name = getattr(getattr(a, "dtype", None), "name", None) or _TYPESTR.get(typestr[1:])
    code = _dtype_code(name, typestr)
    shape = tuple(cai["shape"])
    ptr = cai["data"][0]
    kind, index = _pointer_device(ptr) if ptr else (CUDA, 0)
    if kind != CUDA:
        raise DeviceError("an array offering __cuda_array_interface__ does not point to CUDA memory")
    hint = cai.get("stream") if cai.get("version", 0) >= 3 else None
    return (ptr, code, shape, _element_strides(cai.get("strides"), ITEMSIZE[code], shape), CUDA, index, hint, a)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
# (DLPack type code, bits) -> kiln dtype; codes: 0 int, 1 uint, 2 float, 4 bfloat.
_DL_DTYPES = {(2, 32): F32, (2, 16): F16, (4, 16): BF16, (1, 8): U8, (0, 32): I32, (0, 64): I64}
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def _dlpack(a, stream):
    device_type, device_id = a.__dlpack_device__()
    on_cuda = device_type in (_DL_CUDA, _DL_CUDA_MANAGED)
    if on_cuda:
        # DLPack's stream argument: 1 is the legacy default stream (our handle 0).
        handle = 0 if stream is None else stream
        capsule = a.__dlpack__(stream=handle or 1)
    else:
        capsule = a.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    code = _DL_DTYPES.get((t.dtype.code, t.dtype.bits))
    if code is None or t.dtype.lanes != 1:
        raise UnsupportedDtypeError(f"kiln does not take DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits)")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = _element_strides(None, 1, shape) if not t.strides else tuple(t.strides[i] for i in range(t.ndim))
    ptr = (t.data or 0) + t.byte_offset
    if on_cuda:
        return (ptr, code, shape, strides, CUDA, device_id, stream, (a, capsule))
    return (ptr, code, shape, strides, CPU, 0, None, (a, capsule))


def _unknown(a, stream):
    raise InvalidArgumentError(
        f"kiln cannot read a {type(a).__name__}: pass a torch tensor, a NumPy array, or an array offering "
        "__dlpack__ or __cuda_array_interface__")


_handlers = {}


def _classify(tp):
    module = getattr(tp, "__module__", "") or ""
    numpy = sys.modules.get("numpy")
    if module.startswith("torch") and hasattr(tp, "data_ptr") and hasattr(tp, "get_device"):
        h = _torch
    elif numpy is not None and issubclass(tp, numpy.ndarray):
        h = _numpy
    elif hasattr(tp, "__cuda_array_interface__"):
        h = _cuda_array_interface
    elif hasattr(tp, "__dlpack__") and hasattr(tp, "__dlpack_device__"):
        h = _dlpack
    elif hasattr(tp, "__array_interface__"):
        h = _array_interface
    else:
        h = _unknown
    _handlers[tp] = h
    return h


def handler_for(tp):
    """The handler of a Python type (cached)."""
    return _handlers.get(tp) or _classify(tp)


def describe(a, stream):
    """The description of one array; raises kiln's errors for arrays kiln cannot read."""
    return (_handlers.get(type(a)) or _classify(type(a)))(a, stream)


def empty(like, shape, dtype=None):
    """A new array shaped `shape`, of kiln dtype code `dtype` (None: like's), next to `like`."""
    h = _handlers.get(type(like)) or _classify(type(like))
    if h is _torch:
        if dtype is None:
            return like.new_empty(shape)
        table = _torch_dtypes or torch_dtype_table()
        return like.new_empty(shape, dtype=next(k for k, v in table.items() if v == dtype))
    if h is _numpy:
        import numpy

        return numpy.empty(shape, dtype=like.dtype if dtype is None else DTYPE_NAMES[dtype])
    if h is _unknown:
        _unknown(like, None)
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()
        dt = like.dtype if dtype is None else getattr(xp, DTYPE_NAMES[dtype])
        return xp.empty(shape, dtype=dt, device=like.device)
    cannot_allocate(like)


def cannot_allocate(like):
    if (_handlers.get(type(like)) or _classify(type(like))) is _unknown:
        _unknown(like, None)
    raise InvalidArgumentError(f"kiln cannot allocate an output like a {type(like).__name__}: pass it (out=...)")
