"""CUDA tensors in opfuse and opfuse.torch.

Without a GPU: a CUDA context request raises UnsupportedError with the C
message, the stream entry refuses a CPU context, DLPack kDLCUDA tensors are
imported with their GPU and refused by host-only calls, by a CPU context and
by a CPU model (the C messages), and a module refuses a dtype conversion.

With a GPU (torch.cuda and an opfuse CUDA context; skipped otherwise, each
test saying why): eager Linear and LayerNorm-MLP forward + backward on CUDA
tensors against the CPU within the C tests' GEMM tolerance, an FP8 (current
scaling) recipe within numerics.md's FP8 tolerance and as accurate as the
CPU's, torch.compile on CUDA tensors with the eager bits, opcheck of the
graph's ops on CUDA, the work on torch's current stream (a whole step on a
side stream with the default stream's bits), and device mismatches raising
with the C message."""
import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import opfuse  # noqa: E402
import opfuse.torch as ot  # noqa: E402
from test_custom_ops import RECIPES, assert_same_bits, each_call, make, run, x_in  # noqa: E402

GEMM_TOL = 8e-3  # relative error of a device GEMM against the CPU (tests/cuda/test_cuda_ctx.c)
# An FP8 recipe, device against CPU: quantization is bit-exact between them but the GEMMs'
# accumulation order is not, so an amax moves and a per-tensor scaled gradient is rounded anew
# everywhere (E5M2, 2^-3 of a value at most). numerics.md 8.3: TE's tolerance of an FP8 recipe.
FP8_TOL = 0.125
# ... and the device's run as close to the unquantized result as the CPU's own run: two roundings
# of the same tensors differ in their error norms by a few percent (x moved by 1e-3: under 10%).
FP8_ACCURACY = 1.25


def _gpu_reason():
    if not torch.cuda.is_available():
        return "torch.cuda is not available on this machine"
    try:
        opfuse.default_context("cuda")
    except opfuse.UnsupportedError as e:
        return f"no opfuse CUDA context: {e}"
    return None


GPU_REASON = _gpu_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
no_gpu = pytest.mark.skipif(GPU_REASON is None, reason="the machine has a usable GPU")


# A CUDA x into a CPU model (LayerNorm first): the C call names both devices (ln_fwd's check
# that one call's tensors share a device comes before its check against the context's).
CUDA_X_CPU_MODEL = "layernorm: ln_fwd: x is on cuda, weight on cpu"


# ---- without a GPU ---------------------------------------------------------------------

@no_gpu
def test_cuda_context_without_gpu_raises():
    with pytest.raises(opfuse.UnsupportedError, match="opf_ctx_create"):
        opfuse.Context(device="cuda")
    with pytest.raises(opfuse.UnsupportedError):
        opfuse.default_context("cuda:0")
    with pytest.raises(opfuse.UnsupportedError):
        ot.Sequential(ot.Linear(8, 8), device="cuda")


def test_device_names():
    with pytest.raises(opfuse.InvalidArgError, match="tpu"):
        opfuse.Context(device="tpu")
    with pytest.raises(opfuse.InvalidArgError, match="tpu"):
        opfuse.default_context("tpu")
    c = opfuse.Context()
    assert (c.device, c.index, c.stream) == ("cpu", 0, None)
    assert opfuse.default_context("cpu") is opfuse.default_context()


def test_cpu_context_has_no_stream():
    c = opfuse.Context()
    for s in (None, 0, 12345):
        with pytest.raises(opfuse.UnsupportedError, match="opf_ctx_set_stream: a cpu context "
                           "has no stream"):
            c.set_stream(s)
    c.close()
    with pytest.raises(opfuse.StateError):
        c.set_stream(None)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class FakeCudaArray:
    """A DLPack producer that says its memory is on cuda:index (host memory
    underneath, so that a call that read it by mistake reads something)."""

    def __init__(self, index=0, shape=(64, 128)):
        self.host = np.zeros(shape, np.float32)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.m = _DLManaged(_DLTensor(self.host.ctypes.data, _DLDevice(2, index), len(shape),
                                      _DLDataType(2, 32, 1), self.shape, None, 0), None, None)
        self.streams = []

    def __dlpack_device__(self):
        return (2, self.m.dl_tensor.device.device_id)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
        return new(ctypes.addressof(self.m), b"dltensor", None)


