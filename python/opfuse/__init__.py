"""opfuse: low-precision fusible transformer ops (a C library), from Python.

The extension ``opfuse._C`` is written in C over the library's public API.
Tensors cross in both directions through DLPack without copies: NumPy arrays
(bfloat16 and the float8 types of ml_dtypes included) and torch tensors go
in, and results come back as NumPy (or torch) views of library buffers.

    import numpy as np, opfuse
    x = np.random.randn(64, 128).astype(np.float32)
    q = opfuse.quantize(x, opfuse.Quantizer.mxfp8())
    q.data, q.scale_inv                # e4m3 data, e8m0 scales: views
    y = q.dequantize()                 # float32 numpy array

A context lives on the CPU or on a GPU (``Context(device="cuda", index=0)``,
``default_context("cuda")``): a CUDA context's work is queued on its own
stream, or on the caller's after ``ctx.set_stream(stream.cuda_stream)``.
Device tensors cross as DLPack kDLCUDA tensors (torch, CuPy); NumPy views
are for host memory only.

Errors from the C library raise one exception class per status
(``ShapeError``, ``DtypeError``, ...; all ``opfuse.Error``) with its message.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import types
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

from . import _C
from ._C import (Context, CorruptError, DeviceError, DtypeError, Error, InvalidArgError, IOError,
                 NoMemoryError, ShapeError, StateError, UnsupportedError)

__all__ = [
    "Context", "Error", "InvalidArgError", "ShapeError", "DtypeError", "UnsupportedError",
    "NoMemoryError", "DeviceError", "IOError", "CorruptError", "StateError", "DType", "Scaling",
    "Usage", "RecipeKind", "Format", "Role", "GemmLayout", "OptimKind", "Spec", "Recipe",
    "Quantizer", "QuantizedTensor", "RecipeState", "quantize", "dequantize", "requantize", "gemm",
    "Op", "Seq", "Optim", "Compiled", "default_context", "as_tensor", "to_numpy",
]


# ---- enums (the C enums' values) --------------------------------------------------------
class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    E4M3 = 3
    E5M2 = 4
    E2M1 = 5
    E8M0 = 6
    I32 = 7
    I64 = 8
    U8 = 9


class Scaling(enum.IntEnum):
    NONE = 0
    TENSOR = 1
    MXFP8 = 2
    BLOCK_1D = 3
    BLOCK_2D = 4
    NVFP4_1D = 5
    NVFP4_2D = 6


class Usage(enum.IntFlag):
    ROWWISE = 1
    COLUMNWISE = 2
    BOTH = 3


class RecipeKind(enum.IntEnum):
    NONE = 0
    DELAYED = 1
    CURRENT = 2
    BLOCK = 3
    MXFP8 = 4
    NVFP4 = 5
    CUSTOM = 6


class Format(enum.IntEnum):
    E4M3 = 0
    E5M2 = 1
    HYBRID = 2
    E2M1 = 3


class Role(enum.IntEnum):
    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2
    GRAD_OUTPUT = 3
    GRAD_INPUT = 4


class GemmLayout(enum.IntEnum):
    TN = 0
    NN = 1
    NT = 2


class OptimKind(enum.IntEnum):
    SGD = 0
    ADAMW = 1


# Component indices of a tensor's storage (opf_component).
COMP_DATA, COMP_SCALE_INV, COMP_COL_DATA, COMP_COL_SCALE_INV, COMP_AMAX, COMP_COL_AMAX = range(6)

_NP_DTYPES = {
    DType.F32: np.dtype(np.float32), DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16), DType.E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.E5M2: np.dtype(ml_dtypes.float8_e5m2), DType.E2M1: np.dtype(np.uint8),  # packed pairs
    DType.E8M0: np.dtype(ml_dtypes.float8_e8m0fnu), DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64), DType.U8: np.dtype(np.uint8),
}
_FROM_NP = {v: k for k, v in _NP_DTYPES.items() if k not in (DType.E2M1,)}
_FROM_NP[np.dtype(np.uint8)] = DType.U8
_FROM_NP[np.dtype(np.bool_)] = DType.U8


# ---- values ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """A data-free tensor description (opf_spec)."""
    shape: tuple
    dtype: DType = DType.F32
    scaling: Scaling = Scaling.NONE
    qdtype: DType = DType.E4M3
    usage: int = Usage.ROWWISE
    flags: int = 0

    @staticmethod
    def from_dict(d: dict) -> "Spec":
        return Spec(tuple(d["shape"]), DType(d["dtype"]), Scaling(d["scaling"]), DType(d["qdtype"]),
                    int(d["usage"]), int(d["flags"]))

    def layout(self) -> dict:
        """Components with (dtype, rows, cols, nbytes, offset), padding included."""
        return _C.spec_layout(self)

    def __str__(self) -> str:
        return _C.spec_str(self)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A quantization recipe (opf_recipe). None fields keep the C defaults."""
    kind: RecipeKind = RecipeKind.NONE
    format: Optional[Format] = None
    margin: Optional[float] = None
    amax_history_len: Optional[int] = None
    amax_algo: Optional[int] = None
    reduce_amax: Optional[bool] = None
    power_2_scales: Optional[bool] = None
    amax_epsilon: Optional[float] = None
    x_block_dim: Optional[int] = None
    w_block_dim: Optional[int] = None
    grad_block_dim: Optional[int] = None
    mxfp8_2d_weights: Optional[bool] = None
    nvfp4_rht: Optional[bool] = None
    nvfp4_stochastic: Optional[bool] = None
    nvfp4_2d_weights: Optional[bool] = None
    backward_override: Optional[int] = None
    reject_nonfinite_amax: Optional[bool] = None

    @classmethod
    def delayed(cls, **kw): return cls(RecipeKind.DELAYED, **kw)

    @classmethod
    def current(cls, **kw): return cls(RecipeKind.CURRENT, **kw)

    @classmethod
    def block(cls, **kw): return cls(RecipeKind.BLOCK, **kw)

    @classmethod
    def mxfp8(cls, **kw): return cls(RecipeKind.MXFP8, **kw)

    @classmethod
    def nvfp4(cls, **kw): return cls(RecipeKind.NVFP4, **kw)

    def validate(self) -> "Recipe":
        _C.recipe_validate(self)
        return self

    def quantizer(self, module_type: str, role: Role, name: Optional[str] = None) -> "Quantizer":
        """The built-in rule of this recipe for one tensor role."""
        return Quantizer(**_C.recipe_quantizer(self, module_type, int(role), name))


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """How to quantize one tensor (opf_quantizer), a plain value. Delayed
    scaling quantizers also name their RecipeState (state, backward, slot)."""
    scaling: Scaling = Scaling.NONE
    qdtype: DType = DType.E4M3
    usage: int = Usage.ROWWISE
    swizzled: bool = False
    pow2_scales: bool = False
    amax_epsilon: float = 0.0
    mxfp8_2d: bool = False
    rht: bool = False
    rht_sign_mask: int = 0xD7E8
    stochastic: bool = False
    state: Any = dataclasses.field(default=None, compare=False, hash=False)
    backward: bool = False
    slot: int = 0

    @classmethod
    def current(cls, qdtype=DType.E4M3, usage=Usage.BOTH, **kw):
        return cls(Scaling.TENSOR, qdtype, usage, **kw)

    @classmethod
    def mxfp8(cls, qdtype=DType.E4M3, usage=Usage.BOTH, **kw):
        return cls(Scaling.MXFP8, qdtype, usage, **kw)

    @classmethod
    def block(cls, two_d=False, qdtype=DType.E4M3, usage=Usage.BOTH, **kw):
        return cls(Scaling.BLOCK_2D if two_d else Scaling.BLOCK_1D, qdtype, usage, **kw)

    @classmethod
    def nvfp4(cls, two_d=False, usage=Usage.BOTH, **kw):
        return cls(Scaling.NVFP4_2D if two_d else Scaling.NVFP4_1D, DType.E2M1, usage, **kw)

    def spec(self, spec: Spec) -> Spec:
        return Spec.from_dict(_C.quantizer_spec(self, spec))


