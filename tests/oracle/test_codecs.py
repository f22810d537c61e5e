"""test_codecs.py: the scalar and array dtype codecs against independent references.

numerics.md section 1 is the spec. bf16 and fp16 follow ml_dtypes / numpy bit for bit
(NaN sign and payload included). e4m3 / e5m2 use ml_dtypes' round-to-nearest-even with
the spec's saturation (|x| > max and inf -> +-max) and NaN -> 0x7F applied on top; e2m1
(decision table of 1.3) and e8m0 (round up, 1.4) are written here in numpy. Every
comparison is on bit patterns, so NaNs and signed zeros count.
"""
import ctypes as C
import os
import sys

import ml_dtypes as md
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opfuse_ct as ct  # noqa: E402

# NaN / overflow casts in the references are intended; numpy's warnings about them are noise.
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in nextafter:RuntimeWarning")]

lib = ct.lib
FORMATS = ["bf16", "f16", "e4m3", "e5m2", "e2m1", "e8m0"]
CODE_NP = {"bf16": np.uint16, "f16": np.uint16, "e4m3": np.uint8, "e5m2": np.uint8,
           "e2m1": np.uint8, "e8m0": np.uint8}
OPF_DT = {"f32": ct.F32, "f16": ct.F16, "bf16": ct.BF16, "e4m3": ct.E4M3, "e5m2": ct.E5M2,
          "e2m1": ct.E2M1, "e8m0": ct.E8M0}
SCALAR_C = {np.uint16: C.c_uint16, np.uint8: C.c_uint8}


def _sig(name, res, *args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = list(args)
    return f


for _f in FORMATS:
    _ct = SCALAR_C[CODE_NP[_f]]
    _sig(f"opf_f32_to_{_f}", _ct, C.c_float)
    _sig(f"opf_{_f}_to_f32", C.c_float, _ct)
    _sig(f"opf_f32_to_{_f}_n", None, C.c_void_p, C.c_void_p, C.c_size_t)
    _sig(f"opf_{_f}_to_f32_n", None, C.c_void_p, C.c_void_p, C.c_size_t)
_sig("opf_convert", C.c_int, C.c_void_p, C.c_int, C.c_void_p, C.c_int, C.c_size_t)
_sig("opf_dtype_name", C.c_char_p, C.c_int)
_sig("opf_dtype_nbytes", C.c_size_t, C.c_int, C.c_size_t)

# ---- the library under test -------------------------------------------------


def unpack_e2m1(packed, n):
    codes = np.empty(2 * packed.size, np.uint8)
    codes[0::2] = packed & 0xF
    codes[1::2] = packed >> 4
    return codes[:n]


def pack_e2m1(codes):
    c = np.zeros(codes.size + (codes.size & 1), np.uint8)
    c[:codes.size] = codes
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def c_encode(fmt, x):
    """Codes of fp32 array x through opf_f32_to_<fmt>_n (e2m1 unpacked to one code per element)."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.size
    nbytes = (n + 1) // 2 if fmt == "e2m1" else n
    out = np.zeros(nbytes, CODE_NP[fmt])
    getattr(lib, f"opf_f32_to_{fmt}_n")(x.ctypes.data, out.ctypes.data, n)
    return unpack_e2m1(out, n) if fmt == "e2m1" else out


def c_decode(fmt, codes):
    """fp32 bit patterns of codes through opf_<fmt>_to_f32_n."""
    codes = np.ascontiguousarray(codes, CODE_NP[fmt])
    n = codes.size
    src = pack_e2m1(codes) if fmt == "e2m1" else codes
    y = np.zeros(n, np.float32)
    getattr(lib, f"opf_{fmt}_to_f32_n")(src.ctypes.data, y.ctypes.data, n)
    return y.view(np.uint32)


# ---- independent references -------------------------------------------------


def _sign(x, shift):
    return np.signbit(x).astype(np.uint8) << shift


def ref_bf16(x):
    return x.astype(md.bfloat16).view(np.uint16)


def ref_f16(x):
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16).view(np.uint16)


def _ref_fp8(x, mdtype, max_finite, max_code):
    """ml_dtypes' RNE plus numerics.md 1.3: satfinite (inf too), NaN -> 0x7F."""
    with np.errstate(over="ignore", invalid="ignore"):
        q = x.astype(mdtype).view(np.uint8)
        q = np.where(np.abs(x) > max_finite, _sign(x, 7) | max_code, q)
    return np.where(np.isnan(x), 0x7F, q).astype(np.uint8)


def ref_e4m3(x):
    return _ref_fp8(x, md.float8_e4m3fn, 448.0, 0x7E)


def ref_e5m2(x):
    return _ref_fp8(x, md.float8_e5m2, 57344.0, 0x7B)


def ref_e2m1(x):
    """Decision table of numerics.md 1.3 (ties to the even code), sign kept, NaN -> +6."""
    a = np.abs(x.astype(np.float64))
    code = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
                     [0, 1, 2, 3, 4, 5, 6], 7).astype(np.uint8)
    return np.where(np.isnan(x), 7, code | _sign(x, 3)).astype(np.uint8)


