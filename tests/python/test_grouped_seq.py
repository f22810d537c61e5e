"""GroupedLinear and the grouped MLP (GroupedLinear + ScaledSwiGLU +
GroupedLinear) inside an opfuse.torch.Sequential: eagerly, under
torch.compile (fullgraph, no graph break: the seq's eager nodes run as one
custom op per direction around the C fuser) and through the opfuse layer's
C calls, bit for bit; bad input raises the C message and changes nothing."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from test_grouped import same  # noqa: E402

RECIPES = {"none": None, "current": opfuse.Recipe.current(), "mxfp8": opfuse.Recipe.mxfp8(),
           "delayed": opfuse.Recipe.delayed()}
SPLITS = [32, 64, 0]
ROWS = 128


def mlp(bias=True):
    """LayerNorm then the grouped MLP: extra inputs splits, scales, splits."""
    m = ot.Sequential(ot.LayerNorm(64), ot.GroupedLinear(3, 64, 64, bias=bias), ot.ScaledSwiGLU(),
                      ot.GroupedLinear(3, 32, 64, bias=bias))
    with torch.no_grad():
        for i, p in enumerate(m._plist):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return m


def inputs(splits=SPLITS, rows=ROWS):
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7))
    sp = torch.tensor(splits, dtype=torch.int64)
    sc = torch.rand(rows, generator=torch.Generator().manual_seed(3))
    return x, sp, sc


def step(m, recipe, splits=SPLITS, rows=ROWS):
    x, sp, sc = inputs(splits, rows)
    x.requires_grad_()
    sc.requires_grad_()
    with ot.autocast(recipe=recipe):
        y = m(x, sp, sc, sp)
    y.square().sum().backward()
    out = [y.detach(), x.grad, sc.grad] + [p.grad.clone() for p in m._plist]
    for p in m._plist:
        p.grad = None
    return out


def counting_backend():
    """A torch.compile backend that counts the graphs it gets."""
    n = [0]

    def backend(gm, example_inputs):
        n[0] += 1
        return gm.forward
    return backend, n


def c_step(recipe):
    """The same step through the opfuse layer's C calls."""
    m = mlp()
    s = m._seq
    x, sp, sc = inputs()
    y, _ = s._s.forward(ot.to_opf(x), recipe, True, True,
                        [ot.to_opf(sp), ot.to_opf(sc), ot.to_opf(sp)], None)
    y = ot.to_torch(y).clone()
    s.zero_grad()
    dx, dein = s._s.backward(ot.to_opf(2 * y), None)
    return [y, ot.to_torch(dx).clone(), ot.to_torch(dein[1]).clone()] + [
        g.clone() for g in m._c_grads]


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_mlp_in_sequential_eager_compiled_c_api(recipe):
    torch._dynamo.reset()
    r = RECIPES[recipe]
    m = mlp()
    eager = step(m, r)
    same(eager, c_step(r))
    cm = torch.compile(mlp(), fullgraph=True)
    same(eager, step(cm, r))
    same(step(m, r), step(cm, r))  # the second step too (delayed: the histories)


def test_grouped_linear_in_sequential_no_graph_break():
    torch._dynamo.reset()
    m = ot.Sequential(ot.GroupedLinear(3, 64, 32), ot.GELU(), ot.Linear(32, 16))
    x, sp, _ = inputs()
    ex = torch._dynamo.explain(m)(x, sp)
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    m._seq.discard()  # a forward for backward whose backward never runs, as eagerly
    ex = torch._dynamo.explain(mlp())(*inputs()[:2], inputs()[2], inputs()[1])
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    with torch.no_grad():
        assert torch.equal(m(x, sp), torch.compile(m, fullgraph=True)(x, sp))


def test_grouped_seq_split_tensor_values_without_recompile():
    """Split sizes as a tensor: a graph input, so new values run the same graph."""
    torch._dynamo.reset()
    backend, n = counting_backend()
    cm = torch.compile(mlp(), backend=backend, fullgraph=True)
    for splits in ([32, 64, 0], [0, 96, 32], [128, 0, 0]):
        same(step(mlp(), None, splits), step(cm, None, splits))
    assert n[0] == 1, n[0]


def test_grouped_seq_forward_only_and_microbatch():
    torch._dynamo.reset()
    m, cm = mlp(), torch.compile(mlp(), fullgraph=True)
    with torch.no_grad():
        same([m(*inputs(), inputs()[1])], [cm(*inputs(), inputs()[1])])
    r = RECIPES["current"]
    with ot.autocast(recipe=r), torch.no_grad():
        for first in (True, False, False):
            x, sp, sc = inputs()
            a = m(x, sp, sc, sp, is_first_microbatch=first)
            b = cm(x, sp, sc, sp, is_first_microbatch=first)
            assert torch.equal(a, b)
    m.custom_ops = True  # the path torch.compile traces
    with pytest.raises(opfuse.UnsupportedError, match="is_first_microbatch"):
        m(*inputs(), inputs()[1], is_first_microbatch=torch.tensor(1))


def test_grouped_seq_opcheck():
    m = mlp()
    x, sp, sc = inputs()
    outs = ot._whole_outputs(m._key, 0, False, False, int(opfuse.DType.F32), 64,
                             ((int(opfuse.DType.I64), (3,)), (int(opfuse.DType.F32), (-1,)),
                              (int(opfuse.DType.I64), (3,))), ())
    # forward only: each call for backward must be followed by its backward
    args = (x, [sp, sc, sp], [p.detach() for p in m._plist], m._key, 0, False, False, 0,
            [f for f, _ in outs], [d for _, d in outs])
    torch.library.opcheck(torch.ops.opfuse.seq_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))


def test_grouped_seq_bad_input_raises_and_changes_nothing():
    torch._dynamo.reset()
    m = mlp()
    m.custom_ops = True  # the path torch.compile traces, without Dynamo's wrapping
    cm = m
    before = [p.detach().clone() for p in m._plist]
    x, sp, sc = inputs()
    x0 = x.clone()
    with pytest.raises(opfuse.ShapeError, match="split sizes sum to 200"):
        cm(x, torch.tensor([100, 100, 0]), sc, sp)
    with pytest.raises(opfuse.ShapeError, match="input has 32 features"):
        cm(torch.zeros(ROWS, 32), sp, sc, sp)
    with pytest.raises(opfuse.DtypeError):
        cm(x.double(), sp, sc, sp)
    with pytest.raises(opfuse.Error):
        cm(x, sp, torch.rand(ROWS - 1), sp)
    with pytest.raises(opfuse.StateError, match="previous forward's backward has not run"):
        cm(x, sp, sc, sp)
        cm(x, sp, sc, sp)  # as eagerly: one backward per forward
    m._seq.discard()
    assert torch.equal(x, x0)
    same(before, [p.detach() for p in m._plist])
    same(step(m, None), step(mlp(), None))
    cm = torch.compile(m, fullgraph=True)  # a C error at run time comes out as it is
    with pytest.raises(opfuse.ShapeError, match="split sizes sum to 200"):
        cm(x, torch.tensor([100, 100, 0]), sc, sp)
    same(before, [p.detach() for p in m._plist])


def test_grouped_seq_dynamic_batch_one_graph():
    torch._dynamo.reset()
    backend, n = counting_backend()
    cm = torch.compile(mlp(), backend=backend, fullgraph=True, dynamic=True)
    for rows in (128, 192, 256):
        same(step(mlp(), None, SPLITS, rows), step(cm, None, SPLITS, rows))
    assert n[0] == 1, n[0]
