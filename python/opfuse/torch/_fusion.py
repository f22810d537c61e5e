"""Fusion functions written in Python (the anchor's register_forward_fusion
and register_backward_fusion), registered with the C fuser.

A fusion function reads a group's op window and returns it with some runs
of basic ops replaced by fused ops of registered fused classes:

    def fuse_linear_bias(ops, recipe):
        out, i = [], 0
        while i < len(ops):
            if (i + 1 < len(ops) and ops[i].class_name == "basic_linear"
                    and ops[i + 1].class_name == "bias"):
                out.append(Fused("forward_linear_bias", ops[i:i + 2]))
                i += 2
            else:
                out.append(ops[i])
                i += 1
        return out
    register_forward_fusion(fuse_linear_bias, prepend=True)

ops are FusionOp views (class_name, name, fused, index); recipe is the
recipe kind's name ("mxfp8", ...) or None. The fuser checks that the result
maps back to the basic ops (no op dropped, duplicated or reordered); plans
built after the registration use it, eagerly and under torch.compile (the
traced graph's fused nodes are the fused classes' custom ops).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

from .. import _C

_FORWARD, _BACKWARD, _JOINT = 0, 1, 2
_REGISTERED: dict = {}


class FusionOp(NamedTuple):
    index: int          # its place in the window
    class_name: str
    name: Optional[str]
    fused: bool         # a fused op made by an earlier function (never fused again)


class Fused:
    """A run of the window's basic ops replaced by one op of fused class
    class_name (its covers must equal len(ops))."""

    def __init__(self, class_name: str, ops: Sequence[FusionOp]):
        self.class_name, self.ops = class_name, list(ops)


def _entries(result) -> list:
    out = []
    for e in result:
        if isinstance(e, Fused):
            out.append((e.class_name, [o.index for o in e.ops]))
        elif isinstance(e, FusionOp):
            out.append(e.index)
        else:
            raise TypeError(f"a fusion's result holds FusionOp and Fused entries, not "
                            f"{type(e).__name__}")
    return out


def _register(which: int, fn: Callable, name: Optional[str], prepend: bool) -> str:
    name = name or getattr(fn, "__qualname__", "python_fusion")

    def call(raw, recipe):
        return _entries(fn([FusionOp(*r) for r in raw], recipe))
    handle = _C.register_fusion(which, name, call, prepend)
    _REGISTERED[name] = handle
    return name


def register_forward_fusion(fn: Callable, name: Optional[str] = None,
                            prepend: bool = False) -> str:
    """Registers fn(ops, recipe) -> ops as a forward-only fusion; returns
    its name (fn's qualified name unless given)."""
    return _register(_FORWARD, fn, name, prepend)


def register_backward_fusion(fn: Callable, name: Optional[str] = None,
                             prepend: bool = False) -> str:
    """Registers fn(ops, recipe) -> ops as a backward-only fusion."""
    return _register(_BACKWARD, fn, name, prepend)


def register_forward_backward_fusion(fn: Callable, name: Optional[str] = None,
                                     prepend: bool = False) -> str:
    """Registers fn(ops, recipe) -> ops as a joint fusion (the fused op
    runs in both plans)."""
    return _register(_JOINT, fn, name, prepend)


def unregister_fusion(name: str) -> None:
    if name not in _REGISTERED:
        raise _C.InvalidArgError(f"unregister_fusion: no Python fusion \"{name}\"")
    _C.unregister_fusion(name, _REGISTERED.pop(name))
