/* quantize_tensor_fp8.cu: per-tensor FP8 on the GPU, bit for bit with
 * src/backend/cpu/quantize_tensor_fp8.c (docs/numerics.md 3.1, 3.2).
 *
 * Current scaling: one pass for the amax (an integer max of |x| bit
 * patterns, NaN ignored), then one fused cast + transpose pass that derives
 * the scale from that amax on every thread (no host round trip). Delayed
 * scaling: the scale is read from the state's device memory, and the cast
 * pass computes the amax itself, into the tensor and max-accumulated into
 * the slot's entry of history row 0, also in device memory (no host sync).
 *
 * The passes are fp8-cast.cuh's (with its identity Map): the cast +
 * transpose tile of quantize-tile.h, and the flat passes (the amax, and the
 * rowwise cast alone).
 *
 * Pass order: a pass that follows the tensor's producer (the amax pass, the
 * delayed cast, the cast after a fused amax) reads it from the end, where
 * the producer's last writes may still sit in L2; the cast after the amax
 * pass reads from the start, where that pass ended. */
#include "backend/cuda/fp8-cast.cuh"

enum {
    DQ_THREADS = 256,
    DQ_TILE = 32,       /* edge of the dequantizing transpose tile */
};

/* ---- dequantize ---------------------------------------------------------- */

/* fl(q * scale_inv). A NaN code gives the CPU's bits: its decode is the
 * quiet NaN 0x7FC00000 with the code's sign, which the CPU's multiply
 * passes through (the GPU's would canonicalize it). */
__device__ __forceinline__ float dequant1(uint8_t q, float sinv, bool e4m3)
{
    float v = opf_dev_from_fp8(q, e4m3);
    return isnan(v) ? __uint_as_float((uint32_t)(q & 0x80u) << 24 | 0x7FC00000u) : v * sinv;
}

__global__ void dequant_kernel(const uint8_t *__restrict__ q, int64_t n, const float *sinv_p,
                               bool e4m3, float *__restrict__ out)
{
    float sinv = *sinv_p;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = dequant1(q[i], sinv, e4m3);
}

/* out[m*K + k] from qt[k*M + m] through a DQ_TILE^2 tile. */
__global__ void dequant_t_kernel(const uint8_t *__restrict__ qt, int64_t M, int64_t K,
                                 const float *sinv_p, bool e4m3, float *__restrict__ out)
{
    __shared__ uint8_t tile[DQ_TILE][DQ_TILE + 1];
    float sinv = *sinv_p;
    int64_t m0 = (int64_t)blockIdx.x * DQ_TILE, k0 = (int64_t)blockIdx.y * DQ_TILE;
    for (int r = threadIdx.y; r < DQ_TILE; r += blockDim.y) {
        int64_t k = k0 + r, m = m0 + threadIdx.x;
        if (k < K && m < M) tile[r][threadIdx.x] = qt[k * M + m];
    }
    __syncthreads();
    for (int r = threadIdx.y; r < DQ_TILE; r += blockDim.y) {
        int64_t m = m0 + r, k = k0 + threadIdx.x;
        if (k < K && m < M) out[m * K + k] = dequant1(tile[threadIdx.x][r], sinv, e4m3);
    }
}

/* ---- host side ----------------------------------------------------------- */

template <typename T>
static opf_status launch_amax(opf_ctx *ctx, opf_cuda_state *s, const void *x, int64_t n,
                              unsigned *amax)
{
    opf_f8c_scale none = {NULL, NULL, 0.0f, 0.0f, false};
    opf_f8c_flat_kernel<T, false, true, opf_f8c_same>
        <<<opf_f8c_flat_grid(s, n), OPF_F8C_FLAT_THREADS, 0, s->stream>>>(
            (const T *)x, n, opf_cuda_aligned16(x), true, none, true, NULL, NULL, amax, NULL,
            opf_f8c_same());
    OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 amax)");
    return OPF_OK;
}

/* The cast pass of x itself (fp8-cast.cuh). */
template <typename T>
static opf_status launch_cast(opf_ctx *ctx, opf_cuda_state *s, const void *x, int64_t M,
                              int64_t K, bool rev, const opf_f8c_scale &src, bool e4m3,
                              opf_tensor *out, unsigned *amax, unsigned *amax2)
{
    return opf_f8c_cast<T>(ctx, s, x, M, K, rev, src, e4m3, out, amax, amax2, opf_f8c_same());
}

/* Current scaling with an amax reduction hook: the amax goes to the host,
 * through the hook and back (the hook is host code), by counted copies: a
 * user's host hook is the one reason this path waits for the device. */
static opf_status reduce_amax(opf_ctx *ctx, const opf_quantizer *q, float *amax_dev)
{
    const char *fn = "quantize (fp8 current scaling)";
    float amax = 0.0f;
    opf_status st = opf_cuda_copy(ctx, &amax, amax_dev, sizeof amax, OPF_CUDA_D2H);
    if (st) return st;
    float local = amax;
    if ((st = q->amax_reduce(q->amax_reduce_user, &amax, 1)) != OPF_OK)
        return opf_error(ctx, st, "%s: amax reduction failed with %s (local amax %g); nothing "
                         "written", fn, opf_status_str(st), (double)local);
    return opf_cuda_copy(ctx, amax_dev, &amax, sizeof amax, OPF_CUDA_H2D);
}

