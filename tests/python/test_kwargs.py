"""Kwargs from Python: the is_first_microbatch weight-cache schedule (the
first microbatch quantizes every basic_linear's weight and caches it, later
ones reuse the cache) and value kwargs, eagerly (the C fuser), op by op
(the custom ops) and under torch.compile, bit for bit against the opfuse
layer's C calls; a tensor flag runs the whole schedule in one graph, a
Python value compiles one graph per value."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from opfuse.torch import _program  # noqa: E402

RECIPES = {"current": opfuse.Recipe.current(), "mxfp8": opfuse.Recipe.mxfp8(),
           "block": opfuse.Recipe.block(), "nvfp4": opfuse.Recipe.nvfp4(),
           "delayed": opfuse.Recipe.delayed()}
SCHEDULE = [True, False, False, True, False]


def mlp(hidden=128, ffn=256, custom_ops=False):
    m = ot.Sequential(ot.Linear(hidden, ffn), ot.GELU(), ot.Linear(ffn, hidden),
                      custom_ops=custom_ops)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return m


def x_of(step, rows=128, hidden=128):
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(10 + step))


def schedule(m, recipe, flags, as_tensor=False, touch=True):
    """Runs the microbatches of flags; between them the weights move (an
    optimizer step would), so a reused cache shows in the bits."""
    out = []
    for s, f in enumerate(flags):
        opfuse.default_context().set_rng(5, s)
        x = x_of(s).requires_grad_()
        flag = torch.tensor(int(f)) if as_tensor and f is not None else f
        with ot.autocast(recipe=recipe):
            y = m(x, is_first_microbatch=flag)
        y.square().sum().backward()
        out += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        if touch:
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(0.75)
    return out


def c_schedule(recipe, flags):
    """The same schedule through the opfuse layer's C calls."""
    m = mlp()
    seq = m._seq
    out = []
    for s, f in enumerate(flags):
        opfuse.default_context().set_rng(5, s)
        kw = None if f is None else [{"is_first_microbatch": int(f)} if i in m._linears else None
                                     for i in range(len(seq))]
        y, _ = seq._s.forward(ot.to_opf(x_of(s)), recipe, True, True, None, kw)
        yt = ot.to_torch(y).clone()
        dx, _ = seq._s.backward(ot.to_opf(2 * yt), None)
        out += [yt, ot.to_torch(dx).clone()] + [g.clone() for g in m._c_grads]
        seq.zero_grad()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.75)
    return out


def same(a, b):
    assert len(a) == len(b)
    bad = [i for i, (u, v) in enumerate(zip(a, b)) if not torch.equal(u, v)]
    assert not bad, f"tensors {bad} differ"


def compiles():
    return sum(torch._dynamo.utils.counters["stats"].values()) and \
        torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_schedule_eager_ops_c_api(recipe):
    r = RECIPES[recipe]
    eager = schedule(mlp(), r, SCHEDULE)
    same(eager, c_schedule(r, SCHEDULE))
    same(eager, schedule(mlp(custom_ops=True), r, SCHEDULE))
    same(eager, schedule(mlp(custom_ops=True), r, SCHEDULE, as_tensor=True))
    same(eager, schedule(mlp(), r, SCHEDULE, as_tensor=True))


def test_cache_is_reused():
    """False reads the cache of the last True: weights moved since then do
    not show (None re-quantizes them and does)."""
    r = RECIPES["current"]
    cached = schedule(mlp(), r, [True, False])
    fresh = schedule(mlp(), r, [True, None])
    assert torch.equal(cached[0], fresh[0])
    assert not torch.equal(cached[6], fresh[6])  # the second microbatch's y


def test_reuse_without_cache_raises_c_message():
    m = mlp()
    with pytest.raises(opfuse.StateError, match="is_first_microbatch=0 reuses"):
        with ot.autocast(recipe=RECIPES["current"]):
            m(x_of(0), is_first_microbatch=False)
    with pytest.raises(opfuse.InvalidArgError, match="op_kwargs names op 9"):
        m(x_of(0), op_kwargs={9: {"training": True}})


def _count_compiles(m):
    n = [0]

    def backend(gm, inputs):
        n[0] += 1
        return gm.forward
    return torch.compile(m, backend=backend, fullgraph=True, dynamic=False), n


@pytest.mark.parametrize("recipe", ["current", "mxfp8", "delayed"])
def test_compiled_tensor_flag_one_graph(recipe):
    torch._dynamo.reset()
    r = RECIPES[recipe]
    eager = schedule(mlp(), r, SCHEDULE)
    cm, n = _count_compiles(mlp())
    same(eager, schedule(cm, r, SCHEDULE, as_tensor=True))
    assert n[0] == 1, f"{n[0]} compiles for the schedule"
    torch._dynamo.reset()
    same(eager, schedule(torch.compile(mlp(), fullgraph=True, dynamic=False), r, SCHEDULE,
                         as_tensor=True))


def test_compiled_value_flag_one_graph_per_value():
    torch._dynamo.reset()
    r = RECIPES["current"]
    eager = schedule(mlp(), r, SCHEDULE)
    cm, n = _count_compiles(mlp())
    same(eager, schedule(cm, r, SCHEDULE))
    assert n[0] == 2, f"{n[0]} compiles for two values"


