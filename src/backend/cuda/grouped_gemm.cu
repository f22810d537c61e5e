/* grouped_gemm.cu: GroupedLinear's GEMMs on the GPU, one opf_cuda_gemm per
 * group on the context's stream, in group order.
 *
 * Why not one launch: cuBLASLt (CUDA 13.0) has no grouped matmul. cuBLAS's
 * cublasGemmGroupedBatchedEx takes f32/f16/bf16 only (no FP8 scales, no
 * bias epilogue, no FP8 output with its amax) and pointer arrays in device
 * memory, and cuBLASLt's pointer-array batches need one shape and one scale
 * for all. The groups' launches are asynchronous and back to back on one
 * stream with no host synchronization, so what a grouped kernel would save
 * is the launch gaps (a few microseconds a group) and the tail of small
 * groups; the cached algorithm per shape keeps the host cost per group low.
 * Groups without rows go through the single GEMM, which writes them as the
 * CPU does.
 *
 * cuBLASLt's FP8 GEMMs need K a multiple of 16 (each operand row is K bytes,
 * 16-byte aligned), but the wgrad GEMM's K is a group's row count, any
 * number. Such a group (per-tensor or block FP8) runs as the fp32 GEMM of
 * its decoded operands: the same values, summed in fp32, within the FP8
 * GEMM's tolerance of the CPU (numerics.md 8). The decoded copies come from
 * the caching allocator (stream-ordered: freed once queued). */
#include "backend/cuda/cuda-impl.h"

enum { FP8_K_ALIGN = 16 };

static bool decoded_group(const opf_gemm_args *g)
{
    opf_scaling sc = g->a->spec.scaling;
    bool fp8 = sc == OPF_SCALING_TENSOR || sc == OPF_SCALING_BLOCK_1D || sc == OPF_SCALING_BLOCK_2D;
    return fp8 && g->k % FP8_K_ALIGN != 0 && g->m * g->n != 0;
}

/* The fp32 copy of operand t as the layout reads it (rowwise or columnwise
 * copy), in a plain tensor of t's logical shape; *buf to free. */
static opf_status decode_operand(opf_ctx *ctx, const opf_tensor *t, bool rowwise, opf_tensor *out,
                                 void **buf)
{
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CUDA);
    opf_dequantize_kernel dq = be ? be->dequantize[t->spec.scaling] : NULL;
    if (!dq)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "grouped gemm (cuda): no decode of %s operands",
                         opf_scaling_name(t->spec.scaling));
    memset(out, 0, sizeof *out);
    out->spec = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
    out->spec.device = OPF_DEVICE_CUDA;
    opf_status st = opf_cuda_alloc(ctx, sizeof(float) * (size_t)opf_spec_numel(&out->spec), buf);
    if (st) return st;
    out->data[OPF_COMP_DATA] = *buf;
    return dq(ctx, t, rowwise ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE, (float *)*buf);
}

static opf_status gemm_decoded(opf_ctx *ctx, const opf_gemm_args *g)
{
    bool a_row = g->layout == OPF_GEMM_TN, b_row = g->layout != OPF_GEMM_NT;  /* gemm.cu */
    opf_tensor a, b;
    void *abuf = NULL, *bbuf = NULL;
    opf_gemm_args plain = *g;
    opf_status st = decode_operand(ctx, g->a, a_row, &a, &abuf);
    if (!st) st = decode_operand(ctx, g->b, b_row, &b, &bbuf);
    if (!st) {
        plain.a = &a, plain.b = &b;
        st = opf_cuda_gemm(ctx, &plain);
    }
    opf_cuda_free(ctx, abuf);
    opf_cuda_free(ctx, bbuf);
    return st;
}

extern "C" opf_status opf_cuda_grouped_gemm(opf_ctx *ctx, int count, const opf_gemm_args *args)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < count && !st; i++)
        st = decoded_group(&args[i]) ? gemm_decoded(ctx, &args[i]) : opf_cuda_gemm(ctx, &args[i]);
    return st;
}
