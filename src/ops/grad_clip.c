/* grad_clip.c: global gradient-norm clipping over the parameters of seqs
 * (opfuse/nn.h) by the device's nn kernels: the sum of squares into a
 * double on the device, then the scaling in place, decided there. */
#include <math.h>

#include "backend/backend-impl.h"
#include "ops/ops-impl.h"
#include "opfuse/nn.h"

typedef struct clip_walk {
    opf_ctx   *ctx;
    double    *acc;       /* the sum of squares, one double in the context's device's memory */
    bool       any;       /* pass 1: a gradient was summed */
    double     max_norm;  /* > 0 in pass 2 */
    opf_status st;
} clip_walk;

/* The gradient the optimizer reads, or NULL when the parameter has none. */
static opf_tensor *grad_of(opf_param *p)
{
    if (p->main_grad.data[0]) return &p->main_grad;
    return p->requires_grad && p->has_grad ? &p->grad : NULL;
}

static void visit(void *user, opf_op *op, opf_param *p)
{
    clip_walk *w = user;
    opf_tensor *g = grad_of(p);
    if (w->st || !g) return;
    const opf_backend_i *be = opf_backend_get(g->spec.device);
    if (!be || !be->nn) {
        w->st = opf_error(w->ctx, OPF_ERR_UNSUPPORTED, "clip_grad_norm: no kernels for device %d",
                          (int)g->spec.device);
        return;
    }
    int64_t n = opf_spec_numel(&g->spec);
    if (w->max_norm > 0) {
        w->st = be->nn->clip_scale(w->ctx, g->data[0], g->spec.dtype, n, w->acc, w->max_norm);
        return;
    }
    w->st = be->nn->sumsq_acc(w->ctx, g->data[0], g->spec.dtype, n, w->acc, w->any);
    w->any = true;
}

/* *norm from the device's sum (a host read: only when asked for). */
static opf_status read_norm(opf_ctx *ctx, const opf_tensor *acc, double *norm)
{
    opf_tensor h = *acc;
    opf_status st = acc->spec.device == OPF_DEVICE_CPU ? OPF_OK
                  : opf_tensor_to(ctx, acc, OPF_DEVICE_CPU, &h);
    if (st) return st;
    *norm = sqrt(*(const double *)h.data[0]);
    if (acc->spec.device != OPF_DEVICE_CPU) opf_tensor_release(&h);
    return OPF_OK;
}

/* Pass 1 sums the squares on the device; pass 2's kernels read the sum there
 * and scale only when the norm is finite and above max_norm, so a step needs
 * no host synchronization unless the caller asks for the norm. */
opf_status opf_clip_grad_norm(opf_ctx *ctx, opf_seq *const *seqs, int n_seqs, double max_norm,
                              double *norm)
{
    OPF_CHECK_NULL(NULL, "clip_grad_norm", ctx);
    if (!seqs || n_seqs < 0 || !(max_norm > 0))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "clip_grad_norm: %d seqs at %p, max_norm %g "
                         "(want > 0)", n_seqs, (const void *)seqs, max_norm);
    opf_tensor acc;  /* 8 bytes holding a double */
    opf_spec as = opf_spec_make(1, (int64_t[]){1}, OPF_I64);
    as.device = opf_ctx_device(ctx);
    opf_status st = opf_tensor_alloc(ctx, &as, &acc);
    if (st) return st;
    clip_walk w = {ctx, acc.data[0], false, 0.0, OPF_OK};
    for (int i = 0; i < n_seqs && !w.st; i++) opf_seq_for_each_param(seqs[i], visit, &w);
    if (norm) *norm = 0.0;
    if (!w.st && w.any && norm) w.st = read_norm(ctx, &acc, norm);
    w.max_norm = max_norm;
    for (int i = 0; i < n_seqs && !w.st && w.any; i++) opf_seq_for_each_param(seqs[i], visit, &w);
    opf_tensor_release(&acc);
    return w.st;
}
