"""opfuse.torch's eager call path (Seq.forward_torch / backward_torch):
torch tensors in and out of C, the same bits whatever the input's layout
or lifetime, and nothing kept once the backward has run."""
import sys

import pytest

torch = pytest.importorskip("torch")

import opfuse.torch as ot  # noqa: E402


def grads(m, x, dy):
    """y, dx and the parameter gradients of one forward + backward."""
    x = x.detach().requires_grad_()
    for p in m.parameters():
        p.grad = None
    y = m(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def model():
    torch.manual_seed(3)
    return ot.Sequential(ot.LayerNorm(32), ot.Linear(32, 48), ot.GELU(), ot.Linear(48, 32))


def test_strided_input_and_gradient_same_bits():
    m = model()
    x, dy = torch.randn(32, 8).t(), torch.randn(32, 8).t()  # both strided
    want = grads(m, x.contiguous(), dy.contiguous())
    got = grads(m, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_input_freed_before_backward_same_bits():
    torch.manual_seed(4)
    m = ot.Sequential(ot.Linear(32, 48), ot.GELU(), ot.Linear(48, 32))  # the wgrad reads x
    x = torch.randn(64, 32)
    want = grads(m, x, torch.ones(64, 32))
    for p in m.parameters():
        p.grad = None
    y = m(x.clone())  # the caller drops its input at once (no grad: no graph holds it)
    junk = [torch.full((64, 32), 7.0) for _ in range(64)]  # noqa: F841 (reuses freed memory)
    y.sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want[2:]))


def test_no_grad_forward_same_bits_and_repeatable():
    m = model()
    x = torch.randn(8, 32)
    y = m(x)  # parameters want grads: a backward is pending
    y.sum().backward()
    with torch.no_grad():
        a, b = m(x), m(x)
    assert torch.equal(a, y.detach()) and torch.equal(a, b) and a.grad_fn is None


def test_backward_lets_go_of_the_input():
    m = model()
    x = torch.randn(8, 32, requires_grad=True)
    before = sys.getrefcount(x)
    y = m(x)
    y.sum().backward()
    del y
    assert sys.getrefcount(x) == before
