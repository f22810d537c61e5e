/* grad_clip.c: global gradient-norm clipping over the parameters of seqs
 * (opfuse/nn.h): the sum of squares by the device's nn kernel, the scaling
 * by its element-wise scale kernel, in place. */
#include <math.h>

#include "backend/backend-impl.h"
#include "ops/ops-impl.h"
#include "opfuse/nn.h"

typedef struct clip_walk {
    opf_ctx   *ctx;
    double     sum;     /* pass 1: the sum of squares so far */
    float      scale;   /* pass 2: the factor; 0 in pass 1 */
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
    if (!be || !be->nn || !be->elem) {
        w->st = opf_error(w->ctx, OPF_ERR_UNSUPPORTED, "clip_grad_norm: no kernels for device %d",
                          (int)g->spec.device);
        return;
    }
    if (w->scale > 0) {
        w->st = be->elem->scale(w->ctx, g, w->scale, g);
        return;
    }
    double s = 0;
    w->st = be->nn->sumsq(w->ctx, g->data[0], g->spec.dtype, opf_spec_numel(&g->spec), &s);
    w->sum += s;
}

opf_status opf_clip_grad_norm(opf_ctx *ctx, opf_seq *const *seqs, int n_seqs, double max_norm,
                              double *norm)
{
    OPF_CHECK_NULL(NULL, "clip_grad_norm", ctx);
    if (!seqs || n_seqs < 0 || !(max_norm > 0))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "clip_grad_norm: %d seqs at %p, max_norm %g "
                         "(want > 0)", n_seqs, (const void *)seqs, max_norm);
    clip_walk w = {ctx, 0.0, 0.0f, OPF_OK};
    for (int i = 0; i < n_seqs && !w.st; i++) opf_seq_for_each_param(seqs[i], visit, &w);
    double n = sqrt(w.sum);
    if (norm) *norm = n;
    if (w.st || !isfinite(n) || n <= max_norm) return w.st;
    w.scale = (float)(max_norm / (n + 1e-6));
    for (int i = 0; i < n_seqs && !w.st; i++) opf_seq_for_each_param(seqs[i], visit, &w);
    return w.st;
}
