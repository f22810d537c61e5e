"""opfuse.torch custom ops: one torch.library op per op class and direction
(schema flattened from the C field schema, fakes from the C fakes), checked
by torch.library.opcheck, and whole models under torch.compile(fullgraph=True)
with no graph break and the eager bits."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from opfuse.torch import _ops, _program  # noqa: E402

RECIPES = {"none": None, "mxfp8": opfuse.Recipe.mxfp8(), "current": opfuse.Recipe.current(),
           "block": opfuse.Recipe.block(), "nvfp4": opfuse.Recipe.nvfp4(),
           "delayed": opfuse.Recipe.delayed()}


def make(custom_ops=False, hidden=64, ffn=128):
    m = ot.Sequential(ot.LayerNorm(hidden), ot.Linear(hidden, ffn), ot.GELU(),
                      ot.Linear(ffn, hidden), custom_ops=custom_ops)
    with torch.no_grad():
        for name, p in m.named_parameters():
            g = torch.Generator().manual_seed(p.numel())
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (name == "op0_weight"))
    return m


def run(m, recipe, x, mark_dynamic=False):
    """Loss, input gradient and parameter gradients of one step."""
    opfuse.default_context().set_rng(5, 0)  # NVFP4's stochastic rounding
    x = x.clone().requires_grad_()
    if mark_dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    with ot.autocast(recipe=recipe):
        y = m(x)
    y.square().sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in m.parameters()]


def assert_same_bits(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for p, q in zip(a[2], b[2]):
        assert torch.equal(p, q)


def x_in(rows=64, hidden=64):
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1))


def test_every_class_registers():
    names = _ops.register_all()
    for cls in ("layernorm", "rmsnorm", "basic_linear", "bias", "gelu", "swiglu",
                "forward_linear_bias_activation"):
        assert cls in names
        assert hasattr(torch.ops.opfuse, cls + "_fwd")
    assert hasattr(torch.ops.opfuse, "layernorm_bwd")


@pytest.mark.parametrize("recipe", RECIPES)
def test_custom_ops_equal_eager(recipe):
    x = x_in()
    assert_same_bits(run(make(False), RECIPES[recipe], x), run(make(True), RECIPES[recipe], x))


def program(m, x, recipe, needs_grad=True):
    dt = ot._FROM_TORCH_DT[x.dtype]
    return ot._resolved(m._key, ot._recipe_id(recipe), needs_grad, needs_grad, dt, x.shape[-1],
                        (), x.shape[0])


def each_call(m, x, recipe, on_call):
    """Runs the traced graph's forward and backward steps eagerly, handing
    every custom-op call to on_call first."""
    prog, delayed = program(m, x, recipe)
    env = {(prog[4], 0): x, _program.DEVICE: x.device}
    params = [p.detach() for p in m._plist]
    _program.run(prog[0], env, params, x.shape[0], delayed, on_call)
    y = env[(prog[5], 0)]
    env[(prog[6], 0)] = torch.randn_like(y)
    _program.run(prog[1], env, params, x.shape[0], delayed, on_call)


@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_opcheck_forward_and_backward(recipe):
    """opcheck on every call of the graph, fused and backward-only ops included."""
    m, r = make(True), RECIPES[recipe]
    seen = []

    def check(op, args):
        seen.append(op.name())
        torch.library.opcheck(op, args)
    each_call(m, x_in(), r, check)
    assert "opfuse::forward_linear_bias_activation_fwd" in seen
    assert "opfuse::layernorm_bwd" in seen


@pytest.mark.parametrize("recipe", ["none", "mxfp8", "current"])
def test_compile_fullgraph_no_break_same_bits(recipe):
    torch._dynamo.reset()
    m, r, x = make(False), RECIPES[recipe], x_in()
    eager = run(m, r, x)
    m.zero_grad()
    with ot.autocast(recipe=r):
        ex = torch._dynamo.explain(m)(x.clone().requires_grad_())
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, dynamic=False)
    m.zero_grad()
    assert_same_bits(eager, run(cm, r, x))


def test_custom_ops_bad_input_raises_c_message():
    m = make(True)
    with pytest.raises(opfuse.ShapeError, match="layernorm"):
        m(torch.randn(8, 32))
    with pytest.raises(opfuse.DtypeError):
        m(torch.randn(8, 64, dtype=torch.float64))
    _ops.class_ops("bias")
    tiny = torch.zeros(4, dtype=torch.uint8)   # an MXFP8 [64, 64] x needs far more
    # x: data + scale_inv (mask 3), MXFP8 e4m3 rowwise; b present; next_q; bwd_override; plan
    values = [3, int(opfuse.DType.F32), int(opfuse.Scaling.MXFP8), int(opfuse.DType.E4M3), 1, 0,
              1] + [0] * 14 + [0, 0]
    with pytest.raises(opfuse.ShapeError, match="needs"):
        torch.ops.opfuse.bias_fwd([tiny, tiny, torch.randn(64)], values, [2, 64, 64, 64])


def python_calls(fn) -> list:
    """The Python functions of opfuse that fn runs."""
    import sys
    seen = []

    def prof(frame, event, arg):
        if event == "call" and "opfuse" in frame.f_code.co_filename:
            seen.append(frame.f_code.co_name)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [s for s in seen if s != "<lambda>"]


@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_impls_run_without_python(recipe):
    """A compiled graph calls its forward ops with grad off and its backward
    ops directly: both reach C with no Python function in between, and
    give what the class's ClassCall gives."""
    m, r = make(True), RECIPES[recipe]

    def check(op, args):
        with torch.no_grad():
            assert python_calls(lambda: op(*args)) == []
            out = op(*args)
        cls, which = op.name().split("::")[1].rsplit("_", 1)
        direct = opfuse._C.ClassCall(cls, which == "bwd")(*args)
        assert all(torch.equal(a, b) for a, b in zip(out, direct))
    each_call(m, x_in(), r, check)


