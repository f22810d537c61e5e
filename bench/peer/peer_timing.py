"""What the GPU peers share: the CUDA-event median of a step after warm-up."""
import torch

WARMUP, REPS = 3, 15


def median_ms(fn):
    for _ in range(WARMUP):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(REPS)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[REPS // 2]
