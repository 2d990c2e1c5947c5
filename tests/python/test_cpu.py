"""CPU tests of the kiln package (CI: no GPU, no torch): the install, the CPU fallbacks on NumPy
arrays against NumPy references, and the error paths."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import kiln

F16_TOL = dict(rtol=2e-3, atol=2e-3)
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def ref_rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return x64 * inv * w.astype(np.float64), inv[..., 0]


# --- the install ---


def test_import_does_not_import_torch():
    code = "import sys, kiln; kiln.abi_version(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_library_ships_inside_the_package():
    assert kiln.abi_version() >= kiln.ABI_VERSION == 8
    if "KILN_LIBRARY" not in os.environ:
        assert os.path.dirname(kiln.library_path) == os.path.dirname(kiln.__file__)
        assert os.path.isfile(kiln.library_path)


def test_library_exports_only_the_c_abi():
    out = subprocess.run(["nm", "-D", "--defined-only", kiln.library_path], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm is not available")
    names = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    assert names and all(n.startswith("kiln_") for n in names), [n for n in names if not n.startswith("kiln_")][:5]


def test_ops_go_through_the_abi3_extension():
    from kiln import _fast

    assert _fast.__file__.endswith("_fast.abi3.so")
    assert os.path.dirname(_fast.__file__) == os.path.dirname(kiln.__file__)
    with pytest.raises(TypeError):
        _fast.call(1, None, None)  # rms_norm without its arrays


# --- CPU fallbacks vs NumPy ---


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 64), (256,)])
def test_rms_norm_matches_numpy(rng, dtype, shape):
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal(shape[-1]).astype(dtype)
    y, inv = kiln.rms_norm_with_inv_rms(x, w, 1e-5)
    ref, ref_inv = ref_rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y.astype(np.float64), ref, **(F32_TOL if dtype == np.float32 else F16_TOL))
    assert inv.dtype == np.float32 and inv.size == ref_inv.size
    np.testing.assert_allclose(inv.reshape(ref_inv.shape), ref_inv, rtol=1e-5)


def test_rms_norm_bf16_matches_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = rng.standard_normal((5, 128)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(128).astype(ml_dtypes.bfloat16)
    y = kiln.rms_norm(x, w)
    ref, _ = ref_rms_norm(x.astype(np.float32), w.astype(np.float32), 1e-6)
    assert y.dtype == x.dtype
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=1e-2, atol=1e-2)


def test_rms_norm_strided_rows_and_out(rng):
    wide = rng.standard_normal((6, 80)).astype(np.float32)
    x = wide[:, :64]  # rows strided by 80 elements
    w = rng.standard_normal(64).astype(np.float32)
    out = np.full((6, 64), np.nan, np.float32)
    assert kiln.rms_norm(x, w, out=out) is out
    np.testing.assert_allclose(out, ref_rms_norm(x, w, 1e-6)[0], **F32_TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_add_rms_norm_matches_numpy(rng, dtype):
    x = rng.standard_normal((9, 128)).astype(dtype)
    r = rng.standard_normal((9, 128)).astype(dtype)
    w = rng.standard_normal(128).astype(dtype)
    y, h = kiln.add_rms_norm(x, r, w, 1e-6)
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_allclose(y.astype(np.float64), ref_rms_norm(h_ref, w, 1e-6)[0],
                               **(F32_TOL if dtype == np.float32 else F16_TOL))


def test_add_rms_norm_in_place(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    r = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    h_ref = x + r
    y_ref = ref_rms_norm(h_ref, w, 1e-6)[0]
    y, h = kiln.add_rms_norm(x, r, w, out=x, residual_out=r)
    assert y is x and h is r
    np.testing.assert_allclose(r, h_ref, **F32_TOL)
    np.testing.assert_allclose(x, y_ref, **F32_TOL)


_ACTS = {
    "silu": lambda g: g / (1 + np.exp(-g)),
    "gelu": lambda g: 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2))),
    "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))),
}


@pytest.mark.parametrize("act", sorted(_ACTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_act_and_mul_matches_numpy(rng, act, dtype):
    x = rng.standard_normal((3, 5, 2 * 48)).astype(dtype)
    out = kiln.act_and_mul(x, act)
    g, u = x[..., :48].astype(np.float64), x[..., 48:].astype(np.float64)
    assert out.shape == (3, 5, 48) and out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float64), _ACTS[act](g) * u,
                               **(F32_TOL if dtype == np.float32 else F16_TOL))


@pytest.mark.parametrize("act", sorted(_ACTS))
def test_act_and_mul_backward_matches_central_differences(rng, act):
    """dx against (f(x + h e) - f(x - h e)) / 2h of sum(dy * act_and_mul(x)), per element, in f64."""
    x = rng.standard_normal((2, 3, 2 * 16)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 16)).astype(np.float32)
    dx = kiln.act_and_mul_backward(x, dy, act)
    assert dx.shape == x.shape and dx.dtype == np.float32
    g, u = x[..., :16].astype(np.float64), x[..., 16:].astype(np.float64)
    h = 1e-6
    f = _ACTS[act]
    want_g = dy * u * (f(g + h) - f(g - h)) / (2 * h)
    want_u = dy * f(g)
    np.testing.assert_allclose(dx[..., :16], want_g, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx[..., 16:], want_u, rtol=1e-5, atol=1e-6)
    # In place: the gradient overwrites the saved input.
    y = x.copy()
    kiln.act_and_mul_backward(y, dy, act, dx=y)
    np.testing.assert_array_equal(y, dx)
    assert kiln.OPS["act_and_mul"].backward == "act_and_mul_backward"


def ref_rope(x, cos, sin, pos, layout):
    x = x.astype(np.float64)
    half = x.shape[-1] // 2
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    if layout == "neox":
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_apply_rope_qk_matches_numpy(rng, layout, dtype):
    tokens, head_dim, max_pos = 6, 64, 32
    q = rng.standard_normal((tokens, 4, head_dim)).astype(dtype)
    k = rng.standard_normal((tokens, 2, head_dim)).astype(dtype)  # GQA: fewer kv heads
    angles = rng.uniform(0, 2 * np.pi, (max_pos, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = rng.integers(0, max_pos, tokens).astype(np.int64)
    q_out, k_out = kiln.apply_rope_qk(q, k, cos, sin, pos, layout)
    tol = F32_TOL if dtype == np.float32 else F16_TOL
    np.testing.assert_allclose(q_out.astype(np.float64), ref_rope(q, cos, sin, pos, layout), **tol)
    np.testing.assert_allclose(k_out.astype(np.float64), ref_rope(k, cos, sin, pos, layout), **tol)


def test_rms_norm_backward_matches_finite_differences(rng):
    x = rng.standard_normal((3, 64))
    w = rng.standard_normal(64)
    dy = rng.standard_normal((3, 64))
    eps = 1e-6

    def loss(x_, w_):
        return float((ref_rms_norm(x_, w_, eps)[0] * dy).sum())

    h = 1e-6
    dx_ref = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = h
        dx_ref[i] = (loss(x + e, w) - loss(x - e, w)) / (2 * h)
    dw_ref = np.array([(loss(x, w + h * np.eye(64)[j]) - loss(x, w - h * np.eye(64)[j])) / (2 * h) for j in range(64)])

    x32, w32, dy32 = x.astype(np.float32), w.astype(np.float32), dy.astype(np.float32)
    _, inv = kiln.rms_norm_with_inv_rms(x32, w32, eps)
    dx, dw = kiln.rms_norm_backward(dy32, x32, w32, inv)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4)
    assert kiln.rms_norm_backward_workspace_elements(x32) == 0  # host: no workspace


def test_add_rms_norm_backward_matches_finite_differences(rng):
    # L = sum(dy * rms_norm(h) * w) + sum(dh * h): dx is dL/dh with inv_rms recomputed from h.
    h = rng.standard_normal((3, 64))
    w = rng.standard_normal(64)
    dy, dh = rng.standard_normal((3, 64)), rng.standard_normal((3, 64))
    eps = 1e-3

    def loss(h_, w_):
        return float((ref_rms_norm(h_, w_, eps)[0] * dy).sum() + (h_ * dh).sum())

    step = 1e-6
    dx_ref = np.zeros_like(h)
    for i in np.ndindex(*h.shape):
        e = np.zeros_like(h)
        e[i] = step
        dx_ref[i] = (loss(h + e, w) - loss(h - e, w)) / (2 * step)
    dw_ref = np.array([(loss(h, w + step * np.eye(64)[j]) - loss(h, w - step * np.eye(64)[j])) / (2 * step)
                       for j in range(64)])

    h32, w32, dy32, dh32 = (a.astype(np.float32) for a in (h, w, dy, dh))
    dx, dw = kiln.add_rms_norm_backward(dy32, dh32, h32, w32, eps=eps)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4)
    # Without dh: the norm's gradient alone, as rms_norm_backward gives it from the saved inv_rms.
    dx0, dw0 = kiln.add_rms_norm_backward(dy32, None, h32, w32, eps=eps)
    _, inv = kiln.rms_norm_with_inv_rms(h32, w32, eps)
    dx1, dw1 = kiln.rms_norm_backward(dy32, h32, w32, inv)
    np.testing.assert_allclose(dx0, dx1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw0, dw1, rtol=1e-5, atol=1e-6)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.add_rms_norm_backward(dy32, dh32[:2], h32, w32)
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.add_rms_norm_backward(dy32, dh32, h32, w32, eps=-1.0)


def test_rms_norm_rope_backward_matches_finite_differences(rng):
    # L = sum(dout * rope(rms_norm(x) * w)) with cos/sin whose halves differ; the backward runs on
    # the host (the forward itself is CUDA only).
    b, s, heads, d, eps = 2, 3, 2, 64, 1e-3
    x, w = rng.standard_normal((b, s, heads * d)), rng.standard_normal(heads * d)
    dout = rng.standard_normal((b, s, heads * d))
    angle = rng.uniform(-3, 3, (s, d))
    cos, sin = np.cos(angle), np.sin(angle)

    def loss(x_, w_):
        n = (ref_rms_norm(x_, w_, eps)[0]).reshape(b, s, heads, d)
        rotated = np.concatenate([-n[..., d // 2:], n[..., :d // 2]], -1)
        return float(((n * cos[:, None] + rotated * sin[:, None]).reshape(x_.shape) * dout).sum())

    step = 1e-6
    dx_ref = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = step
        dx_ref[i] = (loss(x + e, w) - loss(x - e, w)) / (2 * step)
    eye = np.eye(heads * d)
    dw_ref = np.array([(loss(x, w + step * eye[j]) - loss(x, w - step * eye[j])) / (2 * step)
                       for j in range(heads * d)])

    x32, w32, g32, c32, s32 = (a.astype(np.float32) for a in (x, w, dout, cos, sin))
    dx, dw = kiln.rms_norm_rope_backward(g32, x32, w32, c32, s32, eps=eps, num_heads=heads)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.rms_norm_rope_backward(g32, x32, w32, c32[:2], s32[:2])
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.rms_norm_rope_backward(g32, x32, w32, c32, s32, eps=-1.0)


# --- other array producers: DLPack and __array_interface__ ---


class DLPackOnly:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayInterfaceOnly:
    def __init__(self, a):
        self._a = a

    @property
    def __array_interface__(self):
        return self._a.__array_interface__


def test_dlpack_and_array_interface_inputs(rng):
    if not hasattr(np.ndarray, "__dlpack__"):
        pytest.skip("this NumPy has no DLPack")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    out = np.empty_like(x)
    kiln.rms_norm(DLPackOnly(x), ArrayInterfaceOnly(w), out=DLPackOnly(out))
    np.testing.assert_allclose(out, ref_rms_norm(x, w, 1e-6)[0], **F32_TOL)
    with pytest.raises(kiln.InvalidArgumentError, match="allocate"):
        kiln.rms_norm(DLPackOnly(x), w)  # no way to allocate an output like it


# --- error paths: the right exception, before anything runs ---


def _operands(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    return x, w, np.full_like(x, 7.0)


def test_errors_are_kiln_errors_and_leave_outputs_untouched(rng):
    x, w, out = _operands(rng)
    cases = [
        (kiln.ShapeMismatchError, "weight must have shape", lambda: kiln.rms_norm(x, w[:32], out=out)),
        (kiln.ShapeMismatchError, "different shapes", lambda: kiln.rms_norm(x, w, out=np.empty((4, 32), np.float32))),
        (kiln.UnsupportedDtypeError, "float64", lambda: kiln.rms_norm(x.astype(np.float64), w, out=out)),
        (kiln.UnsupportedDtypeError, "dtypes differ", lambda: kiln.rms_norm(x, w.astype(np.float16), out=out)),
        (kiln.UnsupportedDtypeError, "i32", lambda: kiln.rms_norm(x.astype(np.int32), w.astype(np.int32),
                                                                   out=out.astype(np.int32))),
        (kiln.InvalidArgumentError, "eps", lambda: kiln.rms_norm(x, w, -1.0, out=out)),
        (kiln.InvalidArgumentError, "eps", lambda: kiln.rms_norm(x, w, float("nan"), out=out)),
        (kiln.ShapeMismatchError, "contiguous", lambda: kiln.rms_norm(np.asfortranarray(x), w, out=out)),
        (kiln.ShapeMismatchError, "rank", lambda: kiln.rms_norm(np.float32(1.0).reshape(()), w, out=out)),
        (kiln.ShapeMismatchError, "inv_rms", lambda: kiln.rms_norm(x, w, out=out, inv_rms=np.empty(3, np.float32))),
        (kiln.InvalidArgumentError, "cannot read", lambda: kiln.rms_norm([[1.0] * 64] * 4, w, out=out)),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=text) as info:
            call()
        assert isinstance(info.value, kiln.KilnError)
        np.testing.assert_array_equal(out, 7.0)


def test_device_error_for_host_arrays_on_a_cuda_only_op(rng):
    x = rng.standard_normal((1, 4, 128)).astype(np.float16)
    w = np.ones(128, np.float16)
    cos = np.ones((4, 64), np.float16)
    with pytest.raises(kiln.DeviceError, match="not a CUDA tensor"):
        kiln.rms_norm_rope(x, w, cos, cos)


def test_act_and_mul_errors(rng):
    x = rng.standard_normal((2, 9)).astype(np.float32)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.act_and_mul(x, out=np.empty((2, 4), np.float32))  # odd last dimension
    with pytest.raises(kiln.InvalidArgumentError, match="activation"):
        kiln.act_and_mul(rng.standard_normal((2, 8)).astype(np.float32), "relu")


def test_rope_errors(rng):
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    cos = np.ones((8, 32), np.float32)
    pos = np.array([0, 8], np.int64)  # 8 is out of range
    with pytest.raises(kiln.InvalidArgumentError, match="position"):
        kiln.apply_rope_qk(q, q.copy(), cos, cos, pos)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.apply_rope_qk(q, q.copy(), cos, cos, pos.astype(np.int32))
    with pytest.raises(kiln.InvalidArgumentError, match="layout"):
        kiln.apply_rope_qk(q, q.copy(), cos, cos, pos, "bogus")


def test_backward_errors(rng):
    x, w, _ = _operands(rng)
    inv = np.ones(4, np.float32)
    with pytest.raises(kiln.UnsupportedDtypeError, match="inv_rms"):
        kiln.rms_norm_backward(x, x, w, inv.astype(np.float16))
    with pytest.raises(kiln.ShapeMismatchError, match="one value per row"):
        kiln.rms_norm_backward(x, x, w, np.ones(3, np.float32))


class FakeCudaArray:
    """A __cuda_array_interface__ at address 0 (no memory: kiln takes it as CUDA without asking the
    driver), to check which stream an op would launch on without a GPU."""

    def __init__(self, stream=None):
        self._stream = stream

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": (2, 64), "typestr": "<f4", "data": (0, False), "strides": None,
                "stream": self._stream}


class StreamObject:
    cuda_stream = 0x1234


def test_launch_stream_choice(rng):
    from kiln import _fast, ops

    def stream_of(*arrays, stream=None):
        return _fast.call(ops._READ, None, stream, *arrays)

    x, w, _ = _operands(rng)
    assert stream_of(x, w) == 0  # host arrays
    assert stream_of(x, None, FakeCudaArray(7), FakeCudaArray(9)) == 7  # the first CUDA array's stream
    assert stream_of(FakeCudaArray()) == 0  # no stream given: the legacy default stream
    assert stream_of(FakeCudaArray(7), stream=5) == 5  # the caller's stream wins
    assert stream_of(x, stream=StreamObject()) == 0x1234
    with pytest.raises(kiln.InvalidArgumentError, match="stream"):
        stream_of(x, stream="s")


def test_rank_errors_name_the_rank(rng):
    x, w, out = _operands(rng)
    with pytest.raises(kiln.ShapeMismatchError, match="not 9"):
        kiln.rms_norm(np.zeros((1,) * 8 + (64,), np.float32), w, out=np.zeros((1,) * 8 + (64,), np.float32))
    with pytest.raises(kiln.ShapeMismatchError, match="0-d"):  # reported before the rank past 8
        kiln.rms_norm(np.zeros((1,) * 8 + (64,), np.float32), w, out=np.float32(1.0).reshape(()))


# --- runtimes ---


def test_runtime_modes_and_counters(rng):
    with pytest.raises(kiln.InvalidArgumentError, match="mode"):
        kiln.Runtime("bogus")
    x, w, out = _operands(rng)
    with kiln.Runtime("embedded") as rt:
        kiln.rms_norm(x, w, out=out, runtime=rt)
        np.testing.assert_allclose(out, ref_rms_norm(x, w, 1e-6)[0], **F32_TOL)
        c = rt.counters()
        assert set(c) == {"table_hits", "from_daemon", "from_embedded", "module_loads"}
        assert c["module_loads"] == 0  # host arrays never load a kernel
    with pytest.raises(kiln.InvalidArgumentError, match="closed"):
        kiln.rms_norm(x, w, out=out, runtime=rt)


# --- FP8 GEMM, its quantization, the fused gated MLP (CPU references in libkiln) ---


def e4m3_values():
    """The value of every e4m3 code (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
    infinities, 0x7F/0xFF NaN), written out here independently of kiln's own decoder."""
    out = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            out[code] = np.nan
        elif exp == 0:
            out[code] = sign * man / 8.0 * 2.0 ** -6
        else:
            out[code] = sign * (1 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3_values()


_FINITE = np.unique(E4M3[np.isfinite(E4M3)])  # sorted, -448 .. 448
_EVEN = np.array([min(c for c in range(256) if E4M3[c] == v) % 2 == 0 for v in _FINITE])


def nearest_e4m3(v):
    """Round to the nearest finite e4m3 value (ties to the even code), saturating at +-448."""
    v = np.clip(v, -448.0, 448.0)
    i = np.clip(np.searchsorted(_FINITE, v), 1, len(_FINITE) - 1)
    lo, hi = _FINITE[i - 1], _FINITE[i]
    up = ((hi - v) < (v - lo)) | (((hi - v) == (v - lo)) & _EVEN[i])
    return np.where(up, hi, lo)


def expand_scales(scale, granularity, shape):
    """Each element's scale, from quantize_fp8's scale array."""
    if granularity == "tensor":
        return np.full(shape, scale.reshape(-1)[0], dtype=np.float64)
    s = np.repeat(scale.astype(np.float64), 128, axis=-1)
    if granularity == "128x128":
        s = np.repeat(s, 128, axis=0)
    return s[:shape[0], :shape[1]]


@pytest.mark.parametrize("granularity", ["tensor", "1x128", "128x128"])
def test_quantize_fp8_matches_an_independent_reference(rng, granularity):
    x = (rng.standard_normal((130, 300)) * 3).astype(np.float32)
    q, scale = kiln.quantize_fp8(x, granularity)
    assert q.dtype == np.uint8 and q.shape == x.shape and scale.dtype == np.float32
    x64 = x.astype(np.float64)
    # Each group's scale is its largest magnitude over 448.
    rb, cb = -(-x.shape[0] // 128), -(-x.shape[1] // 128)
    if granularity == "tensor":
        want = np.array([np.abs(x64).max()])
    elif granularity == "1x128":
        want = np.array([[np.abs(x64[r, j * 128:(j + 1) * 128]).max() for j in range(cb)] for r in range(x.shape[0])])
    else:
        want = np.array([[np.abs(x64[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() for j in range(cb)]
                         for i in range(rb)])
    np.testing.assert_allclose(scale.reshape(want.shape), want / 448.0, rtol=1e-6)
    # Every code is the e4m3 value nearest to x / scale (the f32 scale kiln stored).
    s = expand_scales(scale, granularity, x.shape)
    np.testing.assert_array_equal(E4M3[q], nearest_e4m3((x / s.astype(np.float32)).astype(np.float64)))
    # So the round trip stays within half an e4m3 step (1/16 relative, or the subnormal step) of x.
    assert np.all(np.abs(E4M3[q] * s - x64) <= np.abs(x64) / 16 + s * 2.0 ** -10)


def test_quantize_fp8_transposed_for_a_weight(rng):
    w = rng.standard_normal((64, 48)).astype(np.float32)  # [K, N]
    q, scale = kiln.quantize_fp8(w, "tensor", transpose=True)
    assert q.shape == (48, 64)
    q2, scale2 = kiln.quantize_fp8(np.ascontiguousarray(w.T), "tensor")
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(scale, scale2)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_fp8_gemm_matches_the_dequantized_product(rng, scaling, out_dtype):
    if out_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes", reason="bf16 NumPy arrays need ml_dtypes")
    m, k, n = 37, 160, 45  # M and N off any tile, K two 128-blocks deep (one partial)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    out = kiln.fp8_gemm(a, b, output_dtype=out_dtype, scaling=scaling)
    assert out.shape == (m, n) and out.dtype.name == out_dtype
    # The same product from kiln's quantized operands, dequantized and multiplied in float64.
    gran_a, gran_b = ("1x128", "128x128") if scaling == "block" else ("tensor", "tensor")
    qa, sa = kiln.quantize_fp8(a, gran_a)
    qb, sb = kiln.quantize_fp8(b, gran_b, transpose=True)  # [N, K]
    if scaling == "block":
        da = E4M3[qa] * np.repeat(sa, 128, axis=1)[:, :k]
        db = E4M3[qb] * np.repeat(np.repeat(sb, 128, axis=0), 128, axis=1)[:n, :k]
    else:
        da, db = E4M3[qa] * sa[0], E4M3[qb] * sb[0]
    want = da @ db.T
    got = out.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    # And near the unquantized product (e4m3 keeps 3 mantissa bits).
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.06


def test_fp8_gemm_takes_pre_quantized_operands(rng):
    a = rng.standard_normal((8, 32)).astype(np.float32)
    w = rng.standard_normal((24, 32)).astype(np.float32)  # [N, K], as a Linear's weight
    qa, sa = kiln.quantize_fp8(a)
    qw, sw = kiln.quantize_fp8(w)
    out = kiln.fp8_gemm(qa, qw.T, sa, sw)
    want = (E4M3[qa] * sa[0]) @ (E4M3[qw] * sw[0]).T
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_fp8_gemm_errors(rng):
    a = rng.standard_normal((8, 32)).astype(np.float32)
    qa, sa = kiln.quantize_fp8(a)
    qw, sw = kiln.quantize_fp8(rng.standard_normal((16, 32)).astype(np.float32))
    with pytest.raises(kiln.InvalidArgumentError, match="a_scale"):
        kiln.fp8_gemm(qa, qw.T, None, sw)
    with pytest.raises(kiln.InvalidArgumentError, match="b_scale"):
        kiln.fp8_gemm(qa, qw.T, sa, None)
    with pytest.raises(kiln.ShapeMismatchError):  # K of 20 is not a multiple of 16
        kiln.fp8_gemm(rng.standard_normal((8, 20)).astype(np.float32), rng.standard_normal((20, 8)).astype(np.float32))
    with pytest.raises(kiln.ShapeMismatchError):  # inner dimensions differ
        kiln.fp8_gemm(a, rng.standard_normal((48, 8)).astype(np.float32))
    with pytest.raises(kiln.InvalidArgumentError):  # a row-major [K, N] pre-quantized b
        kiln.fp8_gemm(qa, np.ascontiguousarray(qw.T), sa, sw)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.fp8_gemm(a, a.T.copy(), output_dtype="float32")
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.fp8_gemm(a, a.T.copy(), scaling="rowwise")
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.quantize_fp8(a, "2x2")


def ref_gated(x, wg, wu, act):
    g = x.astype(np.float64) @ wg.astype(np.float64).T
    u = x.astype(np.float64) @ wu.astype(np.float64).T
    if act == "silu":
        a = g / (1 + np.exp(-g))
    else:
        a = 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2)))
    return a * u


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_fused_gated_mlp_matches_numpy(rng, act):
    x = rng.standard_normal((2, 5, 40)).astype(np.float16)
    wg = (rng.standard_normal((72, 40)) * 0.2).astype(np.float16)
    wu = (rng.standard_normal((72, 40)) * 0.2).astype(np.float16)
    out = kiln.fused_gated_mlp(x, wg, wu, act)
    assert out.shape == (2, 5, 72) and out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), ref_gated(x, wg, wu, act), rtol=1e-2, atol=1e-2)


