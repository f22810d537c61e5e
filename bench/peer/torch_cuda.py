"""PyTorch peer of `opfuse bench cuda`, on the same GPU in the same run: a
device copy, torch.compile of each cast (FP8 current scaling with amax and the
transposed copy; MXFP8 1x32 / 32x1 / 32x32 with E8M0 exponents; FP8 block
1x128 and 128x128 with pow2 scales and transposed copies; NVFP4 1x16 with the
global scale, e4m3 block scales and packed e2m1 codes, with and without the
16-point Hadamard transform of the transposed copy, and 16x16), torch.mm (bf16; TN, NN, NT)
and torch._scaled_mm (FP8 per-tensor, fast and split accumulation); LayerNorm,
RMSNorm, GELU and SwiGLU (eager) against the norm and activation kernels;
the transposed copy x.t().contiguous() of a bf16 tensor, a fused AdamW step
(torch.optim.AdamW(fused=True)) over 100 tensors of 1M fp32 parameters;
causal F.scaled_dot_product_attention at GPT-2 small's shape (fp32 with TF32
allowed, and bf16), forward and forward + backward, against opfuse's gemm
and flash attention paths; F.cross_entropy over GPT-2 small's bf16 logits
(16 x 1024 x 50304), forward and forward + backward.
CUDA-event medians after warm-up, random data. Block-scaled, MXFP8 and NVFP4 GEMMs
have no PyTorch peer on Hopper: the table compares them with opfuse's
per-tensor FP8 GEMM and with torch.mm.
Reads opfuse's "name value" file and prints the comparison table last.

Usage: torch_cuda.py OPFUSE_RESULTS [M K S]      default 8192 8192 8192"""
import sys

import torch

from peer_timing import median_ms


def cast_row(x):
    amax = x.abs().amax().float()
    scale = 448.0 / amax
    q = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.reciprocal(), amax


def cast_rowcol(x):
    q, sinv, amax = cast_row(x)
    return q, q.t().contiguous(), sinv, amax


F8 = torch.float8_e4m3fn


def mx_cast(xb, dim):
    """xb fp32 with 32-element blocks along dim: E8M0 exponent rounding up
    amax/448, the elements times 2^-e."""
    amax = xb.abs().amax(dim, keepdim=True)
    e = torch.ceil(torch.log2(amax * (1.0 / 448.0))).clamp(-127.0, 127.0)
    q = (xb * torch.exp2(-e)).clamp(-448.0, 448.0).to(F8)
    return q, (e + 127.0).to(torch.uint8)


