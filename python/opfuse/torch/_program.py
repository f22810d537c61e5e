"""A Sequential under torch.compile: the graph opf_compile traces for one
call (compile.h, "export"), replayed node by node with the op classes'
custom ops.

The graph holds the seq's forward and backward plans as the eager fuser
runs them: fused ops (forward-only, backward-only and joint), extra inputs
and outputs routed through channels, gradient sums and delayed-scaling
updates. Each forward node becomes a call of ``opfuse::<class>_fwd``, each
backward node one of ``opfuse::<class>_bwd``, inside one
torch.autograd.Function whose forward runs the forward nodes and whose
backward runs the backward nodes, so the two fusion plans stay independent
(a backward-only fusion may span ops that two forward fusions split).

A program is made of constants only (tuples of ints and strings), so that
Dynamo bakes it: steps

    ("op", name, tensors, values, shapes, outs)   a custom op; tensors as
        ("v", value, component), ("p", parameter), ("q", parameter,
        component) (its quantized copy: the weight cache), ("f",) (a
        runtime value's tensor: is_first_microbatch) or ("e", shape,
        dtype) (a spec without memory: an empty tensor); shapes None where the
        row count goes; outs as (position in the result, value, component)
    ("add", value, a, b)                          a channel's gradient sum
    ("update", backward, value)                   delayed scaling, after value
"""
from __future__ import annotations

from .. import DType, _C
from . import _ops
from ._tensor import _TORCH_DTYPES

NODE_FORWARD, NODE_BACKWARD, NODE_GRAD_ADD, NODE_AMAX_UPDATE = 0, 1, 4, 5
VAL_NODE, VAL_DY, VAL_DEXTRA_OUT, VAL_KWARG = 0, 3, 4, 5
MAX_EXTRA = 4
DEVICE = "device"  # the environment's key of the device the program runs on
NODE_KINDS = ("forward", "backward", "eager forward", "eager backward", "grad add",
              "amax update", "recompute")


def _comps(spec) -> list:
    return [0] if spec[2] == 0 else _ops._present(spec)


def _source(node_name):
    def src(name, c, s, n):
        if s[0] == "empty":  # a spec without memory: filled in by _Packer
            return ("e",)
        if s[0] == "val":
            if s[3]:
                raise _C.UnsupportedError(f"{node_name}: field {name} reads a value at byte "
                                          f"offset {s[3]}: not in the torch path yet")
            return ("v", s[1], s[2])
        if s[0] == "param" and s[2] == 0:
            return ("p", s[1])
        if s[0] == "qparam":  # the weight cache or a quantized primary weight
            return ("q", s[1], s[2])
        raise _C.UnsupportedError(f"{node_name}: field {name} reads {s[0]} {s[1]} component "
                                  f"{s[2]}: not in the torch path yet")
    return src


def _op_step(node, values, bwd: bool, runtime):
    kind, _, cls, first, count, fields, outs, ins, n_extra_out, n_grads = node
    ops = _ops.class_ops(cls)
    p = _ops._Packer(ops.bwd_fields if bwd else ops.fwd_fields, fields,
                     _source(f"{cls} ({'backward' if bwd else 'forward'})"), runtime)
    vals = p.values + [n_grads if bwd else _ops.NO_PLAN]

    def slot(i):  # forward: outs[1 + MAX_EXTRA] then aux, as the op returns outs then aux
        return i if bwd or i <= MAX_EXTRA else 1 + n_extra_out + i - 1 - MAX_EXTRA
    placed, pos = [], 0
    for i, v in sorted(outs, key=lambda o: slot(o[0])):
        for c in _comps(values[v][0]):
            placed.append((pos, v, c))
            pos += 1
    name = f"{cls}_{'bwd' if bwd else 'fwd'}"
    return ("op", name, tuple(p.tensors), tuple(vals), tuple(p.shapes), tuple(placed))


def _param_grads(node, first_param) -> list:
    """(parameter, value) of the gradients a backward node writes."""
    outs, n_grads = node[6], node[9]
    n_params = sum(first_param[k + 1] - first_param[k] for k in range(node[3], node[3] + node[4]))
    base = first_param[node[3]]
    return [(base + i - 1, v) for i, v in outs if 1 <= i <= n_params and n_grads]


