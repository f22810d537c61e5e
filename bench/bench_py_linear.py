"""Host time from Python: one eager opfuse.torch Linear forward + backward
against torch.nn.Linear at a tiny shape (where the time is the call
overhead, not the math), and a LayerNorm-MLP step (forward + backward),
eager and under torch.compile, against the same model made of torch.nn
modules, eager and compiled. One CPU thread; prints microseconds per call
and the ratios.

    python bench/bench_py_linear.py

The cases run interleaved, each many short rounds (a few milliseconds,
shorter than a scheduler slice), and the best round counts: on a shared
machine that is the figure least moved by other jobs (long rounds are all
preempted alike, and their best moves by tens of percent with the load).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before opfuse's OpenMP starts

import time  # noqa: E402

import torch  # noqa: E402

import opfuse.torch as ot  # noqa: E402


def rounds(cases: dict, n: int, k: int, warm: int = 50) -> dict:
    """Best us per call of each case over k interleaved rounds of n calls."""
    for fn in cases.values():
        for _ in range(warm):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(k):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
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


def mlp_pair(hidden=64, ffn=256):
    ours = ot.Sequential(ot.LayerNorm(hidden), ot.Linear(hidden, ffn), ot.GELU(),
                         ot.Linear(ffn, hidden))
    ref = torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, ffn),
                              torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
    return ours, ref


def main():
    torch.set_num_threads(1)
    x = torch.randn(16, 64, requires_grad=True)
    ref, ours = torch.nn.Linear(64, 64), ot.Linear(64, 64)
    lin = rounds({"ours fb": fwd_bwd(ours, x), "ref fb": fwd_bwd(ref, x),
                  "ours f": fwd(ours, x), "ref f": fwd(ref, x)}, n=10, k=400)
    mlp, tmlp = mlp_pair()
    compile_ = lambda m: torch.compile(m, fullgraph=True, dynamic=False)  # noqa: E731
    steps = rounds({"eager": fwd_bwd(mlp, x), "compiled": fwd_bwd(compile_(mlp), x),
                    "torch eager": fwd_bwd(tmlp, x),
                    "torch compiled": fwd_bwd(compile_(tmlp), x)}, n=4, k=200)
    rows = [("Linear forward+backward vs nn.Linear", lin["ours fb"], lin["ref fb"]),
            ("Linear forward vs nn.Linear", lin["ours f"], lin["ref f"]),
            ("LN-MLP step eager vs torch eager", steps["eager"], steps["torch eager"]),
            ("LN-MLP step compiled vs torch compiled", steps["compiled"],
             steps["torch compiled"]),
            ("LN-MLP step compiled vs opfuse eager", steps["compiled"], steps["eager"])]
    print(f"{'case':40s} {'opfuse us':>10s} {'peer us':>10s} {'ratio':>6s}")
    for name, a, b in rows:
        print(f"{name:40s} {a:10.1f} {b:10.1f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
