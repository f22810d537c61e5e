"""The opfuse package's C extension against NumPy / ml_dtypes: DLPack
exchange, exceptions per status, contexts, specs, recipes, quantize /
dequantize bit for bit with a reference written here, and the GEMM."""
import ml_dtypes
import numpy as np
import pytest

import opfuse
from opfuse import DType, Scaling, Usage

f32, u8, u32 = np.float32, np.uint8, np.uint32
rng = np.random.default_rng(7)


def randn(*shape, dtype=f32):
    return (rng.standard_normal(shape) * 3).astype(dtype)


# ---- reference numerics (docs/numerics.md sections 1-3) -------------------------------------
def e4m3(x):
    """fp32 -> e4m3 bytes: RNE, saturating."""
    x = np.clip(np.asarray(x, f32), -448, 448)
    return x.astype(ml_dtypes.float8_e4m3fn).view(u8)


def current_scaling_ref(x):
    amax = f32(np.max(np.abs(x)))
    s = f32(f32(448.0) / amax)
    return e4m3((x * s).astype(f32)), f32(f32(1) / s), amax


def e8m0_up(t):
    """Smallest power of two >= t as a biased exponent byte (1.4)."""
    bits = np.asarray(t, f32).view(u32)
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (m != 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))
    return np.where(t == 0, 0, e + up).astype(u8)


def mxfp8_rowwise_ref(x):
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.max(np.abs(blocks), axis=2).astype(f32)
    t = (amax * np.array(0x3B124925, u32).view(f32)).astype(f32)
    e = e8m0_up(t)
    mult = ((254 - e.astype(u32)) << 23).view(f32)
    q = e4m3((blocks * mult[:, :, None]).astype(f32)).reshape(m, k)
    return q, e


# ---- DLPack exchange -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [f32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, u8])
def test_dlpack_roundtrip_zero_copy(dtype):
    x = randn(4, 6).astype(dtype)
    t = opfuse.as_tensor(x)
    assert tuple(t.spec["shape"]) == (4, 6)
    y = opfuse.to_numpy(t)
    assert y.dtype == x.dtype and np.array_equal(y.view(u8), x.view(u8))
    assert t.data_ptr() == x.ctypes.data  # the same memory, no copy
    y[0, 0] = 1
    assert x[0, 0] == 1


def test_dlpack_fp8_and_reinterpret():
    x = randn(8, 8).astype(ml_dtypes.float8_e4m3fn)
    t = opfuse.as_tensor(x)
    assert t.spec["dtype"] == DType.E4M3
    assert opfuse.to_numpy(t).dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    t2 = opfuse.as_tensor(x.view(u8), dtype=DType.E4M3)
    assert t2.spec["dtype"] == DType.E4M3


def test_dlpack_rejects_bad_input():
    with pytest.raises(opfuse.InvalidArgError, match="contiguous"):
        opfuse.as_tensor(randn(4, 6)[:, ::2])
    with pytest.raises(opfuse.DtypeError):
        opfuse.as_tensor(np.zeros(3, np.float64))
    with pytest.raises(opfuse.DtypeError):
        opfuse._C.from_dlpack(np.zeros(3, f32), int(DType.BF16))


def test_library_buffer_outlives_python_handles():
    q = opfuse.quantize(randn(32, 64), opfuse.Quantizer.mxfp8())
    data = q.data
    del q
    assert data.shape == (32, 64) and np.isfinite(data.astype(f32)).all()


# ---- errors and contexts ---------------------------------------------------------------------
def test_exception_classes_per_status():
    for name, builtin, status in [("InvalidArgError", ValueError, 1), ("ShapeError", ValueError, 2),
                                  ("DtypeError", TypeError, 3),
                                  ("UnsupportedError", NotImplementedError, 4),
                                  ("NoMemoryError", MemoryError, 5), ("IOError", OSError, 7),
                                  ("CorruptError", ValueError, 8), ("StateError", RuntimeError, 9)]:
        cls = getattr(opfuse, name)
        assert issubclass(cls, opfuse.Error) and issubclass(cls, builtin)
        assert cls.status == status and opfuse._C.status_str(status).startswith("OPF_ERR")