def build(prog: dict, first_param: list, runtime=None) -> tuple:
    """The constant program of a traced graph (classop.c's export);
    first_param[i]: the index of op i's first parameter (one past the end
    last); runtime: the runtime fields read from a tensor ("is_first_microbatch"
    -> its key in the environment)."""
    values, fwd, bwd, grads = prog["values"], [], [], []
    last = (prog["io"][0], 0)
    for node in prog["nodes"]:
        kind, backward = node[0], node[1]
        steps = bwd if backward else fwd
        if kind in (NODE_FORWARD, NODE_BACKWARD):
            step = _op_step(node, values, kind == NODE_BACKWARD, runtime)
            if kind == NODE_BACKWARD:
                grads += _param_grads(node, first_param)
            if step[5]:
                last = step[5][0][1:]
        elif kind == NODE_GRAD_ADD:
            if any(values[v][0][2] for v in node[7]) or values[node[6][0][1]][0][2]:
                raise _C.UnsupportedError("a quantized channel gradient sum: not in the torch "
                                          "path yet")
            step = ("add", node[6][0][1], node[7][0], node[7][1])
            last = (step[1], 0)
        elif kind == NODE_AMAX_UPDATE:
            step = ("update", bool(backward), last)
        else:
            raise _C.UnsupportedError(f"a graph node of kind {NODE_KINDS[kind]} "
                                      f"({node[2] or 'no class'}): not in the torch path yet")
        steps.append(step)
    for v, (spec, kind, *_rest) in enumerate(values):
        if kind == VAL_KWARG:
            raise _C.UnsupportedError(f"tensor kwarg {values[v][-1]}: not in the torch path yet")
    x, y, dy, dx = prog["io"]
    saved = _saved(prog, bwd)
    caches = tuple(sorted({k for st in fwd + bwd if st[0] == "op" for k in st[2]
                           if k[0] == "q"}))
    return (tuple(fwd), tuple(bwd), saved, tuple(sorted(grads)), x, y, dy, dx,
            tuple(prog["extra_in"]), tuple(prog["extra_out"]), tuple(prog["dextra_out"]),
            tuple(prog["dextra_in"]), caches)


def get(env: dict, params, k):
    """The tensor of a program key: a graph value component, a parameter,
    or what the environment holds under the key itself (the weight caches
    ("q", parameter, component), a runtime value)."""
    if k[0] == "e":  # a tensor whose spec alone the op reads (shape, dtype; its device)
        import torch
        return torch.empty(k[1], dtype=_TORCH_DTYPES[DType(k[2])], device=env.get(DEVICE))
    return params[k[1]] if k[0] == "p" else env[k[1:]] if k[0] == "v" else env[k]


def _saved(prog: dict, bwd) -> tuple:
    """What the backward steps read that the forward made or took in:
    value components and parameters (not dy, not what the backward makes)."""
    values, nodes = prog["values"], prog["nodes"]
    keys = []
    for st in bwd:
        reads = st[2] if st[0] == "op" else ((("v", st[2], 0), ("v", st[3], 0))
                                             if st[0] == "add" else ())
        for k in reads:
            if k[0] == "e":  # made where it is read
                continue
            if k[0] == "v":
                spec, kind, _, _, d = values[k[1]][:5]
                if kind in (VAL_DY, VAL_DEXTRA_OUT) or (kind == VAL_NODE and nodes[d][1]):
                    continue
            if k not in keys:
                keys.append(k)
    return tuple(keys)


def run(steps, env: dict, params, rows, delayed, on_call=None) -> None:
    """Runs steps on env ((value, component) -> tensor); on_call(op, args),
    when given, sees each custom op call first (tests)."""
    import torch
    for st in steps:
        if st[0] == "op":
            _, name, tkeys, vals, shapes, placed = st
            ts = [get(env, params, k) for k in tkeys]
            op = getattr(torch.ops.opfuse, name)
            args = (ts, list(vals), [rows if s is None else s for s in shapes] + [rows])
            if on_call is not None:
                on_call(op.default, args)
            out = op(*args)
            for pos, v, c in placed:
                env[(v, c)] = out[pos]
        elif st[0] == "add":
            a, b = env[(st[2], 0)], env[(st[3], 0)]
            env[(st[1], 0)] = a + b if a.dtype == b.dtype else (a.float() + b).to(a.dtype)
        else:
            _ops.delayed_update(env[st[2]], delayed, st[1])
