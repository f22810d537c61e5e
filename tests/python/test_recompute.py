"""Recompute spans (opf_seq_set_recompute) from opfuse.torch: eagerly, under
torch.compile (fullgraph, no graph break) and through the opfuse layer's C
calls, the same bits as without the span; bad spans raise the C message and
change nothing."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from test_grouped import same  # noqa: E402

RECIPES = {"none": None, "current": opfuse.Recipe.current(), "mxfp8": opfuse.Recipe.mxfp8(),
           "delayed": opfuse.Recipe.delayed()}
SPAN = (1, 4)  # Linear, bias, GELU, Linear: the MLP after the norm


def mlp(span=SPAN):
    m = ot.Sequential(ot.LayerNorm(64), ot.Linear(64, 128), ot.GELU(), ot.Linear(128, 64),
                      ot.Dropout(0.0))
    with torch.no_grad():
        for i, p in enumerate(m._plist):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1 + 0.5)
    if span:
        m.set_recompute(*span)
    return m


def step(m, recipe, rows=128):
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    with ot.autocast(recipe=recipe):
        y = m(x)
    y.square().sum().backward()
    out = [y.detach(), x.grad] + [p.grad.clone() for p in m._plist]
    for p in m._plist:
        p.grad = None
    return out


def c_step(recipe):
    """The same step through the opfuse layer's C calls, the span set there."""
    m = mlp(span=None)
    s = m._seq
    s.set_recompute(*SPAN)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(7))
    y, _ = s._s.forward(ot.to_opf(x), recipe, True, True, None, None)
    y = ot.to_torch(y).clone()
    s.zero_grad()
    dx, _ = s._s.backward(ot.to_opf(2 * y), None)
    return [y, ot.to_torch(dx).clone()] + [g.clone() for g in m._c_grads]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_eager_compiled_c_api(recipe):
    torch._dynamo.reset()
    r = RECIPES[recipe]
    m, plain = mlp(), mlp(span=None)
    eager = step(m, r)
    same(eager, step(plain, r))  # the span changes no bit
    same(eager, c_step(r))
    cm = torch.compile(mlp(), fullgraph=True)
    same(eager, step(cm, r))
    same(step(m, r), step(cm, r))  # the second step too (delayed: the histories)


def test_recompute_no_graph_break_and_clear():
    torch._dynamo.reset()
    m = mlp()
    x = torch.randn(128, 64)
    ex = torch._dynamo.explain(m)(x)
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    m._seq.discard()  # that forward's backward never runs
    with torch.no_grad():
        same([m(x)], [torch.compile(m, fullgraph=True)(x)])
    m.clear_recompute()  # back to the replayed graph of custom ops
    assert not m._whole
    same(step(m, None), step(mlp(span=None), None))
    same(step(torch.compile(m, fullgraph=True), None), step(mlp(span=None), None))


def test_recompute_bad_spans_raise_and_change_nothing():
    m = mlp(span=None)
    before = [p.detach().clone() for p in m._plist]
    with pytest.raises(opfuse.Error, match="recompute"):
        m.set_recompute(3, 9)
        step(m, None)
    m.clear_recompute()
    with pytest.raises(opfuse.Error):
        m.set_recompute(-1, 2)
        step(m, None)
    m.clear_recompute()
    m.set_recompute(*SPAN)
    x = torch.randn(128, 64, requires_grad=True)
    m(x)
    with pytest.raises(opfuse.StateError, match="pending"):
        m.set_recompute(0, 1)  # while a backward is pending
    m._seq.discard()
    same(before, [p.detach() for p in m._plist])
    same(step(m, None), step(mlp(), None))
