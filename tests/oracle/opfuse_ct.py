"""opfuse_ct: ctypes bindings of the C library for the oracle tests.

Mirrors the public structs of include/opfuse/*.h exactly; the library path
comes from the OPF_LIB environment variable (ctest sets it) or build/.
"""
import ctypes as C
import os
import pathlib

import numpy as np

_here = pathlib.Path(__file__).resolve().parent
_default = _here.parent.parent / "build" / "libopfuse.so"
lib = C.CDLL(os.environ.get("OPF_LIB", str(_default)))

# ---- enums (keep in step with the headers) ----------------------------------
F32, F16, BF16, E4M3, E5M2, E2M1, E8M0, I32, I64, U8 = range(10)
DEV_CPU = 0
SCALING_NONE, SCALING_TENSOR, SCALING_MXFP8, SCALING_BLOCK_1D, SCALING_BLOCK_2D, \
    SCALING_NVFP4_1D, SCALING_NVFP4_2D = range(7)
ROWWISE, COLUMNWISE = 1, 2
SPEC_SWIZZLED, SPEC_MXFP8_2D, SPEC_NVFP4_RHT = 1, 2, 4
COMP_DATA, COMP_SCALE_INV, COMP_COL_DATA, COMP_COL_SCALE_INV, COMP_AMAX, COMP_COL_AMAX = range(6)
RECIPE_NONE, RECIPE_DELAYED, RECIPE_CURRENT, RECIPE_BLOCK, RECIPE_MXFP8, RECIPE_NVFP4, \
    RECIPE_CUSTOM = range(7)
FORMAT_E4M3, FORMAT_E5M2, FORMAT_HYBRID, FORMAT_E2M1 = range(4)
AMAX_MAX, AMAX_MOST_RECENT = range(2)
OK = 0
MAX_DIMS = 8


class Spec(C.Structure):
    _fields_ = [("ndim", C.c_int), ("shape", C.c_int64 * MAX_DIMS), ("dtype", C.c_int),
                ("device", C.c_int), ("scaling", C.c_int), ("qdtype", C.c_int),
                ("usage", C.c_uint), ("flags", C.c_uint)]


class CompDesc(C.Structure):
    _fields_ = [("present", C.c_bool), ("dtype", C.c_int), ("rows", C.c_int64),
                ("cols", C.c_int64), ("nbytes", C.c_size_t), ("offset", C.c_size_t)]


class Layout(C.Structure):
    _fields_ = [("m", C.c_int64), ("k", C.c_int64), ("comp", CompDesc * 6),
                ("total_bytes", C.c_size_t)]


class Tensor(C.Structure):
    _fields_ = [("spec", Spec), ("data", C.c_void_p * 6), ("buf", C.c_void_p)]


class Allocator(C.Structure):
    _fields_ = [("alloc", C.c_void_p), ("free", C.c_void_p), ("user", C.c_void_p)]


class CtxOptions(C.Structure):
    _fields_ = [("device", C.c_int), ("device_index", C.c_int), ("deterministic", C.c_bool),
                ("seed", C.c_uint64), ("offset", C.c_uint64), ("num_threads", C.c_int),
                ("allocator", Allocator), ("warn", C.c_void_p), ("warn_user", C.c_void_p)]


class Quantizer(C.Structure):
    _fields_ = [("scaling", C.c_int), ("qdtype", C.c_int), ("usage", C.c_uint),
                ("swizzled", C.c_bool), ("pow2_scales", C.c_bool), ("amax_epsilon", C.c_float),
                ("mxfp8_2d", C.c_bool), ("rht", C.c_bool), ("rht_sign_mask", C.c_uint16),
                ("stochastic", C.c_bool), ("delayed", C.c_void_p), ("slot", C.c_int),
                ("amax_reduce", C.c_void_p), ("amax_reduce_user", C.c_void_p)]


