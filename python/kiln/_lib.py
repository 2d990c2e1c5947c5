"""Loads libkiln.so and declares the prototypes of the C ABI calls made through ctypes (kiln.h, ABI version 7)."""
import ctypes
import os

from ._errors import error_for

ABI_VERSION = 8

_P = ctypes.c_void_p

# name: (argtypes) of what ctypes calls; each returns a kiln_code (int). The ops themselves are
# called by kiln._fast, which takes their addresses from this handle.
_OPS = {
    "kiln_runtime_create": (ctypes.c_char_p, _P),
    "kiln_runtime_get_counters": (_P, _P),
    "kiln_pointer_device": (_P, _P, _P),
    "kiln_op_count": (_P,),
    "kiln_op_at": (ctypes.c_int32, _P),
    "kiln_op_infer": (_P, _P, ctypes.c_int32, _P, ctypes.c_int32, _P, ctypes.c_int32),
    "kiln_launch": (_P, ctypes.c_char_p, ctypes.c_int32, _P, ctypes.c_int32, ctypes.c_uint32, _P, ctypes.c_int32, _P),
}


def _library_path():
    explicit = os.environ.get("KILN_LIBRARY")
    if explicit:
        return explicit
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkiln.so")


def _load():
    path = _library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        hint = ""
        if "libsqlite3" in str(e):
            hint = " (libkiln.so needs the system's SQLite: apt-get install libsqlite3-0)"
        raise ImportError(f"kiln: cannot load {path}: {e}{hint}") from e
    lib.kiln_abi_version.restype = ctypes.c_int
    lib.kiln_abi_version.argtypes = ()
    version = lib.kiln_abi_version()
    if version < ABI_VERSION:
        raise ImportError(f"kiln: {path} has C ABI version {version}; this package needs {ABI_VERSION} or later")
    lib.kiln_last_error.restype = ctypes.c_char_p
    lib.kiln_last_error.argtypes = ()
    lib.kiln_runtime_destroy.restype = None
    lib.kiln_runtime_destroy.argtypes = (_P,)
    lib.kiln_runtime_resolver.restype = ctypes.c_char_p
    lib.kiln_runtime_resolver.argtypes = (_P,)
    lib.kiln_runtime_resolver_name.restype = ctypes.c_char_p
    lib.kiln_runtime_resolver_name.argtypes = (_P,)
    lib.kiln_op_describe.restype = ctypes.c_char_p
    lib.kiln_op_describe.argtypes = (_P,)
    lib.kiln_family_describe.restype = ctypes.c_char_p
    lib.kiln_family_describe.argtypes = (ctypes.c_char_p,)
    for name, argtypes in _OPS.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib, path


lib, library_path = _load()


def raise_for(code):
    """Raises the exception for a non-zero kiln_code, with the calling thread's last error."""
    message = lib.kiln_last_error()
    text = message.decode("utf-8", "replace") if message else "kiln error"
    raise error_for(code, text)


def check(code):
    if code:
        raise_for(code)


__all__ = ["lib", "library_path", "check", "raise_for", "ABI_VERSION"]
