"""opfuse.torch: opfuse ops as PyTorch modules.

The eager path runs a whole opfuse.torch.Sequential as one call into C per
forward and per backward (one torch.autograd.Function), so the fuser picks
its forward and backward fusions independently, and the module's parameters
are torch Parameters sharing memory with the C parameters.

    model = opfuse.torch.Sequential(
        opfuse.torch.LayerNorm(1024), opfuse.torch.Linear(1024, 4096),
        opfuse.torch.GELU(), opfuse.torch.Linear(4096, 1024))
    with opfuse.torch.autocast(recipe=opfuse.Recipe.mxfp8()):
        loss = model(x).square().sum()
    loss.backward()
"""
from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from typing import Optional

import torch

import opfuse

from .. import DType, Recipe, Seq, _C, default_context
from . import _ops, _tensor
from ._tensor import component, to_opf, to_torch

__all__ = ["Sequential", "Linear", "LayerNorm", "RMSNorm", "GELU", "ReLU", "SiLU", "SwiGLU",
           "Bias", "BasicLinear", "autocast", "to_opf", "to_torch", "component"]

_state = threading.local()


@contextlib.contextmanager
def autocast(recipe: Optional[Recipe] = None, enabled: bool = True):
    """Quantize every opfuse module called inside with recipe."""
    prev = getattr(_state, "recipe", None), getattr(_state, "recipe_id", 0)
    _state.recipe = recipe if enabled else None
    # the id is what a compiled forward reads (and guards on): an int
    _state.recipe_id = _recipe_id(_state.recipe)
    try:
        yield
    finally:
        _state.recipe, _state.recipe_id = prev


def current_recipe() -> Optional[Recipe]:
    return getattr(_state, "recipe", None)


_DTYPES = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16}


class OpSpec:
    """One basic op of a Sequential: class name, config, name."""

    def __init__(self, class_name: str, config=None, name=None):
        self.class_name, self.config, self.name = class_name, config, name


class _Module(torch.nn.Module):
    """A layer that contributes basic ops to a Sequential. Alone, it runs as
    a Sequential of itself."""

    def op_specs(self) -> list:
        raise NotImplementedError

    def forward(self, x):
        if not hasattr(self, "_alone"):
            object.__setattr__(self, "_alone", Sequential(self))
        return self._alone(x)


def _dt(dtype) -> int:
    return int(_DTYPES[dtype if dtype is not None else torch.float32])


class BasicLinear(_Module):
    def __init__(self, in_features, out_features, dtype=None, name=None):
        super().__init__()
        self.cfg = {"in_features": in_features, "out_features": out_features, "dtype": _dt(dtype)}
        self.name = name

    def op_specs(self):
        return [OpSpec("basic_linear", self.cfg, self.name)]


class Bias(_Module):
    def __init__(self, size, dtype=None, name=None):
        super().__init__()
        self.cfg, self.name = {"size": size, "dtype": _dt(dtype)}, name

    def op_specs(self):
        return [OpSpec("bias", self.cfg, self.name)]


class Linear(_Module):
    """y = x W^T + b as basic_linear (+ bias)."""

    def __init__(self, in_features, out_features, bias=True, dtype=None, name=None):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.dt, self.name = _dt(dtype), name

    def op_specs(self):
        specs = [OpSpec("basic_linear", {"in_features": self.in_features,
                                         "out_features": self.out_features, "dtype": self.dt},
                        self.name)]
        if self.has_bias:
            specs.append(OpSpec("bias", {"size": self.out_features, "dtype": self.dt},
                                None if self.name is None else self.name + "_bias"))
        return specs


class _Norm(_Module):
    kind = ""

    def __init__(self, hidden, eps=1e-5, zero_centered_gamma=False, dtype=None, name=None):
        super().__init__()
        self.cfg = {"hidden": hidden, "eps": eps, "zero_centered_gamma": zero_centered_gamma,
                    "dtype": _dt(dtype)}
        self.name = name

    def op_specs(self):
        return [OpSpec(self.kind, self.cfg, self.name)]


