"""Ops, seqs, training steps, the compiled path and checkpoints from Python,
checked against NumPy float64 references of the same math."""
import numpy as np
import pytest

import opfuse
from opfuse import DType

f32, f64 = np.float32, np.float64
rng = np.random.default_rng(11)


def randn(*shape):
    return rng.standard_normal(shape).astype(f32)


def layernorm_ref(x, g, b, eps=1e-5):
    x = x.astype(f64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def lnmlp(hidden=64, ffn=128):
    ctx = opfuse.Context(seed=1)
    seq = opfuse.Seq(ctx=ctx)
    seq.append(opfuse.Op("layernorm", {"hidden": hidden, "eps": 1e-5, "dtype": DType.F32},
                         "ln", ctx=ctx))
    seq.append_linear(hidden, ffn, True, DType.F32, "fc1")
    seq.append(opfuse.Op("gelu", None, "act", ctx=ctx))
    seq.append_linear(ffn, hidden, True, DType.F32, "fc2")
    return seq


def init(seq):
    for p in seq.params():
        p.value[...] = rng.standard_normal(p.value.shape).astype(f32) * 0.1 + (
            1.0 if p.name == "weight" and p.value.ndim == 1 else 0.0)


def test_params_share_memory_with_c():
    seq = lnmlp()
    names = [(p.name, p.value.shape) for p in seq.params()]
    assert ("weight", (128, 64)) in names and len(names) == 6
    w = seq[1].params()[0].value
    w[...] = 0
    assert np.all(seq[1].params()[0].value == 0)  # same memory


def test_layernorm_linear_forward_backward_matches_numpy():
    ctx = opfuse.Context()
    seq = opfuse.Seq(ctx=ctx)
    seq.append(opfuse.Op("layernorm", {"hidden": 32, "eps": 1e-5, "dtype": DType.F32}, "ln",
                         ctx=ctx))
    seq.append_linear(32, 16, False, DType.F32, "fc")
    (g, b), (w,) = [p.value for p in seq[0].params()], [p.value for p in seq[1].params()]
    g[...] = 1 + 0.1 * randn(32)
    b[...] = 0.1 * randn(32)
    w[...] = 0.2 * randn(16, 32)
    x = randn(8, 32)
    y = seq.forward(x)
    ref = layernorm_ref(x, g, b) @ w.astype(f64).T
    assert np.allclose(y, ref, rtol=1e-4, atol=1e-4)
    dy = randn(8, 16)
    dx = seq.backward(dy)
    assert dx.shape == x.shape
    dw = seq[1].params()[0].grad
    assert np.allclose(dw, dy.astype(f64).T @ layernorm_ref(x, g, b), rtol=1e-4, atol=1e-4)


def test_plans_show_fusions():
    seq = lnmlp()
    init(seq)
    seq.forward(randn(16, 64))
    seq.discard()
    fwd, bwd = seq.plans()[0]
    assert any(cls.startswith("forward_linear_bias") for _, cls, _, _ in fwd)


@pytest.mark.parametrize("recipe", [None, opfuse.Recipe.current(), opfuse.Recipe.mxfp8(),
                                    opfuse.Recipe.block(), opfuse.Recipe.nvfp4(),
                                    opfuse.Recipe.delayed()])
def test_training_compiled_equals_eager_bitwise(recipe):
    def run(compiled):
        seq = lnmlp()
        rng2 = np.random.default_rng(5)
        for p in seq.params():
            p.value[...] = rng2.standard_normal(p.value.shape).astype(f32) * 0.1
        opt = opfuse.Optim(seq, opfuse.OptimKind.ADAMW, lr=1e-2)
        runner = opfuse.Compiled(seq) if compiled else seq
        losses = []
        for step in range(3):
            x = rng2.standard_normal((32, 64)).astype(f32)
            seq.zero_grad()
            y = runner.forward(x, recipe=recipe)
            losses.append(float(np.sum(y.astype(f64) ** 2)))
            runner.backward((2 * y).astype(f32))
            opt.step()
        return losses, [p.value.copy() for p in seq.params()]

    le, pe = run(False)
    lc, pc = run(True)
    assert le == lc
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(pe, pc))
    assert all(np.isfinite(v).all() for v in pe)


def test_compiled_stats_and_dynamic_leading():
    seq = lnmlp()
    init(seq)
    c = opfuse.Compiled(seq, max_leading=64)
    for n in (64, 17, 32):
        y = c.forward(randn(n, 64))
        assert y.shape == (n, 64)
        c.backward(np.ones((n, 64), f32))
    st = c.stats()
    assert st["recompiles"] == 0 and st["n_eager"] == 0 and st["n_fused"] >= 1


def test_kwargs_is_first_microbatch():
    seq = opfuse.Seq()
    seq.append_linear(64, 64, False, DType.F32, "fc")
    init(seq)
    x = randn(32, 64)
    r = opfuse.Recipe.current()
    y1 = seq.forward(x, recipe=r, requires_grad=False, kwargs=[{"is_first_microbatch": 1}])
    y2 = seq.forward(x, recipe=r, requires_grad=False, kwargs=[{"is_first_microbatch": 0}])
    assert np.array_equal(y1, y2)
    with pytest.raises(opfuse.InvalidArgError, match="entries"):
        seq.forward(x, kwargs=[None, None])


def test_bad_input_raises_and_changes_nothing():
    seq = lnmlp()
    init(seq)
    before = [p.value.copy() for p in seq.params()]
    with pytest.raises(opfuse.ShapeError) as e:
        seq.forward(randn(8, 63))
    assert "63" in str(e.value)
    with pytest.raises(opfuse.ShapeError):
        seq.forward(randn(30, 64), recipe=opfuse.Recipe.mxfp8())  # 30 rows: not a multiple of 32
    with pytest.raises(opfuse.StateError):
        seq.backward(randn(8, 64))  # no forward ran
    assert all(np.array_equal(a, p.value) for a, p in zip(before, seq.params()))
    with pytest.raises(opfuse.InvalidArgError):
        opfuse.Op("no_such_op")


def test_checkpoint_round_trip(tmp_path):
    seq = lnmlp()
    init(seq)
    opt = opfuse.Optim(seq)
    x = randn(32, 64)
    y = seq.forward(x, recipe=opfuse.Recipe.delayed())
    seq.backward(np.ones_like(y))
    opt.step()
    path = tmp_path / "ck.safetensors"
    seq.save(path, opt)
    seq2 = lnmlp()
    opt2 = opfuse.Optim(seq2)
    seq2.prepare(opfuse.Recipe.delayed())
    seq2.load(path, opt2)
    assert all(np.array_equal(a.value, b.value) for a, b in zip(seq.params(), seq2.params()))
    assert opt2.step_count == 1
    path.write_bytes(b"garbage")
    with pytest.raises(opfuse.CorruptError):
        seq2.load(path, opt2)
    with pytest.raises(opfuse.IOError):
        seq2.load(tmp_path / "missing.safetensors")
