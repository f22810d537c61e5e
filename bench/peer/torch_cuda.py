"""PyTorch peer of `opfuse bench cuda`, on the same GPU in the same run: a
device copy, torch.compile of the FP8 current-scaling cast (with amax and the
transposed copy), torch.mm (bf16) and torch._scaled_mm (FP8 per-tensor, fast
and split accumulation). CUDA-event medians after warm-up, random data.
Reads opfuse's "name value" file and prints the comparison table last.

Usage: torch_cuda.py OPFUSE_RESULTS [M K S]      default 8192 8192 8192"""
import sys

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
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[REPS // 2]


def cast_row(x):
    amax = x.abs().amax().float()
    scale = 448.0 / amax
    q = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.reciprocal(), amax


def cast_rowcol(x):
    q, sinv, amax = cast_row(x)
    return q, q.t().contiguous(), sinv, amax


def main():
    path = sys.argv[1]
    M, K, S = (int(a) for a in sys.argv[2:5]) if len(sys.argv) >= 5 else (8192, 8192, 8192)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    peer = {}
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    in_bytes = x.numel() * 2
    ms = median_ms(lambda: y.copy_(x))
    peer["copy_gbs"] = 2 * in_bytes / ms * 1e-6
    for name, fn, copies in (("fp8_current_row", cast_row, 1), ("fp8_current_rowcol", cast_rowcol, 2)):
        c = torch.compile(fn)
        ms = median_ms(lambda: c(x))
        peer[name + "_gbs"] = in_bytes * (1 + copies / 2) / ms * 1e-6
    del x, y
    a = torch.randn(S, S, device=dev, dtype=torch.bfloat16)
    b = torch.randn(S, S, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * S ** 3
    ms = median_ms(lambda: torch.mm(a, b.t()))
    peer["gemm_bf16_tflops"] = flop / ms * 1e-9
    qa, sa, _ = cast_row(a)
    qb, sb, _ = cast_row(b)
    for name, fast in (("gemm_fp8_fast_tflops", True), ("gemm_fp8_split_tflops", False)):
        ms = median_ms(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb,
                                                out_dtype=torch.bfloat16, use_fast_accum=fast))
        peer[name] = flop / ms * 1e-9

    ours = {}
    with open(path) as f:
        for line in f:
            k, v = line.split()
            ours[k] = float(v)
    print(f"\nopfuse vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'what':34s} {'opfuse':>9s} {'peer':>9s} {'ratio':>6s}  peer is")
    rows = [
        ("copy_gbs", "GB/s", "tensor.copy_"),
        ("fp8_current_row_gbs", "GB/s", "torch.compile cast"),
        ("fp8_current_rowcol_gbs", "GB/s", "torch.compile cast+T"),
        ("fp8_delayed_row_gbs", "GB/s", "compile (current)"),
        ("fp8_delayed_rowcol_gbs", "GB/s", "compile (current)"),
        ("gemm_bf16_tflops", "TF/s", "torch.mm"),
        ("gemm_fp8_fast_tflops", "TF/s", "_scaled_mm fast"),
        ("gemm_fp8_split_tflops", "TF/s", "_scaled_mm split"),
    ]
    for k, unit, what in rows:
        pk = k.replace("delayed", "current")
        o, p = ours.get(k), peer.get(pk)
        r = f"{o / p:6.2f}" if o and p else "     -"
        print(f"{k + ' (' + unit + ')':34s} {o or 0:9.1f} {p or 0:9.1f} {r}  {what}")
    for k in sorted(ours):
        if k.endswith("_gbs") and k != "copy_gbs":
            print(f"{k:34s} {100 * ours[k] / ours['copy_gbs']:8.1f}% of our device copy")


main()