# ---- contexts --------------------------------------------------------------------------
_tls = threading.local()


def _device_key(device="cpu", index=None) -> tuple:
    """("cpu", 0) or ("cuda", N) of a device name ("cpu", "cuda", "cuda:N", a
    torch.device) and an index (which "cuda:N" overrides)."""
    kind, _, n = str(device).partition(":")
    if kind == "cpu":
        return "cpu", 0
    if kind != "cuda":
        raise InvalidArgError(f"device \"{device}\" is not \"cpu\", \"cuda\" or \"cuda:N\"")
    return "cuda", int(n) if n else int(index or 0)


def default_context(device="cpu", index=None) -> Context:
    """This thread's default context of a device (one per thread of use and
    device, as in C): the CPU's, or GPU index's for device "cuda" ("cuda:N")."""
    key = _device_key(device, index)
    ctxs = getattr(_tls, "ctxs", None)
    if ctxs is None:
        ctxs = _tls.ctxs = {}
    ctx = ctxs.get(key)
    if ctx is None or ctx.closed:
        ctx = ctxs[key] = Context(device=key[0], index=key[1])
    return ctx


def _ctx(ctx):
    return default_context() if ctx is None else ctx


# ---- tensor exchange ---------------------------------------------------------------------
def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def as_tensor(x, dtype: Optional[DType] = None, ctx: Optional[Context] = None) -> "_C.Tensor":
    """A plain opfuse tensor over x's memory (no copy): a NumPy array, a torch
    tensor (CPU or CUDA), an opfuse QuantizedTensor or _C.Tensor. x must be
    contiguous. With ctx, a CUDA tensor must be on the context's GPU."""
    if isinstance(x, _C.Tensor):
        return x
    if isinstance(x, QuantizedTensor):
        return x._t
    if _is_torch(x):
        from .torch import _tensor as tt
        return tt.to_opf(x, dtype, ctx)
    x = np.asarray(x)
    if not x.flags.c_contiguous:
        raise InvalidArgError("array is not C-contiguous: pass np.ascontiguousarray(x)")
    dt = _FROM_NP.get(x.dtype) if dtype is None else DType(dtype)
    if dt is None:
        raise DtypeError(f"numpy dtype {x.dtype} has no opfuse dtype")
    if x.dtype.itemsize == 0 or x.dtype.kind not in "fiub" or x.dtype.type in _ML_TYPES:
        x = x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return _C.from_dlpack(x, int(dt))