class LayerNorm(_Norm):
    kind = "layernorm"


class RMSNorm(_Norm):
    kind = "rmsnorm"


def _activation(kind):
    class Act(_Module):
        def __init__(self, name=None):
            super().__init__()
            self.name = name

        def op_specs(self):
            return [OpSpec(kind, None, self.name)]
    Act.__name__ = Act.__qualname__ = kind.upper() if len(kind) <= 4 else kind.capitalize()
    return Act


GELU, ReLU, SiLU, SwiGLU = (_activation(k) for k in ("gelu", "relu", "silu", "swiglu"))


_MODELS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_RECIPES: list = [None]
_PLAN_CACHE: dict = {}
_FROM_TORCH_DT = {t: int(d) for t, d in _tensor._FROM_TORCH.items()}


def _register_model(m) -> int:
    key = len(_PLAN_CACHE) + len(_MODELS) + 1
    while key in _MODELS:
        key += 1
    _MODELS[key] = m
    return key


def _recipe_id(recipe) -> int:
    """A small integer per distinct recipe value (0: none), so that the
    resolve step's key is made of constants."""
    if recipe is None:
        return 0
    try:
        return _RECIPES.index(recipe)
    except ValueError:
        _RECIPES.append(recipe)
        return len(_RECIPES) - 1


# Row counts the resolve step runs at: two, so that what follows the rows
# shows (and becomes the symbolic row count in the graph); multiples of
# every block size of every format.
_PROBES = (128, 256)


@torch._dynamo.assume_constant_result
def _resolved(key, recipe_id, needs_grad, dtype, k, rows=-1):
    """The per-op plans of model `key` for inputs [rows, k] (resolved once
    per key; rows -1: any row count, or None when some op's fields follow
    the rows in a way the templates cannot carry). Dynamo calls this at
    trace time and bakes the result, a tuple of constants."""
    key_ = (key, recipe_id, needs_grad, dtype, k, rows)
    if key_ not in _PLAN_CACHE:
        _PLAN_CACHE[key_] = _MODELS[key]._resolve(recipe_id, needs_grad, dtype, k, rows)
    return _PLAN_CACHE[key_]


