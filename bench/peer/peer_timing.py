"""What the GPU peers share: the CUDA-event median of a step after warm-up.

The warm-up runs the step at least WARMUP times and until the GPU has been
busy with it for OPF_BENCH_SETTLE_MS (default 300), as opfuse's own GPU
benchmarks do (bench/bench_cuda.h): an H200 reaches its power cap some 40 ms
into a large GEMM and lowers its clocks by a fifth, so both sides are timed
in that steady state. Before its first timing a process also loads the GPU
for OPF_BENCH_PREHEAT_MS (default 3000) with bf16 GEMMs, so that no process
starts its first case on an idle, cool GPU (an nn.Linear step timed first in
its process ran 4.31 ms; timed again after some 5 s of other GEMMs, 4.93)."""
import os
import time

import torch

WARMUP, REPS = 3, 15
SETTLE_S = float(os.environ.get("OPF_BENCH_SETTLE_MS") or 300) / 1000
PREHEAT_S = float(os.environ.get("OPF_BENCH_PREHEAT_MS") or 3000) / 1000
_heated = False


def preheat():
    """4096^3 bf16 GEMMs on random data for PREHEAT_S, once a process."""
    global _heated
    if _heated or PREHEAT_S <= 0:
        return
    _heated = True
    a = torch.rand(4096, 4096, device="cuda", dtype=torch.bfloat16) * 2 - 1
    b = a * 0.5
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < PREHEAT_S:
        for _ in range(50):
            a @ b.t()
        torch.cuda.synchronize()


def settle(fn):
    """Runs fn in growing batches (a synchronize after each) until WARMUP
    runs and SETTLE_S seconds have passed."""
    t0, n, batch = time.perf_counter(), 0, 1
    while True:
        for _ in range(batch):
            fn()
        n += batch
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        left = SETTLE_S - t
        if n >= WARMUP and left <= 0:
            return
        need = int(left / (t / n)) + 1 if left > 0 else WARMUP - n
        batch = max(1, min(need, 2 * batch))


def median_ms(fn):
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
    per = REPS // rounds

    def both():
        fa()
        fb()
    preheat()
    settle(both)
    runs = []
    for _ in range(rounds):
        for f in (fa, fb):
            for _ in range(per):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                runs.append((f is fa, a, b))
    torch.cuda.synchronize()
    ta = sorted(a.elapsed_time(b) for is_a, a, b in runs if is_a)
    tb = sorted(a.elapsed_time(b) for is_a, a, b in runs if not is_a)
    return ta[len(ta) // 2], tb[len(tb) // 2]
