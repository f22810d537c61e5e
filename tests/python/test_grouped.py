"""opfuse.torch.GroupedLinear: eagerly (the C fuser) and under torch.compile
(a custom op per direction around the C fuser), bit for bit against the
opfuse layer's C calls; split sizes are host values (one graph per list);
bad input raises the C message and changes nothing."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402

RECIPES = {"none": None, "current": opfuse.Recipe.current(), "mxfp8": opfuse.Recipe.mxfp8(),
           "delayed": opfuse.Recipe.delayed()}
SPLITS = [32, 64, 0]


def grouped(bias=True):
    m = ot.GroupedLinear(3, 64, 32, bias=bias)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return m


def x_in(rows=128):
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(7))


def step(m, recipe, splits=SPLITS, x=None):
    params = list(m.parameters())
    x = (x_in() if x is None else x).clone().requires_grad_()
    with ot.autocast(recipe=recipe):
        y = m(x, splits)
    y.square().sum().backward()
    out = [y.detach(), x.grad] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def c_step(recipe, splits=SPLITS):
    """The same step through the opfuse layer's C calls."""
    m = grouped()
    s = m._model._seq
    x, sp = x_in(), torch.tensor(splits, dtype=torch.int64)  # alive until the backward
    y, _ = s._s.forward(ot.to_opf(x), recipe, True, True, [ot.to_opf(sp)], None)
    y = ot.to_torch(y).clone()
    s.zero_grad()
    dx, _ = s._s.backward(ot.to_opf(2 * y), None)
    return [y, ot.to_torch(dx).clone()] + [g.clone() for g in m._model._c_grads]


def same(a, b):
    assert len(a) == len(b)
    bad = [i for i, (u, v) in enumerate(zip(a, b)) if not torch.equal(u, v)]
    assert not bad, f"tensors {bad} differ"


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_eager_compiled_c_api(recipe):
    torch._dynamo.reset()
    r = RECIPES[recipe]
    m = grouped()
    eager = step(m, r)
    assert torch.count_nonzero(eager[0][sum(SPLITS):]) == 0  # padding rows
    same(eager, c_step(r))
    m2 = grouped()
    same(eager, step(torch.compile(m2, fullgraph=True), r))


def test_grouped_split_list_compiles_once_per_value():
    torch._dynamo.reset()
    n = [0]

    def backend(gm, inputs):
        n[0] += 1
        return gm.forward
    m = grouped()
    cm = torch.compile(m, backend=backend, fullgraph=True)
    for splits in ([32, 64, 0], [32, 64, 0], [0, 96, 32], [0, 96, 32]):
        same(step(grouped(), None, splits), step(cm, None, splits))
    assert n[0] == 2, n[0]
    ex = torch._dynamo.explain(grouped())(x_in(), SPLITS)
    assert ex.graph_break_count == 0


def test_grouped_bad_input_raises_and_changes_nothing():
    m = grouped()
    before = [p.detach().clone() for p in m.parameters()]
    x = x_in()
    x0 = x.clone()
    with pytest.raises(opfuse.ShapeError, match="mxfp8 needs both dims"):
        with ot.autocast(recipe=RECIPES["mxfp8"]):
            m(x, [30, 66, 0])
    with pytest.raises(opfuse.ShapeError, match="split sizes sum to 200"):
        m(x, [100, 100, 0])
    with pytest.raises(opfuse.ShapeError, match=r"split sizes are .* expected plain i64\[3\]"):
        m(x, [64, 64])
    with pytest.raises(opfuse.ShapeError, match="input has 32 features"):
        m(torch.zeros(128, 32), SPLITS)
    with pytest.raises(opfuse.DtypeError):
        m(x.double(), SPLITS)
    assert torch.equal(x, x0)
    same(before, [p.detach() for p in m.parameters()])
    same(step(m, None), step(grouped(), None))