def test_dlpack_cuda_import_and_device_checks():
    a = FakeCudaArray(index=1)
    t = opfuse._C.from_dlpack(a)
    assert t.__dlpack_device__() == (2, 1) and t.data_ptr() == a.host.ctypes.data
    assert t.component(0).__dlpack_device__() == (2, 1)
    with pytest.raises(opfuse.UnsupportedError, match="NumPy"):
        opfuse.to_numpy(t)
    cpu = opfuse.Context()
    with pytest.raises(opfuse.InvalidArgError, match="DLPack tensor on cuda:1, the context on cpu"):
        opfuse._C.from_dlpack(FakeCudaArray(index=1), ctx=cpu)
    with pytest.raises(opfuse.UnsupportedError, match="host memory"):
        opfuse._C.convert(FakeCudaArray(), 0, np.zeros((64, 128), np.float32), 0)
    # a device tensor handed to a CPU context: the C call refuses it
    with pytest.raises(opfuse.InvalidArgError, match="is on cuda, the context on cpu"):
        opfuse._C.quantize(cpu, opfuse.Quantizer.current(), t)
    # ... and by a CPU model's first op, naming both devices
    b = FakeCudaArray(shape=(64, 64))
    for grad in (False, True):
        with pytest.raises(opfuse.InvalidArgError, match=CUDA_X_CPU_MODEL):
            make()._seq._s.forward(opfuse._C.from_dlpack(b), None, grad, False)
    assert not a.host.any() and not b.host.any()


def test_module_refuses_dtype_conversion_keeps_parameters():
    m = ot.Sequential(ot.Linear(16, 8))
    before = list(m.parameters())
    with pytest.raises(opfuse.UnsupportedError, match="dtype"):
        m.half()
    assert m.to("cpu") is m and m.cpu() is m
    assert all(p is q for p, q in zip(before, m.parameters()))
    assert m.device == torch.device("cpu")


# ---- on a GPU ----------------------------------------------------------------------------

def rel_err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_errs(got, want) -> list:
    """rel_err of y, dx and each parameter's gradient of two run() results."""
    return [rel_err(a, b) for a, b in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2]))]


def assert_close(got, want, tol):
    errs = rel_errs(got, want)
    assert max(errs) <= tol, errs


def cuda_run(m, recipe, x):
    """run() on CUDA: one step from no gradients (run() adds to .grad), with
    the CUDA context's generator seeded."""
    m.zero_grad()
    opfuse.default_context("cuda").set_rng(5, 0)
    return run(m, recipe, x.cuda())


def moved(m):
    """A CUDA copy of CPU model m (same parameter values)."""
    c = make(m.custom_ops)
    with torch.no_grad():
        for p, q in zip(c.parameters(), m.parameters()):
            p.copy_(q)
    return c.cuda()


@gpu
def test_module_moves_to_cuda_keeping_parameters():
    m = make()
    before = [(p, p.detach().clone()) for p in m.parameters()]
    assert m.cuda() is m and m.device == torch.device("cuda", 0)
    for (p, v), q in zip(before, m.parameters()):
        assert p is q and p.is_cuda and torch.equal(p.detach().cpu(), v)
    m.cpu()
    assert all(p.device.type == "cpu" for p in m.parameters())


@gpu
def test_eager_linear_forward_backward_on_cuda():
    m = ot.Sequential(ot.Linear(64, 96))
    x = x_in()
    want = run(m, None, x)
    got = cuda_run(moved_linear(m), None, x)
    assert got[0].is_cuda and got[1].is_cuda
    assert_close(got, want, GEMM_TOL)