def test_fused_gated_mlp_errors(rng):
    x = rng.standard_normal((4, 40)).astype(np.float16)
    w = rng.standard_normal((8, 40)).astype(np.float16)
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.fused_gated_mlp(x, w, w, "relu")
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.fused_gated_mlp(x, w, rng.standard_normal((8, 32)).astype(np.float16))
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.fused_gated_mlp(x.astype(np.float32), w.astype(np.float32), w.astype(np.float32))


# --- ops from their declarations ---


def test_every_declared_op_is_a_module_function():
    ops = kiln.ops.OPS
    for name in ("rms_norm", "rms_norm_backward", "add_rms_norm", "act_and_mul", "apply_rope_qk", "rms_norm_rope",
                 "quantize_fp8", "fp8_gemm", "fused_gated_mlp"):
        assert name in ops, name
    for name, decl in ops.items():
        fn = getattr(kiln.ops, name)
        assert decl.name in (fn.__doc__ or "") or name == "fp8_gemm"  # fp8_gemm adds quantization by hand
        assert [t["name"] for t in decl.tensors] == [t["name"] for t in decl.inputs + decl.outputs]
        if decl.backward:
            assert decl.backward in ops
    assert kiln.ACTIVATIONS == {"silu": 0, "gelu": 1, "gelu_tanh": 2}