def mxfp8_row(x):
    M, K = x.shape
    q, e = mx_cast(x.float().view(M, K // 32, 32), 2)
    return q.view(M, K), e


def mxfp8_rowcol(x):
    M, K = x.shape
    q, e = mxfp8_row(x)
    qc, ec = mx_cast(x.float().view(M // 32, 32, K), 1)
    return q, e, qc.view(M, K), ec


def mxfp8_2d_rowcol(x):
    M, K = x.shape
    q, e = mx_cast(x.float().view(M // 32, 32, K // 32, 32), (1, 3))
    q = q.view(M, K)
    return q, q.clone(), e


def blk_cast(xb, dim):
    """Pow2 block scale 448/amax rounded down to a power of two."""
    amax = xb.abs().amax(dim, keepdim=True).clamp(min=1e-30)
    s = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (xb * s).clamp(-448.0, 448.0).to(F8), 1.0 / s


def block1d_row(x):
    M, K = x.shape
    q, s = blk_cast(x.float().view(M, K // 128, 128), 2)
    return q.view(M, K), s


def block1d_rowcol(x):
    M, K = x.shape
    q, s = block1d_row(x)
    qc, sc = blk_cast(x.float().view(M // 128, 128, K), 1)
    return q, s, qc.view(M, K).t().contiguous(), sc


def block2d_rowcol(x):
    M, K = x.shape
    q, s = blk_cast(x.float().view(M // 128, 128, K // 128, 128), (1, 3))
    q = q.view(M, K)
    return q, q.t().contiguous(), s


def fp4_codes(v):
    """e2m1 codes of fp32 v (|v| <= 6 after scaling), nearest with ties to
    even, sign in bit 3, packed two a byte along the last dim."""
    a = v.abs()
    c = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
         + (a >= 3.5) + (a > 5)) | ((v < 0).to(torch.uint8) << 3)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def nv_cast(xb, dim, s_enc):
    """Blocks of xb along dim: e4m3 scale of amax * S_enc / 6, codes of
    x * S_enc / scale."""
    amax = xb.abs().amax(dim, keepdim=True)
    sf = (amax * (s_enc / 6.0)).clamp(max=448.0).to(F8)
    return xb * (s_enc / sf.float().clamp(min=2.0 ** -9)), sf


def nvfp4_row(x):
    M, K = x.shape
    xf = x.float()
    v, sf = nv_cast(xf.view(M, K // 16, 16), 2, 2688.0 / xf.abs().amax())
    return fp4_codes(v.view(M, K)), sf


def rht_matrix(dev):
    """diag(s) H16 / 4 with the sign mask 0xD7E8."""
    i = torch.arange(16, device=dev)
    pc = torch.zeros(16, 16, dtype=torch.int64, device=dev)
    a = i[:, None] & i[None, :]
    for b in range(4):
        pc += (a >> b) & 1
    h = 1.0 - 2.0 * (pc % 2).float()
    s = 1.0 - 2.0 * ((0xD7E8 >> i) & 1).float()
    return s[:, None] * h / 4.0


def nvfp4_col(x, rot):
    M, K = x.shape
    xt = x.float().t().reshape(K, M // 16, 16)
    if rot is not None:
        xt = (xt @ rot).to(torch.bfloat16).float()
    v, sf = nv_cast(xt, 2, 2688.0 / xt.abs().amax())
    return fp4_codes(v.reshape(K, M)), sf


def nvfp4_rowcol(x):
    return nvfp4_row(x), nvfp4_col(x, None)


RHT = None


def nvfp4_rht_rowcol(x):
    return nvfp4_row(x), nvfp4_col(x, RHT)


def nvfp4_2d_rowcol(x):
    M, K = x.shape
    xf = x.float()
    v, sf = nv_cast(xf.view(M // 16, 16, K // 16, 16), (1, 3), 2688.0 / xf.abs().amax())
    q = fp4_codes(v.reshape(M, K))
    return q, fp4_codes(v.reshape(M, K).t()), sf


CASTS = (("fp8_current_row", cast_row, 1), ("fp8_current_rowcol", cast_rowcol, 2),
         ("mxfp8_row", mxfp8_row, 1), ("mxfp8_rowcol", mxfp8_rowcol, 2),
         ("mxfp8_2d_rowcol", mxfp8_2d_rowcol, 2), ("block1d_row", block1d_row, 1),
         ("block1d_rowcol", block1d_rowcol, 2), ("block2d_rowcol", block2d_rowcol, 2))
# NVFP4: half a byte per element and copy
FP4_CASTS = (("nvfp4_row", nvfp4_row, 1), ("nvfp4_rowcol", nvfp4_rowcol, 2),
             ("nvfp4_rht_rowcol", nvfp4_rht_rowcol, 2), ("nvfp4_2d_rowcol", nvfp4_2d_rowcol, 2))


NA_ROWS, NA_H = 8192, 4096
NORM_ACT_ROWS = (("layernorm_fwd_gbs", "F.layer_norm"),
                 ("layernorm_bwd_gbs", "aten layer_norm bwd"),
                 ("rmsnorm_fwd_gbs", "F.rms_norm"),
                 ("gelu_fwd_gbs", "F.gelu tanh fp32"),
                 ("gelu_bwd_gbs", "aten gelu_backward"),
                 ("swiglu_fwd_gbs", "silu(a)*b fp32"),
                 ("swiglu_bwd_gbs", "silu_backward, cat"))


def norm_act_peer(dev):
    """The rows of opfuse's norm and activation benchmark: bf16 [8192, 4096]
    norms, fp32 activations (SwiGLU input [8192, 8192]), bytes read + written
    per second as opfuse counts them."""
    M, H = NA_ROWS, NA_H
    n, eps, out = M * H, 1e-5, {}
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    dz = torch.randn_like(x)
    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
    bias = torch.randn_like(w)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, (H,), w, bias, eps)
    F = torch.nn.functional
    for name, fn, nbytes in (
            ("layernorm_fwd_gbs", lambda: F.layer_norm(x, (H,), w, bias, eps), 4 * n),
            ("layernorm_bwd_gbs", lambda: torch.ops.aten.native_layer_norm_backward(
                dz, x, (H,), mean, rstd, w, bias, [True, True, True]), 6 * n),
            ("rmsnorm_fwd_gbs", lambda: F.rms_norm(x, (H,), w, eps), 4 * n)):
        out[name] = nbytes / median_ms(fn) * 1e-6
    del x, dz
    x = torch.randn(M, 2 * H, device=dev)
    dy = torch.randn(M, H, device=dev)
    g, a, b = torch.randn(M, H, device=dev), x[:, :H], x[:, H:]
    for name, fn, nbytes in (
            ("gelu_fwd_gbs", lambda: F.gelu(g, approximate="tanh"), 8 * n),
            ("gelu_bwd_gbs", lambda: torch.ops.aten.gelu_backward(dy, g, approximate="tanh"),
             12 * n),
            ("swiglu_fwd_gbs", lambda: F.silu(a) * b, 12 * n),
            ("swiglu_bwd_gbs", lambda: torch.cat(
                (torch.ops.aten.silu_backward(dy * b, a), F.silu(a) * dy), 1), 20 * n)):
        out[name] = nbytes / median_ms(fn) * 1e-6
    return out


def elem_peers(peer, M, K, dev):
    """The transposed copy and the fused AdamW step; AdamW's GB/s counts the
    28 bytes a parameter moves (gradient, weight, moments read; weight and
    moments written), as opfuse's row does."""
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    ms = median_ms(lambda: x.t().contiguous())
    peer["cast_transpose_bf16_gbs"] = 4.0 * M * K / ms * 1e-6
    del x
    n_t, n = 100, 1000000
    params = [torch.full((n,), 0.0115, device=dev, requires_grad=True) for _ in range(n_t)]
    for p in params:
        p.grad = torch.full_like(p, 0.0115)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    ms = median_ms(opt.step)
    peer["adamw_100m_gbs"] = 28.0 * n_t * n / ms * 1e-6


AT_B, AT_T, AT_H, AT_D = 16, 1024, 12, 64
# (opfuse's row, the peer's, what the peer is); ms, ratio = peer / opfuse
# (attention, and the cross-entropy below)
MS_ROWS = (("attn_fwd_gemm_ms", "attn_fwd_ms", "SDPA causal fp32 (TF32)"),
             ("attn_fwd_flash_ms", "attn_fwd_ms", "SDPA causal fp32 (TF32)"),
             ("attn_fwd_flash_bf16_ms", "attn_fwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwd_flash2_bf16_ms", "attn_fwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwd_cudnn_bf16_ms", "attn_fwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwd_cudnn_atomic_bf16_ms", "attn_fwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwdbwd_gemm_ms", "attn_fwdbwd_ms", "SDPA causal fp32 (TF32)"),
             ("attn_fwdbwd_flash_ms", "attn_fwdbwd_ms", "SDPA causal fp32 (TF32)"),
             ("attn_fwdbwd_flash_bf16_ms", "attn_fwdbwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwdbwd_flash2_bf16_ms", "attn_fwdbwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwdbwd_cudnn_bf16_ms", "attn_fwdbwd_bf16_ms", "SDPA causal bf16"),
             ("attn_fwdbwd_cudnn_atomic_bf16_ms", "attn_fwdbwd_bf16_ms", "SDPA causal bf16"),
             ("xent_fwd_bf16_ms", "xent_fwd_bf16_ms", "F.cross_entropy bf16"),
             ("xent_fwdbwd_bf16_ms", "xent_fwdbwd_bf16_ms", "F.cross_entropy bf16"))


def attn_peer(dev):
    """Causal SDPA on [B, H, T, D] q, k, v at opfuse's attention shape: fp32
    with TF32 allowed, and bf16; the forward, and the forward with the
    gradients of q, k and v, in ms."""
    F, out = torch.nn.functional, {}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for dt, tag in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        q, k, v = (torch.randn(AT_B, AT_H, AT_T, AT_D, device=dev, dtype=dt, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        out["attn_fwd" + tag + "_ms"] = median_ms(fwd)
        out["attn_fwdbwd" + tag + "_ms"] = median_ms(
            lambda: torch.autograd.grad(fwd(), (q, k, v), do))
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return out


XE_ROWS, XE_V = 16 * 1024, 50304


def xent_peer(dev):
    """F.cross_entropy on bf16 logits [16 x 1024, 50304] (GPT-2 small's), the
    forward and the forward with the logits' gradient, in ms."""
    x = torch.randn(XE_ROWS, XE_V, device=dev, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, XE_V, (XE_ROWS,), device=dev)

    def fwd():
        return torch.nn.functional.cross_entropy(x, t)

    return {"xent_fwd_bf16_ms": median_ms(fwd),
            "xent_fwdbwd_bf16_ms": median_ms(lambda: torch.autograd.grad(fwd(), x))}


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
    global RHT
    RHT = rht_matrix(dev)
    for casts, per_copy in ((CASTS, 1 / 2), (FP4_CASTS, 1 / 4)):
        for name, fn, copies in casts:
            c = torch.compile(fn)
            ms = median_ms(lambda: c(x))
            peer[name + "_gbs"] = in_bytes * (1 + copies * per_copy) / ms * 1e-6
    del x, y
    a = torch.randn(S, S, device=dev, dtype=torch.bfloat16)
    b = torch.randn(S, S, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * S ** 3
    ms = median_ms(lambda: torch.mm(a, b.t()))
    peer["gemm_bf16_tflops"] = flop / ms * 1e-9
    # opfuse's NN is D = B A, its NT D = B^T A (B, A row-major): torch.mm(b, a), torch.mm(b.t(), a)
    peer["gemm_bf16_nn_tflops"] = flop / median_ms(lambda: torch.mm(b, a)) * 1e-9
    peer["gemm_bf16_nt_tflops"] = flop / median_ms(lambda: torch.mm(b.t(), a)) * 1e-9
    qa, sa, _ = cast_row(a)
    qb, sb, _ = cast_row(b)
    for name, fast in (("gemm_fp8_fast_tflops", True), ("gemm_fp8_split_tflops", False)):
        ms = median_ms(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb,
                                                out_dtype=torch.bfloat16, use_fast_accum=fast))
        peer[name] = flop / ms * 1e-9

    del a, b, qa, qb
    peer.update(norm_act_peer(dev))
    elem_peers(peer, M, K, dev)
    peer.update(attn_peer(dev))
    peer.update(xent_peer(dev))

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
        ("gemm_bf16_nn_tflops", "TF/s", "torch.mm (NN)"),
        ("gemm_bf16_nt_tflops", "TF/s", "torch.mm (NT)"),
        ("gemm_fp8_fast_tflops", "TF/s", "_scaled_mm fast"),
        ("gemm_fp8_split_tflops", "TF/s", "_scaled_mm split"),
        ("cast_transpose_bf16_gbs", "GB/s", "x.t().contiguous()"),
        ("adamw_100m_gbs", "GB/s", "AdamW(fused=True)"),
    ]
    rows[5:5] = [(n + "_gbs", "GB/s", "torch.compile cast") for n, _, _ in CASTS[2:] + FP4_CASTS]
    rows += [(n, "GB/s", what) for n, what in NORM_ACT_ROWS]
    for k, unit, what in rows:
        pk = k.replace("delayed", "current")
        o, p = ours.get(k), peer.get(pk)
        r = f"{o / p:6.2f}" if o and p else "     -"
        print(f"{k + ' (' + unit + ')':34s} {o or 0:9.1f} {p or 0:9.1f} {r}  {what}")
    # No PyTorch peer on Hopper: against opfuse's per-tensor FP8 (split) and torch.mm.
    fp8, bf16 = ours.get("gemm_fp8_split_tflops"), peer.get("gemm_bf16_tflops")
    for k, base, what in (("gemm_block_1x2_tflops", fp8, "x our FP8 per-tensor split"),
                          ("gemm_block_1x1_tflops", fp8, "x our FP8 per-tensor split"),
                          ("gemm_mxfp8_tflops", bf16, "x torch.mm speed (time ratio = 1/x)"),
                          ("gemm_nvfp4_tflops", bf16, "x torch.mm speed (time ratio = 1/x)")):
        o = ours.get(k)
        r = f"{o / base:6.2f}" if o and base else "     -"
        print(f"{k + ' (TF/s)':34s} {o or 0:9.1f} {base or 0:9.1f} {r}  {what}")
    # Attention and cross-entropy in ms: the ratio is peer / opfuse (above 1: opfuse faster).
    for k, pk, what in MS_ROWS:
        o, p = ours.get(k), peer.get(pk)
        r = f"{p / o:6.2f}" if o and p else "     -"
        print(f"{k + ' (ms)':34s} {o or 0:9.3f} {p or 0:9.3f} {r}  {what}")
    for k in sorted(ours):
        if k.endswith("_gbs") and k != "copy_gbs":
            print(f"{k:34s} {100 * ours[k] / ours['copy_gbs']:8.1f}% of our device copy")


main()
