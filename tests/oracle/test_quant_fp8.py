"""Oracle for the FP8 quantizers: per-tensor delayed and current scaling, FP8
block scaling (1D 1x128, 2D 128x128) and MXFP8 (1x32, 32x1, 32x32; compact
and swizzled scales), checked bit for bit against a numpy implementation of
docs/numerics.md sections 1-4 written here, independent of the C code.

Every comparison is on raw bytes: data, scales (padding included), amax,
and the delayed-scaling state (scales and amax history).
"""
import ctypes as C

import ml_dtypes
import numpy as np
import pytest

import opfuse_ct as ct

f32, u8, u16, u32 = np.float32, np.uint8, np.uint16, np.uint32
FLT_MAX = np.finfo(f32).max
BF16_MAX = f32(float.fromhex("0x1.FEp127"))
FP16_MAX = f32(65504.0)
FP8_MAX = {ct.E4M3: f32(448.0), ct.E5M2: f32(57344.0)}
FP8_NP = {ct.E4M3: ml_dtypes.float8_e4m3fn, ct.E5M2: ml_dtypes.float8_e5m2}


# ---- reference numerics ------------------------------------------------------

def rup(a, b):
    return -(-a // b) * b


def cvt(x, qd):
    """1.3: fp32 -> FP8 bytes, RNE, satfinite (inf included), NaN -> 0x7F."""
    x = np.asarray(x, dtype=f32)
    y = np.clip(x, -FP8_MAX[qd], FP8_MAX[qd])  # |x| > max rounds to max under satfinite
    b = y.astype(FP8_NP[qd]).view(u8).copy()
    b[np.isnan(x)] = 0x7F
    return b


def decode(b, qd):
    return b.view(FP8_NP[qd]).astype(f32)


def amax_of(x, axis=None):
    """amax: |v| maximum, NaN ignored, starting from 0."""
    a = np.abs(np.where(np.isnan(x), f32(0), x)).astype(f32)
    return np.max(a, axis=axis, initial=f32(0))


def scale_from_amax(amax, fp8_max, pow2, eps, vinf):
    """2.1, vectorized."""
    amax = np.asarray(amax, dtype=f32)
    amax = np.where(amax < f32(eps), f32(eps), amax).astype(f32)
    bad = np.isinf(amax) | np.isnan(amax) | (amax == 0)
    with np.errstate(divide="ignore", over="ignore"):
        s = (f32(fp8_max) / np.where(bad, f32(1), amax)).astype(f32)
    s = np.where(np.isposinf(s), f32(vinf), s).astype(f32)
    if pow2:
        s = (s.view(u32) & u32(0xFF800000)).view(f32)
    return np.where(bad, f32(1), s).astype(f32)


def recip32_via_f64(s):
    """2.3 block scaling: fl32(1/s) computed in double."""
    return (1.0 / np.asarray(s, dtype=np.float64)).astype(f32)


def e8m0(t):
    """1.4 as 'smallest power of two >= t, clamped to [2^-127, 2^127]';
    0 -> 0, inf -> 254, NaN -> 255."""
    t = np.asarray(t, dtype=f32).astype(np.float64)
    fr, ex = np.frexp(t)  # t = fr * 2^ex, fr in [0.5, 1)
    lg = np.where(fr == 0.5, ex - 1, ex)  # ceil(log2 t)
    e = np.clip(lg + 127, 0, 254)
    e = np.where(t == 0, 0, e)
    e = np.where(np.isinf(t), 254, e)
    e = np.where(np.isnan(t), 255, e)
    return e.astype(u8)


def swizzle(S):
    """4.4: compact R x C (R % 128 == 0, C % 4 == 0) -> flat swizzled bytes."""
    R, Cc = S.shape
    i, j = np.meshgrid(np.arange(R), np.arange(Cc), indexing="ij")
    idx = ((i // 128) * (Cc // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
    out = np.zeros(R * Cc, dtype=u8)
    out[idx.ravel()] = S.ravel()
    return out


# ---- inputs --------------------------------------------------------------------

IN_NP = {ct.F32: np.float32, ct.BF16: ml_dtypes.bfloat16, ct.F16: np.float16}
IN_MAX = {ct.F32: FLT_MAX, ct.BF16: BF16_MAX, ct.F16: FP16_MAX}
KINDS = ["normal", "wide", "tiny", "huge", "special"]


def make_input(rng, shape, dt, kind):
    """Returns (array to pass to C: f32 or uint16 bits, its exact f32 values)."""
    n = int(np.prod(shape))
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    if kind == "normal":
        v = rng.standard_normal(n) * 3.0
    elif kind == "wide":  # log-uniform magnitudes over most of the range
        lo, hi = (-7, 4.5) if dt == ct.F16 else (-30, 30)
        v = sign * 10.0 ** rng.uniform(lo, hi, n)
    elif kind == "tiny":  # subnormal range of the input dtype (fp32 for f32 / bf16)
        lo, hi = (-7.2, -4.8) if dt == ct.F16 else (-44, -37)
        v = sign * 10.0 ** rng.uniform(lo, hi, n)
    elif kind == "huge":
        top = float(IN_MAX[dt])
        v = sign * top * rng.uniform(0.01, 1.0, n)
    else:  # special: normal values with zero rows/columns, inf and NaN
        v = rng.standard_normal(n) * 10.0
    v = v.reshape(shape).astype(np.float64)
    if kind == "special":
        v2 = v.reshape(-1, shape[-1])
        M, K = v2.shape
        v2[1 % M, :] = 0.0
        v2[:, 3 % K] = 0.0
        if M > 32:
            v2[-16:, :] = 0.0  # whole edge blocks of zeros
        v2[5 % M, 7 % K] = np.inf
        v2[(M - 20) % M, (K - 1) % K] = -np.inf
        v2[2 % M, 10 % K] = np.nan
        v2[9 % M, 0] = np.nan
        v2[(M // 2) % M, (K // 2) % K] = 1e-42 if dt != ct.F16 else 6e-8
    if dt == ct.F16:
        v = np.clip(v, -65504.0, 65504.0)
    x = np.asarray(v).astype(f32).astype(IN_NP[dt])
    vals = x.astype(f32)
    if dt == ct.F32:
        return np.ascontiguousarray(vals), vals.reshape(-1, shape[-1])
    return np.ascontiguousarray(x.view(u16)), vals.reshape(-1, shape[-1])


def quantizer(scaling, qd=ct.E4M3, usage=ct.ROWWISE | ct.COLUMNWISE, **kw):
    q = ct.lib.opf_quantizer_default()
    q.scaling, q.qdtype, q.usage = scaling, qd, usage
    for k, v in kw.items():
        setattr(q, k, v)
    return q


def comp(t, c, L):
    return ct.component(t, c, L)


def same_f32(a, b):
    """Bitwise equality of fp32 arrays, NaNs equal to NaNs."""
    a, b = np.asarray(a, dtype=f32), np.asarray(b, dtype=f32)
    if a.shape != b.shape:
        return False
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(u32), b[~nb].view(u32)))


@pytest.fixture(autouse=True)
def quiet_overflow():
    # the reference overflows on purpose (saturation, value_for_inf)
    with np.errstate(over="ignore", invalid="ignore"):
        yield


@pytest.fixture(scope="module")
def ctx():
    with ct.Ctx() as c:
        yield c


REDUCE_FN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_float), C.c_int)


def make_reduce(other, status=0):
    """A reduce hook that max-merges with another 'rank' (NaN-free)."""
    def fn(user, p, n):
        for i in range(n):
            p[i] = max(p[i], float(other[i % len(other)]))
        return status
    cb = REDUCE_FN(fn)
    return cb, C.cast(cb, C.c_void_p)


def check_dequant(ctx, t, L, which, expect):
    got = ct.dequantize(ctx, t, which)
    assert same_f32(got.reshape(expect.shape), expect), f"dequantize which={which}"


# ---- constants ----------------------------------------------------------------

def test_reciprocal_constants():
    assert (f32(1) / f32(448)).view(u32) == 0x3B124925
    assert (f32(1) / f32(57344)).view(u32) == 0x37924925


def test_reference_self_checks():
    # the reference's own building blocks against numerics.md examples
    assert list(cvt(np.array([500, -1e9, np.inf, np.nan, 2.0**-10, 2.0**-9], f32), ct.E4M3)) \
        == [0x7E, 0xFE, 0x7E, 0x7F, 0x00, 0x01]
    assert list(cvt(np.array([61440, np.inf, -np.inf], f32), ct.E5M2)) == [0x7B, 0x7B, 0xFB]
    assert list(e8m0(np.array([0, 1, 1.5, 2.0**-127, 2.0**-130, 2.0**127, 3e38, np.inf], f32))) \
        == [0, 127, 128, 0, 0, 254, 254, 254]
    s = scale_from_amax(np.array([0, np.inf, 1e-40, 448, 3.0], f32), 448, True, 0, FLT_MAX)
    assert list(s) == [1, 1, 2.0**127, 1, 128]
    assert scale_from_amax(np.array([1e-40], f32), 448, False, 0, FP16_MAX)[0] == 65504


# ---- per-tensor current scaling (3.2) ---------------------------------------------

def ref_current(X, qd, pow2, eps, reduced_amax=None):
    a = amax_of(X)
    if reduced_amax is not None:
        a = f32(max(a, reduced_amax))
    s = scale_from_amax(a, FP8_MAX[qd], pow2, eps, FLT_MAX)[()]
    q = cvt(X * s, qd)
    return q, f32(f32(1) / s), f32(a)


CUR_CASES = [
    ((4, 5), ct.F32), ((64, 96), ct.BF16), ((17, 33), ct.F16), ((2, 8, 48), ct.F32),
    ((1, 1), ct.F32), ((130, 70), ct.BF16),
    # large 16-bit inputs: the kernel switches to a 65536-entry byte table
    ((512, 640), ct.BF16), ((600, 480), ct.F16),
]


@pytest.mark.parametrize("shape,dt", CUR_CASES)
@pytest.mark.parametrize("qd", [ct.E4M3, ct.E5M2])
def test_current_scaling(ctx, shape, dt, qd):
    rng = np.random.default_rng(hash((shape, dt, qd)) % 2**32)
    for kind in KINDS:
        for pow2, eps in [(False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-30)]:
            xb, X = make_input(rng, shape, dt, kind)
            q = quantizer(ct.SCALING_TENSOR, qd, pow2_scales=pow2, amax_epsilon=eps)
            t, L = ct.quantize(ctx, q, xb, dt)
            try:
                eq, es, ea = ref_current(X, qd, pow2, f32(eps))
                assert np.array_equal(comp(t, ct.COMP_DATA, L), eq), (kind, pow2, eps)
                assert np.array_equal(comp(t, ct.COMP_COL_DATA, L), eq.T), (kind, pow2, eps)
                assert comp(t, ct.COMP_SCALE_INV, L).view(u32)[0, 0] == es.view(u32)
                assert comp(t, ct.COMP_COL_SCALE_INV, L).view(u32)[0, 0] == es.view(u32)
                assert comp(t, ct.COMP_AMAX, L).view(u32)[0, 0] == ea.view(u32)
                expect = (decode(eq, qd) * es).astype(f32)
                check_dequant(ctx, t, L, ct.ROWWISE, expect)
                check_dequant(ctx, t, L, ct.COLUMNWISE, expect)
            finally:
                ct.lib.opf_tensor_release(C.byref(t))


def test_current_rowwise_only_and_reduce(ctx):
    rng = np.random.default_rng(5)
    xb, X = make_input(rng, (32, 48), ct.F32, "normal")
    other = [1000.0]
    cb, p = make_reduce(other)
    q = quantizer(ct.SCALING_TENSOR, ct.E4M3, usage=ct.ROWWISE, amax_reduce=p)
    t, L = ct.quantize(ctx, q, xb, ct.F32)
    eq, es, ea = ref_current(X, ct.E4M3, False, 0.0, reduced_amax=f32(1000.0))
    assert np.array_equal(comp(t, ct.COMP_DATA, L), eq)
    assert comp(t, ct.COMP_COL_DATA, L) is None
    assert comp(t, ct.COMP_SCALE_INV, L).view(u32)[0, 0] == es.view(u32)
    assert comp(t, ct.COMP_AMAX, L)[0, 0] == f32(1000.0)
    ct.lib.opf_tensor_release(C.byref(t))
    # a failing reduction is reported and leaves the output untouched
    cb2, p2 = make_reduce([0.0], status=6)  # OPF_ERR_DEVICE
    q.amax_reduce = p2
    qs = ct.Spec()
    xt = ct.wrap(xb, ct.F32)
    ct.check(ctx, ct.lib.opf_quantizer_spec(C.byref(q), C.byref(xt.spec), C.byref(qs)))
    out = ct.Tensor()
    ct.check(ctx, ct.lib.opf_tensor_alloc(ctx.h, C.byref(qs), C.byref(out)))
    L = ct.layout(out.spec)
    C.memset(out.data[ct.COMP_DATA], 0xAB, L.comp[ct.COMP_DATA].nbytes)
    st = ct.lib.opf_quantize(ctx.h, C.byref(q), C.byref(xt), C.byref(out))
    assert st == 6 and "amax reduction" in ctx.error()
    assert np.all(comp(out, ct.COMP_DATA, L) == 0xAB)
    ct.lib.opf_tensor_release(C.byref(out))


# ---- delayed scaling (3.1) ----------------------------------------------------------

class RefDelayed:
    def __init__(self, fmt, margin, L, algo, backward, n):
        e4 = fmt == ct.FORMAT_E4M3 or (fmt == ct.FORMAT_HYBRID and not backward)
        self.qd = ct.E4M3 if e4 else ct.E5M2
        self.scaled_max = f32(FP8_MAX[self.qd] * f32(2.0 ** -margin))
        self.algo, self.L, self.n = algo, L, n
        self.scale = np.ones(n, f32)
        self.hist = np.zeros((L, n), f32)

    def quantize(self, X, slot):
        s = self.scale[slot]
        a = amax_of(X)
        self.hist[0, slot] = max(self.hist[0, slot], a)
        return cvt(X * s, self.qd), f32(f32(1) / s), f32(a)

    def update(self, reduced=None):
        L = self.L
        for j in range(self.n):
            a = self.hist[0, j]
            if reduced is not None and reduced[j] != 0:
                a = f32(reduced[j])
            if a == 0:
                continue
            window = [a] + list(self.hist[1:, j])
            if self.algo == ct.AMAX_MAX:
                amax = max([f32(0)] + [w for w in window if not np.isnan(w)])
            else:
                amax = a
            new = np.zeros(L, f32)
            new[1:L - 1] = self.hist[2:L, j]
            new[L - 1] = a
            new[0] = 0
            self.hist[:, j] = new
            if np.isfinite(amax) and amax > 0:
                with np.errstate(over="ignore"):
                    s = f32(self.scaled_max / f32(amax))
            else:
                s = self.scale[j]
            self.scale[j] = FLT_MAX if np.isinf(s) else s


def state_arrays(st, L, n):
    sc = np.ctypeslib.as_array(ct.lib.opf_delayed_state_scale(st), shape=(n,)).copy()
    h = np.ctypeslib.as_array(ct.lib.opf_delayed_state_history(st), shape=(L, n)).copy()
    return sc, h


# per step, per slot: (shape, kind, value scale); None = slot not used this step
DELAYED_STEPS = [
    [((32, 64), "normal", 1.0), ((16, 48), "normal", 50.0), ((8, 8), "normal", 0.01)],
    [((32, 64), "normal", 3.0), ((16, 48), "zero", 0.0), None],
    [((32, 64), "normal", 0.5), None, ((8, 8), "normal", 1e4)],
    [((32, 64), "wide", 1.0), ((16, 48), "normal", 2.0), ((8, 8), "special", 1.0)],
    [((32, 64), "tiny", 1.0), ((16, 48), "huge", 1.0), ((8, 8), "normal", 7.0)],
    [((32, 64), "normal", 1.0), None, ((8, 8), "normal", 1e-3)],
]


@pytest.mark.parametrize("fmt,backward", [(ct.FORMAT_HYBRID, False), (ct.FORMAT_HYBRID, True),
                                          (ct.FORMAT_E4M3, True)])
@pytest.mark.parametrize("algo", [ct.AMAX_MAX, ct.AMAX_MOST_RECENT])
@pytest.mark.parametrize("margin,hist_len", [(0.0, 3), (2.0, 3), (1.0, 1), (0.0, 4)])
@pytest.mark.parametrize("reduce", [False, True])
def test_delayed_scaling(ctx, fmt, backward, algo, margin, hist_len, reduce):
    n = 3
    st = C.c_void_p()
    ct.check(ctx, ct.lib.opf_delayed_state_create(ctx.h, fmt, margin, hist_len, algo, backward,
                                                  n, C.byref(st)))
    ref = RefDelayed(fmt, margin, hist_len, algo, backward, n)
    rng = np.random.default_rng(77)
    dt = ct.BF16 if backward else ct.F32
    # the "other rank" amaxes: slot 1 stays 0 so the local value is used
    other = [30.0, 0.0, 0.125]
    cb, p = make_reduce(other)
    try:
        for step in DELAYED_STEPS:
            for slot, item in enumerate(step):
                if item is None:
                    continue
                shape, kind, mul = item
                if kind == "zero":
                    X = np.zeros(shape, f32)
                    xb = X.astype(IN_NP[dt]).view(u16) if dt != ct.F32 else X
                else:
                    xb, X = make_input(rng, shape, dt, kind)
                    if mul != 1.0:
                        X = (X * f32(mul)).astype(f32).astype(IN_NP[dt]).astype(f32)
                        xb = X.astype(IN_NP[dt])
                        xb = xb.view(u16) if dt != ct.F32 else xb
                xb = np.ascontiguousarray(xb.reshape(shape))
                q = quantizer(ct.SCALING_TENSOR, ref.qd, delayed=st.value, slot=slot)
                t, L = ct.quantize(ctx, q, xb, dt)
                eq, es, ea = ref.quantize(X.reshape(-1, shape[-1]), slot)
                assert np.array_equal(comp(t, ct.COMP_DATA, L), eq)
                assert np.array_equal(comp(t, ct.COMP_COL_DATA, L), eq.T)
                assert comp(t, ct.COMP_SCALE_INV, L).view(u32)[0, 0] == es.view(u32)
                assert comp(t, ct.COMP_COL_SCALE_INV, L).view(u32)[0, 0] == es.view(u32)
                assert comp(t, ct.COMP_AMAX, L).view(u32)[0, 0] == ea.view(u32)
                ct.lib.opf_tensor_release(C.byref(t))
            sc, h = state_arrays(st, hist_len, n)
            assert same_f32(h, ref.hist), "history after quantize"
            red = None
            if reduce:
                red = np.array([max(ref.hist[0, j], f32(other[j])) for j in range(n)], f32)
            ct.check(ctx, ct.lib.opf_delayed_state_update(ctx.h, st, p if reduce else None, None))
            ref.update(red)
            sc, h = state_arrays(st, hist_len, n)
            assert same_f32(sc, ref.scale), f"scales {sc} vs {ref.scale}"
            assert same_f32(h, ref.hist), f"history {h} vs {ref.hist}"
    finally:
        ct.lib.opf_delayed_state_destroy(st)


# ---- FP8 block scaling (3.5) -----------------------------------------------------------

def ref_block_1d(X, qd, pow2, eps, vinf):
    """1x128 blocks along the rows of X [R, N]: data [R, N], scale_inv [nb, R]."""
    R, N = X.shape
    nb = -(-N // 128)
    Xp = np.zeros((R, nb * 128), f32)
    Xp[:, :N] = np.where(np.isnan(X), f32(0), X)
    s = scale_from_amax(amax_of(Xp.reshape(R, nb, 128), axis=2), FP8_MAX[qd], pow2, eps, vinf)
    q = cvt(X * np.repeat(s, 128, axis=1)[:, :N], qd)
    return q, recip32_via_f64(s).T


def ref_block_2d(X, qd, pow2, eps, vinf):
    """128x128 tiles: data [M, K], scale_inv [nmb, nkb]."""
    M, K = X.shape
    nm, nk = -(-M // 128), -(-K // 128)
    Xp = np.zeros((nm * 128, nk * 128), f32)
    Xp[:M, :K] = np.where(np.isnan(X), f32(0), X)
    a = amax_of(Xp.reshape(nm, 128, nk, 128), axis=(1, 3))
    s = scale_from_amax(a, FP8_MAX[qd], pow2, eps, vinf)
    sfull = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:M, :K]
    return cvt(X * sfull, qd), recip32_via_f64(s)


def padded(vals, rows, cols):
    out = np.zeros((rows, cols), f32)
    out[:vals.shape[0], :vals.shape[1]] = vals
    return out


def dequant_1d(q, sinv_t, qd):
    """q [R, N] with scale_inv [nb, R]: fl(q * s)."""
    R, N = q.shape
    s = np.repeat(sinv_t.T, 128, axis=1)[:, :N]
    return (decode(q, qd) * s).astype(f32)


# the anchor's exact tests run 303x300 and 305x256: partial blocks and tiles
# on both edges; 1x1 and 7x129 are the smallest edge cases
BLOCK_SHAPES = [(144, 272), (128, 128), (16, 16), (2, 80, 48), (256, 400), (303, 300),
                (305, 256), (1, 1), (7, 129), (3, 101, 5)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
@pytest.mark.parametrize("dt", [ct.F32, ct.BF16, ct.F16])
@pytest.mark.parametrize("two_d", [False, True])
def test_block_scaling(ctx, shape, dt, two_d):
    rng = np.random.default_rng(hash((shape, dt, two_d)) % 2**32)
    scaling = ct.SCALING_BLOCK_2D if two_d else ct.SCALING_BLOCK_1D
    for kind in KINDS:
        for qd, pow2, eps in [(ct.E4M3, True, 0.0), (ct.E4M3, False, 0.0), (ct.E5M2, False, 1e-2),
                              (ct.E5M2, True, 0.0)]:
            xb, X = make_input(rng, shape, dt, kind)
            M, K = X.shape
            q = quantizer(scaling, qd, pow2_scales=pow2, amax_epsilon=eps)
            t, L = ct.quantize(ctx, q, xb, dt)
            vinf = IN_MAX[dt]
            try:
                d, dc = comp(t, ct.COMP_DATA, L), comp(t, ct.COMP_COL_DATA, L)
                s, sc = comp(t, ct.COMP_SCALE_INV, L), comp(t, ct.COMP_COL_SCALE_INV, L)
                if two_d:
                    eq, es = ref_block_2d(X, qd, pow2, f32(eps), vinf)
                    nm, nk = es.shape
                    assert np.array_equal(d, eq), (kind, qd, pow2)
                    assert np.array_equal(dc, eq.T), (kind, qd, pow2)
                    assert same_f32(s, padded(es, nm, rup(nk, 4))), (kind, qd, pow2)
                    assert same_f32(sc, padded(es.T, nk, rup(nm, 4))), (kind, qd, pow2)
                    sfull = np.repeat(np.repeat(es, 128, 0), 128, 1)[:M, :K]
                    expect = (decode(eq, qd) * sfull).astype(f32)
                    check_dequant(ctx, t, L, ct.ROWWISE, expect)
                    check_dequant(ctx, t, L, ct.COLUMNWISE, expect)
                else:
                    eq, es = ref_block_1d(X, qd, pow2, f32(eps), vinf)
                    eqc, esc = ref_block_1d(np.ascontiguousarray(X.T), qd, pow2, f32(eps), vinf)
                    assert np.array_equal(d, eq), (kind, qd, pow2)
                    assert np.array_equal(dc, eqc), (kind, qd, pow2)
                    assert same_f32(s, padded(es, es.shape[0], rup(M, 4))), (kind, qd, pow2)
                    assert same_f32(sc, padded(esc, esc.shape[0], rup(K, 4))), (kind, qd, pow2)
                    check_dequant(ctx, t, L, ct.ROWWISE, dequant_1d(eq, es, qd))
                    check_dequant(ctx, t, L, ct.COLUMNWISE, dequant_1d(eqc, esc, qd).T)
            finally:
                ct.lib.opf_tensor_release(C.byref(t))


def test_block_value_for_inf(ctx):
    # A tiny block amax makes fp8_max/amax overflow: the scale becomes the
    # input dtype's max finite (bf16: 0x1.FEp127; pow2: 2^127).
    X = np.full((16, 128), 1e-39, f32)
    X[:, 64:] = 2.0
    xb = X.astype(ml_dtypes.bfloat16)
    Xv = xb.astype(f32)
    for pow2, want in [(False, BF16_MAX), (True, f32(2.0**127))]:
        q = quantizer(ct.SCALING_BLOCK_1D, ct.E4M3, usage=ct.COLUMNWISE, pow2_scales=pow2)
        t, L = ct.quantize(ctx, q, np.ascontiguousarray(xb.view(u16)), ct.BF16)
        sc = comp(t, ct.COMP_COL_SCALE_INV, L)
        assert sc[0, 0] == recip32_via_f64(want)
        eqc, _ = ref_block_1d(np.ascontiguousarray(Xv.T), ct.E4M3, pow2, f32(0), BF16_MAX)
        assert np.array_equal(comp(t, ct.COMP_COL_DATA, L), eqc)
        ct.lib.opf_tensor_release(C.byref(t))


# ---- MXFP8 (3.3) -----------------------------------------------------------------------

def mx_mult(E):
    return np.ldexp(np.ones(E.shape, f32), 127 - E.astype(np.int32)).astype(f32)


def ref_mxfp8(X, qd, two_d):
    """Returns (row data, row E [M, K/32], col data, col E [M/32, K])."""
    M, K = X.shape
    R = f32(1) / FP8_MAX[qd]
    if two_d:
        a = amax_of(X.reshape(M // 32, 32, K // 32, 32), axis=(1, 3))
        E = e8m0((a * R).astype(f32))
        Mu = np.repeat(np.repeat(mx_mult(E), 32, 0), 32, 1)
        q = cvt(X * Mu, qd)
        return q, np.repeat(E, 32, axis=0), q, np.repeat(E, 32, axis=1)
    ar = amax_of(X.reshape(M, K // 32, 32), axis=2)
    Er = e8m0((ar * R).astype(f32))
    qr = cvt(X * np.repeat(mx_mult(Er), 32, axis=1), qd)
    ac = amax_of(X.reshape(M // 32, 32, K), axis=1)
    Ec = e8m0((ac * R).astype(f32))
    qc = cvt(X * np.repeat(mx_mult(Ec), 32, axis=0), qd)
    return qr, Er, qc, Ec


def mx_dequant_rows(q, E, qd, axis):
    """fl(q * 2^(E-127)), the scales repeated 32x along axis."""
    s = np.ldexp(np.float64(1), np.repeat(E, 32, axis=axis).astype(np.int32) - 127)
    return (decode(q, qd).astype(np.float64) * s).astype(f32)


MX_SHAPES = [(32, 32), (64, 96), (160, 256), (2, 48, 288)]


@pytest.mark.parametrize("shape", MX_SHAPES)
@pytest.mark.parametrize("dt", [ct.F32, ct.BF16, ct.F16])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("swz", [False, True])
def test_mxfp8(ctx, shape, dt, two_d, swz):
    rng = np.random.default_rng(hash((shape, dt, two_d, swz)) % 2**32)
    for kind in KINDS:
        for qd in [ct.E4M3, ct.E5M2]:
            xb, X = make_input(rng, shape, dt, kind)
            M, K = X.shape
            q = quantizer(ct.SCALING_MXFP8, qd, swizzled=swz, mxfp8_2d=two_d)
            t, L = ct.quantize(ctx, q, xb, dt)
            try:
                qr, Er, qc, Ec = ref_mxfp8(X, qd, two_d)
                assert np.array_equal(comp(t, ct.COMP_DATA, L), qr), (kind, qd)
                assert np.array_equal(comp(t, ct.COMP_COL_DATA, L), qc), (kind, qd)
                Sr = np.zeros((rup(M, 128), rup(K // 32, 4)), u8)
                Sr[:M, :K // 32] = Er
                Sc = np.zeros((rup(M // 32, 4), rup(K, 128)), u8)
                Sc[:M // 32, :K] = Ec
                gr, gc = comp(t, ct.COMP_SCALE_INV, L), comp(t, ct.COMP_COL_SCALE_INV, L)
                if swz:
                    assert np.array_equal(gr.ravel(), swizzle(Sr)), (kind, qd)
                    assert np.array_equal(gc.ravel(), swizzle(np.ascontiguousarray(Sc.T))), \
                        (kind, qd)
                else:
                    assert np.array_equal(gr, Sr), (kind, qd)
                    assert np.array_equal(gc, Sc), (kind, qd)
                check_dequant(ctx, t, L, ct.ROWWISE, mx_dequant_rows(qr, Er, qd, 1))
                check_dequant(ctx, t, L, ct.COLUMNWISE, mx_dequant_rows(qc, Ec, qd, 0))
            finally:
                ct.lib.opf_tensor_release(C.byref(t))


@pytest.mark.parametrize("usage", [ct.ROWWISE, ct.COLUMNWISE])
def test_mxfp8_single_copy(ctx, usage):
    rng = np.random.default_rng(11)
    xb, X = make_input(rng, (64, 128), ct.BF16, "wide")
    q = quantizer(ct.SCALING_MXFP8, ct.E4M3, usage=usage)
    t, L = ct.quantize(ctx, q, xb, ct.BF16)
    qr, Er, qc, Ec = ref_mxfp8(X, ct.E4M3, False)
    if usage == ct.ROWWISE:
        assert np.array_equal(comp(t, ct.COMP_DATA, L), qr)
        assert comp(t, ct.COMP_COL_DATA, L) is None
    else:
        assert np.array_equal(comp(t, ct.COMP_COL_DATA, L), qc)
        assert comp(t, ct.COMP_DATA, L) is None
    ct.lib.opf_tensor_release(C.byref(t))


def test_thread_count_independent():
    rng = np.random.default_rng(3)
    xb, X = make_input(rng, (384, 512), ct.BF16, "wide")
    cases = [quantizer(ct.SCALING_TENSOR, ct.E4M3), quantizer(ct.SCALING_BLOCK_1D, ct.E4M3),
             quantizer(ct.SCALING_BLOCK_2D, ct.E5M2), quantizer(ct.SCALING_MXFP8, ct.E4M3),
             quantizer(ct.SCALING_MXFP8, ct.E4M3, swizzled=True, mxfp8_2d=True)]
    big_b, _ = make_input(rng, (640, 512), ct.F16, "wide")  # the table path of per-tensor
    for q, x, dt in [(q, xb, ct.BF16) for q in cases] + [(cases[0], big_b, ct.F16)]:
        outs = []
        for nt in (1, 2):
            with ct.Ctx(num_threads=nt) as c:
                t, L = ct.quantize(c, q, x, dt)
                outs.append([None if comp(t, i, L) is None else comp(t, i, L).tobytes()
                             for i in range(6)])
                ct.lib.opf_tensor_release(C.byref(t))
        assert outs[0] == outs[1], q.scaling
