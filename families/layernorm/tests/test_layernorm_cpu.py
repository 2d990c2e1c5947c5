"""LayerNorm from Python on the CPU (CI: no GPU, no torch): kiln.layer_norm and
kiln.layer_norm_backward, which kiln generates from the ops' declarations, against NumPy."""
import numpy as np
import pytest

import kiln

F16_TOL = dict(rtol=2e-3, atol=2e-3)
F32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng():
    return np.random.default_rng()



def ref_layer_norm(x, w, b, eps):
    x64 = x.astype(np.float64)
    mean = x64.mean(-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * w.astype(np.float64)
    return y if b is None else y + b.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_numpy(rng, dtype, bias):
    x = (rng.standard_normal((3, 5, 96)) + 4).astype(dtype)
    w = rng.standard_normal(96).astype(dtype)
    b = rng.standard_normal(96).astype(dtype) if bias else None
    y = kiln.layer_norm(x, w, b, 1e-5)
    assert y.shape == x.shape and y.dtype == x.dtype
    tol = F32_TOL if dtype == np.float32 else F16_TOL
    np.testing.assert_allclose(y.astype(np.float64), ref_layer_norm(x, w, b, 1e-5), **tol)
    mean = np.empty(15, np.float32)
    rstd = np.empty(15, np.float32)
    out = np.empty_like(x)
    assert kiln.layer_norm(x, w, bias=b, out=out, mean=mean, rstd=rstd) is out
    np.testing.assert_allclose(mean, x.astype(np.float64).reshape(15, 96).mean(-1), rtol=1e-5, atol=1e-5)


def test_layer_norm_backward_matches_finite_differences(rng):
    x = rng.standard_normal((4, 24)).astype(np.float32)
    w = rng.standard_normal(24).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    dy = rng.standard_normal((4, 24)).astype(np.float32)
    mean = np.empty(4, np.float32)
    rstd = np.empty(4, np.float32)
    kiln.layer_norm(x, w, b, mean=mean, rstd=rstd)
    dbias = np.empty(24, np.float32)
    dx, dw = kiln.layer_norm_backward(dy, x, w, mean, rstd, dbias=dbias)

    def loss(x_, w_, b_):
        return float((dy.astype(np.float64) * ref_layer_norm(x_, w_, b_, 1e-5)).sum())

    h = 1e-6
    for arr, got in ((x, dx), (w, dw), (b, dbias)):
        a64 = arr.astype(np.float64)
        num = np.empty_like(a64)
        for i in np.ndindex(a64.shape):
            keep = a64[i]
            a64[i] = keep + h
            up = loss(*(a64 if arr is v else v.astype(np.float64) for v in (x, w, b)))
            a64[i] = keep - h
            down = loss(*(a64 if arr is v else v.astype(np.float64) for v in (x, w, b)))
            a64[i] = keep
            num[i] = (up - down) / (2 * h)
        np.testing.assert_allclose(got, num, rtol=1e-3, atol=1e-4)


def test_layer_norm_errors(rng):
    x = rng.standard_normal((2, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(kiln.ShapeMismatchError):
        kiln.layer_norm(x, np.ones(7, np.float32))
    with pytest.raises(kiln.InvalidArgumentError):
        kiln.layer_norm(x, w, None, -1.0)
    with pytest.raises(kiln.UnsupportedDtypeError):
        kiln.layer_norm(x.astype(np.int32), w)
    with pytest.raises(TypeError):
        kiln.layer_norm(x)  # weight is required
    assert kiln.ops.OPS["layer_norm"].backward == "layer_norm_backward"
