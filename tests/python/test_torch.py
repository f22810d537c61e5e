"""opfuse.torch: torch tensors through DLPack (float8 included), and the eager
Sequential (one C call per forward and backward) against torch CPU."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402


def test_torch_tensors_zero_copy_and_fp8_components():
    x = torch.randn(64, 128)
    t = ot.to_opf(x)
    assert t.data_ptr() == x.data_ptr()
    q = opfuse.quantize(x, opfuse.Quantizer.mxfp8())
    data = ot.component(q._t, opfuse.COMP_DATA)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (64, 128)
    assert np.array_equal(data.view(torch.uint8).numpy(), q.data.view(np.uint8))
    y = ot.to_torch(ot.to_opf(data.contiguous(), opfuse.DType.E4M3))
    assert y.dtype == torch.float8_e4m3fn
    xb = x.to(torch.bfloat16)
    assert ot.to_torch(ot.to_opf(xb)).dtype == torch.bfloat16


def test_torch_bad_input():
    with pytest.raises(opfuse.InvalidArgError, match="contiguous"):
        ot.to_opf(torch.randn(4, 6).t())
    with pytest.raises(opfuse.DtypeError):
        ot.to_opf(torch.zeros(3, dtype=torch.float64))


def reference(m, x):
    """The same model in plain torch, reading the opfuse parameters."""
    p = dict(m.named_parameters())
    h = torch.nn.functional.layer_norm(x, (32,), p["op0_weight"], p["op0_bias"], 1e-5)
    h = torch.nn.functional.linear(h, p["op1_weight"], p["op2_bias"])
    h = torch.nn.functional.gelu(h, approximate="tanh")
    return torch.nn.functional.linear(h, p["op4_weight"], p["op5_bias"])


def make():
    torch.manual_seed(0)
    m = ot.Sequential(ot.LayerNorm(32), ot.Linear(32, 64), ot.GELU(), ot.Linear(64, 32))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name == "op0_weight" else 0.0))
    return m


def test_parameters_share_memory_with_c():
    m = make()
    w = m.op1_weight
    c_w = m._seq[1].params()[0].value
    assert w.data_ptr() == c_w.ctypes.data


def test_sequential_matches_torch_cpu():
    m = make()
    x = torch.randn(16, 32, requires_grad=True)
    y = m(x)
    xr = x.detach().clone().requires_grad_()
    yr = reference(m, xr)
    assert torch.allclose(y, yr, rtol=1e-4, atol=1e-4)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    yr.square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, rtol=1e-3, atol=1e-3)
    for n, p in m.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-3, atol=1e-3), n


def test_torch_optimizer_updates_c_parameters():
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    l0 = m(x).square().mean()
    l0.backward()
    opt.step()
    l1 = m(x).square().mean()
    assert l1 < l0  # the C forward sees the step torch took


@pytest.mark.parametrize("recipe", [opfuse.Recipe.current(), opfuse.Recipe.mxfp8(),
                                    opfuse.Recipe.nvfp4()])
def test_autocast_recipes_close_to_fp32(recipe):
    m = make()
    x = torch.randn(32, 32, requires_grad=True)
    with ot.autocast(recipe=recipe):
        y = m(x)
    y.square().sum().backward()
    yr = reference(m, x.detach())
    rel = (y - yr).norm() / yr.norm()
    assert rel < (0.3 if recipe.kind == opfuse.RecipeKind.NVFP4 else 0.1)
    assert torch.isfinite(x.grad).all()


def test_no_grad_forward_saves_nothing():
    m = make()
    with torch.no_grad():
        y = m(torch.randn(8, 32))
    assert not y.requires_grad
    y2 = m(torch.randn(8, 32))  # a fresh forward after the inference one
    y2.sum().backward()