def test_packed_arguments_checked():
    _ops.class_ops("bias")
    x, b = torch.randn(4, 8), torch.randn(8)
    values = [1, 0, 0, 0, 0, 0, 1] + [0] * 14 + [0, 0]
    assert torch.equal(torch.ops.opfuse.bias_fwd([x, b], values, [4])[0], x + b)
    with pytest.raises(opfuse.InvalidArgError, match="no row count"):
        torch.ops.opfuse.bias_fwd([x, b], values, [])
    with pytest.raises(opfuse.InvalidArgError, match="values list ends early"):
        torch.ops.opfuse.bias_fwd([x, b], values[:10], [4])
    with pytest.raises(opfuse.InvalidArgError, match="left over"):
        torch.ops.opfuse.bias_fwd([x, b, b], values, [4])
    with pytest.raises(opfuse.InvalidArgError, match="tensors list ends early"):
        torch.ops.opfuse.bias_fwd([x], values, [4])
    with pytest.raises(opfuse.InvalidArgError, match="not contiguous"):
        torch.ops.opfuse.bias_fwd([x.t().contiguous().t(), b], values, [4])
    assert [n for n, _ in _ops.describe("bias")] == ["x", "b", "next_q", "bwd_override"]


def dynamic_steps(m, cm, recipe, inputs, mark_dynamic=False):
    """Eager and compiled steps on each input, same bits; the graphs made."""
    from torch._dynamo.utils import counters
    counters.clear()
    for x in inputs:
        eager = run(m, recipe, x)
        m.zero_grad()
        assert_same_bits(eager, run(cm, recipe, x, mark_dynamic))
        m.zero_grad()
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("recipe", ["none", "mxfp8", "current", "nvfp4"])
def test_compile_dynamic_rows_no_recompile(recipe):
    """dynamic=True: the fakes give outputs whose rows are the symbolic row
    count (quantized components' padded sizes too), so new batch sizes reuse
    the one graph, with the eager bits; a 3D input is one graph more (its
    rank). (The first call has rows != features: Dynamo gives equal sizes
    one symbol, and the features are pinned.)"""
    torch._dynamo.reset()
    m, r = make(False), RECIPES[recipe]
    cm = torch.compile(m, fullgraph=True, dynamic=True)
    xs = [x_in(rows) for rows in (96, 64, 160)] + [x_in(96).reshape(3, 32, 64)]
    assert dynamic_steps(m, cm, r, xs) == 2


def test_compile_mark_dynamic_rows():
    torch._dynamo.reset()
    m, r = make(False), RECIPES["mxfp8"]
    cm = torch.compile(m, fullgraph=True)
    xs = [x_in(rows) for rows in (64, 128, 32)]
    assert dynamic_steps(m, cm, r, xs, mark_dynamic=True) == 1


def steps(m, recipe, n=3):
    """n training steps on growing inputs (so delayed scaling's history and
    scales move); each step's loss, input and parameter gradients."""
    out = []
    for i in range(n):
        out.append(run(m, recipe, x_in() * (1 + 2 * i)))
        m.zero_grad()
    return out


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8"])
def test_compiled_steps_carry_recipe_state(recipe):
    """Delayed scaling's amax history and scales update after each forward
    and each backward under compile as eagerly (an ordered custom op):
    compiled == eager bit for bit over several steps."""
    torch._dynamo.reset()
    r = RECIPES[recipe]
    eager = steps(make(False), r)
    compiled = steps(torch.compile(make(False), fullgraph=True, dynamic=False), r)
    custom = steps(make(True), r)
    for a, b, c in zip(eager, compiled, custom):
        assert_same_bits(a, b)
        assert_same_bits(a, c)
