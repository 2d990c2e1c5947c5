"""kiln's error kinds as Python exceptions, one class per kiln_code."""


class KilnError(Exception):
    """Base of every kiln error. `code` is the kiln_code, `code_name` its name."""

    code = 13
    code_name = "internal"


class InvalidArgumentError(KilnError, ValueError):
    code, code_name = 1, "invalid_argument"


class DeviceError(KilnError):
    code, code_name = 2, "device_error"


class ShapeMismatchError(KilnError, ValueError):
    code, code_name = 3, "shape_mismatch"


class UnsupportedDtypeError(KilnError, TypeError):
    code, code_name = 4, "unsupported_dtype"


class NotFoundError(KilnError):
    code, code_name = 5, "not_found"


class CorruptionError(KilnError):
    code, code_name = 6, "corruption"


class CompileError(KilnError):
    code, code_name = 7, "compile_error"


class DriverError(KilnError):
    code, code_name = 8, "driver_error"


class KilnIOError(KilnError, OSError):
    code, code_name = 9, "io_error"


class UnavailableError(KilnError):
    code, code_name = 10, "unavailable"


class KilnTimeoutError(KilnError, TimeoutError):
    code, code_name = 11, "timeout"


class ShuttingDownError(KilnError):
    code, code_name = 12, "shutting_down"


class InternalError(KilnError):
    code, code_name = 13, "internal"


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgumentError, DeviceError, ShapeMismatchError, UnsupportedDtypeError, NotFoundError,
                CorruptionError, CompileError, DriverError, KilnIOError, UnavailableError, KilnTimeoutError,
                ShuttingDownError, InternalError)
}


def error_for(code, message):
    """The exception for a kiln_code returned by the C ABI, with kiln_last_error()'s message."""
    return _BY_CODE.get(code, InternalError)(message)
