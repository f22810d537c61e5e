"""opfuse op classes as torch.library custom ops (namespace ``opfuse``).

Every op class with a forward gets ``opfuse::<class>_fwd`` and, with a
backward, ``opfuse::<class>_bwd``, both

    (Tensor[] tensors, int[] values, SymInt[] shapes) -> Tensor[]

Their arguments are the class's C args struct flattened field by field
(``_C.class_fields``, ``describe(cls)``) and packed into three lists, read
in field order:

    plain tensor         values: present (0/1); tensors: the tensor
    plain or quantized   values: mask (bit c: component c is passed), dtype,
                         scaling, qdtype, usage, flags; tensors: the passed
                         components (data, scale_inv, col_data, col_scale_inv,
                         amax, col_amax); shapes: ndim, dims (quantized only;
                         a plain value is its component 0)
    quantizer            values: its 14 fields (by value)
    float                values: the bits of the double
    int, enum, bool, ref values: one int

and ``values`` ends with NO_PLAN (forward) or n_grads (backward). Lists keep every class under
torch's 64-argument limit (grouped_linear has hundreds of fields) and make a
call cheap for the dispatcher; absent tensors take no slot. Both return the
outputs' (forward: outputs then aux) or the gradients' components in order;
quantized components travel as bytes (uint8), fp32 scales as float32.

The fakes are the C fakes on specs (``ClassCall.fake``): nothing is
computed, only empty tensors made from the specs. The impl is the
``_C.ClassCall`` itself: one C call that reads the torch arguments,
allocates the same tensors and runs the C impl on their memory.

Every op runs on the device of its tensors: the CPU, or a GPU through that
GPU's default CUDA context, whose work goes on torch's current stream (the
impl hands it to the context on each call); a fake's outputs are on its
inputs' device.

Models reach these ops through _program: the graph opf_compile traces
for a call (forward and backward plans with their fused ops) replayed node
by node, differentiated as a whole by one torch.autograd.Function. The
forward and backward custom ops of an op are independent calls, so a graph
compiler sees and schedules them separately.
"""
from __future__ import annotations

import struct
import threading

import torch

from .. import DType, _C, default_context
from ._tensor import _FROM_TORCH, _TORCH_DTYPES

def _stream_of(index: int) -> int:
    """torch's current CUDA stream of GPU index (0: the default stream)."""
    return torch.cuda.current_stream(index).cuda_stream


_C.torch_setup(torch.empty, torch.zeros, default_context,
               {t: int(d) for t, d in _FROM_TORCH.items()},
               {int(d): t for d, t in _TORCH_DTYPES.items()},
               getattr(torch._C, "_cuda_getCurrentRawStream", _stream_of))
_BACKENDS = ("CPU", "CUDA")  # the dispatch keys the impls are registered for

TENSOR, TENSOR_Q, QUANTIZER, INT, FLOAT, BOOL, ENUM, BUNDLE, REF, F32, I32 = range(11)
N_COMP = 6
SCHEMA = "(Tensor[] tensors, int[] values, SymInt[] shapes) -> Tensor[]"

_lib = torch.library.Library("opfuse", "FRAGMENT")
_lock = threading.Lock()
_CLASS_OPS: dict = {}

NO_PLAN = 0  # the forward's last value: a reserved slot (a plan id once)


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def describe(cls: str, bwd: bool = False) -> list:
    """The flattened fields of a class's forward (or backward) as
    (name, kind): the order in which the packed lists are read."""
    names = ("tensor", "tensor_or_quantized", "quantizer", "int", "float", "bool", "enum",
             "bundle", "ref", "float", "int")
    return [(name, names[kind]) for name, kind, _ in _C.class_fields(cls, bwd)]


# ---- fakes -------------------------------------------------------------------------------

def _same(a, b) -> bool:
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and \
        a.node.expr == b.node.expr


def _int(d, rows, value) -> int:
    """d for the C fake: value where d is the row count, a number otherwise
    (a symbolic size's hint: component sizes, which the C fake never reads)."""
    if isinstance(d, torch.SymInt):
        return value if _same(d, rows) else d.node.hint or 0
    return int(d)


