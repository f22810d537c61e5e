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

On a GPU: model.cuda() (or .to("cuda:N"), or Sequential(..., device="cuda"))
moves the C-side parameters to that GPU's default CUDA context; calls then
take CUDA tensors of that GPU, and each call queues opfuse's kernels on
torch's current stream, ordered with torch's own work.
"""
from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from typing import Optional

import torch

import opfuse

from .. import DType, Op, Recipe, Seq, _C, _device_key, default_context
from . import _ops, _program, _tensor
from ._fusion import (Fused, FusionOp, register_backward_fusion, register_forward_backward_fusion,
                      register_forward_fusion, unregister_fusion)
from ._tensor import component, to_opf, to_torch

__all__ = ["Sequential", "GroupedLinear", "Linear", "LayerNorm", "RMSNorm", "GELU", "ReLU", "SiLU",
           "SwiGLU", "ScaledSwiGLU", "ScaledSReLU", "Attention", "Dropout", "Quantize", "Bias", "BasicLinear", "AddExtraInput", "MakeExtraOutput",
           "Optimizer", "autocast", "to_opf", "to_torch", "component", "register_forward_fusion",
           "register_backward_fusion", "register_forward_backward_fusion", "unregister_fusion",
           "Fused", "FusionOp"]

_state = threading.local()
# Seq.forward_torch / backward_torch hand their results to torch's DLPack
# importer directly (quantized or raw-byte results: to_torch)
_C.torch_eager_setup(getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack), to_torch)


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
    """One basic op of a Sequential: class name, config, name, and its
    extra inputs' and outputs' channels as (output, index, channel,
    to_caller) (channel None: a public one, passed or returned)."""

    def __init__(self, class_name: str, config=None, name=None, channels=()):
        self.class_name, self.config, self.name = class_name, config, name
        self.channels = channels


class _Module(torch.nn.Module):
    """A layer that contributes basic ops to a Sequential. Alone, it runs as
    a Sequential of itself."""

    def op_specs(self) -> list:
        raise NotImplementedError

    def forward(self, x, *extra_in):
        alone = self.__dict__.get("_alone")
        if alone is None:
            alone = Sequential(self, device=self.__dict__.get("_device", "cpu"))
            object.__setattr__(self, "_alone", alone)
        return alone.forward(x, *extra_in)  # hidden: no hooks of its own to run

    def _apply(self, fn, recurse=True):
        """.to() / .cuda() / .cpu(): alone, this layer runs on that device."""
        dev = _target_device(fn, torch.device(self.__dict__.get("_device", "cpu")), self)
        object.__setattr__(self, "_device", str(dev))
        alone = self.__dict__.get("_alone")
        if alone is not None:
            alone._apply(fn, recurse)
        return self


def _target_device(fn, device, module) -> torch.device:
    """Where a module conversion (Module._apply's fn) takes a float32
    tensor on device; the dtype must stay (a C op's dtype is its config's)."""
    probe = fn(torch.empty(0, device=device))
    if probe.dtype != torch.float32:
        raise opfuse.UnsupportedError(
            f"{type(module).__name__}: parameters keep the dtype their ops were made with (the "
            f"modules' dtype=); .to() and .cuda() change the device only, not to {probe.dtype}")
    return probe.device


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


class Attention(_Module):
    """Causal multi-head self-attention over a packed qkv [B, T, 3C] (what a
    Linear(C, 3C) gives) into [B, T, C]; computed in fp32, never
    quantized. A Sequential holding one keeps x's dims (B and T are read)."""

    def __init__(self, heads, name=None):
        super().__init__()
        self.heads, self.name = heads, name

    def op_specs(self):
        return [OpSpec("attention", {"heads": self.heads}, self.name)]


def _scaled_activation(kind):
    class ScaledAct(_Module):
        """y = act(x) * scales[row], the scales an extra input from the caller
        (after x, in op order): the activation of a grouped MLP."""

        def __init__(self, name=None):
            super().__init__()
            self.name = name

        def op_specs(self):
            return [OpSpec(kind, None, self.name, ((False, 0, None, False),))]
    ScaledAct.__name__ = ScaledAct.__qualname__ = {
        "scaled_swiglu": "ScaledSwiGLU", "scaled_srelu": "ScaledSReLU"}[kind]
    return ScaledAct


ScaledSwiGLU, ScaledSReLU = (_scaled_activation(k) for k in ("scaled_swiglu", "scaled_srelu"))


class Dropout(_Module):
    """Drops activations with probability p (Philox draws of the context's
    generator); the kwarg training (op_kwargs={index: {"training": False}})
    makes it the identity, a value kwarg: compiled, one graph per value."""

    def __init__(self, p=0.1, name=None):
        super().__init__()
        self.cfg, self.name = {"p": p}, name

    def op_specs(self):
        return [OpSpec("dropout", self.cfg, self.name)]


class Quantize(_Module):
    """Quantizes the activation (forward) and/or its gradient (backward)
    with the op's own recipe quantizers, so that the next op takes it
    quantized (FP8 output into the next op). Identity without a recipe."""

    def __init__(self, forward=True, backward=False, name=None):
        super().__init__()
        self.cfg, self.name = {"forward": forward, "backward": backward}, name

    def op_specs(self):
        return [OpSpec("quantize", self.cfg, self.name)]


class AddExtraInput(_Module):
    """y = x + extra: a residual from a channel made earlier in the same
    Sequential (MakeExtraOutput), or with channel None from the caller (the
    Sequential's extra inputs follow x, in op order)."""

    def __init__(self, channel=None, in_place=False, name=None):
        super().__init__()
        self.channel, self.in_place, self.name = channel, in_place, name

    def op_specs(self):
        return [OpSpec("add_extra_input", {"in_place": self.in_place}, self.name,
                       ((False, 0, self.channel, False),))]


class MakeExtraOutput(_Module):
    """y = x, and x again as an extra output: into a channel a later
    AddExtraInput reads, and with to_caller (or channel None) returned after
    y."""

    def __init__(self, channel=None, to_caller=False, in_place=False, name=None):
        super().__init__()
        self.channel, self.to_caller, self.name = channel, to_caller, name
        self.in_place = in_place

    def op_specs(self):
        return [OpSpec("make_extra_output", {"in_place": self.in_place}, self.name,
                       ((True, 0, self.channel, self.to_caller),))]


_MODELS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_RECIPES: list = [None]
_PLAN_CACHE: dict = {}
_FROM_TORCH_DT = {t: int(d) for t, d in _tensor._FROM_TORCH.items()}
_FLAG = ("f",)
_READS_DIMS = {"attention"}  # the environment key of a runtime value read from a tensor
# classes the C trace keeps as eager nodes (host-side split sizes, weights by reference)
_EAGER_CLASSES = {"grouped_linear"}


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


# Row counts the trace runs at: two, so that what follows the rows shows
# (and becomes the symbolic row count in the graph); multiples of every
# block size of every format.
_PROBES = (128, 256)


@torch._dynamo.assume_constant_result
def _resolved(key, recipe_id, needs_grad, x_grad, dtype, k, extra=(), rows=-1, kw=()):
    """The program (_program.build) of model `key` for inputs [rows, k] and
    extra inputs [rows, e] of extra = ((dtype, e), ...) and the kwargs kw
    (Sequential._kwargs), with the ops' delayed-scaling addresses; traced
    once per key (rows -1: any row count, or None when some op's fields
    follow the rows in a way the program cannot carry). Dynamo calls this at
    trace time and bakes the result, a tuple of constants."""
    key_ = (key, recipe_id, needs_grad, x_grad, dtype, k, extra, rows, kw)
    if key_ not in _PLAN_CACHE:
        _PLAN_CACHE[key_] = _MODELS[key]._resolve(recipe_id, needs_grad, x_grad, dtype, k, extra,
                                                  rows, kw)
    return _PLAN_CACHE[key_]


def _merge_rows(a, b):
    """a and b (the same program at the two probes) as one, with None
    where the value is the row count; ValueError where they differ
    otherwise."""
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise ValueError
        return type(a)(_merge_rows(x, y) for x, y in zip(a, b))
    if a == b:
        return a
    if (a, b) == _PROBES and not isinstance(a, bool):
        return None
    raise ValueError


def _run_program(prog, delayed, x, extra_in, params, side=()):
    """The forward steps of prog on x: the environment they leave. side:
    the weight caches prog reads (prog[12], in order), then the runtime
    flag when the program takes one."""
    env = {(prog[4], 0): x, _program.DEVICE: x.device}
    env.update(((v, 0), t) for v, t in zip(prog[8], extra_in))
    env.update(zip(prog[12] + (_FLAG,), side))
    _program.run(prog[0], env, params, x.shape[0], delayed)
    return env


def _outputs(prog, env):
    y = env[(prog[5], 0)]
    return (y,) + tuple(env[(v, 0)] for v in prog[9]) if prog[9] else y


class _GraphFunction(torch.autograd.Function):
    """The forward nodes of a traced graph forward, its backward nodes
    backward (what torch.compile sees: custom ops only)."""

    @staticmethod
    def forward(ctx, resolved, n_extra, n_side, x, *rest):
        prog, delayed = resolved
        extra_in, side = rest[:n_extra], rest[n_extra:n_extra + n_side]
        params = rest[n_extra + n_side:]
        env = _run_program(prog, delayed, x, extra_in, params, side)
        ctx.resolved, ctx.n_extra, ctx.n_side, ctx.n_params = resolved, n_extra, n_side, len(params)
        ctx.save_for_backward(*[_program.get(env, params, k) for k in prog[2]])
        return _outputs(prog, env)

    @staticmethod
    def backward(ctx, dy, *dextra_out):
        prog, delayed = ctx.resolved
        env, params = {(prog[6], 0): dy.contiguous(), _program.DEVICE: dy.device}, {}
        for k, t in zip(prog[2], ctx.saved_tensors):
            if k[0] == "p":
                params[k[1]] = t
            else:
                env[k[1:] if k[0] == "v" else k] = t
        for v, d in zip(prog[10], dextra_out):
            env[(v, 0)] = torch.zeros_like(env[(prog[6], 0)]) if d is None else d.contiguous()
        _program.run(prog[1], env, params, dy.shape[0], delayed)
        grads = [None] * ctx.n_params
        for i, v in prog[3]:
            grads[i] = env[(v, 0)]
        dx = env.get((prog[7], 0)) if prog[7] >= 0 else None
        dein = [env.get((v, 0)) if v >= 0 else None for v in prog[11]]
        return (None, None, None, dx, *dein, *[None] * ctx.n_side, *grads)


class _SeqFunction(torch.autograd.Function):
    """One C forward and one C backward for a whole Sequential; public extra
    inputs follow x, public extra outputs follow y."""

    @staticmethod
    def forward(ctx, seq_module, kwargs, n_extra, x, *rest):
        ctx.seq_module = seq_module
        ctx.wants = (x.requires_grad, *[e.requires_grad for e in rest[:n_extra]])
        # the C side keeps x and the extra inputs alive until the backward
        y, extra_out = seq_module._seq._s.forward_torch(x, current_recipe(), True, x.requires_grad,
                                                        rest[:n_extra] or None, kwargs)
        return (y, *extra_out) if extra_out else y

    @staticmethod
    def backward(ctx, dy, *dextra_out):
        s = ctx.seq_module._seq._s
        s.zero_grad()
        de = [torch.zeros_like(dy) if d is None else d for d in dextra_out]
        dx, dextra_in = s.backward_torch(dy, de or None)
        grads = [g.clone() for g in ctx.seq_module._c_grads]
        ins = [d if w else None for d, w in zip((dx, *dextra_in), ctx.wants)]
        return (None, None, None, *ins, *grads)


class Sequential(torch.nn.Module):
    """opfuse modules run by the C fuser: one call into C per forward and
    per backward; parameters share memory with the C side."""

    def __init__(self, *modules, ctx=None, custom_ops=False, device=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(modules)
        if ctx is None:
            ctx = default_context(*_device_key(device or "cpu"))
        self._spans = []  # recompute spans, replayed by a move
        self._primaries = {}  # parameter index -> (op, its parameter): quantized primaries
        self._build(ctx)
        self.custom_ops = custom_ops
        self._key = _register_model(self)

    def _build(self, ctx):
        """The C seq of the layers' ops on ctx, and the Parameters viewing its
        parameters (existing Parameters keep their identity: .data moves)."""
        self._seq = Seq(ctx=ctx)
        for m in self.layers:
            for spec in m.op_specs():
                op = Op(spec.class_name, spec.config, spec.name, ctx=self._seq.ctx)
                for output, index, channel, to_caller in spec.channels:
                    if output:
                        op.set_extra_output(index, channel, to_caller)
                    else:
                        op.set_extra_input(index, channel)
                self._seq.append(op)
        self._c_grads = []
        plist = []
        for i in range(len(self._seq)):
            h = self._seq[i]._h
            for j in range(h.info()["num_params"]):
                p = h.param(j)
                name, value = f"op{i}_{p['name']}", to_torch(p["value"])
                param = self._parameters.get(name)
                if param is None:
                    param = torch.nn.Parameter(value)
                    self.register_parameter(name, param)
                else:
                    param.data = value
                plist.append(param)
                self._c_grads.append(to_torch(p["grad"]))
        self._plist = plist
        for first, count in self._spans:
            self._seq.set_recompute(first, count)
        classes = [self._seq[i]._h.info()["class_name"] for i in range(len(self._seq))]
        self._linears = tuple(i for i, c in enumerate(classes) if c == "basic_linear")
        # ops that read x's leading dims themselves: the torch path keeps them
        self._keeps_dims = any(c in _READS_DIMS for c in classes)
        # ops that are eager nodes of the C graph: the whole seq is one custom op per direction
        self._eager_nodes = any(c in _EAGER_CLASSES for c in classes)
        self._whole = self._eager_nodes or bool(self._spans)
        self._cache_views = {}  # ("q", parameter, component) -> a torch view of the C cache
        self._first_param = [0]
        for i in range(len(self._seq)):
            self._first_param.append(self._first_param[-1] + self._seq[i]._h.info()["num_params"])

    @property
    def device(self) -> torch.device:
        """The device of the C-side parameters (the context's)."""
        return torch.device(self._seq.ctx.device)

    def _apply(self, fn, recurse=True):
        """.to(device) / .cuda() / .cpu(): the C seq is made again on the
        device's default context and the parameters' values (and gradients)
        copied over; each Parameter keeps its identity (its .data moves), so
        an optimizer made before still holds it. Move before training: the
        ops' other state (delayed-scaling histories, weight caches) starts
        afresh, and a model compiled before must be compiled again. dtype
        conversions are refused (_target_device)."""
        dev = _target_device(fn, self.device, self)
        if recurse:
            for m in self.layers:
                m._apply(fn, recurse)
        if dev != self.device:
            self._move(dev)
        return self

    def _move(self, dev: torch.device):
        if self._primaries:
            raise opfuse.UnsupportedError("opfuse.torch.Sequential: quantized primary weights "
                                          "cannot move: move the model before "
                                          "set_param_quantized")
        old_seq = self._seq  # alive until its values are copied out
        values = [p.data for p in self._plist]
        self._build(default_context(*_device_key(dev)))
        with torch.no_grad():
            for p, v in zip(self._plist, values):
                p.data.copy_(v)
                if p.grad is not None:
                    p.grad = p.grad.to(dev)
        del old_seq
        self._key = _register_model(self)  # programs traced for the old seq stay with it

    def forward(self, x, *extra_in, is_first_microbatch=None, op_kwargs=None):
        """y (and the public extra outputs after it) of x and the public extra
        inputs. is_first_microbatch (every basic_linear's weight cache): None
        quantizes the weights on every call; True quantizes them and caches
        them, False reuses the cache; a one-element integer tensor says the
        same as a graph input, so that under torch.compile one graph runs
        the whole schedule. op_kwargs: {basic op index: {kwarg: value}},
        value kwargs of other ops (a new value compiles a graph of its own)."""
        # Grad mode is off inside Function.forward: decide here.
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(e.requires_grad for e in extra_in) or
            any(p.requires_grad for p in self._plist))
        if self.custom_ops or torch.compiler.is_compiling():
            return self._forward_ops(x, extra_in, needs_grad, is_first_microbatch, op_kwargs)
        kwargs = None  # the common call builds nothing
        if is_first_microbatch is not None or op_kwargs:
            kwargs = self._kwargs_list(self._kwargs(is_first_microbatch, op_kwargs, eager=True))
        if not needs_grad:  # no graph to record: the C forward alone
            y, extra_out = self._seq._s.forward_torch(x, current_recipe(), False, False,
                                                      extra_in or None, kwargs)
            return (y, *extra_out) if extra_out else y
        return _SeqFunction.apply(self, kwargs, len(extra_in), x, *extra_in, *self._plist)

    def _kwargs(self, first_mb, op_kwargs, eager=False) -> tuple:
        """The call's kwargs as constants: ((op, name, value), ...) sorted;
        a tensor is_first_microbatch as the value "tensor" (eagerly: its
        value)."""
        kw = []
        if first_mb is not None:
            if isinstance(first_mb, torch.Tensor):
                first_mb = int(first_mb) if eager else "tensor"
            else:
                first_mb = int(bool(first_mb))
            kw += [(i, "is_first_microbatch", first_mb) for i in self._linears]
        for i, d in (op_kwargs or {}).items():
            kw += [(operator.index(i), str(n), v) for n, v in d.items()]
        return tuple(sorted(kw))

    def _kwargs_list(self, kw, tensor_value=1) -> list:
        """kw as the C call's per-op kwargs (a tensor value as tensor_value)."""
        out = [None] * len(self._seq)
        for i, name, v in kw:
            if not 0 <= i < len(out):
                raise opfuse.InvalidArgError(f"opfuse.torch.Sequential: op_kwargs names op {i}, "
                                             f"the seq has {len(out)} ops")
            out[i] = dict(out[i] or {}, **{name: tensor_value if v == "tensor" else v})
        return out

    def _forward_ops(self, x, extra_in, needs_grad, first_mb=None, op_kwargs=None):
        """The traced graph's nodes as custom ops (_program): what
        torch.compile sees. The ops run on the 2D view [rows, features];
        the program holds for any row count where it can, so a dynamic
        batch size stays symbolic."""
        rid = getattr(_state, "recipe_id", 0)
        dt = _FROM_TORCH_DT.get(x.dtype, -1)
        if x.dim() == 0:
            raise opfuse.ShapeError("opfuse.torch.Sequential: input has no dims")
        if self._whole:
            return _whole_forward(self, x, extra_in, needs_grad, rid, dt, first_mb, op_kwargs)
        # operator.index: Dynamo pins a symbolic size it converts so (a guard)
        shape, k = x.shape, operator.index(x.shape[-1])
        if self._keeps_dims and x.dim() > 2:  # [rows, middle dims..., k]
            k = tuple(operator.index(d) for d in shape[1:])
        else:
            x = x.reshape(-1, k)
        extra_in = tuple(e.reshape(-1, operator.index(e.shape[-1])) for e in extra_in)
        extra = tuple((_FROM_TORCH_DT.get(e.dtype, -1), operator.index(e.shape[-1]))
                      for e in extra_in)
        x_grad = bool(needs_grad and x.requires_grad)
        kw = self._kwargs(first_mb, op_kwargs)
        r = _resolved(self._key, rid, bool(needs_grad), x_grad, dt, k, extra, -1, kw)
        if r is None:  # pinned to this row count (a guard under torch.compile)
            r = _resolved(self._key, rid, bool(needs_grad), x_grad, dt, k, extra,
                          operator.index(x.shape[0]), kw)
        side = [self._cache_views[q] for q in r[0][12]]
        if isinstance(first_mb, torch.Tensor):
            if first_mb.numel() != 1 or first_mb.is_floating_point() or first_mb.is_complex():
                raise opfuse.DtypeError(f"opfuse.torch.Sequential: is_first_microbatch as a "
                                        f"tensor is one integer or bool element, not "
                                        f"{first_mb.dtype} of {first_mb.numel()}")
            side.append(first_mb.reshape(()).to(torch.int64))
        if needs_grad:
            out = _GraphFunction.apply(r, len(extra_in), len(side), x, *extra_in, *side,
                                       *self._plist)
        else:
            out = _outputs(r[0], _run_program(r[0], r[1], x, extra_in, self._plist, side))
        if isinstance(out, tuple):
            return (out[0].reshape(*shape[:-1], out[0].shape[-1]),) + out[1:]
        return out.reshape(*shape[:-1], out.shape[-1])

    def _resolve_at(self, recipe_id, needs_grad, x_grad, dtype, k, extra, rows, kw):
        dt, dev = _tensor._TORCH_DTYPES[DType(dtype)], self.device
        x = to_opf(torch.zeros(rows, *(k if isinstance(k, tuple) else (k,)), dtype=dt, device=dev))
        ein = [to_opf(torch.zeros(rows, e, dtype=_tensor._TORCH_DTYPES[DType(d)], device=dev))
               for d, e in extra]
        # a tensor is_first_microbatch traces as 1 (the cache is made) and is
        # read from its tensor at run time: 1 and 0 run the same nodes
        prog = self._seq._s.trace(x, _RECIPES[recipe_id], needs_grad, x_grad, ein or None,
                                  self._kwargs_list(kw) if kw else None)
        runtime = {n: _FLAG for _, n, v in kw if v == "tensor"}
        return _program.build(prog, self._first_param, runtime)

    def _cache_view(self, key):
        """A torch view of component key[2] of parameter key[1]'s quantized
        copy (the weight cache: its memory stays put across calls)."""
        i = next(i for i in range(len(self._seq)) if self._first_param[i + 1] > key[1])
        q = self._seq[i]._h.param(key[1] - self._first_param[i])["qvalue"]
        t = component(q, key[2])  # as the custom ops pass components: bytes, fp32 scales
        return t if t.dtype == torch.float32 else t.view(torch.uint8)

    def _resolve(self, recipe_id, needs_grad, x_grad, dtype, k, extra, rows, kw=()):
        if dtype < 0:
            raise opfuse.DtypeError("opfuse.torch.Sequential: the input's torch dtype has no "
                                    "opfuse dtype")
        args = (recipe_id, needs_grad, x_grad, dtype, k, extra)
        if rows >= 0:
            prog = self._resolve_at(*args, rows, kw)
        else:
            try:
                prog = _merge_rows(self._resolve_at(*args, _PROBES[0], kw),
                                   self._resolve_at(*args, _PROBES[1], kw))
            except (ValueError, opfuse.Error):
                return None
            if _has_none_value(prog):
                return None
        for q in prog[12]:
            self._cache_views[q] = self._cache_view(q)
        ops = [self._seq[i]._h for i in range(len(self._seq))]
        return prog, tuple(_C.delayed_ops(ops))

    def set_param_quantized(self, name: str, quantizer):
        """Makes parameter name ("op1_weight", as named_parameters names it) a
        quantized primary weight (opf_op_set_param_quantized, irreversible):
        its value quantized with quantizer (not delayed; what the recipe
        makes for the weight) becomes the parameter, and the high-precision
        memory goes. The quantized components are buffers ("op1_weight_q0"
        data, "_q1" scales, ...: views of the C memory); the Parameter keeps
        its name, shape and dtype but is the dequantized weight, a copy that
        carries the gradient: the op reads the quantized buffers. The fp32
        master lives in opfuse's optimizer: train with
        opfuse.torch.Optimizer, which re-quantizes the weight after each
        step (a torch optimizer would update the copy only)."""
        i, j = self._param_index(name)
        self._seq[i]._h.set_param_quantized(j, quantizer)
        q = self._seq[i]._h.param(j)["qvalue"]
        for c in range(6):
            t = component(q, c)
            if t is not None:
                self.register_buffer(f"{name}_q{c}", t, persistent=False)
        g = self._first_param[i] + j
        self._primaries[g] = (i, j)
        self._refresh_primary(g)

    def _param_index(self, name):
        for i in range(len(self._seq)):
            h = self._seq[i]._h
            for j in range(h.info()["num_params"]):
                if f"op{i}_{h.param(j)['name']}" == name:
                    return i, j
        raise opfuse.InvalidArgError(f"opfuse.torch.Sequential: no parameter \"{name}\" "
                                     f"(named_parameters names them)")

    def _refresh_primary(self, g):
        """The Parameter of quantized primary g: its dequantized value."""
        i, j = self._primaries[g]
        p = self._plist[g]
        q = self._seq[i]._h.param(j)["qvalue"]
        usage = 1 if q.spec["usage"] & 1 else 2
        _C.torch_follow(self._seq.ctx)
        deq = to_torch(_C.dequantize(self._seq.ctx, q, usage, _FROM_TORCH_DT[p.dtype]))
        p.data = deq.reshape(p.shape).clone()

    def set_recompute(self, first: int, count: int):
        """Basic ops [first, first + count) (in op order, a Linear with bias
        being two) as a recompute span (opf_seq_set_recompute): its forward
        keeps only its input and the backward runs it again, same bits.
        Under torch.compile a Sequential with spans runs as the whole-seq
        custom ops (seq_fwd, seq_bwd), whose C fuser does the recompute."""
        span = (operator.index(first), operator.index(count))
        self._seq.set_recompute(*span)
        self._spans.append(span)
        self._whole = True

    def clear_recompute(self):
        self._seq.clear_recompute()
        self._spans = []
        self._whole = self._eager_nodes

    def plans(self):
        return self._seq.plans()


def _has_none_value(prog) -> bool:
    """Whether a value field of some step follows the row count."""
    return any(st[0] == "op" and None in st[3] for st in prog[0] + prog[1])


# ---- whole-seq ops ---------------------------------------------------------------------
# A seq holding an op the traced graph cannot carry (grouped_linear reads its
# split sizes on the host and its weights through a reference: an eager node
# of the C graph), or with recompute spans (whose re-run forward lives in the
# C fuser's backward), runs under torch.compile as one custom op per direction
# around the C fuser's own forward and backward of the seq: the same C calls
# as the eager path, so the same bits. The backward op reads what the
# forward op left in the seq (one backward per forward, in order, as
# autograd runs them). The fakes need only the outputs' features and dtypes
# (from one C trace per input signature) and the inputs' shapes.
_ops._lib.define("seq_fwd(Tensor x, Tensor[] extra, Tensor[] params, int key, int recipe, "
                 "bool needs_grad, bool x_grad, int kwargs, int[] out_features, "
                 "int[] out_dtypes) -> Tensor[]")
_ops._lib.define("seq_bwd(Tensor dy, Tensor[] dextra_out, Tensor[] extra, Tensor[] params, "
                 "int key, SymInt[] x_shape) -> Tensor[]")
_KWARGS: list = [()]  # the kwargs of whole-seq calls by id (0: none)


def _kwargs_id(kw) -> int:
    if kw not in _KWARGS:
        _KWARGS.append(kw)
    return _KWARGS.index(kw)


def _seq_fwd(x, extra, params, key, recipe, needs_grad, x_grad, kwargs, out_features,
             out_dtypes):
    m = _MODELS[key]
    kw, ctx = _KWARGS[kwargs], m._seq.ctx
    _C.torch_follow(ctx)
    y, extra_out = m._seq._s.forward(to_opf(x.contiguous(), ctx=ctx), _RECIPES[recipe],
                                     needs_grad, x_grad,
                                     [to_opf(e.contiguous(), ctx=ctx) for e in extra] or None,
                                     m._kwargs_list(kw) if kw else None)
    return [to_torch(t).clone() for t in [y] + list(extra_out or [])]


def _seq_bwd(dy, dextra_out, extra, params, key, x_shape):
    m, ctx = _MODELS[key], _MODELS[key]._seq.ctx
    _C.torch_follow(ctx)
    m._seq.zero_grad()
    de = [to_opf(d.contiguous(), ctx=ctx) for d in dextra_out]
    dx, dextra_in = m._seq._s.backward(to_opf(dy.contiguous(), ctx=ctx), de or None)
    dx = dy.new_zeros(x_shape) if dx is None else to_torch(dx).clone()
    dein = [torch.zeros_like(e) if d is None else to_torch(d).clone()
            for d, e in zip(list(dextra_in or []) + [None] * len(extra), extra)]
    return [dx] + dein + [g.clone() for g in m._c_grads]


def _seq_fwd_fake(x, extra, params, key, recipe, needs_grad, x_grad, kwargs, out_features,
                  out_dtypes):
    return [x.new_empty(x.shape[0], f, dtype=_tensor._TORCH_DTYPES[DType(d)])
            for f, d in zip(out_features, out_dtypes)]


for _key in _ops._BACKENDS:
    _ops._lib.impl("seq_fwd", _seq_fwd, _key)
    _ops._lib.impl("seq_bwd", _seq_bwd, _key)
torch.library.register_fake("opfuse::seq_fwd", _seq_fwd_fake, lib=_ops._lib)
torch.library.register_fake(
    "opfuse::seq_bwd", lambda dy, dextra_out, extra, params, key, x_shape:
    [dy.new_empty(x_shape)] + [torch.empty_like(e) for e in extra] +
    [torch.empty_like(p) for p in params], lib=_ops._lib)


def _seq_setup(ctx, inputs, output):
    ctx.key, ctx.n_extra, ctx.x_grad = inputs[3], len(inputs[1]), inputs[6]
    ctx.n_out, ctx.x_shape = len(output), inputs[0].shape
    ctx.extra_grad = [e.requires_grad for e in inputs[1]]
    ctx.save_for_backward(*inputs[1], *inputs[2])


def _seq_backward(ctx, grads):
    saved = ctx.saved_tensors
    extra, params = list(saved[:ctx.n_extra]), list(saved[ctx.n_extra:])
    dy = grads[0] if grads[0] is not None else torch.zeros_like(extra[0])
    dextra_out = [torch.zeros_like(dy) if g is None else g for g in grads[1:]]
    out = torch.ops.opfuse.seq_bwd(dy, dextra_out, extra, params, ctx.key, list(ctx.x_shape))
    dx = out[0] if ctx.x_grad else None
    dein = [d if w else None for d, w in zip(out[1:1 + ctx.n_extra], ctx.extra_grad)]
    return (dx, dein, list(out[1 + ctx.n_extra:]), None, None, None, None, None, None, None)


torch.library.register_autograd("opfuse::seq_fwd", _seq_backward, setup_context=_seq_setup,
                                lib=_ops._lib)


@torch._dynamo.assume_constant_result
def _whole_outputs(key, recipe_id, needs_grad, x_grad, dtype, k, extra, kw):
    """((features, dtype), ...) of y and the public extra outputs of model
    key for inputs [rows, k] and extra inputs extra = ((dtype, shape with
    -1 for the rows), ...): one C trace per signature, baked by Dynamo."""
    key_ = ("whole", key, recipe_id, needs_grad, x_grad, dtype, k, extra, kw)
    if key_ not in _PLAN_CACHE:
        _PLAN_CACHE[key_] = _MODELS[key]._whole_outputs(recipe_id, needs_grad, x_grad, dtype, k,
                                                        extra, kw)
    return _PLAN_CACHE[key_]


def _follows(d, rows) -> bool:
    """Whether an extra input's leading dim d is x's row count (scales)."""
    if isinstance(d, torch.SymInt) or isinstance(rows, torch.SymInt):
        return _ops._same(d, rows)
    return d == rows


def _whole_forward(m, x, extra_in, needs_grad, rid, dt, first_mb, op_kwargs):
    """Sequential._forward_ops for a seq with eager nodes: seq_fwd on the
    2D view of x; extra inputs as they come (split sizes, scales)."""
    if isinstance(first_mb, torch.Tensor):
        raise opfuse.UnsupportedError(
            "opfuse.torch.Sequential: a seq holding grouped_linear or a recompute span takes "
            "is_first_microbatch as a bool under torch.compile (one graph per value), not a "
            "tensor")
    shape, k = x.shape, operator.index(x.shape[-1])
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    extra = tuple((_FROM_TORCH_DT.get(e.dtype, -1),
                   tuple(-1 if i == 0 and _follows(d, rows) else operator.index(d)
                         for i, d in enumerate(e.shape))) for e in extra_in)
    x_grad = bool(needs_grad and x.requires_grad)
    kw = m._kwargs(first_mb, op_kwargs)
    outs = _whole_outputs(m._key, rid, bool(needs_grad), x_grad, dt, k, extra, kw)
    ys = torch.ops.opfuse.seq_fwd(x2, list(extra_in), list(m._plist), m._key, rid,
                                  bool(needs_grad), x_grad, _kwargs_id(kw),
                                  [f for f, _ in outs], [d for _, d in outs])
    y = ys[0].reshape(*shape[:-1], outs[0][0])
    return (y, *ys[1:]) if len(ys) > 1 else y


def _sequential_whole_outputs(self, recipe_id, needs_grad, x_grad, dtype, k, extra, kw):
    if dtype < 0 or any(d < 0 for d, _ in extra):
        raise opfuse.DtypeError("opfuse.torch.Sequential: an input's torch dtype has no "
                                "opfuse dtype")
    rows, dev = _PROBES[0], self.device
    x = to_opf(torch.zeros(rows, k, dtype=_tensor._TORCH_DTYPES[DType(dtype)], device=dev))
    ein = [to_opf(torch.zeros(*[rows if n < 0 else n for n in shp],
                              dtype=_tensor._TORCH_DTYPES[DType(d)], device=dev))
           for d, shp in extra]
    prog = self._seq._s.trace(x, _RECIPES[recipe_id], needs_grad, x_grad, ein or None,
                              self._kwargs_list(kw) if kw else None)
    outs = []
    for v in (prog["io"][1],) + tuple(prog["extra_out"]):
        spec = prog["values"][v][0]
        if spec[2] != 0:
            raise opfuse.UnsupportedError("opfuse.torch.Sequential: a quantized output of a seq "
                                          "holding grouped_linear or a recompute span under "
                                          "torch.compile")
        outs.append((spec[0][-1], spec[1]))
    return tuple(outs)


Sequential._whole_outputs = _sequential_whole_outputs


class Optimizer:
    """opfuse's optimizer (opfuse.Optim: SGD or AdamW with fp32 master
    weights in C) over an opfuse.torch.Sequential's parameters: what a
    Sequential with quantized primary weights trains with. step() hands
    each Parameter's .grad to the C parameter (the compiled path's
    gradients are torch tensors), steps the C optimizer, which updates the
    masters and re-quantizes the primaries in place, and refreshes the
    primaries' dequantized Parameters."""

    def __init__(self, model: "Sequential", kind=opfuse.OptimKind.ADAMW, **kw):
        self.model = model
        self._o = opfuse.Optim(model._seq, kind, **kw)

    def step(self):
        m = self.model
        _C.torch_follow(m._seq.ctx)  # the C step after torch's gradients, on its stream
        with torch.no_grad():
            for g, (p, c) in enumerate(zip(m._plist, m._c_grads)):
                i = next(i for i in range(len(m._seq)) if m._first_param[i + 1] > g)
                if p.grad is not None:
                    c.copy_(p.grad)
                m._seq[i]._h.set_has_grad(g - m._first_param[i], p.grad is not None)
            self._o.step()
            for g in m._primaries:
                m._refresh_primary(g)

    def zero_grad(self):
        for p in self.model._plist:
            p.grad = None


class GroupedLinear(torch.nn.Module):
    """groups independent linears over consecutive row groups of x:
    y_g = x_g W_g^T (+ b_g), the rows of group g given by split_sizes (a
    list of ints read on the host, the documented exception: under
    torch.compile each distinct list compiles a graph of its own; an int64
    tensor is taken eagerly). Rows past the sum are padding (zero in y and
    dx). Parameters weight0..G-1 (then bias0..G-1) share memory with the C
    op."""

    def __init__(self, groups, in_features, out_features, bias=True, dtype=None, name=None,
                 ctx=None, device=None):
        super().__init__()
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.spec = spec = OpSpec("grouped_linear", {"groups": groups, "in_features": in_features,
                                         "out_features": out_features, "bias": bias,
                                         "dtype": _dt(dtype)}, name, ((False, 0, None, False),))
        holder = _Module()
        holder.op_specs = lambda: [spec]
        object.__setattr__(self, "_model", Sequential(holder, ctx=ctx, device=device))
        for pname, p in self._model.named_parameters():
            self.register_parameter(pname.split("_", 1)[1], p)

    def op_specs(self):
        """Inside an opfuse.torch.Sequential: its split sizes are an extra
        input of the Sequential (an int64 tensor after x, in op order) and
        its parameters the Sequential's (this module's own stay unused)."""
        return [self.spec]

    def _apply(self, fn, recurse=True):
        """.to() / .cuda(): the inner Sequential moves (its Parameters, which
        are this module's, keep their identity)."""
        self._model._apply(fn, recurse)
        return self

    def forward(self, x, split_sizes):
        if isinstance(split_sizes, torch.Tensor):
            splits = split_sizes.to(torch.int64)
        else:
            splits = torch.tensor([operator.index(s) for s in split_sizes], dtype=torch.int64)
        return self._model(x, splits)