def _merge_rows(a, b):
    """a and b (the same resolve at the two probes) as one, with None
    where the value is the row count; ValueError where they differ
    otherwise."""
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise ValueError
        return type(a)(_merge_rows(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        # output layouts (component rows and cols) are not arguments: the fakes lift them
        r = {k: v if k in ("outs", "aux", "bwd") else _merge_rows(v, b[k]) for k, v in a.items()}
        if a.get("bwd") is not None:
            r["bwd"] = (_merge_rows(a["bwd"][0], b["bwd"][0]),) + tuple(a["bwd"][1:])
        return r
    if a == b:
        return a
    if (a, b) == _PROBES and not isinstance(a, bool):
        return None
    raise ValueError


class _SeqFunction(torch.autograd.Function):
    """One C forward and one C backward for a whole Sequential."""

    @staticmethod
    def forward(ctx, seq_module, needs_grad, x, *params):
        seq = seq_module._seq
        recipe = current_recipe()
        ctx.seq_module = seq_module
        ctx.x_requires_grad = x.requires_grad
        y, _ = seq._s.forward(to_opf(x.contiguous()), recipe, needs_grad, x.requires_grad)
        return to_torch(y)

    @staticmethod
    def backward(ctx, dy):
        m = ctx.seq_module
        m._seq.zero_grad()
        dx, _ = m._seq._s.backward(to_opf(dy.contiguous()))
        grads = [g.clone() for g in m._c_grads]
        return (None, None, None if dx is None or not ctx.x_requires_grad else to_torch(dx), *grads)


class Sequential(torch.nn.Module):
    """opfuse modules run by the C fuser: one call into C per forward and
    per backward; parameters share memory with the C side."""

    def __init__(self, *modules, ctx=None, custom_ops=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(modules)
        self._seq = Seq(ctx=ctx if ctx is not None else default_context())
        for m in modules:
            for spec in m.op_specs():
                from .. import Op
                self._seq.append(Op(spec.class_name, spec.config, spec.name, ctx=self._seq.ctx))
        self._c_grads = []
        plist = []
        for i in range(len(self._seq)):
            h = self._seq[i]._h
            for j in range(h.info()["num_params"]):
                p = h.param(j)
                param = torch.nn.Parameter(to_torch(p["value"]))
                self.register_parameter(f"op{i}_{p['name']}", param)
                plist.append(param)
                self._c_grads.append(to_torch(p["grad"]))
        self._plist = plist
        self.custom_ops = custom_ops
        self._key = _register_model(self)

    def forward(self, x):
        # Grad mode is off inside Function.forward: decide here.
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or
                                                  any(p.requires_grad for p in self._plist))
        if self.custom_ops or torch.compiler.is_compiling():
            return self._forward_ops(x, needs_grad)
        return _SeqFunction.apply(self, needs_grad, x, *self._plist)

    def _forward_ops(self, x, needs_grad):
        """One forward custom op per basic op, each with its autograd
        formula: what torch.compile sees. The ops run on the 2D view
        [rows, features]; the plans hold for any row count where they can,
        so a dynamic batch size stays symbolic."""
        rid = getattr(_state, "recipe_id", 0)
        dt = _FROM_TORCH_DT.get(x.dtype, -1)
        if x.dim() == 0:
            raise opfuse.ShapeError("opfuse.torch.Sequential: input has no dims")
        # operator.index: Dynamo pins a symbolic size it converts so (a guard)
        shape, k = x.shape, operator.index(x.shape[-1])
        x = x.reshape(-1, k)
        r = _resolved(self._key, rid, bool(needs_grad), dt, k)
        if r is None:  # pinned to this row count (a guard under torch.compile)
            r = _resolved(self._key, rid, bool(needs_grad), dt, k, operator.index(x.shape[0]))
        plans, delayed = r
        for pid, cls, template, main, first in plans:
            x = _ops.call(cls, template, main, x, self._plist[first:])
        if needs_grad:
            _ops.delayed_update(x, delayed, False)
        return x.reshape(*shape[:-1], x.shape[-1])

    def _resolve_at(self, recipe_id, needs_grad, dtype, k, rows):
        ops = [self._seq[i]._h for i in range(len(self._seq))]
        return _C.resolve(self._seq.ctx, ops, ((rows, k), dtype, 0, 0, 0, 0),
                          _RECIPES[recipe_id], needs_grad, None), ops

    def _resolve(self, recipe_id, needs_grad, dtype, k, rows):
        if rows >= 0:
            res, ops = self._resolve_at(recipe_id, needs_grad, dtype, k, rows)
        else:
            res, ops = self._resolve_at(recipe_id, needs_grad, dtype, k, _PROBES[0])
            try:
                res = _merge_rows(res, self._resolve_at(recipe_id, needs_grad, dtype, k,
                                                        _PROBES[1])[0])
            except ValueError:
                return None
        out, first = [], 0
        try:
            for r, op in zip(res, ops):
                n = op.info()["num_params"]
                out.append(_ops.add_plan(r, n) + (first,))
                first += n
        except opfuse.UnsupportedError:
            if rows >= 0:
                raise
            return None
        delayed = tuple(_C.delayed_ops(ops))
        with_bwd = [p[0] for p, r in zip(out, res) if r["bwd"] is not None]
        if delayed and with_bwd:  # the first op's backward is the step's last
            _ops.set_bwd_update(with_bwd[0], delayed)
        return tuple(out), delayed

    def plans(self):
        return self._seq.plans()