def _device(tensors) -> torch.device:
    """The device of a call: its first GPU tensor's, else the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _concrete(tensors, values, shapes, rows, value):
    for t in tensors:
        if t.device.type not in ("cpu", "cuda"):
            raise _C.UnsupportedError(f"tensor on {t.device}: opfuse takes CPU and CUDA tensors")
    ts = []
    for t in tensors:
        dt = _FROM_TORCH.get(t.dtype)
        if dt is None:
            raise _C.DtypeError(f"torch dtype {t.dtype} has no opfuse dtype")
        ts.append((tuple(_int(d, rows, value) for d in t.shape), int(dt)))
    return ts, [int(v) for v in values], [_int(s, rows, value) for s in shapes]


def _round_up(x, a):
    return (x + a - 1) // a * a


def _ceil_div(x, a):
    return (x + a - 1) // a


# The component shapes of each quantized format as functions of the 2D view
# [m, k] (rows, cols), for symbolic m: opf_spec_layout's table
# (docs/numerics.md 4.2) again, because the C layout takes numbers only.
# _lifted checks it against the C layout on the hint at every use.
_LAYOUTS = {
    1: lambda m, k: ((m, k), (1, 1), (k, m), (1, 1), (1, 1), None),
    2: lambda m, k: ((m, k), (_round_up(m, 128), _round_up(k // 32, 4)), (m, k),
                     (_round_up(m // 32, 4), _round_up(k, 128)), None, None),
    3: lambda m, k: ((m, k), (_ceil_div(k, 128), _round_up(m, 4)), (k, m),
                     (_ceil_div(m, 128), _round_up(k, 4)), None, None),
    4: lambda m, k: ((m, k), (_ceil_div(m, 128), _round_up(_ceil_div(k, 128), 4)), (k, m),
                     (_ceil_div(k, 128), _round_up(_ceil_div(m, 128), 4)), None, None),
    5: lambda m, k: ((m, k), (_round_up(m, 128), _round_up(k // 16, 4)), (k, m),
                     (_round_up(k, 128), _round_up(m // 16, 4)), (1, 1), (1, 1)),
}
_LAYOUTS[6] = _LAYOUTS[5]


def _present(spec) -> list:
    """The components a quantized spec has, as in _LAYOUTS."""
    scaling, usage = spec[2], spec[4]
    comps = ([0, 1] if usage & 1 else []) + ([2, 3] if usage & 2 else [])
    return comps + {1: [4], 5: [4, 5], 6: [4, 5]}.get(scaling, [])


def _tensor_shapes(spec) -> list:
    """The torch shapes of a quantized spec's components (as ClassCall
    allocates them: 2D, fp4 data two to a byte), for a possibly symbolic
    shape."""
    shape, _, scaling, qdtype = spec[:4]
    m = 1
    for d in shape[:-1]:
        m = m * d
    comps = _LAYOUTS[scaling](m, shape[-1])
    fp4 = qdtype == int(DType.E2M1)
    return [(comps[c][0], comps[c][1] // 2 if fp4 and c in (0, 2) else comps[c][1])
            for c in _present(spec)]


def _lifted(a, b, rows, h1, h2):
    """The torch shapes of one output from the C fake run at two row
    counts (h1, h2): dims that follow the rows become the symbolic rows;
    None when a dim changes otherwise."""
    (spec_a, allocs), (spec_b, _) = a, b
    dims = []
    for x, y in zip(spec_a[0], spec_b[0]):
        if x != y and (x, y) != (h1, h2):
            return None
        dims.append(x if x == y else rows)
    if spec_a[2] == 0:
        return [dims]
    if _tensor_shapes(spec_a) != [tuple(al[0]) for al in allocs]:
        raise _C.UnsupportedError(f"the symbolic layout of {spec_a} disagrees with the C one")
    return _tensor_shapes((tuple(dims),) + tuple(spec_a[1:]))


def _empty(shape, dt, zero, device):
    return (torch.zeros if zero else torch.empty)(shape, dtype=_TORCH_DTYPES[DType(dt)],
                                                  device=device)


def _fake(call, tensors, values, shapes) -> list:
    """The outputs of one call as empty tensors, from the C fake's specs
    (the tensors ClassCall allocates for the real call). Under dynamic
    shapes the C fake runs at two row counts and the dims that follow the
    rows come out symbolic; a dim that follows them otherwise pins the rows
    (a guard: the graph is specialized to this size)."""
    rows, dev = shapes[-1], _device(tensors)
    if isinstance(rows, torch.SymInt) and rows.node.has_hint():
        h1 = rows.node.hint
        h2 = h1 + 256  # as divisible as h1 by every block size of every format
        a = call.fake(*_concrete(tensors, values, shapes, rows, h1))
        b = call.fake(*_concrete(tensors, values, shapes, rows, h2))
        lifted = [_lifted(x, y, rows, h1, h2) for x, y in zip(a, b)]
        if all(shp is not None for shp in lifted):
            return [_empty(shp, dt, zero, _on(out[0], dev)) for out, shps in zip(a, lifted)
                    for shp, (_, dt, zero) in zip(shps, out[1])]
        rows = int(rows)
    outs = call.fake(*_concrete(tensors, values, shapes, None, 0))
    return [_empty(shape, dt, zero, _on(spec, dev)) for spec, allocs in outs
            for shape, dt, zero in allocs]


SPEC_HOST = 8  # OPF_SPEC_HOST: an output the op reads on the host stays there


def _on(spec, dev):
    """The device of an output of spec in a call on dev."""
    return torch.device("cpu") if spec[5] & SPEC_HOST else dev


# ---- registration ------------------------------------------------------------------------

class ClassOps:
    """The forward and backward custom ops of one op class."""

    def __init__(self, cls: str):
        self.cls = cls
        self.fwd_fields, self.bwd_fields = _fields(cls, False), _fields(cls, True)
        if not self.fwd_fields and not self.bwd_fields:
            raise _C.UnsupportedError(f"op class \"{cls}\" has neither forward nor backward")
        self.calls = {}
        self.fwd = self._define("fwd") if self.fwd_fields is not None else None
        self.bwd = self._define("bwd") if self.bwd_fields is not None else None
        if self.fwd is not None:  # a backward-only class has no forward to differentiate
            torch.library.register_autograd(f"opfuse::{cls}_fwd", _backward,
                                            setup_context=_setup_context, lib=_lib)
            _fast_autograd(self.fwd, self.calls["fwd"])

    def _define(self, which: str):
        name = f"{self.cls}_{which}"
        _lib.define(name + SCHEMA)
        call = _C.ClassCall(self.cls, which == "bwd")
        self.calls[which] = call
        # the real call is one C call: no Python between the dispatcher and C
        for key in _BACKENDS:
            _lib.impl(name, call, key)
        torch.library.register_fake(f"opfuse::{name}",
                                    lambda t, v, s: _fake(call, t, v, s), lib=_lib)
        return getattr(torch.ops.opfuse, name).default


def _fields(cls: str, bwd: bool):
    """A class's flattened forward or backward fields; None when it has none."""
    try:
        return _C.class_fields(cls, bwd)
    except _C.UnsupportedError:
        return None