_ML_TYPES = {ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
             ml_dtypes.float8_e8m0fnu}


def _np_component(t: "_C.Tensor", comp: int) -> Optional[np.ndarray]:
    view = t.component(comp, raw=True)
    if view is None:
        return None
    if view.__dlpack_device__()[0] != 1:
        raise UnsupportedError("a device tensor has no NumPy view: take it with "
                               "torch.from_dlpack (opfuse.torch.component / to_torch)")
    a = np.from_dlpack(view)
    spec = t.spec
    if spec["scaling"] == Scaling.NONE:
        dt = DType(spec["dtype"])
    else:
        dt = DType(t_layout(t)[comp][0])
    return a.view(_NP_DTYPES[dt])


def t_layout(t: "_C.Tensor"):
    return _C.spec_layout(types.SimpleNamespace(**t.spec))["components"]


def to_numpy(t) -> np.ndarray:
    """A NumPy view (no copy) of a plain opfuse tensor."""
    if isinstance(t, np.ndarray):
        return t
    return _np_component(as_tensor(t), COMP_DATA)


class QuantizedTensor:
    """A quantized tensor: the storage of opf_tensor_alloc for a quantized spec.
    data, scale_inv, columnwise_data, columnwise_scale_inv, amax and
    columnwise_amax are NumPy views of its components (None when absent)."""

    def __init__(self, t: "_C.Tensor", ctx: Context):
        self._t = t
        self._ctx = ctx

    @property
    def spec(self) -> Spec:
        return Spec.from_dict(self._t.spec)

    @property
    def shape(self) -> tuple:
        return self.spec.shape

    def component(self, comp: int) -> Optional[np.ndarray]:
        return _np_component(self._t, comp)

    data = property(lambda s: s.component(COMP_DATA))
    scale_inv = property(lambda s: s.component(COMP_SCALE_INV))
    columnwise_data = property(lambda s: s.component(COMP_COL_DATA))
    columnwise_scale_inv = property(lambda s: s.component(COMP_COL_SCALE_INV))
    amax = property(lambda s: s.component(COMP_AMAX))
    columnwise_amax = property(lambda s: s.component(COMP_COL_AMAX))

    def dequantize(self, which: int = Usage.ROWWISE, dtype: DType = DType.F32) -> np.ndarray:
        return dequantize(self, which, dtype, ctx=self._ctx)

    def update_usage(self, usage: int) -> "QuantizedTensor":
        _C.update_usage(self._ctx, self._t, int(usage))
        return self

    def swizzle(self, swizzled: bool = True) -> "QuantizedTensor":
        _C.swizzle(self._ctx, self._t, swizzled)
        return self

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.spec})"