def test_shape_error_carries_the_c_message():
    with pytest.raises(opfuse.ShapeError) as e:
        opfuse.quantize(randn(30, 64), opfuse.Quantizer.mxfp8())
    assert "30" in str(e.value) and e.value.status == 2


def test_closed_context_raises_state_error():
    ctx = opfuse.Context(seed=3)
    assert ctx.get_rng() == (3, 0)
    q = opfuse.quantize(randn(32, 32), opfuse.Quantizer.current(), ctx=ctx)
    ctx.close()
    assert ctx.closed
    with pytest.raises(opfuse.StateError, match="closed"):
        opfuse.quantize(randn(32, 32), opfuse.Quantizer.current(), ctx=ctx)
    assert q.data.shape == (32, 32)  # results made before stay valid
    with opfuse.Context() as c2:
        assert not c2.closed
    assert c2.closed


def test_alloc_stats_count_library_buffers():
    ctx = opfuse.Context()
    before = ctx.alloc_stats()["n_alloc"]
    opfuse.quantize(randn(32, 32), opfuse.Quantizer.current(), ctx=ctx)
    assert ctx.alloc_stats()["n_alloc"] > before


# ---- specs and recipes -----------------------------------------------------------------------
def test_spec_layout_and_str():
    s = opfuse.Spec((256, 1024), DType.BF16, Scaling.MXFP8, DType.E4M3, Usage.BOTH)
    L = s.layout()
    assert (L["m"], L["k"]) == (256, 1024)
    assert L["components"][opfuse.COMP_SCALE_INV][1:3] == (256, 32)
    assert "mxfp8" in str(s)
    with pytest.raises(opfuse.ShapeError):
        opfuse.Spec((250, 1024), DType.BF16, Scaling.MXFP8, DType.E4M3).layout()


def test_recipes_mirror_c_defaults_and_validate():
    q = opfuse.Recipe.mxfp8().quantizer("linear", opfuse.Role.INPUT)
    assert q.scaling == Scaling.MXFP8 and q.qdtype == DType.E4M3
    q = opfuse.Recipe.nvfp4().quantizer("linear", opfuse.Role.WEIGHT)
    assert q.scaling == Scaling.NVFP4_2D
    with pytest.raises(opfuse.InvalidArgError):
        opfuse.Recipe.delayed(amax_history_len=0).validate()
    assert opfuse.Recipe.current(power_2_scales=True).validate().power_2_scales


def test_delayed_recipe_state_views():
    rs = opfuse.RecipeState(opfuse.Recipe.delayed(amax_history_len=4), "linear", "fc1")
    q = rs.quantizer(opfuse.Role.INPUT)
    assert q.state is rs and q.scaling == Scaling.TENSOR
    scale, hist = rs.scale_history()
    assert hist.shape == (4, 3) and np.all(scale == 1)
    x = randn(16, 32)
    opfuse.quantize(x, q)
    assert hist[0, q.slot] == np.max(np.abs(x))  # the amax went into the history
    rs.update()
    assert scale[q.slot] == f32(448) / np.max(np.abs(x))


def test_delayed_recipe_rejects_nonfinite_amax_on_request():
    rs = opfuse.RecipeState(opfuse.Recipe.delayed(amax_history_len=4, reject_nonfinite_amax=True),
                            "linear", "fc1")
    q = rs.quantizer(opfuse.Role.INPUT)
    scale, hist = rs.scale_history()
    x = randn(16, 32)
    opfuse.quantize(x, q)
    rs.update()
    before = scale[q.slot]
    x[3, 5] = np.inf
    opfuse.quantize(x, q)
    rs.update()  # the infinite amax stays out of the history; the scale holds
    assert np.all(np.isfinite(hist)) and scale[q.slot] == before


# ---- quantize / dequantize ----------------------------------------------------------------------
def test_current_scaling_bit_exact():
    x = randn(64, 128)
    q = opfuse.quantize(x, opfuse.Quantizer.current())
    data, sinv, amax = current_scaling_ref(x)
    assert np.array_equal(q.data.view(u8), data)
    assert q.scale_inv.view(u32)[0, 0] == np.array(sinv).view(u32)
    assert q.amax[0, 0] == amax
    # the columnwise copy of per-tensor FP8 is the transpose
    assert np.array_equal(q.columnwise_data.view(u8), data.T)