def _fast_autograd(op, call):
    """Puts a FastAutograd in front of the autograd kernel register_autograd
    made (torch builds the same kernel again here: the fallback)."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
        fallback = make_autograd_impl(op, Info(_backward, _setup_context))
    except (ImportError, TypeError):  # another torch: its own kernel alone
        return
    for key in _BACKENDS:
        backend = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        _lib.impl(op._schema.name.split("::")[1], _C.FastAutograd(
            call, fallback, backend, torch._C._after_autograd_keyset, torch.is_grad_enabled),
            "Autograd" + key, with_keyset=True)


def class_ops(cls: str) -> ClassOps:
    """The custom ops of op class cls, registered on first use."""
    with _lock:
        ops = _CLASS_OPS.get(cls)
        if ops is None:
            ops = _CLASS_OPS[cls] = ClassOps(cls)
        return ops


def register_all() -> list:
    """Registers every op class (forward, backward or both); returns the
    class names."""
    names = []
    for cls in _C.op_classes():
        try:
            class_ops(cls)
        except _C.UnsupportedError:
            continue
        names.append(cls)
    return names


# ---- delayed scaling ------------------------------------------------------------------------
# The update of the ops' delayed-scaling state that the eager fuser runs
# after a forward that records for backward and after the backward: an
# ordered (effectful) op, so a compiled graph neither drops nor moves it; it
# takes a tensor the update must follow (the last forward output, or a
# gradient of the last backward op).
_lib.define("delayed_update(Tensor after, int[] ops, bool backward) -> ()")


def device_context(device: torch.device):
    """The thread's default context of a torch device, its work on torch's
    current stream (a GPU's)."""
    ctx = default_context(device.type, device.index)
    _C.torch_follow(ctx)
    return ctx


def _delayed_update(after, ops, backward):
    _C.delayed_update(device_context(after.device), ops, backward)


for _key in _BACKENDS:
    _lib.impl("delayed_update", _delayed_update, _key)
torch.library.register_fake("opfuse::delayed_update", lambda after, ops, backward: None, lib=_lib)
torch.library._register_effectful_op(torch.ops.opfuse.delayed_update.default,
                                     torch._library.effects.EffectType.ORDERED, lib=_lib)


def delayed_update(after: torch.Tensor, ops, backward: bool):
    if ops:
        torch.ops.opfuse.delayed_update(after, list(ops), backward)


# ---- resolved plans ---------------------------------------------------------------------

def _value_ints(kind: int, v) -> list:
    if v is None or kind == QUANTIZER and None in v:
        raise _C.UnsupportedError("a value field follows the row count")
    if kind == QUANTIZER:
        return [int(f) for f in v]
    if kind in (FLOAT, F32):
        return [_float_bits(v)]
    return [int(v)]


RUNTIME = 4          # OPF_FIELD_RUNTIME
FROM_TENSOR = -(1 << 62)  # a runtime field's value slot: read from the next tensor


def _runtime_key(runtime, name):
    """runtime's key for field name: the kwarg's own name, or a fused op's
    field of it (prefixed with its op's: "lin_is_first_microbatch")."""
    for n, key in (runtime or {}).items():
        if name == n or name.endswith("_" + n):
            return key
    return None


class _Packer:
    """Builds the three packed lists of one call from a resolved field list:
    tensors as what src(field, component, source, index in tensors) returns,
    values as constants, shapes as constants or None (the row count).
    runtime maps the names of runtime fields whose value is a tensor (a graph
    input, so no recompile per value) to that tensor's key."""

    def __init__(self, fields, entries, src, runtime=None):
        self.tensors, self.values, self.shapes = [], [], []
        for (name, kind, flags), e in zip(fields, entries):
            key = _runtime_key(runtime, name) if flags & RUNTIME else None
            if key is not None:
                self.values.append(FROM_TENSOR)
                self.tensors.append(key)
            elif kind not in (TENSOR, TENSOR_Q):
                self.values += _value_ints(kind, e[1])
            elif e[0] == "v":  # absent
                self.values += [0] if kind == TENSOR else [0] * 6
            elif kind == TENSOR or e[1][2] == 0:  # plain
                k = src(name, 0, e[2][0], len(self.tensors))
                self.tensors.append(k + (e[1][0], e[1][1]) if k == ("e",) else k)
                self.values += [1] if kind == TENSOR else [1, e[1][1], 0, 0, 0, 0]
            else:
                spec, srcs = e[1], e[2]
                mask = sum(1 << c for c in range(N_COMP) if srcs[c] is not None)
                self.values += [mask] + list(spec[1:])
                self.shapes += [len(spec[0])] + list(spec[0])
                for c in range(N_COMP):
                    if srcs[c] is not None:
                        self.tensors.append(src(name, c, srcs[c], len(self.tensors)))


def _setup_context(ctx, inputs, output):
    ctx.n_tensors = len(inputs[0])
    # torch matches the gradients' structure to the inputs': an empty list
    # is a list, a list of ints a leaf
    ctx.no_shapes = [] if len(inputs[2]) == 0 else None


def _backward(ctx, grads):
    """A forward op called on its own carries no gradient: opfuse.torch
    differentiates a whole traced graph (its backward nodes are the
    backward ops, _program), because a backward plan may fuse ops that the
    forward plan split."""
    return [None] * ctx.n_tensors, None, ctx.no_shapes