def _wrap_result(t: "_C.Tensor", ctx):
    if t.spec["scaling"] != Scaling.NONE:
        return QuantizedTensor(t, ctx)
    return to_numpy(t)


class RecipeState(_C.RecipeState):
    """The quantizers of one module under a recipe (opf_recipe_state); delayed
    scaling keeps its scales and amax histories here."""

    def __init__(self, recipe: Recipe, module_type: str, name=None, num_gemms=1, ctx=None):
        super().__init__(_ctx(ctx), recipe, module_type, name, num_gemms)

    def quantizer(self, role: Role, gemm: int = 0) -> Quantizer:
        return Quantizer(**super().quantizer(int(role), gemm))

    def scale_history(self, backward: bool = False):
        r = self.delayed(backward)
        return None if r is None else tuple(np.from_dlpack(v) for v in r)


# ---- quantization and GEMM ------------------------------------------------------------------
def quantize(x, quantizer: Quantizer, ctx: Optional[Context] = None) -> QuantizedTensor:
    """Quantizes a plain f32/bf16/f16 tensor (NumPy, torch) with quantizer."""
    ctx = _ctx(ctx)
    return QuantizedTensor(_C.quantize(ctx, quantizer, as_tensor(x, ctx=ctx)), ctx)


def dequantize(q: QuantizedTensor, which: int = Usage.ROWWISE, dtype: DType = DType.F32,
               ctx: Optional[Context] = None) -> np.ndarray:
    return to_numpy(_C.dequantize(_ctx(ctx), as_tensor(q), int(which), int(dtype)))


def requantize(q: QuantizedTensor, quantizer: Quantizer, ctx=None) -> QuantizedTensor:
    ctx = _ctx(ctx)
    return QuantizedTensor(_C.requantize(ctx, quantizer, as_tensor(q)), ctx)


def gemm(a, b, layout: GemmLayout = GemmLayout.TN, dtype: DType = DType.F32, *, alpha=1.0,
         beta=1.0, accumulate=False, bias=None, out=None, out_quantizer=None, ctx=None):
    """The GEMM of the anchor's layout convention (TN: D = B A^T, NN: B A,
    NT: B^T A) over plain or quantized operands."""
    ctx = _ctx(ctx)
    out_t = None if out is None else as_tensor(out, ctx=ctx)
    d = _C.gemm(ctx, as_tensor(a, ctx=ctx), as_tensor(b, ctx=ctx), int(layout), int(dtype), alpha,
                beta, accumulate, None if bias is None else as_tensor(bias, ctx=ctx), out_t,
                out_quantizer)
    return out if out is not None else _wrap_result(d, ctx)


# ---- ops, seqs, training --------------------------------------------------------------------
@dataclasses.dataclass
class Param:
    name: str
    value: np.ndarray       # shares memory with the C parameter
    grad: Optional[np.ndarray]
    requires_grad: bool


def _config(config):
    if config is None or not isinstance(config, dict):
        return config
    return types.SimpleNamespace(**config)


class Op:
    """One op instance of a registered class (ops.h names: "layernorm",
    "basic_linear", "gelu", ...). config is a dict of the C config fields."""

    def __init__(self, class_name: str, config: Optional[dict] = None, name: Optional[str] = None,
                 ctx: Optional[Context] = None, _handle=None):
        self._h = _handle if _handle is not None else _C.op_create(_ctx(ctx), class_name,
                                                                   _config(config), name)

    @property
    def name(self) -> str:
        return self._h.info()["name"]

    @property
    def class_name(self) -> str:
        return self._h.info()["class_name"]

    def params(self) -> list:
        out = []
        for i in range(self._h.info()["num_params"]):
            p = self._h.param(i)
            out.append(Param(p["name"], to_numpy(p["value"]),
                             None if p["grad"] is None else to_numpy(p["grad"]), p["requires_grad"]))
        return out

    def zero_grad(self):
        self._h.zero_grad()

    def set_extra_input(self, index: int, channel: Optional[str]):
        self._h.set_channel(False, index, channel)

    def set_extra_output(self, index: int, channel: Optional[str], to_caller: bool = False):
        self._h.set_channel(True, index, channel, to_caller)


