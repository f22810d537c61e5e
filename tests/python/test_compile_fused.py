"""torch.compile over fused ops, backward-only fusions and extra inputs and
outputs: the graph opf_compile traces, replayed as custom ops, compiles with
no graph break, and its losses and gradients equal eager (the C fuser) and
the opfuse layer's C calls bit for bit."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from opfuse.torch import _program  # noqa: E402

RECIPES = {"none": None, "mxfp8": opfuse.Recipe.mxfp8(), "current": opfuse.Recipe.current(),
           "block": opfuse.Recipe.block(), "nvfp4": opfuse.Recipe.nvfp4(),
           "delayed": opfuse.Recipe.delayed()}


def block(hidden=64, ffn=128):
    """A residual MLP block and a projection with a caller's residual: forward
    linear+bias+activation and linear+bias+add, backward activation+bias and
    linear+add fusions, a channel and a public extra input and output."""
    m = ot.Sequential(
        ot.MakeExtraOutput("r1", in_place=True), ot.Linear(hidden, hidden, bias=False),
        ot.LayerNorm(hidden), ot.Linear(hidden, ffn), ot.GELU(), ot.Linear(ffn, hidden),
        ot.AddExtraInput("r1", in_place=True), ot.MakeExtraOutput(to_caller=True),
        ot.RMSNorm(hidden), ot.Linear(hidden, hidden), ot.AddExtraInput())
    with torch.no_grad():
        for name, p in m.named_parameters():
            g = torch.Generator().manual_seed(p.numel() + len(name))
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 )
    return m


def inputs(rows=64, hidden=64):
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)


def step(m, recipe, x, e):
    opfuse.default_context().set_rng(5, 0)
    x, e = x.clone().requires_grad_(), e.clone().requires_grad_()
    with ot.autocast(recipe=recipe):
        y, out = m(x, e)
    (y.square().sum() + (out * 0.5).sum()).backward()
    r = [y.detach(), out.detach(), x.grad, e.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return r


def same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i} differs"


def classes(m, recipe, x, e):
    prog = ot._resolved(m._key, ot._recipe_id(recipe), True, True, ot._FROM_TORCH_DT[x.dtype],
                        x.shape[-1], ((ot._FROM_TORCH_DT[e.dtype], e.shape[-1]),), x.shape[0])[0]
    return {st[1] for st in prog[0] + prog[1] if st[0] == "op"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_graph_compiles_with_eager_bits(recipe):
    torch._dynamo.reset()
    m, r = block(), RECIPES[recipe]
    x, e = inputs()
    eager = step(m, r, x, e)
    seen = classes(block(), r, x, e)
    for cls in ("forward_linear_bias_activation_fwd", "forward_linear_bias_add_fwd",
                "backward_linear_add_bwd"):
        assert cls in seen, (cls, seen)
    with ot.autocast(recipe=r):   # a model of its own: a call moves delayed scaling's state
        ex = torch._dynamo.explain(block())(x.clone().requires_grad_(),
                                            e.clone().requires_grad_())
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    torch._dynamo.reset()
    same(eager, step(torch.compile(block(), fullgraph=True, dynamic=False), r, x, e))
    same(eager, step(block_ops(), r, x, e))  # the same program eagerly, op by op


def block_ops():
    m = block()
    m.custom_ops = True
    return m


@pytest.mark.parametrize("recipe", ["none", "mxfp8", "delayed"])
def test_compiled_equals_c_api(recipe):
    """The compiled module's outputs and input gradients equal the opfuse
    layer's Seq forward and backward (C calls on NumPy arrays)."""
    torch._dynamo.reset()
    m, r = block(), RECIPES[recipe]
    x, e = inputs()
    ref = block()
    opfuse.default_context().set_rng(5, 0)
    y, (out,) = ref._seq.forward(x.numpy(), r, extra_in=[e.numpy()])
    dy = 2 * y
    dx, (de,) = ref._seq.backward(dy, [np.full_like(out, 0.5)])
    c = step(torch.compile(m, fullgraph=True, dynamic=False), r, x, e)
    for i, want in enumerate((y, out, dx, de)):
        assert np.array_equal(c[i].numpy(), want), f"output {i} differs from the C API"
    for p, q in zip(c[4:], ref._c_grads):
        assert torch.equal(p, q)


@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_fused_graph_dynamic_rows(recipe):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    m, r = block(), RECIPES[recipe]
    cm = torch.compile(m, fullgraph=True, dynamic=True)
    for rows in (96, 64, 160):
        x, e = inputs(rows)
        same(step(m, r, x, e), step(cm, r, x, e))
    assert counters["stats"]["unique_graphs"] == 1


def test_backward_only_class_registers_bwd_only():
    ops = ot._ops.class_ops("backward_activation_bias")
    assert ops.fwd is None and ops.bwd is not None
    assert "backward_linear_add" in ot._ops.register_all()


def test_eager_nodes_refused_with_reason():
    with pytest.raises(opfuse.UnsupportedError, match="not in the torch path"):
        _program.build({"values": [], "nodes": [(6, 0, None, 0, 0, None, [], [], 0, 1)],
                        "io": (0, 0, 0, 0), "extra_in": [], "extra_out": [], "dextra_out": [],
                        "dextra_in": []}, [0])