def ref_e8m0(x):
    """Smallest power of two >= |x|, clamped to [2^-127, 2^127] (numerics.md 1.4); NaN -> 255,
    inf -> 254, 0 -> 0. The sign is ignored like the anchor's bit fallback does."""
    a = np.abs(x.astype(np.float64))
    with np.errstate(invalid="ignore"):
        m, e = np.frexp(a)          # a = m * 2^e with m in [0.5, 1)
        p = np.where(m == 0.5, e - 1, e)
        r = np.clip(p + 127, 0, 254)
    r = np.where(a == 0, 0, r)
    r = np.where(np.isinf(a), 254, r)
    return np.where(np.isnan(a), 255, r).astype(np.uint8)


REF_ENCODE = {"bf16": ref_bf16, "f16": ref_f16, "e4m3": ref_e4m3, "e5m2": ref_e5m2,
              "e2m1": ref_e2m1, "e8m0": ref_e8m0}

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)


def ref_decode(fmt, codes):
    """fp32 bit patterns of codes (ml_dtypes / numpy decode)."""
    mdt = {"bf16": md.bfloat16, "f16": np.float16, "e4m3": md.float8_e4m3fn,
           "e5m2": md.float8_e5m2, "e8m0": md.float8_e8m0fnu}
    codes = np.asarray(codes, CODE_NP[fmt])
    if fmt == "e2m1":
        return E2M1_VALUES[codes & 0xF].view(np.uint32)
    return codes.view(mdt[fmt]).astype(np.float32).view(np.uint32)


def all_codes(fmt):
    return np.arange(16 if fmt == "e2m1" else 1 << (8 * np.dtype(CODE_NP[fmt]).itemsize),
                     dtype=CODE_NP[fmt])


# ---- inputs -----------------------------------------------------------------


def _f32(bits):
    return np.array(bits, np.uint32).view(np.float32)


def edge_values():
    """Signed zeros, fp32 subnormals, each target's subnormals / ties / max + half ulp
    (and the floats either side), infinities, NaNs of both signs with payloads."""
    pos = [0.0, 2.0 ** -149, 2.0 ** -148, 3 * 2.0 ** -149, 2.0 ** -126 - 2.0 ** -149, 2.0 ** -126,
           1.0, 1.5, 2.0, 3.4028234663852886e38, np.inf]
    # e4m3: min subnormal 2^-9, half of it 2^-10 (tie to 0), 1.5 and 2.5 ulps (ties), max
    # subnormal, min normal, the tie between them, 448, 464 (= max + half ulp), 480.
    pos += [2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 7 * 2.0 ** -9,
            7.5 * 2.0 ** -9, 2.0 ** -6, 448.0, 456.0, 464.0, 480.0, 1e4]
    # e5m2: 2^-16, 2^-17, 57344, 61440 (max + half ulp), 65536.
    pos += [2.0 ** -16, 2.0 ** -17, 1.5 * 2.0 ** -16, 3.5 * 2.0 ** -16, 2.0 ** -14, 57344.0,
            59392.0, 61440.0, 65536.0]
    # fp16: 2^-24, 2^-25 (tie to 0), max 65504, 65520 (tie to inf), bf16 max and its tie.
    pos += [2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25, 65504.0, 65520.0,
            float.fromhex("0x1.FEp127"), float.fromhex("0x1.FFp127"),
            float.fromhex("0x1.FDp127"), 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -134]
    # e2m1 decision boundaries and ties, e8m0 limits.
    pos += [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 2.0 ** -127, 2.0 ** 127,
            2.0 ** 127 + 2.0 ** 104, 2.0 ** -127 + 2.0 ** -149]
    p = np.array(pos, np.float32)
    p = np.concatenate([p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0))])
    nans = _f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7F802000,
                 0x7FFFFFFF, 0xFFFFFFFF, 0x7F801FFF, 0xFFBFFFFF])
    return np.concatenate([p, -p, nans]).astype(np.float32)


