#!/usr/bin/env python3
"""fit_act_math.py: derives the polynomial coefficients of src/backend/cpu/act-math.h.

    .venv/bin/python scripts/fit_act_math.py

Prints the fp32 coefficients (as C hex literals) of
  exp:  e^r = 1 + r + r^2 Q(r),       Q of degree 4, r in [-0.3467, 0.3467] (ln2/2 and the
        slack of rounding z*log2(e) in fp32)
  tanh: tanh x = x + x^3 P(x^2),      P of degree 5, |x| < 0.75
each a weighted minimax fit of the *relative* error of e^r and tanh x (not of Q or P),
by Lawson's algorithm (iteratively reweighted least squares, which converges to the
minimax solution) on 40001 Chebyshev points, in float64. The coefficients are then
rounded to fp32 once; docs/numerics.md 6.3.1 has the resulting errors, measured over every
fp32 input by tests/ops/test_act_math.c (OPF_TEST_EXHAUSTIVE=1).

Only numpy is needed; the reference values come from numpy's float64 exp/expm1/tanh, whose
~1e-16 error is far below the ~1e-9 fit error.
"""
import numpy as np

EXP_R = 0.3467          # |r| <= ln2/2 = 0.34657..., plus slack
TANH_C = 0.75           # the polynomial covers |x| < 0.75; above, 1 - 2/(e^{2|x|} + 1)


def minimax(func, weight, lo, hi, deg, iters=400):
    """Coefficients c[0..deg] (increasing powers) of the polynomial p that minimises
    max |weight(t) * (p(t) - func(t))| over [lo, hi], and that maximum."""
    t = (lo + hi) / 2 + (hi - lo) / 2 * np.cos(np.linspace(0.0, np.pi, 40001))
    y, w = func(t), weight(t)
    V = np.vander(t, deg + 1, increasing=True)
    lw = np.full(t.shape, 1.0 / t.size)
    for _ in range(iters):
        sw = np.sqrt(lw) * w
        c, *_ = np.linalg.lstsq(V * sw[:, None], y * sw, rcond=None)
        e = np.abs((V @ c - y) * w)
        lw *= e
        lw /= lw.sum()
    return c, e.max()


def exp_q(r):
    """(e^r - 1 - r) / r^2."""
    r = np.where(r == 0.0, 1e-300, r)
    small = np.abs(r) < 1e-3
    series = 0.5 + r / 6 + r * r / 24 + r ** 3 / 120
    return np.where(small, series, (np.expm1(r) - r) / (r * r))


def tanh_p(u):
    """(tanh x - x) / x^3 with u = x^2."""
    x = np.sqrt(u)
    small = x < 1e-2
    xs = np.where(small, 1.0, x)
    series = -1 / 3 + 2 / 15 * u - 17 / 315 * u * u + 62 / 2835 * u ** 3
    return np.where(small, series, (np.tanh(xs) - xs) / xs ** 3)


def c_hex(v):
    """A C hex float literal of the fp32 value v."""
    return float(np.float32(v)).hex().replace("0000000p", "p") + "f"


def main():
    # relative error of e^r: r^2 (Q - q) / e^r
    q, eq = minimax(exp_q, lambda r: r * r / np.exp(r), -EXP_R, EXP_R, 4)
    # relative error of tanh x: x^3 (P - p) / tanh x, in u = x^2
    def wt(u):
        x = np.maximum(np.sqrt(u), 1e-30)
        return x ** 3 / np.tanh(x)
    p, ep = minimax(tanh_p, wt, 0.0, TANH_C * TANH_C, 5)
    print(f"exp  Q: max relative error of the fit {eq:.3g} ({eq / 2**-24:.3f} ulp of 1)")
    for i, v in enumerate(q):
        print(f"  Q{i} = {c_hex(v):>20}  /* {np.float32(v)!r} */")
    print(f"tanh P: max relative error of the fit {ep:.3g} ({ep / 2**-24:.3f} ulp of 1)")
    for i, v in enumerate(p):
        print(f"  P{i} = {c_hex(v):>20}  /* {np.float32(v)!r} */")


if __name__ == "__main__":
    main()