def moved_linear(m):
    c = ot.Sequential(ot.Linear(64, 96), device="cuda")
    with torch.no_grad():
        for p, q in zip(c.parameters(), m.parameters()):
            p.copy_(q)
    return c


@gpu
@pytest.mark.parametrize("recipe,tol", [("none", GEMM_TOL), ("current", FP8_TOL)])
def test_eager_layernorm_mlp_on_cuda(recipe, tol):
    """The CUDA step against opfuse's CPU step under the same recipe; under
    FP8 also each against the unquantized CPU step (FP8_TOL's comment)."""
    m, x, r = make(), x_in(), RECIPES[recipe]
    got, want = cuda_run(moved(m), r, x), run(m, r, x)
    assert_close(got, want, tol)
    if r is not None:
        exact = run(make(), None, x)
        for e, e0 in zip(rel_errs(got, exact), rel_errs(want, exact)):
            assert e <= FP8_ACCURACY * e0, (e, e0)


@gpu
def test_work_runs_on_torch_current_stream():
    m, x = moved(make()), x_in().cuda()
    ctx = m._seq.ctx
    with torch.no_grad():  # a forward that records must be followed by its backward
        want = m(x)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            got = m(x)
            assert ctx.stream == s.cuda_stream
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        m(x)
    assert ctx.stream == (torch.cuda.current_stream().cuda_stream or 1)


@gpu
def test_step_on_torch_side_stream_same_bits():
    """Forward and backward (autograd runs it on the forward's stream) on a
    side stream: the bits of the step on the default stream."""
    m, x = moved(make()), x_in()
    want = cuda_run(m, None, x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = cuda_run(m, None, x)
        assert m._seq.ctx.stream == s.cuda_stream
    torch.cuda.synchronize()
    assert_same_bits(got, want)


@gpu
@pytest.mark.parametrize("recipe", ["none", "current"])
def test_compile_on_cuda_same_bits_as_eager(recipe):
    torch._dynamo.reset()
    m, r, x = moved(make()), RECIPES[recipe], x_in()
    eager = cuda_run(m, r, x)
    cm = torch.compile(m, fullgraph=True)
    explain = torch._dynamo.explain(cm)(x.cuda())
    assert explain.graph_break_count == 0
    compiled = cuda_run(cm, r, x)
    for a, b in zip(eager[:2] + tuple(eager[2]), compiled[:2] + tuple(compiled[2])):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_opcheck_on_cuda(recipe):
    m, x = moved(make(True)), x_in().cuda()
    seen = []

    def check(op, args):
        seen.append(op.name())
        torch.library.opcheck(op, args)
    each_call(m, x, RECIPES[recipe], check)
    assert "opfuse::layernorm_bwd" in seen


@gpu
def test_device_mismatch_raises_c_message():
    m = moved(make())
    with pytest.raises(opfuse.InvalidArgError, match="on cpu|on cuda"):
        m(x_in())  # CPU input, CUDA parameters
    with pytest.raises(opfuse.InvalidArgError, match=CUDA_X_CPU_MODEL):
        make()(x_in().cuda())  # CUDA input, CPU model
    with pytest.raises(opfuse.InvalidArgError, match="on cpu|on cuda"):
        moved(make(True))(x_in())  # the custom ops: refused by the C call
    if torch.cuda.device_count() > 1:
        with pytest.raises(opfuse.InvalidArgError, match="cuda:1, the context on cuda:0"):
            m(x_in().to("cuda:1"))


@gpu
def test_quantize_on_cuda_context_same_bytes_as_cpu():
    x = x_in()
    g = opfuse.default_context("cuda")
    q = opfuse.Quantizer.current()
    cpu_q = opfuse.quantize(x, q)
    gpu_q = opfuse.quantize(x.cuda(), q, ctx=g)
    assert gpu_q._t.__dlpack_device__() == (2, 0)
    data = ot.component(gpu_q._t, opfuse.COMP_DATA)
    assert data.is_cuda
    assert torch.equal(data.view(torch.uint8).cpu(),
                       torch.from_numpy(cpu_q.data.view(np.uint8)))