def format_grid():
    """Every finite value of every format, the midpoints between neighbours (exact ties) and
    the fp32 numbers on either side of each midpoint, both signs."""
    parts = []
    for fmt in FORMATS:
        v = ref_decode(fmt, all_codes(fmt)).view(np.float32).astype(np.float64)
        v = np.unique(v[np.isfinite(v) & (v >= 0)])
        mids = np.float32((v[:-1] + v[1:]) / 2)  # exact: ties need one more bit than the format
        assert np.all(mids.astype(np.float64) == (v[:-1] + v[1:]) / 2)
        top = np.float32(v[-1] + (v[-1] - v[-2]) / 2)  # max + half ulp
        grid = np.concatenate([np.float32(v), mids, [top]])
        parts += [grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(0))]
    g = np.concatenate(parts)
    return np.concatenate([g, -g]).astype(np.float32)


def random_bits(n, seed):
    return np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint32).view(np.float32)


def random_ranges(n, seed):
    """Half log-uniform over every fp32 binade (and past both ends), half uniform in ranges
    around each format's interesting region."""
    rng = np.random.default_rng(seed)
    h = n // 2
    e = rng.uniform(-152, 130, h)
    logu = np.where(rng.random(h) < 0.5, -1, 1) * np.exp2(e)
    ranges = [1e-8, 1e-6, 1e-4, 2e-3, 2e-2, 1, 8, 500, 7e4, 1e5, 1e38]
    r = np.array(ranges)[rng.integers(0, len(ranges), n - h)]
    uni = rng.uniform(-1, 1, n - h) * r
    with np.errstate(over="ignore"):
        return np.concatenate([logu, uni]).astype(np.float32)


INPUTS = {
    "edges": edge_values,
    "grid": format_grid,
    "bf16_all": lambda: ref_decode("bf16", all_codes("bf16")).view(np.float32),
    "f16_all": lambda: ref_decode("f16", all_codes("f16")).view(np.float32),
    "random_bits": lambda: random_bits(1_000_000, 11),
    "random_ranges": lambda: random_ranges(1_000_000, 12),
}
_cache = {}


def inputs(name):
    if name not in _cache:
        _cache[name] = INPUTS[name]()
    return _cache[name]


def assert_same_codes(x, got, want, what):
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[:8]
        bits = x.view(np.uint32) if x.dtype == np.float32 else x
        rows = [f"x={x[j]!r} (0x{int(bits[j]):X}) got 0x{int(got[j]):X} want 0x{int(want[j]):X}"
                for j in i]
        pytest.fail(f"{what}: {bad.size} of {x.size} differ:\n  " + "\n  ".join(rows))


