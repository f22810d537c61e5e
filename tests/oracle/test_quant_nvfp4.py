"""Oracle for the NVFP4 quantizer (docs/numerics.md 3.4.1-3.4.5, layouts 4.2
and 4.4): an independent numpy implementation of every rounding step, compared
bit for bit with the C library on data nibbles, scale bytes (compact and
swizzled, padding included) and both amaxes; stochastic rounding both
statistically and bit for bit against a numpy Philox4x32-10 with the mapping
documented in src/backend/cpu/quantize_nvfp4.c."""
import ctypes as C
import zlib

import ml_dtypes
import numpy as np
import pytest

import opfuse_ct as ct

F32MAX = np.float32(np.finfo(np.float32).max)
INV6 = np.float32(1.0) / np.float32(6.0)  # fl32(1/6) = 0x3E2AAAAB
assert INV6.view(np.uint32) == 0x3E2AAAAB
SIGN_MASK = 0xD7E8

# ---- narrow formats (numerics.md 1.1, 1.3) ----------------------------------


def _e4m3_values():
    v = []
    for c in range(0x7F):  # 0x7F is NaN
        e, m = c >> 3, c & 7
        v.append(2.0 ** -6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))
    return np.array(v)


E4M3_VALS = _e4m3_values()
E2M1_VALS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def grid_rne(a, vals):
    """Code (index into ascending vals) of non-negative a rounded to nearest,
    ties to the even code, saturating at the top. Exact: compares against
    midpoints in float64."""
    a = np.asarray(a, dtype=np.float64)
    hi = np.clip(np.searchsorted(vals, a, side="left"), 1, len(vals) - 1)
    lo = hi - 1
    mid = (vals[lo] + vals[hi]) / 2
    up = (a > mid) | ((a == mid) & (hi % 2 == 0))
    code = np.where(up, hi, lo)
    return np.where(a >= vals[-1], len(vals) - 1, code).astype(np.uint8)


def e4m3(x):
    """cvt_e4m3 for the non-negative, non-NaN block scales (satfinite)."""
    return grid_rne(x, E4M3_VALS)


def e4m3_decode(c):
    return E4M3_VALS[c].astype(np.float32)


def e2m1(x):
    """cvt_e2m1: RNE, saturate to 6, sign kept (also for zero), NaN -> +6."""
    x = np.asarray(x, dtype=np.float32)
    nan = np.isnan(x)
    code = grid_rne(np.where(nan, 0, np.abs(x)), E2M1_VALS)
    code = code | np.where(np.signbit(x), 8, 0).astype(np.uint8)
    return np.where(nan, 7, code).astype(np.uint8)


def e2m1_decode(c):
    v = E2M1_VALS[c & 7].astype(np.float32)
    return np.where(c & 8, -v, v).astype(np.float32)