def test_declared_op_calls_bind_like_python(rng):
    x = rng.standard_normal((2, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(TypeError):
        kiln.rms_norm(x)  # weight is required
    with pytest.raises(TypeError):
        kiln.rms_norm(x, w, nonsense=1)
    with pytest.raises(TypeError):
        kiln.rms_norm(x, w, 1e-6, eps=1e-6)
    with pytest.raises(kiln.InvalidArgumentError, match="activation must be one of silu, gelu, gelu_tanh"):
        kiln.act_and_mul(np.ones((2, 8), np.float32), "relu")
    np.testing.assert_array_equal(kiln.rms_norm(x, w, eps=1e-6), kiln.rms_norm(x, w, 1e-6))


def test_launch_checks_family_problem_and_buffers_first():
    with pytest.raises(kiln.NotFoundError, match="no_such_family"):
        kiln.launch("no_such_family", [0], {"n": 1})
    fields = {"rows": 4, "d": 32, "x_row_stride": 64, "out_row_stride": 32, "activation": 0}
    with pytest.raises(kiln.InvalidArgumentError, match=r"missing \['activation', 'out_row_stride', 'x_row_stride'\]"):
        kiln.launch("act_and_mul", [0, 0], {"rows": 4, "d": 32})
    with pytest.raises(kiln.InvalidArgumentError, match=r"unknown \['cols'\]"):
        kiln.launch("act_and_mul", [0, 0], dict(fields, cols=3))
    with pytest.raises(kiln.InvalidArgumentError, match="is an integer"):
        kiln.launch("act_and_mul", [0, 0], dict(fields, rows=2.5))
    host = np.zeros(256, np.float32)
    # Host memory is a DeviceError: nothing is launched.
    with pytest.raises(kiln.DeviceError):
        kiln.launch("act_and_mul", [host.ctypes.data, host.ctypes.data], fields)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.launch("act_and_mul", [host.ctypes.data], fields, dtype="f64")


def test_describe_family_lists_problem_fields():
    d = kiln.describe_family("rope")
    assert d["name"] == "rope"
    names = [f["name"] for f in d["fields"]]
    assert names[0] == "tokens" and "q_stride" in names
    by_name = {f["name"]: f for f in d["fields"]}
    assert by_name["tokens"]["bucketed"] and by_name["tokens"]["key"]
    assert not by_name["q_stride"]["key"] and by_name["q_stride"]["type"] == "i64"
    assert sorted(f["slot"] for f in d["fields"]) == list(range(len(names)))
    assert {p["name"] for p in d["params"]} >= {"dtype", "head_dim", "layout", "vec", "block"}
    with pytest.raises(kiln.NotFoundError):
        kiln.describe_family("no_such_family")


def test_declarations_say_which_tensors_take_strided_rows():
    """kiln.ops carries the declarations' strided_rows marks, which kiln.torch follows."""
    marked = {name: {t["name"] for t in decl.tensors if t["strided_rows"]} for name, decl in kiln.ops.OPS.items()}
    assert marked["act_and_mul_backward"] == {"x", "dy", "dx"}
    assert marked["add_rms_norm_backward"] == {"dy", "dh", "h", "dx"}
    assert marked["layer_norm"] == {"x", "out"}
    assert marked["layer_norm_backward"] == {"dy", "x", "dx"}


def test_moe_ops_on_host_arrays(rng):
    """Routing, permute, the grouped GEMM and combine through their CPU fallbacks, against numpy."""
    tokens, experts, hidden, inter, k = 11, 4, 16, 8, 2
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    w, ids = kiln.moe_topk(logits, None, k)
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=1, kind="stable")[:, :k])
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    picked = np.take_along_axis(p, ids.astype(np.int64), 1)
    np.testing.assert_allclose(w, picked / picked.sum(1, keepdims=True), rtol=1e-5)
    x = rng.standard_normal((tokens, hidden)).astype(np.float16)
    xs, offsets, row_of, src_of = kiln.moe_permute(x, ids, experts)
    flat = ids.reshape(-1)
    perm = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(src_of, perm)
    np.testing.assert_array_equal(xs, x[perm // k])
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=experts))]))
    weight = (rng.standard_normal((experts, inter, hidden)) * 0.3).astype(np.float16)
    ends = offsets[1:].copy()
    h = kiln.grouped_gemm(xs, weight, ends)
    for e in range(experts):
        rows = slice(offsets[e], offsets[e + 1])
        np.testing.assert_allclose(h[rows].astype(np.float64), xs[rows].astype(np.float64) @
                                   weight[e].astype(np.float64).T, rtol=2e-3, atol=2e-3)
    dx = kiln.grouped_gemm_dgrad(h, weight, ends)  # weight [experts, inter, hidden] as stored
    for e in range(experts):
        rows = slice(offsets[e], offsets[e + 1])
        np.testing.assert_allclose(dx[rows].astype(np.float64), h[rows].astype(np.float64) @
                                   weight[e].astype(np.float64), rtol=2e-3, atol=2e-3)
    dw = kiln.grouped_gemm_wgrad(h, xs, ends)
    for e in range(experts):
        rows = slice(offsets[e], offsets[e + 1])
        np.testing.assert_allclose(dw[e].astype(np.float64), h[rows].astype(np.float64).T @
                                   xs[rows].astype(np.float64), rtol=2e-3, atol=2e-3)
    back = kiln.moe_combine(xs, row_of, w)
    np.testing.assert_allclose(back.astype(np.float64), x.astype(np.float64) * w.sum(1, keepdims=True),
                               rtol=2e-3, atol=2e-3)
    with pytest.raises(kiln.InvalidArgumentError, match="not an expert"):
        kiln.moe_permute(x, ids + experts, experts)
    with pytest.raises(kiln.InvalidArgumentError, match="offsets"):
        kiln.grouped_gemm(xs, weight, ends[::-1].copy())


