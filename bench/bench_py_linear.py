"""Host time from Python: one eager opfuse.torch Linear forward + backward
against torch.nn.Linear at a tiny shape (where the time is the call
overhead, not the math), and a compiled LayerNorm-MLP step against eager.
One CPU thread; prints microseconds per call and the ratios.

    python bench/bench_py_linear.py
"""
import time

import torch

import opfuse.torch as ot


def per_call_us(fn, n=2000, warm=200):
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def fwd_bwd(m, x):
    def step():
        m(x).sum().backward()
    return step


def fwd(m, x):
    def step():
        with torch.no_grad():
            m(x)
    return step


def main():
    torch.set_num_threads(1)
    x = torch.randn(16, 64, requires_grad=True)
    ref, ours = torch.nn.Linear(64, 64), ot.Linear(64, 64)
    rows = []
    for what, make in (("forward+backward", fwd_bwd), ("forward", fwd)):
        t_ref, t_ours = per_call_us(make(ref, x)), per_call_us(make(ours, x))
        rows.append((f"Linear {what}", t_ours, t_ref))
    mlp = ot.Sequential(ot.LayerNorm(64), ot.Linear(64, 256), ot.GELU(), ot.Linear(256, 64))
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)
    t_eager = per_call_us(fwd_bwd(mlp, x), n=500)
    t_comp = per_call_us(fwd_bwd(compiled, x), n=500)
    print(f"{'case':34s} {'opfuse us':>10s} {'peer us':>10s} {'ratio':>6s}")
    for name, a, b in rows:
        print(f"{name + ' vs nn.Linear':34s} {a:10.1f} {b:10.1f} {a / b:6.2f}")
    print(f"{'LN-MLP step compiled vs eager':34s} {t_comp:10.1f} {t_eager:10.1f} "
          f"{t_comp / t_eager:6.2f}")


if __name__ == "__main__":
    main()