# ---- tests ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("src", list(INPUTS))
def test_encode_matches_reference(src, fmt):
    x = inputs(src)
    assert_same_codes(x, c_encode(fmt, x), REF_ENCODE[fmt](x), f"f32->{fmt} on {src}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_all_codes(fmt):
    codes = all_codes(fmt)
    got, want = c_decode(fmt, codes), ref_decode(fmt, codes)
    assert_same_codes(codes, got, want, f"{fmt}->f32")


def test_decode_matches_spec_formulas():
    """The decodes against numerics.md 1.1 directly, not only against ml_dtypes."""
    e = np.arange(256)
    want = np.ldexp(1.0, e - 127).astype(np.float32)
    got = c_decode("e8m0", e.astype(np.uint8)).view(np.float32)
    assert np.array_equal(got[:255], want[:255]) and np.isnan(got[255])
    assert got[0] == np.float32(2.0 ** -127) and got[254] == np.float32(2.0 ** 127)
    q = np.arange(256)
    for fmt, mb, bias in (("e4m3", 3, 7), ("e5m2", 2, 15)):
        s, ex, m = q >> 7, (q >> mb) & ((1 << (7 - mb)) - 1), q & ((1 << mb) - 1)
        val = np.where(ex == 0, np.ldexp(m / 2.0 ** mb, 1 - bias),
                       np.ldexp(1 + m / 2.0 ** mb, ex - bias)) * np.where(s == 1, -1.0, 1.0)
        got = c_decode(fmt, q.astype(np.uint8)).view(np.float32)
        nan = ((q & 0x7F) == 0x7F) if fmt == "e4m3" else ((q & 0x7F) > 0x7C)
        inf = np.zeros_like(nan) if fmt == "e4m3" else ((q & 0x7F) == 0x7C)
        ok = ~(nan | inf)
        assert np.array_equal(got[ok], val[ok].astype(np.float32))
        assert np.all(np.isnan(got[nan])) and np.all(np.isinf(got[inf]))
        assert np.array_equal(np.signbit(got), s == 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scalar_codecs_match_arrays(fmt):
    x = np.concatenate([edge_values(), random_ranges(2000, 5), random_bits(2000, 6)])
    enc, dec = getattr(lib, f"opf_f32_to_{fmt}"), getattr(lib, f"opf_{fmt}_to_f32")
    # c_float objects carry the exact bits (a Python float would quiet signaling NaNs).
    got = np.array([enc(C.c_float.from_buffer_copy(v.tobytes())) for v in x], CODE_NP[fmt])
    assert_same_codes(x, got, REF_ENCODE[fmt](x), f"scalar f32->{fmt}")
    codes = all_codes(fmt)
    got = np.array([dec(int(c)) for c in codes], np.float32).view(np.uint32)
    want = ref_decode(fmt, codes)
    # ctypes returns a Python float, which quiets a signaling NaN result on the way.
    nan = (want & 0x7FFFFFFF) > 0x7F800000
    want = np.where(nan, want | 0x00400000, want)
    assert_same_codes(codes, got, want, f"scalar {fmt}->f32")


def test_e2m1_packing():
    """Even index in the low nibble; an odd n writes the last high nibble as 0 and touches
    no byte past (n + 1) / 2; the decoder reads the same layout."""
    x = random_ranges(10_001, 7) * np.float32(1e-30)  # mostly tiny: make many codes 0/8
    x[::3] = np.random.default_rng(8).uniform(-7, 7, x[::3].size)
    for n in (1, 2, 3, 4097, 10_001):
        buf = np.full((n + 1) // 2 + 4, 0xAB, np.uint8)
        lib.opf_f32_to_e2m1_n(x.ctypes.data, buf.ctypes.data, n)
        want = ref_e2m1(x[:n])
        packed = buf[:(n + 1) // 2]
        assert np.array_equal(packed & 0xF, want[0::2]), n
        assert np.array_equal(packed[:n // 2] >> 4, want[1::2]), n
        if n & 1:
            assert packed[-1] >> 4 == 0
        assert np.all(buf[(n + 1) // 2:] == 0xAB), "wrote past the packed array"
        y = np.full(n + 1, 9.0, np.float32)
        lib.opf_e2m1_to_f32_n(packed.ctypes.data, y.ctypes.data, n)
        assert np.array_equal(y[:n].view(np.uint32), E2M1_VALUES[want].view(np.uint32))
        assert y[n] == 9.0


def _random_codes(dt, n, rng):
    if dt == "f32":
        return random_ranges(n, int(rng.integers(1 << 30)))
    if dt == "e2m1":
        return rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
    return rng.integers(0, np.iinfo(CODE_NP[dt]).max + 1, n, dtype=CODE_NP[dt])


def _ref_convert(src, sdt, ddt, n):
    if sdt == ddt:
        out = src.copy()
        if sdt == "e2m1" and n & 1:
            out[-1] &= 0xF
        return out
    if sdt == "f32":
        f = src
    elif sdt == "e2m1":
        f = E2M1_VALUES[unpack_e2m1(src, n)]
    else:
        f = ref_decode(sdt, src).view(np.float32)
    if ddt == "f32":
        return f
    q = REF_ENCODE[ddt](f)
    return pack_e2m1(q) if ddt == "e2m1" else q


@pytest.mark.parametrize("sdt", list(OPF_DT))
def test_convert_every_pair(sdt):
    rng = np.random.default_rng(OPF_DT[sdt])
    for ddt in OPF_DT:
        for n in (5, 70_001):  # the second runs the OpenMP path
            src = _random_codes(sdt, n, rng)
            want = _ref_convert(src, sdt, ddt, n)
            nb = lib.opf_dtype_nbytes(OPF_DT[ddt], n)
            dst = np.zeros(nb + 8, np.uint8)
            st = lib.opf_convert(src.ctypes.data, OPF_DT[sdt], dst.ctypes.data, OPF_DT[ddt], n)
            assert st == ct.OK, ct.lib.opf_last_error(None)
            got = dst[:nb].view(want.dtype)
            if got.dtype == np.float32:
                got, want = got.view(np.uint32), want.view(np.uint32)
            assert np.array_equal(got, want), f"{sdt}->{ddt} n={n}"
            assert np.all(dst[nb:] == 0), f"{sdt}->{ddt} wrote past the end"


def test_convert_rejects_bad_input():
    x = np.ones(4, np.float32)
    y = np.full(4, 7, np.int32)
    st = lib.opf_convert(x.ctypes.data, ct.F32, y.ctypes.data, ct.I32, 4)
    assert st == 3 and "i32" in lib.opf_last_error(None).decode()
    st = lib.opf_convert(None, ct.F32, y.ctypes.data, ct.BF16, 4)
    assert st == 1 and "src" in lib.opf_last_error(None).decode()
    assert np.all(y == 7)