@pytest.mark.parametrize("block", [False, True])
def test_grouped_gemm_fp8_on_host_arrays(rng, block):
    """The FP8 grouped GEMM's CPU fallback, rowwise and block-scaled, against the dequantized product."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    experts, rows, n, k = 3, 13, 24, 160
    offs = np.array([5, 5, 11], np.int32)  # expert 1 empty; rows 11 and 12 belong to no expert
    a8 = (rng.standard_normal((rows, k)) * 2).astype(ml_dtypes.float8_e4m3fn)
    w8 = rng.standard_normal((experts, n, k)).astype(ml_dtypes.float8_e4m3fn)
    kb, nb = 2, 1
    sa = (rng.random((rows, kb) if block else rows) + 0.5).astype(np.float32)
    sb = (rng.random((experts, nb, kb) if block else (experts, n)) + 0.5).astype(np.float32)
    out = kiln.grouped_gemm_fp8(a8.view(np.uint8), w8.view(np.uint8), offs, sa, sb, "f16")
    a, w = a8.astype(np.float64), w8.astype(np.float64)
    start = 0
    for e in range(experts):
        rs = slice(start, offs[e])
        if offs[e] == start:
            continue
        if block:
            want = sum((a[rs, q * 128:(q + 1) * 128] * sa[rs, q:q + 1]) @ (w[e][:, q * 128:(q + 1) * 128].T * sb[e, 0, q])
                       for q in range(kb))
        else:
            want = (a[rs] @ w[e].T) * sa[rs, None] * sb[e][None, :]
        np.testing.assert_allclose(out[rs].astype(np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
        start = offs[e]


def _ref_lora(x, w, a, b, scale, bias=None):
    x64 = x.astype(np.float64)
    out = x64 @ w.astype(np.float64).T + scale * (x64 @ a.astype(np.float64).T) @ b.astype(np.float64).T
    return out if bias is None else out + bias.astype(np.float64)


@pytest.mark.parametrize("rank", [1, 8, 64, 128])
def test_lora_linear_on_host_arrays(rng, rank):
    """lora_linear's CPU fallback (the two kernels' references) against numpy in fp64: k and n
    not multiples of any tile, with and without a bias, and scale 0 giving the base GEMM."""
    m, n, k = 7, 72, 136
    x = rng.standard_normal((m, k)).astype(np.float16)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    a = (rng.standard_normal((rank, k)) / np.sqrt(k)).astype(np.float16)
    b = (rng.standard_normal((n, rank)) / np.sqrt(rank)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    out = kiln.lora_linear(x, w, a, b, bias, 2.0)
    assert out.shape == (m, n) and out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), _ref_lora(x, w, a, b, 2.0, bias), rtol=5e-3, atol=5e-3)
    base = kiln.lora_linear(x, w, a, b, None, 0.0)
    np.testing.assert_allclose(base.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64).T, rtol=2e-3,
                               atol=2e-3)


def test_lora_linear_multi_on_host_arrays(rng):
    """Three adapters of ranks 8, 16 and 4 (stack rank 16) over merged-QKV slices, rows in any
    order, some with index -1 (the base GEMM alone)."""
    m, k, r, adapters = 9, 64, 16, 3
    ends = (40, 56)
    n = 72
    x = rng.standard_normal((m, k)).astype(np.float16)
    w = (rng.standard_normal((n, k)) / 8).astype(np.float16)
    a = (rng.standard_normal((adapters, 3 * r, k)) / 8).astype(np.float16)
    b = (rng.standard_normal((adapters, n, r)) / 4).astype(np.float16)
    idx = np.array([2, -1, 0, 1, 1, -1, 0, 2, 2], dtype=np.int32)
    ranks = np.array([8, 16, 4], dtype=np.int32)
    scales = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    out = kiln.lora_linear_multi(x, w, a, b, idx, ranks, scales, None, ends[0], ends[1])
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bounds = [0, ends[0], ends[1], n]
    for i in range(m):
        e = idx[i]
        if e < 0:
            continue
        for s in range(3):
            cols = slice(bounds[s], bounds[s + 1])
            rows = slice(s * r, s * r + ranks[e])
            t = x[i].astype(np.float64) @ a[e, rows].astype(np.float64).T
            want[i, cols] += scales[e] * b[e, cols, :ranks[e]].astype(np.float64) @ t
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=5e-3, atol=5e-3)
    with pytest.raises(kiln.ShapeMismatchError, match="indices"):
        kiln.lora_linear_multi(x, w, a, b, idx[:4], ranks, scales)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.lora_linear(x.astype(np.float32), w, a[0, :r], b[0])
