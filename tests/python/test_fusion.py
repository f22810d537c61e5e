"""User fusions from Python: fusion functions over op windows registered
with the C fuser, taken eagerly (the plans hold their fused ops) and under
torch.compile (the traced graph calls the fused classes' custom ops), with
compiled == eager == the opfuse layer's C calls bit for bit; a function
that raises or returns a bad list fails the forward with its message."""
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402


def window_fusion(cls, pattern, calls):
    """A sliding-window fusion: every run of basic ops of classes pattern
    becomes one cls."""
    def fn(ops, recipe):
        calls.append(([o.class_name for o in ops], recipe))
        out, i, k = [], 0, len(pattern)
        while i < len(ops):
            win = ops[i:i + k]
            if len(win) == k and not any(o.fused for o in win) and \
                    tuple(o.class_name for o in win) == pattern:
                out.append(ot.Fused(cls, win))
                i += k
            else:
                out.append(ops[i])
                i += 1
        return out
    return fn


@pytest.fixture
def fusions():
    names = []
    yield names
    for n in names:
        ot.unregister_fusion(n)


def mlp():
    m = ot.Sequential(ot.Linear(64, 128), ot.GELU(), ot.Linear(128, 64))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    return m


def step(m, recipe=None):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with ot.autocast(recipe=recipe):
        y = m(x)
    y.square().sum().backward()
    out = [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return out


def same(a, b):
    bad = [i for i, (u, v) in enumerate(zip(a, b)) if not torch.equal(u, v)]
    assert len(a) == len(b) and not bad, f"tensors {bad} differ"


def plan_classes(m, backward):
    return [e[0].split("(")[0] for g in m.plans() for e in g[1 if backward else 0]]


def compiled_classes(m):
    x = torch.zeros(64, 64, requires_grad=True)
    prog = ot._resolved(m._key, 0, True, True, ot._FROM_TORCH_DT[x.dtype], 64, (), 64)[0]
    return [st[1] for st in prog[0] + prog[1] if st[0] == "op"]


@pytest.mark.parametrize("recipe", [None, "fp8-current"])
def test_python_forward_fusion_taken_eager_and_compiled(fusions, recipe):
    r = opfuse.Recipe.current() if recipe else None
    ref = step(mlp(), r)  # built-in plans: linear+bias+gelu fused forward
    calls = []
    fusions.append(ot.register_forward_fusion(
        window_fusion("forward_linear_bias", ("basic_linear", "bias"), calls),
        name="py_linear_bias", prepend=True))
    m = mlp()
    eager = step(m, r)
    assert calls and calls[0][0][:3] == ["basic_linear", "bias", "gelu"] and calls[0][1] == recipe
    fwd = plan_classes(m, False)
    assert fwd.count("forward_linear_bias") == 2 and "forward_linear_bias_activation" not in fwd
    same(ref, eager)  # f32: the fused forwards are bitwise the unfused ones
    assert compiled_classes(mlp()).count("forward_linear_bias_fwd") == 2
    torch._dynamo.reset()
    same(eager, step(torch.compile(mlp(), fullgraph=True, dynamic=False), r))


def test_python_backward_fusion_taken_eager_and_compiled(fusions):
    calls = []
    m0 = ot.Sequential(ot.MakeExtraOutput("r", in_place=True), ot.Linear(64, 64, bias=False),
                       ot.AddExtraInput("r"))
    fusions.append(ot.register_backward_fusion(
        window_fusion("backward_linear_add", ("make_extra_output", "basic_linear"), calls),
        name="py_linear_add", prepend=True))
    m = ot.Sequential(ot.MakeExtraOutput("r", in_place=True), ot.Linear(64, 64, bias=False),
                      ot.AddExtraInput("r"))
    with torch.no_grad():
        for a, b in zip(m.parameters(), m0.parameters()):
            b.copy_(a)
    eager = step(m)
    assert calls and "backward_linear_add" in plan_classes(m, True)
    assert "backward_linear_add_bwd" in compiled_classes(m)
    torch._dynamo.reset()
    m2 = ot.Sequential(ot.MakeExtraOutput("r", in_place=True), ot.Linear(64, 64, bias=False),
                       ot.AddExtraInput("r"))
    with torch.no_grad():
        for a, b in zip(m.parameters(), m2.parameters()):
            b.copy_(a)
    same(eager, step(torch.compile(m2, fullgraph=True, dynamic=False)))


def test_bad_fusions_fail_with_their_message(fusions):
    def raises(ops, recipe):
        raise ValueError("no window today")

    def drops(ops, recipe):
        return ops[1:]

    def nests(ops, recipe):
        return [ot.Fused("forward_linear_bias", ops[:3])] + ops[3:]
    x = torch.randn(64, 64)
    for fn, err, msg in ((raises, opfuse.InvalidArgError, "raised ValueError: no window today"),
                         (drops, opfuse.InvalidArgError, "does not map back"),
                         (nests, opfuse.Error, "forward_linear_bias")):
        name = ot.register_forward_fusion(fn, name="py_bad", prepend=True)
        try:
            m = mlp()
            before = [p.detach().clone() for p in m.parameters()]
            with pytest.raises(err, match=msg):
                m(x)
            same(before, [p.detach() for p in m.parameters()])
        finally:
            ot.unregister_fusion(name)
    with pytest.raises(opfuse.InvalidArgError, match="already registered"):
        ot.register_forward_fusion(raises, name="forward_linear_bias_activation")
    with pytest.raises(opfuse.InvalidArgError, match="no Python fusion"):
        ot.unregister_fusion("py_never")
    same(step(mlp()), step(mlp()))  # the registries are as they were
