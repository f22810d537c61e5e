"""What the GPU peers share: the CUDA-event median of a step after warm-up.

The warm-up runs the step at least WARMUP times and until OPF_BENCH_SETTLE_MS
(default 300) of wall time have passed after its first run (whose one-time
setup, a compilation, is no warm-up), as opfuse's own GPU benchmarks do
(bench/bench_cuda.h): an H200 reaches its power cap some 40 ms into a large
GEMM and lowers its clocks by a fifth, so both sides are timed in that steady
state. Before its first timing a process also loads the GPU for
OPF_BENCH_PREHEAT_MS (default 3000) with bf16 GEMMs (median_ms(fn,
preheat=False) skips it), so that no process times its first case on an
idle, cool GPU; added for an nn.Linear step that ran 4.31 ms timed first in
its process and 4.93 ms timed again after other GEMMs (whether this is all of
that gap is open: bench/RESULTS.md, Dec 3)."""
import math
import os
import sys
import time

import torch

WARMUP, REPS = 3, 15


def env_ms(name, default):
    """A non-negative number of milliseconds from the environment, in
    seconds; default where unset or empty, and where not one (said)."""
    v = os.environ.get(name) or ""
    if not v:
        return default / 1000
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not math.isfinite(x) or x < 0:
        print(f'{name}="{v}" is not a number of milliseconds >= 0: {default:g} used',
              file=sys.stderr)
        x = default
    return x / 1000


SETTLE_S = env_ms("OPF_BENCH_SETTLE_MS", 300)
PREHEAT_S = env_ms("OPF_BENCH_PREHEAT_MS", 3000)
_heated = False


def preheat():
    """4096^3 bf16 GEMMs on random data for PREHEAT_S, once a process."""
    global _heated
    if _heated or PREHEAT_S <= 0:
        return
    _heated = True
    a = torch.rand(4096, 4096, device="cuda", dtype=torch.bfloat16) * 2 - 1
    b = torch.rand(4096, 4096, device="cuda", dtype=torch.bfloat16) * 2 - 1
    settle(lambda: a @ b.t(), PREHEAT_S, 1)


def settle(fn, seconds=None, min_runs=WARMUP):
    """Runs fn once, then in growing batches (a synchronize after each)
    until min_runs runs in all and seconds (default SETTLE_S) after the
    first."""
    seconds = SETTLE_S if seconds is None else seconds
    fn()
    torch.cuda.synchronize()
    t0, n, done, batch = time.perf_counter(), 1, 0, 1
    while True:
        t = time.perf_counter() - t0
        left = seconds - t
        if n >= min_runs and left <= 0:
            return
        if done:  # twice the last batch at most, no more than the time left needs
            need = int(left / max(t / done, 1e-9)) + 1 if left > 0 else min_runs - n
            batch = max(1, min(need, 2 * batch, 1 << 20))
        for _ in range(batch):
            fn()
        n += batch
        done += batch
        torch.cuda.synchronize()


def median_ms(fn, preheat_gpu=True):
    if preheat_gpu:
        preheat()
    settle(fn)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(REPS)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[REPS // 2]


def pair_ms(fa, fb, rounds=5):
    """Medians (ms) of fa and fb timed in turns, rounds of REPS // rounds runs
    each after the warm-up of both, all queued before the first read (as
    opfuse's time_pair_ms): both see the same clocks and heat."""
    per = max(1, REPS // rounds)

    def both():
        fa()
        fb()
    preheat()
    settle(both)
    runs = []  # (0 for fa / 1 for fb, start event, end event)
    for _ in range(rounds):
        for k, f in enumerate((fa, fb)):
            for _ in range(per):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                runs.append((k, a, b))
    torch.cuda.synchronize()
    ta = sorted(a.elapsed_time(b) for k, a, b in runs if k == 0)
    tb = sorted(a.elapsed_time(b) for k, a, b in runs if k == 1)
    return ta[len(ta) // 2], tb[len(tb) // 2]
