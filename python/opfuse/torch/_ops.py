"""opfuse op classes as torch.library custom ops (namespace ``opfuse``).

Every op class with a forward gets ``opfuse::<class>_fwd`` and, with a
backward, ``opfuse::<class>_bwd``. Their arguments are the class's C args
struct flattened field by field (``_C.class_fields``):

    plain tensor         Tensor? <name>
    plain or quantized   Tensor? <name>, <name>_scale_inv, <name>_col_data,
                         <name>_col_scale_inv, <name>_amax, <name>_col_amax
                         (the components) and int[] <name>_meta
                         (dtype, scaling, qdtype, usage, flags, *shape)
    quantizer            int[] <name> (its fields, by value)
    int, enum, ref       int <name>      float: float <name>   bool: bool <name>

plus ``int plan`` (forward: which resolved op the autograd formula belongs
to) or ``int n_grads`` (backward). Both return Tensor[]: the outputs' (forward:
outputs then aux) or the gradients' components in order; quantized components
travel as bytes (uint8), fp32 scales as float32. The fakes are the C fakes
on specs (``_C.class_fake``): nothing is computed, only empty tensors made
from the specs. The impl allocates the same tensors and runs the C impl on
their memory.

What the C resolve step reads from an op (parameters, quantizers of its
recipe state, kwargs) is resolved once per (model, input rank, feature size,
dtype, recipe, requires_grad) outside the graph (``resolve``): the result says,
per field, whether it is the main input, a parameter, one of the forward's
outputs, dy or a constant, and the autograd formula registered on each
forward op builds the backward op's arguments from it. The forward and
backward custom ops of an op are independent calls, so a graph compiler sees
and schedules them separately.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .. import DType, _C, default_context
from ._tensor import _FROM_TORCH, _TORCH_DTYPES

TENSOR, TENSOR_Q, QUANTIZER, INT, FLOAT, BOOL, ENUM, BUNDLE, REF, F32, I32 = range(11)
COMP_SUFFIX = ("", "_scale_inv", "_col_data", "_col_scale_inv", "_amax", "_col_amax")
_RESERVED = {"out", "self", "dtype", "layout", "device", "memory_format", "input", "plan",
             "n_grads", "name"}

MAX_ARGS = 64  # torch's limit per operator schema
_lib = torch.library.Library("opfuse", "FRAGMENT")
_lock = threading.Lock()
_CLASS_OPS: dict = {}
_PLANS: list = []


def _arg_name(name: str) -> str:
    return name + "_" if name in _RESERVED else name


def _schema_args(fields) -> list:
    args = []
    for name, kind, _ in fields:
        n = _arg_name(name)
        if kind == TENSOR:
            args.append(f"Tensor? {n}")
        elif kind == TENSOR_Q:
            args += [f"Tensor? {n}{s}" for s in COMP_SUFFIX] + [f"int[] {n}_meta"]
        elif kind == QUANTIZER:
            args.append(f"int[] {n}")
        elif kind in (FLOAT, F32):
            args.append(f"float {n}")
        elif kind == BOOL:
            args.append(f"bool {n}")
        else:
            args.append(f"int {n}")
    return args


def _nargs(kind: int) -> int:
    return 7 if kind == TENSOR_Q else 1


# ---- tensors to and from C values ---------------------------------------------------------

def _check_cpu(t: torch.Tensor, what: str):
    if t.device.type != "cpu":
        raise _C.UnsupportedError(f"{what}: tensor on {t.device}; this build takes CPU tensors")
    if not t.is_contiguous():
        raise _C.InvalidArgError(f"{what}: tensor is not contiguous")


def _ptr(t: Optional[torch.Tensor], fake: bool):
    if t is None or fake:
        return (0, 0)
    return (t.data_ptr(), t.numel() * t.element_size())


def _plain_value(t: torch.Tensor, what: str, fake: bool):
    _check_cpu(t, what)
    dt = _FROM_TORCH.get(t.dtype)
    if dt is None:
        raise _C.DtypeError(f"{what}: torch dtype {t.dtype} has no opfuse dtype")
    ptrs = None if fake else (_ptr(t, False),) + ((0, 0),) * 5
    # int(): under fake tensors with symbolic sizes the C fake needs numbers
    return (tuple(int(d) for d in t.shape), int(dt), 0, 0, 0, 0, ptrs)


def _quant_value(comps, meta, what: str, fake: bool):
    dtype, scaling, qdtype, usage, flags = meta[:5]
    if scaling == 0:
        if comps[0] is None:
            return None
        return _plain_value(comps[0], what, fake)
    for c in comps:
        if c is not None:
            _check_cpu(c, what)
    ptrs = None if fake else tuple(_ptr(c, False) for c in comps)
    return (tuple(meta[5:]), dtype, scaling, qdtype, usage, flags, ptrs)


def _values(fields, args, fake: bool) -> list:
    """The C values of the flattened torch arguments."""
    vals, i = [], 0
    for name, kind, _ in fields:
        if kind == TENSOR:
            t = args[i]
            vals.append(None if t is None else _plain_value(t, name, fake))
        elif kind == TENSOR_Q:
            vals.append(_quant_value(args[i:i + 6], list(args[i + 6]), name, fake))
        elif kind == QUANTIZER:
            vals.append(tuple(args[i]))
        else:
            vals.append(args[i])
        i += _nargs(kind)
    return vals


def _alloc(entry) -> list:
    """Tensors for one output entry of a fake: (spec, components)."""
    (shape, dtype, scaling, *_), comps = entry
    if scaling == 0:
        return [torch.empty(shape, dtype=_TORCH_DTYPES[DType(dtype)])]
    out = []
    for c, (present, cdt, rows, cols, nbytes) in enumerate(comps):
        if not present:
            continue
        if cdt == DType.F32:
            out.append(torch.zeros(rows, cols, dtype=torch.float32))
        else:  # bytes; scales zeroed, as their padding must be
            make = torch.empty if c in (0, 2) else torch.zeros
            out.append(make(rows, nbytes // max(rows, 1), dtype=torch.uint8))
    return out


def _c_out(entry, tensors) -> Optional[tuple]:
    if entry is None or entry == "pass":
        return None
    (shape, dtype, scaling, qdtype, usage, flags), comps = entry
    it = iter(tensors)
    ptrs = tuple(_ptr(next(it), False) if p[0] else (0, 0) for p in comps)
    return (shape, dtype, scaling, qdtype, usage, flags, ptrs)


def _run(cls: str, bwd: bool, fields, args, n_grads: int, fake: bool) -> list:
    vals = _values(fields, args, fake)
    specs = _C.class_fake(cls, bwd, vals, n_grads)
    entries = specs if bwd else list(specs[0]) + list(specs[1])
    groups = [[] if e is None or e == "pass" else _alloc(e) for e in entries]
    if not fake:
        _C.class_impl(default_context(), cls, bwd, vals,
                      [_c_out(e, g) for e, g in zip(entries, groups)])
    return [t for g in groups for t in g]


# ---- registration ------------------------------------------------------------------------

class ClassOps:
    """The forward and backward custom ops of one op class."""

    def __init__(self, cls: str):
        self.cls = cls
        self.fwd_fields = _C.class_fields(cls, False)
        try:
            self.bwd_fields = _C.class_fields(cls, True)
        except _C.UnsupportedError:
            self.bwd_fields = None
        for fields in (self.fwd_fields, self.bwd_fields or []):
            if len(_schema_args(fields)) >= MAX_ARGS:
                raise _C.UnsupportedError(f"op class {cls}: {len(_schema_args(fields)) + 1} "
                                          f"arguments, torch takes {MAX_ARGS}: not registered yet")
        self.fwd = self._define("fwd", self.fwd_fields, "int plan")
        self.bwd = self._define("bwd", self.bwd_fields, "int n_grads") if self.bwd_fields else None
        torch.library.register_autograd(f"opfuse::{cls}_fwd", _backward,
                                        setup_context=_setup_context, lib=_lib)

    def _define(self, which: str, fields, extra: str):
        name = f"{self.cls}_{which}"
        args = _schema_args(fields) + [extra]
        _lib.define(f"{name}({', '.join(args)}) -> Tensor[]")
        bwd = which == "bwd"
        cls = self.cls

        def impl(*args):
            return _run(cls, bwd, fields, args[:-1], args[-1] if bwd else 1, False)

        def fake(*args):
            return _run(cls, bwd, fields, args[:-1], args[-1] if bwd else 1, True)

        _lib.impl(name, impl, "CPU")
        torch.library.register_fake(f"opfuse::{name}", fake, lib=_lib)
        return getattr(torch.ops.opfuse, name).default


def class_ops(cls: str) -> ClassOps:
    """The custom ops of op class cls, registered on first use."""
    with _lock:
        ops = _CLASS_OPS.get(cls)
        if ops is None:
            ops = _CLASS_OPS[cls] = ClassOps(cls)
        return ops


def register_all() -> list:
    """Registers every op class with a forward; returns the class names."""
    names = []
    for cls in _C.op_classes():
        try:
            class_ops(cls)
        except _C.UnsupportedError:
            continue
        names.append(cls)
    return names


# ---- resolved plans ---------------------------------------------------------------------

class OpPlan:
    """One resolved op: how to call its forward and backward custom ops."""

    def __init__(self, r: dict, n_params: int):
        self.cls = r["class"]
        self.ops = class_ops(self.cls)
        self.fwd_args, self.x_arg, self.param_arg = self._fwd_template(r["fwd"], n_params)
        entries = list(r["outs"]) + list(r["aux"])
        self.out_index, k = {}, 0   # (slot, component) -> index in the forward's outputs
        for slot, e in enumerate(entries):
            if e is None:
                continue
            comps = [0] if e[0][2] == 0 else [c for c, p in enumerate(e[1]) if p[0]]
            for c in comps:
                self.out_index[(slot, c)] = k
                k += 1
        self.n_aux_base = len(r["outs"])
        self.main = self.out_index[(0, 0)]
        self.bwd = r["bwd"] is not None
        if self.bwd:
            self._bwd_template(*r["bwd"])

    def _fwd_template(self, fields, n_params):
        """Per torch argument: ("x",), ("param", i), ("const", v)."""
        args, x_arg, param_arg = [], None, {}
        for (name, kind, _), e in zip(self.ops.fwd_fields, fields):
            if kind not in (TENSOR, TENSOR_Q):
                args.append(("const", e[1]))
                continue
            srcs = [None] * 6 if e[1] is None else e[2]
            spec = None if e[1] is None else e[1]
            for c in range(6 if kind == TENSOR_Q else 1):
                s = srcs[c]
                if s is None:
                    args.append(("const", None))
                elif s[0] == "x" and s[2] == c == 0:
                    x_arg = len(args) if x_arg is None else x_arg
                    args.append(("x",))
                elif s[0] == "param" and s[2] == c == 0:
                    param_arg.setdefault(s[1], len(args))
                    args.append(("param", s[1]))
                else:
                    raise _C.UnsupportedError(f"{self.cls}: field {name} reads {s[0]} "
                                              f"component {s[2]}: not in the torch path yet")
            if kind == TENSOR_Q:
                args.append(("const", [0, 0, 0, 0, 0] if spec is None
                             else list(spec[1:]) + list(spec[0])))
        return args, x_arg, param_arg

    def _bwd_template(self, fields, grads, n_grads):
        """Backward arguments as ("dy",), ("saved", k), ("const", v); what
        setup_context saves as ("in", arg index) or ("out", output index)."""
        self.saved, self.bwd_args, self.n_grads = [], [], n_grads
        where = {}

        def saved_index(src):
            kind, idx, comp = src
            if kind == "x" and comp == 0:
                key = ("in", self.x_arg)
            elif kind == "param" and comp == 0 and idx in self.param_arg:
                key = ("in", self.param_arg[idx])
            elif kind in ("out", "aux"):
                slot = idx if kind == "out" else self.n_aux_base + idx
                key = ("out", self.out_index[(slot, comp)])
            else:
                raise _C.UnsupportedError(f"{self.cls}: backward reads {kind} {idx}.{comp}: "
                                          "not in the torch path yet")
            if key not in where:
                where[key] = len(self.saved)
                self.saved.append(key)
            return where[key]

        for (name, kind, _), e in zip(self.ops.bwd_fields, fields):
            if kind not in (TENSOR, TENSOR_Q):
                self.bwd_args.append(("const", e[1]))
                continue
            srcs = [None] * 6 if e[1] is None else e[2]
            for c in range(6 if kind == TENSOR_Q else 1):
                s = srcs[c]
                if s is None:
                    self.bwd_args.append(("const", None))
                elif s[0] == "dy" and s[2] == 0 and c == 0:
                    self.bwd_args.append(("dy",))
                else:
                    self.bwd_args.append(("saved", saved_index(s)))
            if kind == TENSOR_Q:
                spec = e[1]
                self.bwd_args.append(("const", [0, 0, 0, 0, 0] if spec is None
                                      else list(spec[1:]) + list(spec[0])))
        # gradient i -> index in the backward's outputs ("pass": dx = dy)
        self.grad_index, k = [], 0
        for g in grads:
            if g is None or g == "pass":
                self.grad_index.append(g)
            else:
                self.grad_index.append(k)
                k += 1 if g[0][2] == 0 else sum(1 for p in g[1] if p[0])


def _setup_context(ctx, inputs, output):
    plan = _PLANS[inputs[-1]]
    ctx.plan = inputs[-1]
    ctx.n_inputs = len(inputs)
    if plan.bwd:
        ctx.save_for_backward(*saved_tensors(inputs[-1], inputs, output))


def _backward(ctx, grads):
    plan = _PLANS[ctx.plan]
    result = [None] * ctx.n_inputs
    if not plan.bwd:
        return tuple(result)
    dy = grads[plan.main]
    if dy is None:
        return tuple(result)
    out = plan.ops.bwd(*bwd_args(ctx.plan, ctx.saved_tensors, dy))
    dx = plan.grad_index[0]
    if plan.x_arg is not None:
        result[plan.x_arg] = dy if dx == "pass" else None if dx is None else out[dx]
    for i, arg in plan.param_arg.items():
        g = plan.grad_index[1 + i]
        result[arg] = None if g is None or g == "pass" else out[g]
    return tuple(result)


def saved_tensors(pid: int, inputs, outputs) -> list:
    """What the autograd formula of plan pid keeps from a forward call."""
    return [inputs[i] if k == "in" else outputs[i] for k, i in _PLANS[pid].saved]


def bwd_args(pid: int, saved, dy) -> list:
    """The backward custom op's arguments (n_grads last)."""
    plan = _PLANS[pid]
    dy = dy.contiguous()
    args = [dy if a[0] == "dy" else saved[a[1]] if a[0] == "saved" else a[1]
            for a in plan.bwd_args]
    return args + [plan.n_grads]


def add_plan(r: dict, n_params: int) -> tuple:
    """Registers a resolved op; returns (plan id, forward template, main output)."""
    plan = OpPlan(r, n_params)
    with _lock:
        _PLANS.append(plan)
        pid = len(_PLANS) - 1
    return pid, plan.cls, tuple(tuple(a) for a in plan.fwd_args), plan.main


def fwd_args(pid: int, template, x, params) -> list:
    """The forward custom op's arguments (plan id last)."""
    args = []
    for a in template:
        if a[0] == "x":
            args.append(x)
        elif a[0] == "param":
            args.append(params[a[1]])
        else:
            args.append(a[1])
    return args + [pid]


def call(pid: int, cls: str, template, main: int, x, params):
    """One op's forward custom op (traceable by Dynamo: only constants)."""
    return getattr(torch.ops.opfuse, cls + "_fwd")(*fwd_args(pid, template, x, params))[main]