def test_mxfp8_bit_exact_and_dequantize():
    x = randn(64, 128)
    q = opfuse.quantize(x, opfuse.Quantizer.mxfp8(usage=Usage.ROWWISE))
    data, e = mxfp8_rowwise_ref(x)
    assert np.array_equal(q.data.view(u8), data)
    assert np.array_equal(q.scale_inv.view(u8)[:64, :4], e)
    assert q.columnwise_data is None
    deq = q.dequantize()
    ref = (data.view(ml_dtypes.float8_e4m3fn).astype(f32).reshape(64, 4, 32) *
           (e.astype(u32) << 23).view(f32)[:, :, None]).reshape(64, 128)
    assert np.array_equal(deq, ref)


@pytest.mark.parametrize("make", [
    lambda: opfuse.Quantizer.block(), lambda: opfuse.Quantizer.block(two_d=True),
    lambda: opfuse.Quantizer.nvfp4(), lambda: opfuse.Quantizer.nvfp4(two_d=True)])
def test_other_formats_round_trip_closely(make):
    x = randn(128, 256)
    q = opfuse.quantize(x, make())
    y = q.dequantize()
    tol = 0.5 if q.spec.qdtype == DType.E2M1 else 0.07
    assert np.max(np.abs(y - x)) <= tol * np.max(np.abs(x))


def test_bf16_input_and_output():
    x = randn(32, 64).astype(ml_dtypes.bfloat16)
    q = opfuse.quantize(x, opfuse.Quantizer.current())
    y = q.dequantize(dtype=DType.BF16)
    assert y.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.allclose(y.astype(f32), x.astype(f32), rtol=0.07, atol=1e-2)


def test_update_usage_and_requantize():
    x = randn(64, 64)
    q = opfuse.quantize(x, opfuse.Quantizer.current(usage=Usage.ROWWISE))
    q.update_usage(Usage.BOTH)
    assert np.array_equal(q.columnwise_data.view(u8), q.data.view(u8).T)
    q2 = opfuse.requantize(q, opfuse.Quantizer.mxfp8())
    assert q2.spec.scaling == Scaling.MXFP8
    m = opfuse.quantize(x, opfuse.Quantizer.mxfp8(usage=Usage.ROWWISE))
    with pytest.raises(opfuse.UnsupportedError):
        m.update_usage(Usage.BOTH)
    assert m.columnwise_data is None  # unchanged on error


# ---- GEMM ------------------------------------------------------------------------------------
def test_gemm_plain_layouts():
    a, b = randn(48, 32), randn(16, 32)   # TN: D = B A^T, A [N,K], B [M,K]
    d = opfuse.gemm(a, b, opfuse.GemmLayout.TN)
    assert np.allclose(d, b @ a.T, rtol=1e-5, atol=1e-4)
    d = opfuse.gemm(a.T.copy(), b, opfuse.GemmLayout.NN)
    assert np.allclose(d, b @ a.T, rtol=1e-5, atol=1e-4)
    bias = randn(48)
    d = opfuse.gemm(a, b, bias=bias)
    assert np.allclose(d, b @ a.T + bias, rtol=1e-5, atol=1e-4)


def test_gemm_quantized_equals_dequantized_product():
    a, b = randn(64, 128), randn(32, 128)
    qa = opfuse.quantize(a, opfuse.Quantizer.current())
    qb = opfuse.quantize(b, opfuse.Quantizer.current())
    d = opfuse.gemm(qa, qb)
    ref = qb.dequantize().astype(np.float64) @ qa.dequantize().astype(np.float64).T
    assert np.allclose(d, ref, rtol=1e-5, atol=1e-3)


def test_gemm_shape_mismatch_changes_nothing():
    out = np.full((16, 48), 7, f32)
    with pytest.raises(opfuse.ShapeError):
        opfuse.gemm(randn(48, 31), randn(16, 32), out=out)
    assert np.all(out == 7)