def bf16_round(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def amax(x, axis=None):
    a = np.abs(np.asarray(x, dtype=np.float32))
    return np.where(np.isnan(a), np.float32(0), a).max(axis=axis, initial=np.float32(0))


# ---- scales (3.4.1, 3.4.2) -------------------------------------------------


def global_scale(A):
    A = np.float32(A)
    s = np.float32(2688.0) / A
    s = F32MAX if (np.isnan(s) or s > F32MAX) else s
    if A == 0 or s == 0:
        s = np.float32(1.0)
    return np.float32(s), np.float32(1.0) / np.float32(s)


def block_scale(b, s_enc, s_dec):
    """b: float32 block amaxes -> (sf codes, enc factors)."""
    d = b * np.float32(s_enc * INV6)
    sf = e4m3(np.minimum(d, F32MAX))
    enc = np.float32(1.0) / (e4m3_decode(sf) * s_dec)
    return sf, np.minimum(enc, F32MAX).astype(np.float32)


# ---- RHT (3.4.3) -----------------------------------------------------------

H16 = np.array([[(-1) ** bin(r & c).count("1") for c in range(16)] for r in range(16)])


def rht_columnwise(x, mask):
    """x [M, K] float32 -> rotated transposed values [K, M]: bf16 inputs, fp32
    sum r = 0..15 from +0, bf16 result."""
    xt = bf16_round(x.T)
    k, m = xt.shape
    blocks = xt.reshape(k, m // 16, 16)
    s = np.array([-1.0 if (mask >> r) & 1 else 1.0 for r in range(16)])
    coef = (0.25 * s[:, None] * H16).astype(np.float32)
    acc = np.zeros_like(blocks)
    for r in range(16):
        acc = acc + blocks[..., r:r + 1] * coef[r]
    return bf16_round(acc.reshape(k, m))


# ---- Philox4x32-10 and the SR mapping (3.4.5) -------------------------------


def philox(ctr, key):
    """ctr: uint64 array [n, 4] of 32-bit words, key: 2 ints."""
    M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    mask = np.uint64(0xFFFFFFFF)
    c = [ctr[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0 = np.uint64(M0) * c[0]
        p1 = np.uint64(M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]
        k0 = (k0 + np.uint64(W0)) & mask
        k1 = (k1 + np.uint64(W1)) & mask
    return np.stack(c, axis=1).astype(np.uint32)


def test_philox_known_answer():
    # Random123's published Philox4x32-10 known-answer vectors.
    z = philox(np.zeros((1, 4), np.uint64), (0, 0))[0]
    assert [hex(v) for v in z] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    f = philox(np.full((1, 4), 0xFFFFFFFF, np.uint64), (0xFFFFFFFF, 0xFFFFFFFF))[0]
    assert [hex(v) for v in f] == ["0x408f276d", "0x41c83b0e", "0xa20bc7c6", "0x6d5451fd"]


def sr_bytes(n, seed, offset, copy_id):
    """r8 for the stored elements 0..n-1 of one copy."""
    nb = (n + 15) // 16
    b = np.arange(nb, dtype=np.uint64) + np.uint64(offset)
    ctr = np.stack([b & np.uint64(0xFFFFFFFF), b >> np.uint64(32),
                    np.full(nb, copy_id, np.uint64), np.zeros(nb, np.uint64)], axis=1)
    w = philox(ctr, (seed & 0xFFFFFFFF, seed >> 32)).astype("<u4")
    return w.view(np.uint8).reshape(-1)[:n]


def sr_round(v, r8):
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v)
    u = r8.astype(np.float32) / np.float32(256)

    def step(z):
        return np.where(z < 2, np.float32(0.5), np.where(z < 4, np.float32(1), np.float32(2)))

    t = (a + u * step(a)).astype(np.float32)  # the fma: u*step is exact
    q = np.minimum(np.floor(t / step(t)) * step(t), np.float32(6))
    code = grid_rne(np.where(np.isnan(q), 0, q), E2M1_VALS)
    code = code | np.where(np.signbit(v), 8, 0).astype(np.uint8)
    return np.where(np.isnan(v), 7, code).astype(np.uint8)


# ---- the quantizer ---------------------------------------------------------


def quantize_1d(vals, A, sr=None):
    """vals [R, C] (stored layout) -> codes [R, C], sf [R, C/16]."""
    r, c = vals.shape
    s_enc, s_dec = global_scale(A)
    blk = vals.reshape(r, c // 16, 16)
    sf, enc = block_scale(amax(blk, axis=-1), s_enc, s_dec)
    v = (blk * enc[..., None]).astype(np.float32).reshape(r, c)
    codes = e2m1(v) if sr is None else sr_round(v, sr.reshape(r, c))
    return codes, sf


def quantize_2d(x, A, sr=None):
    m, k = x.shape
    s_enc, s_dec = global_scale(A)
    tiles = x.reshape(m // 16, 16, k // 16, 16)
    sf, enc = block_scale(amax(tiles, axis=(1, 3)), s_enc, s_dec)
    v = (tiles * enc[:, None, :, None]).astype(np.float32).reshape(m, k)
    codes = e2m1(v) if sr is None else sr_round(v, sr.reshape(m, k))
    return codes, np.repeat(sf, 16, axis=0)  # rowwise grid [M, K/16]


def swizzle_index(i, j, C):
    return ((i // 128) * (C // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def scale_store(sf, rows_pad, cols_pad, swizzled):
    S = np.zeros((rows_pad, cols_pad), np.uint8)
    S[:sf.shape[0], :sf.shape[1]] = sf
    if not swizzled:
        return S.reshape(-1)
    out = np.zeros(rows_pad * cols_pad, np.uint8)
    i, j = np.meshgrid(np.arange(rows_pad), np.arange(cols_pad), indexing="ij")
    out[swizzle_index(i, j, cols_pad).reshape(-1)] = S.reshape(-1)
    return out


def pack(codes):
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def roundup(a, b):
    return (a + b - 1) // b * b


def reference(x, two_d, rht, swizzled, sr=None):
    """Expected components of the rowwise+columnwise quantization of x
    (float32 values of the input); sr = (seed, offset) or None."""
    m, k = x.shape
    a_row = amax(x)
    rot = rht_columnwise(x, SIGN_MASK) if rht else None
    a_col = amax(rot) if rht else a_row
    r8 = sr_bytes(m * k, sr[0], sr[1], 0) if sr else None  # rowwise indices, copy 0
    if two_d:  # one quantization; the columnwise copy is its transpose
        codes, sf = quantize_2d(x, a_row, r8)
        ccodes, csf = codes.T, np.repeat(sf[::16].T, 16, axis=0)
    else:
        codes, sf = quantize_1d(x, a_row, r8)
        r8c = sr_bytes(m * k, sr[0], sr[1], 1) if sr else None
        ccodes, csf = quantize_1d(rot if rht else np.ascontiguousarray(x.T), a_col, r8c)
    return {
        ct.COMP_DATA: pack(codes),
        ct.COMP_SCALE_INV: scale_store(sf, roundup(m, 128), roundup(k // 16, 4), swizzled),
        ct.COMP_COL_DATA: pack(np.ascontiguousarray(ccodes)),
        ct.COMP_COL_SCALE_INV: scale_store(csf, roundup(k, 128), roundup(m // 16, 4), swizzled),
        ct.COMP_AMAX: np.float32(a_row),
        ct.COMP_COL_AMAX: np.float32(a_col),
        "codes": codes, "ccodes": np.ascontiguousarray(ccodes), "rot": rot,
        "sf": sf, "csf": csf,
    }


def dequant_ref(codes, sf_grid, A):
    """codes [R, C], sf_grid [R, C/16] e4m3 codes -> values [R, C]."""
    _, s_dec = global_scale(A)
    q = e2m1_decode(codes) * np.repeat(e4m3_decode(sf_grid), 16, axis=1)
    return (q * s_dec).astype(np.float32)


# ---- inputs ----------------------------------------------------------------


def make_input(shape, kind, rng):
    n = int(np.prod(shape))
    if kind == "normal":
        x = rng.normal(0, 1, n)
    elif kind == "wide":  # magnitudes over 40 binades, plus zero blocks
        x = rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-20, 20, n)
        x[: min(n, 48)] = 0
    elif kind == "large":
        x = rng.normal(0, 3e4, n)
    elif kind == "tiny":  # global amax near fp32's bottom: S_enc clamps to FLT_MAX
        x = rng.normal(0, 1e-39, n)
    elif kind == "special":
        x = rng.normal(0, 2, n)
        x[rng.integers(0, n, 6)] = np.inf
        x[rng.integers(0, n, 6)] = -np.inf
        x[rng.integers(0, n, 6)] = np.nan
        x[16:48] = 0
        x[64:80] = np.nan
    elif kind == "nan_only":  # NaN and finite, no inf: finite global scale
        x = rng.uniform(-5, 5, n)
        x[rng.integers(0, n, n // 20)] = np.nan
        x[:16] = np.nan
    elif kind == "grid":  # S_enc = 2^10 and blocks with enc = 16 exactly: v = 16 x lands
        # on E2M1 values, midpoints and step edges (numerics.md 3.4.5 boundaries)
        x = rng.choice([-1, 1], n) * rng.integers(0, 6 * 64 + 1, n) / 64.0 / 16.0
        x[::16] = 0.375  # every block's amax: d = 64.000002 -> sf = 64, enc = 16
        x[0] = 2.625  # A = 2688 / 2^10
    elif kind == "zeros":
        x = np.zeros(n)
    return x.astype(np.float32).reshape(shape)


def to_c(x, dtype):
    """(array handed to C, float32 values the reference sees)."""
    if dtype == ct.BF16:
        b = x.astype(ml_dtypes.bfloat16)
        return np.ascontiguousarray(b.view(np.uint16)), b.astype(np.float32)
    return np.ascontiguousarray(x), x


def quantizer(two_d=False, rht=False, swizzled=False, stochastic=False,
              usage=ct.ROWWISE | ct.COLUMNWISE):
    q = ct.lib.opf_quantizer_default()
    q.scaling = ct.SCALING_NVFP4_2D if two_d else ct.SCALING_NVFP4_1D
    q.qdtype = ct.E2M1
    q.usage = usage
    q.swizzled = swizzled
    q.rht = rht
    q.rht_sign_mask = SIGN_MASK
    q.stochastic = stochastic
    return q


def run(x, dtype, q, seed=0, offset=0):
    """Quantizes and returns ({component: array}, dequantized rowwise, columnwise)."""
    xc, _ = to_c(x, dtype)
    with ct.Ctx(seed=seed, offset=offset) as ctx:
        t, L = ct.quantize(ctx, q, xc, dtype)
        try:
            got = {c: ct.component(t, c, L) for c in range(6)}
            deq = {w: ct.dequantize(ctx, t, w) for w in (ct.ROWWISE, ct.COLUMNWISE)
                   if q.usage & w}
        finally:
            ct.lib.opf_tensor_release(C.byref(t))
    return got, deq


def compare(got, want):
    for c in (ct.COMP_DATA, ct.COMP_COL_DATA):
        g, w = got[c], want[c]
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"component {c}: {len(bad)} bytes differ, first {bad[:4].tolist()}"
    for c in (ct.COMP_SCALE_INV, ct.COMP_COL_SCALE_INV):
        assert np.array_equal(got[c].reshape(-1), want[c]), f"scale component {c} differs"
    for c in (ct.COMP_AMAX, ct.COMP_COL_AMAX):
        assert got[c].reshape(-1)[0].tobytes() == want[c].tobytes(), \
            f"amax {c}: {got[c]} vs {want[c]}"


SHAPES = [(16, 32), (128, 64), (48, 80), (256, 256), (2, 24, 48)]
KINDS = ["normal", "wide", "large", "tiny", "special", "nan_only", "zeros", "grid"]


def cases():
    out = []
    i = 0
    for two_d in (False, True):
        for rht in ((False, True) if not two_d else (False,)):
            for swz in (False, True):
                for dt in (ct.F32, ct.BF16):
                    for shape in SHAPES:
                        kind = KINDS[i % len(KINDS)]
                        i += 1
                        out.append((two_d, rht, swz, dt, shape, kind))
    return out


def ident(c):
    two_d, rht, swz, dt, shape, kind = c
    return (f"{'2d' if two_d else '1d'}-{'rht' if rht else 'plain'}-"
            f"{'swz' if swz else 'compact'}-{'bf16' if dt == ct.BF16 else 'f32'}-"
            f"{'x'.join(map(str, shape))}-{kind}")


@pytest.mark.parametrize("case", cases(), ids=ident)
def test_quantize_exact(case):
    two_d, rht, swz, dt, shape, kind = case
    rng = np.random.default_rng(zlib.crc32(ident(case).encode()))
    x = make_input(shape, kind, rng)
    _, xf = to_c(x, dt)
    x2d = xf.reshape(-1, shape[-1])
    with np.errstate(all="ignore"):
        want = reference(x2d, two_d, rht, swz)
    got, deq = run(x, dt, quantizer(two_d, rht, swz))
    compare(got, want)
    # Decoding: fp4 * sf * S_dec, columnwise transposed back (rotated values with RHT).
    m, k = x2d.shape
    with np.errstate(all="ignore"):
        row = dequant_ref(want["codes"], want["sf"], want[ct.COMP_AMAX])
        col = dequant_ref(want["ccodes"], want["csf"], want[ct.COMP_COL_AMAX])
    assert np.array_equal(deq[ct.ROWWISE].reshape(m, k).view(np.uint32), row.view(np.uint32))
    assert np.array_equal(deq[ct.COLUMNWISE].reshape(m, k).view(np.uint32),
                          col.T.view(np.uint32))


@pytest.mark.parametrize("usage", [ct.ROWWISE, ct.COLUMNWISE])
@pytest.mark.parametrize("two_d,rht", [(False, False), (False, True), (True, False)])
def test_single_copy_matches_both(usage, two_d, rht):
    rng = np.random.default_rng(7)
    x = make_input((64, 96), "normal", rng)
    both, _ = run(x, ct.F32, quantizer(two_d, rht))
    one, _ = run(x, ct.F32, quantizer(two_d, rht, usage=usage))
    comps = [ct.COMP_DATA, ct.COMP_SCALE_INV] if usage == ct.ROWWISE else \
        [ct.COMP_COL_DATA, ct.COMP_COL_SCALE_INV, ct.COMP_COL_AMAX]
    for c in comps + [ct.COMP_AMAX]:
        assert np.array_equal(one[c], both[c]), f"component {c}"
    absent = ct.COMP_COL_DATA if usage == ct.ROWWISE else ct.COMP_DATA
    assert one[absent] is None


def test_f16_input():
    rng = np.random.default_rng(11)
    x = make_input((32, 64), "normal", rng).astype(np.float16)
    xc = np.ascontiguousarray(x.view(np.uint16))
    with ct.Ctx() as ctx:
        t, L = ct.quantize(ctx, quantizer(rht=True), xc, ct.F16)
        got = {c: ct.component(t, c, L) for c in range(6)}
        ct.lib.opf_tensor_release(C.byref(t))
    with np.errstate(all="ignore"):
        want = reference(x.astype(np.float32), False, True, False)
    compare(got, want)


def test_rht_known_vectors():
    # A unit impulse at r gives row r of T: s_r * H[r][:] / 4.
    x = np.zeros((16, 16), np.float32)
    x[np.arange(16), np.arange(16)] = 1.0  # column k holds the impulse at m = k
    rot = rht_columnwise(x, SIGN_MASK)  # [K=16, M=16]
    s = np.array([-1.0 if (SIGN_MASK >> r) & 1 else 1.0 for r in range(16)])
    assert np.array_equal(rot, (0.25 * s[:, None] * H16).astype(np.float32))
    assert list(np.where(s < 0)[0]) == [3, 5, 6, 7, 8, 9, 10, 12, 14, 15]


@pytest.mark.parametrize("dt", [ct.F32, ct.BF16])
def test_rht_summation_order(dt):
    """Pins the documented fp32 order (from +0, r = 0..15): column k=0 sums
    2^24 + 1 + ... + 1 - 2^24 for output 0 (0 in this order, 14 reversed);
    column k=1 holds signed zeros whose every term is -0 (+0 from a +0 start,
    -0 from a -0 start: nibble 0 vs 8)."""
    s = np.array([-1.0 if (SIGN_MASK >> r) & 1 else 1.0 for r in range(16)])
    t = np.array([2.0 ** 24] + [1.0] * 14 + [-(2.0 ** 24)])
    x = np.zeros((32, 32), np.float32)
    x[:16, 0] = 4 * t * s  # y_0 = sum_r x_r s_r / 4 = sum_r t_r
    x[:16, 1] = np.where(s > 0, -0.0, 0.0)
    x[16:, 2:] = np.random.default_rng(1).normal(0, 1e6, (16, 30))
    xc, xf = to_c(x, dt)
    with np.errstate(all="ignore"):
        want = reference(xf, False, True, False)
    assert want["rot"][0, 0] == 0 and want["rot"][1, 0] == 0 and not np.signbit(want["rot"][1, 0])
    got, _ = run(x, dt, quantizer(rht=True))
    compare(got, want)


# ---- stochastic rounding ---------------------------------------------------

SR_CASES = [(False, False, ct.F32, (128, 64), "normal"), (False, False, ct.F32, (64, 64), "grid"),
            (False, True, ct.BF16, (48, 80), "special"), (True, False, ct.F32, (64, 32), "wide"),
            (False, True, ct.F32, (2, 16, 32), "normal")]


@pytest.mark.parametrize("two_d,rht,dt,shape,kind", SR_CASES)
@pytest.mark.parametrize("seed,offset", [(0, 0), (0x1234_5678_9ABC_DEF0, 2**32 - 3)])
def test_sr_exact(two_d, rht, dt, shape, kind, seed, offset):
    rng = np.random.default_rng(seed % 1000 + 3)
    x = make_input(shape, kind, rng)
    _, xf = to_c(x, dt)
    x2d = xf.reshape(-1, shape[-1])
    with np.errstate(all="ignore"):
        want = reference(x2d, two_d, rht, False, sr=(seed, offset))
    got, _ = run(x, dt, quantizer(two_d, rht, stochastic=True), seed=seed, offset=offset)
    compare(got, want)


def test_sr_advances_offset_and_differs():
    rng = np.random.default_rng(5)
    x = make_input((64, 64), "normal", rng)
    q = quantizer(rht=True, stochastic=True)
    with ct.Ctx(seed=9, offset=100) as ctx:
        t1, L = ct.quantize(ctx, q, x, ct.F32)
        s, o = C.c_uint64(), C.c_uint64()
        ct.lib.opf_ctx_get_rng(ctx.h, C.byref(s), C.byref(o))
        assert (s.value, o.value) == (9, 100 + 64 * 64 // 16)
        t2, _ = ct.quantize(ctx, q, x, ct.F32)
        d1, d2 = ct.component(t1, ct.COMP_DATA, L), ct.component(t2, ct.COMP_DATA, L)
        assert not np.array_equal(d1, d2)
        assert np.array_equal(ct.component(t1, ct.COMP_SCALE_INV, L),
                              ct.component(t2, ct.COMP_SCALE_INV, L))
        for t in (t1, t2):
            ct.lib.opf_tensor_release(C.byref(t))


@pytest.mark.parametrize("rht", [False, True])
def test_sr_statistics(rht):
    """Every SR output brackets the scaled value; the mean of 64 draws beats
    round-to-nearest in RMSE (TE's own SR test, numerics.md 8.2)."""
    rng = np.random.default_rng(21)
    m, k = 128, 64
    x = make_input((m, k), "normal", rng)
    with np.errstate(all="ignore"):
        want = reference(x, False, rht, False)
    vals = {ct.ROWWISE: x, ct.COLUMNWISE: want["rot"] if rht else np.ascontiguousarray(x.T)}
    amaxes = {ct.ROWWISE: want[ct.COMP_AMAX], ct.COLUMNWISE: want[ct.COMP_COL_AMAX]}
    rn_codes = {ct.ROWWISE: want["codes"], ct.COLUMNWISE: want["ccodes"]}
    sums = {w: np.zeros_like(vals[w], dtype=np.float64) for w in vals}
    draws = 64
    with ct.Ctx(seed=77, offset=0) as ctx:
        for _ in range(draws):
            t, L = ct.quantize(ctx, quantizer(rht=rht, stochastic=True), x, ct.F32)
            for w, (dc, sc) in {ct.ROWWISE: (ct.COMP_DATA, ct.COMP_SCALE_INV),
                                ct.COLUMNWISE: (ct.COMP_COL_DATA, ct.COMP_COL_SCALE_INV)}.items():
                packed = ct.component(t, dc, L)
                codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
                codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
                r, c = codes.shape
                s_enc, s_dec = global_scale(amaxes[w])
                sf, enc = block_scale(amax(vals[w].reshape(r, c // 16, 16), axis=-1),
                                      s_enc, s_dec)
                v = np.abs(vals[w].reshape(r, c // 16, 16) * enc[..., None]).reshape(r, c)
                got = np.abs(e2m1_decode(codes))
                lo = E2M1_VALS[np.searchsorted(E2M1_VALS, v, side="right") - 1]
                hi = E2M1_VALS[np.minimum(np.searchsorted(E2M1_VALS, v, side="left"), 7)]
                assert np.all((got == lo) | (got == hi)), "SR output outside its bracket"
                sgn = np.signbit(e2m1_decode(codes)) == np.signbit(vals[w])
                assert np.all(sgn | (got == 0))
                sums[w] += dequant_ref(codes, sf, amaxes[w])
            ct.lib.opf_tensor_release(C.byref(t))
    for w in vals:
        ref = vals[w].astype(np.float64)
        rn = dequant_ref(rn_codes[w], quantize_1d(vals[w], amaxes[w])[1], amaxes[w])
        rmse_sr = np.sqrt(np.mean((sums[w] / draws - ref) ** 2))
        rmse_rn = np.sqrt(np.mean((rn - ref) ** 2))
        assert rmse_sr < rmse_rn, (w, rmse_sr, rmse_rn)
