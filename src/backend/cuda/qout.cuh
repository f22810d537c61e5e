/* qout.cuh: a *_q entry's output on the GPU (qout.h), shared by norm.cu,
 * act.cu and elem.cu. The entry's kernel writes the values (or, for
 * dbias_q, only reads them: dy itself), and for current-scaling FP8 takes
 * their amax on the way: out's amax component is zeroed first, the kernel
 * max-accumulates the amax keys (opf_dev_amax_max) of the values into it,
 * and quantize_tensor_fp8.cu's cast pass reads that amax (cuda.h's
 * opf_cuda_quantize_tensor_fp8_cast): the bits opf_cuda_quantize_tensor_fp8
 * gives from the values, one pass fewer. Other formats quantize after the
 * kernel (opf_qout_end); a plain output is the kernel's alone. */
#ifndef OPFUSE_CUDA_QOUT_CUH
#define OPFUSE_CUDA_QOUT_CUH

#include "backend/cuda/cuda-impl.h"

/* produce(unsigned *amax) -> opf_status launches the kernel that leaves the
 * values in `in` (the output itself when o is plain, else in hp or as
 * opf_qout_reads_as_is allows) on s's stream; amax is out's amax component
 * for current-scaling FP8 (opf_qout_current_fp8), else NULL. Then the cast
 * pass or opf_qout_end. fn names the entry in errors. */
template <typename F>
static opf_status opf_cuda_qout_run(opf_ctx *ctx, opf_cuda_state *s, const char *fn,
                                    const opf_qout *o, const opf_tensor *in, F produce)
{
    bool fp8 = opf_qout_current_fp8(o);
    unsigned *amax = fp8 ? (unsigned *)o->out->data[OPF_COMP_AMAX] : NULL;
    if (amax) OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(amax, 0, sizeof *amax, s->stream));
    opf_status st = produce(amax);
    if (st) return st;
    return fp8 ? opf_cuda_quantize_tensor_fp8_cast(ctx, o->q, in, o->out)
               : opf_qout_end(ctx, opf_backend_get(OPF_DEVICE_CUDA), o, in);
}

#endif