def _kwargs_list(kwargs):
    if kwargs is None:
        return None
    return [None if k is None else dict(k) for k in kwargs]


class _Runner:
    """forward / backward over self._r (a _C.Seq or _C.Compiled)."""

    def forward(self, x, recipe: Optional[Recipe] = None, requires_grad=True,
                input_requires_grad=True, extra_in=None, kwargs=None):
        """y (and the public extra outputs when there are any) as NumPy views."""
        y, extra = self._r.forward(as_tensor(x), recipe, requires_grad, input_requires_grad,
                                   None if extra_in is None else [as_tensor(e) for e in extra_in],
                                   _kwargs_list(kwargs))
        y = to_numpy(y)
        return (y, [None if e is None else to_numpy(e) for e in extra]) if extra else y

    def backward(self, dy, dextra_out=None):
        """dx (None when not wanted), plus the extra inputs' gradients when any."""
        dx, dextra = self._r.backward(
            as_tensor(dy), None if dextra_out is None else [as_tensor(d) for d in dextra_out])
        dx = None if dx is None else to_numpy(dx)
        return (dx, [None if d is None else to_numpy(d) for d in dextra]) if dextra else dx


class Seq(_Runner):
    """An opf_seq: ops run by the fuser, eagerly forward and backward."""

    def __init__(self, ops: Sequence[Op] = (), ctx: Optional[Context] = None):
        self.ctx = _ctx(ctx)
        self._s = self._r = _C.Seq(self.ctx)
        for op in ops:
            self.append(op)

    def append(self, op: Op) -> "Seq":
        self._s.append(op._h)
        return self

    def append_linear(self, in_features, out_features, bias=True, dtype=DType.F32, name=None):
        self._s.append_linear(in_features, out_features, bias, int(dtype), name)
        return self

    def __len__(self) -> int:
        return self._s.size()

    def __getitem__(self, i: int) -> Op:
        return Op("", _handle=self._s.at(i if i >= 0 else len(self) + i))

    def params(self) -> list:
        return [p for i in range(len(self)) for p in self[i].params()]

    def zero_grad(self):
        self._s.zero_grad()

    def discard(self):
        self._s.discard()

    def set_recompute(self, first: int, count: int):
        """Ops [first, first + count) as a recompute span (opf_seq_set_recompute)."""
        self._s.set_recompute(first, count)

    def clear_recompute(self):
        self._s.clear_recompute()

    def set_fusions(self, enabled: bool):
        self._s.set_fusions(enabled)

    def prepare(self, recipe: Optional[Recipe]):
        self._s.prepare(recipe)

    def plans(self) -> list:
        """[(forward plan, backward plan)] per group: (op, class, first, count)."""
        return self._s.plans()

    def save(self, path: str, optim: Optional["Optim"] = None):
        _C.checkpoint(True, self._s, None if optim is None else optim._o, str(path))

    def load(self, path: str, optim: Optional["Optim"] = None):
        _C.checkpoint(False, self._s, None if optim is None else optim._o, str(path))


class Optim:
    """SGD or AdamW over a seq's parameters with fp32 master weights."""

    def __init__(self, seq: Seq, kind: OptimKind = OptimKind.ADAMW, lr=1e-3, momentum=0.0,
                 beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        self._o = _C.Optim(seq._s, int(kind), lr, momentum, beta1, beta2, eps, weight_decay)

    def step(self):
        self._o.step()

    @property
    def step_count(self) -> int:
        return self._o.step_count


class Compiled(_Runner):
    """A seq compiled into static graphs (opf_compiled): same results as
    eager, no allocation per step. Outputs are views valid until the next
    forward."""

    def __init__(self, seq: Seq, max_leading: int = 0, max_variants: int = 8):
        self.seq = seq
        self._c = self._r = _C.Compiled(seq._s, max_leading, max_variants)

    def stats(self) -> dict:
        return self._c.stats()


def op_classes() -> list:
    """Names of every registered op class."""
    return _C.op_classes()