def _sig(name, res, *args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = list(args)
    return f


_sig("opf_status_str", C.c_char_p, C.c_int)
_sig("opf_last_error", C.c_char_p, C.c_void_p)
_sig("opf_ctx_options_default", CtxOptions)
_sig("opf_ctx_create", C.c_int, C.POINTER(CtxOptions), C.POINTER(C.c_void_p))
_sig("opf_ctx_destroy", None, C.c_void_p)
_sig("opf_ctx_set_rng", None, C.c_void_p, C.c_uint64, C.c_uint64)
_sig("opf_ctx_get_rng", None, C.c_void_p, C.POINTER(C.c_uint64), C.POINTER(C.c_uint64))
_sig("opf_spec_layout", C.c_int, C.POINTER(Spec), C.POINTER(Layout))
_sig("opf_tensor_alloc", C.c_int, C.c_void_p, C.POINTER(Spec), C.POINTER(Tensor))
_sig("opf_tensor_wrap", C.c_int, C.POINTER(Spec), C.c_void_p, C.POINTER(Tensor))
_sig("opf_tensor_release", None, C.POINTER(Tensor))
_sig("opf_quantizer_default", Quantizer)
_sig("opf_quantizer_spec", C.c_int, C.POINTER(Quantizer), C.POINTER(Spec), C.POINTER(Spec))
_sig("opf_quantize", C.c_int, C.c_void_p, C.POINTER(Quantizer), C.POINTER(Tensor),
     C.POINTER(Tensor))
_sig("opf_dequantize", C.c_int, C.c_void_p, C.POINTER(Tensor), C.c_uint, C.POINTER(Tensor))
_sig("opf_delayed_state_create", C.c_int, C.c_void_p, C.c_int, C.c_float, C.c_int, C.c_int,
     C.c_bool, C.c_int, C.POINTER(C.c_void_p))
_sig("opf_delayed_state_destroy", None, C.c_void_p)
_sig("opf_delayed_state_scale", C.POINTER(C.c_float), C.c_void_p)
_sig("opf_delayed_state_history", C.POINTER(C.c_float), C.c_void_p)
_sig("opf_delayed_state_update", C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p)

_NP = {F32: np.float32, F16: np.uint16, BF16: np.uint16, E4M3: np.uint8, E5M2: np.uint8,
       E2M1: np.uint8, E8M0: np.uint8, I32: np.int32, I64: np.int64, U8: np.uint8}


class OpfError(RuntimeError):
    pass


class Ctx:
    """A context; `with Ctx(seed=1) as ctx:` destroys it on exit."""

    def __init__(self, seed=0, offset=0, num_threads=0):
        o = lib.opf_ctx_options_default()
        o.seed, o.offset, o.num_threads = seed, offset, num_threads
        h = C.c_void_p()
        check(None, lib.opf_ctx_create(C.byref(o), C.byref(h)))
        self.h = h

    def close(self):
        if self.h:
            lib.opf_ctx_destroy(self.h)
            self.h = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def error(self):
        return lib.opf_last_error(self.h).decode()


def check(ctx, st):
    if st != OK:
        msg = lib.opf_last_error(ctx.h if ctx else None).decode()
        raise OpfError(f"{lib.opf_status_str(st).decode()}: {msg}")


def spec(shape, dtype=F32):
    s = Spec()
    s.ndim = len(shape)
    for i, d in enumerate(shape):
        s.shape[i] = d
    s.dtype = dtype
    return s


def layout(s):
    L = Layout()
    check(None, lib.opf_spec_layout(C.byref(s), C.byref(L)))
    return L


def wrap(arr, dtype):
    """A plain tensor over a C-contiguous numpy array (kept alive by the caller).
    bf16/f16 arrays are passed as their uint16 bit patterns."""
    assert arr.flags["C_CONTIGUOUS"]
    t = Tensor()
    check(None, lib.opf_tensor_wrap(C.byref(spec(arr.shape, dtype)), arr.ctypes.data, C.byref(t)))
    return t


def component(t, comp, L=None):
    """Copy of one component of a tensor as a 2D numpy array (rows x cols in
    elements; e2m1 data comes back as packed bytes rows x cols/2)."""
    L = L or layout(t.spec)
    d = L.comp[comp]
    if not d.present or not t.data[comp]:
        return None
    nbytes = d.nbytes
    raw = np.frombuffer((C.c_uint8 * nbytes).from_address(t.data[comp]), dtype=np.uint8).copy()
    if d.dtype == E2M1:
        return raw.reshape(d.rows, d.cols // 2)
    return raw.view(_NP[d.dtype]).reshape(d.rows, d.cols)


def quantize(ctx, q, x, dtype=F32):
    """Quantizes numpy array x (dtype given as an opf dtype) with quantizer q;
    returns (tensor, layout). Release with lib.opf_tensor_release."""
    xt = wrap(x, dtype)
    qs = Spec()
    check(ctx, lib.opf_quantizer_spec(C.byref(q), C.byref(xt.spec), C.byref(qs)))
    out = Tensor()
    check(ctx, lib.opf_tensor_alloc(ctx.h, C.byref(qs), C.byref(out)))
    st = lib.opf_quantize(ctx.h, C.byref(q), C.byref(xt), C.byref(out))
    if st != OK:
        lib.opf_tensor_release(C.byref(out))
        check(ctx, st)
    return out, layout(out.spec)


def dequantize(ctx, t, which, dtype=F32):
    shape = tuple(t.spec.shape[i] for i in range(t.spec.ndim))
    y = np.empty(shape, dtype=_NP[dtype])
    yt = wrap(y, dtype)
    check(ctx, lib.opf_dequantize(ctx.h, C.byref(t), which, C.byref(yt)))
    return y
