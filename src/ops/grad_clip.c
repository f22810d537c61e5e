/* grad_clip.c: global gradient-norm clipping over the parameters of seqs
 * (opfuse/nn.h) by the device's nn kernels: the sum of squares into a
 * double on the device, then the scaling in place, decided there. */
#include <math.h>
#include <stdlib.h>

#include "backend/backend-impl.h"
#include "ops/ops-impl.h"
#include "opfuse/nn.h"

/* The gradients of every parameter, gathered for one call of each entry. */
typedef struct clip_walk {
    opf_ctx     *ctx;
    opf_nn_span *spans;
    int          count, cap;
    opf_device   dev;
    opf_status   st;
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
    if (g->spec.device != w->dev) {
        w->st = opf_error(w->ctx, OPF_ERR_INVALID_ARG, "clip_grad_norm: the gradient of \"%s\" is on "
                          "device %d, the context's on %d", p->name, (int)g->spec.device,
                          (int)w->dev);
        return;
    }
    if (w->count == w->cap) {
        int cap = w->cap ? 2 * w->cap : 64;
        opf_nn_span *s = realloc(w->spans, sizeof *s * (size_t)cap);
        if (!s) {
            w->st = opf_error(w->ctx, OPF_ERR_NO_MEMORY, "clip_grad_norm: out of host memory");
            return;
        }
        w->spans = s, w->cap = cap;
    }
    w->spans[w->count++] = (opf_nn_span){g->data[0], g->spec.dtype, opf_spec_numel(&g->spec)};
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

/* The squares of every gradient summed on the device in one call, then one
 * call whose kernels read the sum there and scale only when the norm is
 * finite and above max_norm: no host synchronization unless the caller asks
 * for the norm. */
opf_status opf_clip_grad_norm(opf_ctx *ctx, opf_seq *const *seqs, int n_seqs, double max_norm,
                              double *norm)
{
    OPF_CHECK_NULL(NULL, "clip_grad_norm", ctx);
    if (!seqs || n_seqs < 0 || !(max_norm > 0))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "clip_grad_norm: %d seqs at %p, max_norm %g "
                         "(want > 0)", n_seqs, (const void *)seqs, max_norm);
    if (norm) *norm = 0.0;
    clip_walk w = {ctx, NULL, 0, 0, opf_ctx_device(ctx), OPF_OK};
    for (int i = 0; i < n_seqs && !w.st; i++) opf_seq_for_each_param(seqs[i], visit, &w);
    const opf_backend_i *be = opf_backend_get(w.dev);
    if (!w.st && w.count && (!be || !be->nn))
        w.st = opf_error(ctx, OPF_ERR_UNSUPPORTED, "clip_grad_norm: no kernels for device %d",
                         (int)w.dev);
    if (w.st || !w.count) {
        free(w.spans);
        return w.st;
    }
    opf_tensor acc = {0};  /* 8 bytes holding a double */
    opf_spec as = opf_spec_make(1, (int64_t[]){1}, OPF_I64);
    as.device = w.dev;
    opf_status st = opf_tensor_alloc(ctx, &as, &acc);
    if (!st) st = be->nn->sumsq_acc(ctx, w.spans, w.count, acc.data[0], false);
    if (!st && norm) st = read_norm(ctx, &acc, norm);
    if (!st) st = be->nn->clip_scale(ctx, w.spans, w.count, acc.data[0], max_norm);
    if (acc.data[0]) opf_tensor_release(&acc);
    free(w.spans);
    return st;
}
