"""Quantized primary weights (opf_op_set_param_quantized) from
opfuse.torch: the quantized weight as buffers, the Parameter its
dequantized copy carrying the gradient, the fp32 master in opfuse's
optimizer (opfuse.torch.Optimizer). Eager, compiled (fullgraph, no graph
break) and the opfuse layer's C calls agree bit for bit over training
steps; bad input raises the C message and changes nothing."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from test_grouped import same  # noqa: E402

CASES = {"current": (opfuse.Recipe.current(), opfuse.Quantizer.current()),
         "mxfp8": (opfuse.Recipe.mxfp8(), opfuse.Quantizer.mxfp8())}
STEPS = 2


def mlp(q=None):
    m = ot.Sequential(ot.LayerNorm(64), ot.Linear(64, 128), ot.GELU(), ot.Linear(128, 64))
    with torch.no_grad():
        for i, p in enumerate(m._plist):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1 + 0.5)
    if q is not None:
        m.set_param_quantized("op1_weight", q)
        m.set_param_quantized("op4_weight", q)
    return m


def x_of(s):
    return torch.randn(128, 64, generator=torch.Generator().manual_seed(s))


def train(m, recipe, model=None):
    """STEPS AdamW steps; model: the module holding the parameters (m may be
    its compiled form)."""
    model = m if model is None else model
    opt = ot.Optimizer(model, lr=1e-2)
    out = []
    for s in range(STEPS):
        x = x_of(s).requires_grad_()
        with ot.autocast(recipe=recipe):
            y = m(x)
        y.square().sum().backward()
        out += [y.detach(), x.grad] + [p.grad.clone() for p in model._plist]
        opt.step()
        opt.zero_grad()
    return out + [p.detach().clone() for p in model._plist] + [b.clone() for b in model.buffers()]


def c_train(recipe, q):
    """The same steps through the opfuse layer's C calls."""
    m = mlp()
    s = m._seq
    s[1]._h.set_param_quantized(0, q)
    s[4]._h.set_param_quantized(0, q)
    opt = opfuse.Optim(s, lr=1e-2)
    out = []
    for k in range(STEPS):
        x = x_of(k)
        y, _ = s._s.forward(ot.to_opf(x), recipe, True, True, None, None)
        y = ot.to_torch(y).clone()
        s.zero_grad()
        dx, _ = s._s.backward(ot.to_opf(2 * y), None)
        out += [y, ot.to_torch(dx).clone()] + [g.clone() for g in m._c_grads]
        opt.step()
    return out


@pytest.mark.parametrize("case", CASES)
def test_quantized_weights_eager_compiled_c_api(case):
    torch._dynamo.reset()
    recipe, q = CASES[case]
    eager = train(mlp(q), recipe)
    m = mlp(q)
    same(eager, train(torch.compile(m, fullgraph=True), recipe, m))
    c = c_train(recipe, q)
    n = len(c) // STEPS
    for k in range(STEPS):  # y, dx, the gradients; the primaries' gradients from the Parameters
        same(eager[k * n:(k + 1) * n], c[k * n:(k + 1) * n])
    assert not torch.equal(eager[-1], mlp(q).op4_weight_q0)  # the steps moved the weight


def test_quantized_weights_buffers_and_no_graph_break():
    torch._dynamo.reset()
    recipe, q = CASES["mxfp8"]
    m = mlp(q)
    names = [n for n, _ in m.named_buffers()]
    assert "op1_weight_q0" in names and "op1_weight_q1" in names
    assert m.op1_weight_q0.dtype == torch.float8_e4m3fn and m.op1_weight.shape == (128, 64)
    with ot.autocast(recipe=recipe):
        ex = torch._dynamo.explain(m)(x_of(0))
    assert ex.graph_break_count == 0 and ex.graph_count == 1


def test_quantized_weights_bad_input_raises_and_changes_nothing():
    recipe, q = CASES["current"]
    m = mlp()
    before = [p.detach().clone() for p in m._plist]
    with pytest.raises(opfuse.InvalidArgError, match="without delayed scaling"):
        m.set_param_quantized("op1_weight", opfuse.Quantizer())
    with pytest.raises(opfuse.InvalidArgError, match="no parameter \"op9_weight\""):
        m.set_param_quantized("op9_weight", q)
    same(before, [p.detach() for p in m._plist])
    m.set_param_quantized("op1_weight", q)
    with pytest.raises(opfuse.StateError, match="already quantized"):
        m.set_param_quantized("op1_weight", q)
    fresh = mlp()
    fresh.set_param_quantized("op1_weight", q)
    same(train(m, recipe), train(fresh, recipe))