def test_opcheck_reusing_the_cache():
    """opcheck on every call of the tensor-flag program as a reusing
    microbatch runs it (flag 0: the caches are read only; flag 1 writes
    them, the op's own memory, which no opcheck sees declared)."""
    m, r = mlp(custom_ops=True), RECIPES["mxfp8"]
    schedule(m, r, [True], as_tensor=True, touch=False)
    x = x_of(0)
    kw = m._kwargs(torch.tensor(0), None)
    prog, delayed = ot._resolved(m._key, ot._recipe_id(r), True, True, ot._FROM_TORCH_DT[x.dtype],
                                 x.shape[-1], (), x.shape[0], kw)
    env = {(prog[4], 0): x, ot._FLAG: torch.tensor(0)}
    env.update((q, m._cache_views[q]) for q in prog[12])
    params = [p.detach() for p in m._plist]
    seen = []

    def check(op, args):
        seen.append(op.name())
        torch.library.opcheck(op, args)
    _program.run(prog[0], env, params, x.shape[0], delayed, check)
    env[(prog[6], 0)] = torch.randn_like(env[(prog[5], 0)])
    _program.run(prog[1], env, params, x.shape[0], delayed, check)
    assert "opfuse::basic_linear_bwd" in seen and len(seen) >= 4


def test_bad_input_raises_and_changes_nothing():
    """Wrong dtypes and shapes, a recipe the shape cannot take, a bad flag,
    a closed context: the C message, the caller's tensors and the
    parameters untouched, the model usable after."""
    m = mlp()
    before = [p.detach().clone() for p in m.parameters()]
    x = x_of(0)
    x0 = x.clone()
    with pytest.raises(opfuse.ShapeError, match="mxfp8 needs both dims"):
        with ot.autocast(recipe=RECIPES["mxfp8"]):
            m(x[:30], is_first_microbatch=True)
    with pytest.raises(opfuse.ShapeError, match="basic_linear"):
        m(torch.zeros(16, 96), is_first_microbatch=torch.tensor(1))
    with pytest.raises(opfuse.DtypeError):
        m(x.to(torch.int32))
    for bad in (torch.tensor([1, 0]), torch.tensor(1.0)):
        with pytest.raises(opfuse.DtypeError, match="one integer or bool element"):
            with ot.autocast(recipe=RECIPES["current"]):
                m._forward_ops(x, (), False, bad, None)
    with pytest.raises(opfuse.InvalidArgError, match="is_first_microbatch"):
        with ot.autocast(recipe=RECIPES["current"]):
            m(x, op_kwargs={0: {"is_first_microbatch": 7}})
    assert torch.equal(x, x0)
    same(before, [p.detach() for p in m.parameters()])
    same(schedule(m, RECIPES["current"], [True, False], touch=False),
         schedule(mlp(), RECIPES["current"], [True, False], touch=False))

    ctx = opfuse.Context()
    c = ot.Sequential(ot.Linear(128, 128), ctx=ctx)
    c(x)
    ctx.close()
    with pytest.raises(opfuse.StateError, match="closed"):
        c(x)
    # compiled: raised while Dynamo traces, which wraps it (the cause is ours)
    with pytest.raises(Exception) as info:
        torch.compile(c, fullgraph=True)(x)
    err = info.value
    while err is not None and not isinstance(err, opfuse.Error):
        err = err.__cause__ or err.__context__
    assert isinstance(err, opfuse.StateError) and "closed" in str(err), repr(info.value)
    assert torch.equal(x, x0)


def chain(q_backward):
    m = ot.Sequential(ot.Linear(128, 128), ot.Quantize(backward=q_backward), ot.Linear(128, 128))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return m


@pytest.mark.parametrize("recipe", ["current", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("q_backward", [False, True])
def test_quantized_output_into_next_op(recipe, q_backward):
    """Quantize hands the next Linear an FP8 (FP4) activation: the traced
    graph carries it as its component tensors; training and the
    forward-only path compile with the eager bits, caller memory untouched."""
    torch._dynamo.reset()
    r = RECIPES[recipe]
    m = chain(q_backward)
    prog = ot._resolved(m._key, ot._recipe_id(r), True, True, 0, 128, (), 128)[0]
    assert "quantize_fwd" in [st[1] for st in prog[0]]
    eager = schedule(m, r, [None, None], touch=False)
    same(eager, schedule(torch.compile(chain(q_backward), fullgraph=True, dynamic=False), r,
                         [None, None], touch=False))
    x = x_of(0)
    x0 = x.clone()
    with torch.no_grad(), ot.autocast(recipe=r):
        y_eager, y_comp = m(x), torch.compile(chain(q_backward), fullgraph=True)(x)
    assert torch.equal(y_eager, y_comp) and torch.equal(y_eager, eager[0]) and torch.equal(x, x0)


def test_value_kwarg_compiles_once_per_value():
    """dropout's training kwarg is a value: each new value compiles a graph
    of its own, a value seen before reuses its graph; every call equals
    eager (the same Philox draws)."""
    torch._dynamo.reset()

    def make():
        m = ot.Sequential(ot.Linear(128, 128), ot.Dropout(0.25), ot.Linear(128, 128))
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
        return m

    def run(m, values):
        out = []
        for s, v in enumerate(values):
            opfuse.default_context().set_rng(9, s)
            x = x_of(s).requires_grad_()
            y = m(x, op_kwargs={2: {"training": v}})  # basic ops: linear, bias, dropout
            y.square().sum().backward()
            out += [y.detach(), x.grad]
        return out
    values = [True, False, True, False, True]
    eager = run(make(), values)
    opfuse.default_context().set_rng(9, 0)
    assert not torch.equal(eager[0], run(make(), [False])[0])  # dropout on differs from off
    cm, n = _count_compiles(make())
    same(eager, run(cm, values))
    assert n[0] == 2, f"{n[0]} compiles for two values"
