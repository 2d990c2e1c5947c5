"""kiln: JIT-compiled LLM kernels (RMSNorm, add + RMSNorm, activation-and-mul, RoPE, RMSNorm +
RoPE, RMSNorm backward, LayerNorm and its backward, FP8 GEMM and its quantization, the fused gated
MLP) on torch tensors, NumPy arrays and any DLPack or __cuda_array_interface__ array. Every op the
loaded libkiln declares is a function here (kiln.ops.OPS). Importing kiln does not import torch;
kiln.torch has the PyTorch custom ops and modules.
"""
from ._errors import (CompileError, CorruptionError, DeviceError, DriverError, InternalError, InvalidArgumentError,
                      KilnError, KilnIOError, KilnTimeoutError, NotFoundError, ShapeMismatchError, ShuttingDownError,
                      UnavailableError, UnsupportedDtypeError)
from ._lib import ABI_VERSION, lib as _lib, library_path
from . import ops
from .ops import (ACTIVATIONS, OPS, FP8_GRANULARITIES, GATED_ACTIVATIONS, ROPE_LAYOUTS, Runtime, act_and_mul, describe_family, launch,
                  add_rms_norm, apply_rope_qk, counters, fp8_gemm, fused_gated_mlp, quantize_fp8, resolver, rms_norm,
                  rms_norm_backward, rms_norm_backward_workspace_elements, rms_norm_rope, rms_norm_with_inv_rms)

# Every declared op (families/*/ops.cpp), the ones imported by name above included.
globals().update({_name: getattr(ops, _name) for _name in OPS})

__version__ = "0.1.0"


def abi_version():
    """The C ABI version of the loaded libkiln.so."""
    return _lib.kiln_abi_version()


__all__ = [
    "KilnError", "InvalidArgumentError", "DeviceError", "ShapeMismatchError", "UnsupportedDtypeError",
    "NotFoundError", "CorruptionError", "CompileError", "DriverError", "KilnIOError", "UnavailableError",
    "KilnTimeoutError", "ShuttingDownError", "InternalError", "Runtime", "rms_norm", "rms_norm_with_inv_rms",
    "rms_norm_backward", "rms_norm_backward_workspace_elements", "add_rms_norm", "act_and_mul", "apply_rope_qk",
    "rms_norm_rope", "quantize_fp8", "fp8_gemm", "fused_gated_mlp", "counters", "resolver", "abi_version",
    "library_path", "ABI_VERSION", "ACTIVATIONS", "ROPE_LAYOUTS", "FP8_GRANULARITIES", "GATED_ACTIVATIONS", "OPS",
    "launch", "describe_family",
] + sorted(set(OPS) - {"rms_norm", "rms_norm_backward", "add_rms_norm", "act_and_mul", "apply_rope_qk",
                       "rms_norm_rope", "quantize_fp8", "fp8_gemm", "fused_gated_mlp"})