template <typename T>
static opf_status quantize_typed(opf_ctx *ctx, opf_cuda_state *s, const opf_quantizer *q,
                                 const opf_tensor *in, opf_tensor *out,
                                 const opf_quantize_state *qs)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    const void *x = in->data[OPF_COMP_DATA];
    unsigned *amax = (unsigned *)out->data[OPF_COMP_AMAX];
    bool e4m3 = q->qdtype == OPF_E4M3;
    opf_f8c_scale src = {NULL, NULL, opf_fp8_max(q->qdtype), q->amax_epsilon, q->pow2_scales};
    OPF_CUDA_TRY(ctx, "quantize (fp8)", cudaMemsetAsync(amax, 0, sizeof(float), s->stream));
    opf_status st;
    if (q->delayed) {
        /* Both in the state's device memory: history row 0 holds amaxes
         * (>= 0), whose bit patterns order as their values, so the integer
         * atomicMax of the amax key max-accumulates the float (3.1). */
        src.scale = qs->delayed_scale;
        return launch_cast<T>(ctx, s, x, M, K, true, src, e4m3, out, amax,
                              (unsigned *)qs->delayed_amax);
    }
    if ((st = launch_amax<T>(ctx, s, x, M * K, amax))) return st;
    if (q->amax_reduce && (st = reduce_amax(ctx, q, (float *)amax))) return st;
    src.amax_bits = amax;
    return launch_cast<T>(ctx, s, x, M, K, false, src, e4m3, out, NULL, NULL);
}

extern "C" opf_status opf_cuda_quantize_tensor_fp8(opf_ctx *ctx, const opf_quantizer *q,
                                                   const opf_tensor *in, opf_tensor *out,
                                                   const opf_quantize_state *qs)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "quantize (fp8)");
    if (!s) return OPF_ERR_STATE;
    switch (in->spec.dtype) {
    case OPF_F32: return quantize_typed<float>(ctx, s, q, in, out, qs);
    case OPF_BF16: return quantize_typed<__nv_bfloat16>(ctx, s, q, in, out, qs);
    case OPF_F16: return quantize_typed<__half>(ctx, s, q, in, out, qs);
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "quantize (fp8): input dtype %s, expected f32/bf16/f16",
                         opf_dtype_name(in->spec.dtype));
    }
}

/* Current scaling's cast pass alone (cuda.h): the amax is already in out's
 * amax component, max-accumulated by the kernel that wrote in. */
template <typename T>
static opf_status cast_typed(opf_ctx *ctx, opf_cuda_state *s, const opf_quantizer *q,
                             const opf_tensor *in, opf_tensor *out)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    return launch_cast<T>(ctx, s, in->data[OPF_COMP_DATA], M, K, true, opf_f8c_current(q, out),
                          q->qdtype == OPF_E4M3, out, NULL, NULL);
}

extern "C" opf_status opf_cuda_quantize_tensor_fp8_cast(opf_ctx *ctx, const opf_quantizer *q,
                                                        const opf_tensor *in, opf_tensor *out)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "quantize (fp8 cast)");
    if (!s) return OPF_ERR_STATE;
    switch (in->spec.dtype) {
    case OPF_F32: return cast_typed<float>(ctx, s, q, in, out);
    case OPF_BF16: return cast_typed<__nv_bfloat16>(ctx, s, q, in, out);
    case OPF_F16: return cast_typed<__half>(ctx, s, q, in, out);
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "quantize (fp8 cast): input dtype %s",
                         opf_dtype_name(in->spec.dtype));
    }
}

extern "C" opf_status opf_cuda_dequantize_tensor_fp8(opf_ctx *ctx, const opf_tensor *t,
                                                     unsigned which, float *out)
{
    const char *fn = "dequantize (fp8)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    if (M * K == 0) return OPF_OK;  /* an empty tensor: no grid to launch */
    bool col = which == OPF_USAGE_COLUMNWISE, e4m3 = t->spec.qdtype == OPF_E4M3;
    const uint8_t *d = (const uint8_t *)t->data[col ? OPF_COMP_COL_DATA : OPF_COMP_DATA];
    const float *sinv = (const float *)t->data[col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV];
    if (!col) {
        dequant_kernel<<<opf_cuda_grid(s, M * K, DQ_THREADS), DQ_THREADS, 0, s->stream>>>(d, M * K, sinv,
                                                                                   e4m3, out);
    } else {
        dim3 grid((unsigned)((M + DQ_TILE - 1) / DQ_TILE), (unsigned)((K + DQ_TILE - 1) / DQ_TILE));
        dequant_t_kernel<<<grid, dim3(DQ_TILE, 8), 0, s->stream>>>(d, M, K, sinv, e4m3, out);
    }
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}
