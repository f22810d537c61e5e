/* optim.c: SGD (with momentum) and AdamW over a seq's parameters, with FP32
 * master weights written back in each parameter's dtype. The state lives
 * here, in the memory of the context's device; one step is one call of the
 * device's multi-tensor kernel (backend/optim.h) over every parameter that
 * has a gradient. A quantized primary parameter (its value is qvalue) gets
 * its master from the decoded qvalue, and after each step the master
 * quantized again with the parameter's quantizer. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "fuser/fuser-impl.h"
#include "opfuse/nn.h"

typedef struct slot {
    opf_param *p;
    int64_t    n;
    float     *master, *m, *v;  /* fp32 [n]; m/v as the algorithm needs */
    opf_tensor mem;             /* on a device: master, m, v in one f32 tensor */
} slot;

struct opf_optim {
    opf_ctx          *ctx;
    opf_optim_kind    kind;
    opf_optim_options o;
    int               n, cap;  /* slots filled, allocated */
    slot             *s;
    opf_optim_tensor *list;  /* [cap] the kernel's view of the slots of one step */
    int64_t           step;
    opf_seq          *seq;   /* NULL once the seq is destroyed */
    opf_optim        *next;  /* the seq's next optimizer */
};

/* The seq's list of optimizers: while it is not empty the seq refuses
 * mutations, so the slots stay the seq's parameters. */
static void link_seq(opf_optim *opt, opf_seq *seq)
{
    opt->seq = seq;
    opt->next = seq->optims;
    seq->optims = opt;
}

static void unlink_seq(opf_optim *opt)
{
    if (!opt->seq) return;
    for (opf_optim **at = &opt->seq->optims; *at; at = &(*at)->next)
        if (*at == opt) {
            *at = opt->next;
            break;
        }
    opt->seq = NULL;
}

void opf_optim_detach_seq(opf_seq *seq)
{
    for (opf_optim *o = seq->optims, *next; o; o = next) {
        next = o->next;
        o->seq = NULL, o->next = NULL;
        for (int i = 0; i < o->n; i++) o->s[i].p = NULL;  /* freed with the seq */
    }
    seq->optims = NULL;
}

opf_optim_options opf_optim_options_default(void)
{
    return (opf_optim_options){.lr = 1e-3f, .momentum = 0.0f, .beta1 = 0.9f, .beta2 = 0.999f,
                               .eps = 1e-8f, .weight_decay = 0.0f};
}

typedef struct collect {
    opf_param **p;
    int n;
} collect;

static void count_param(void *user, opf_op *op, opf_param *p)
{
    collect *c = user;
    if (c->p) c->p[c->n] = p;
    c->n++;
}

void opf_optim_destroy(opf_optim *opt)
{
    if (!opt) return;
    unlink_seq(opt);
    opf_ctx *ctx = opt->ctx;
    for (int i = 0; i < opt->n; i++) {
        size_t bytes = sizeof(float) * (size_t)opt->s[i].n;
        if (opt->s[i].mem.buf) {
            opf_tensor_release(&opt->s[i].mem);
            continue;
        }
        opf_ctx_free(ctx, opt->s[i].master, bytes);
        opf_ctx_free(ctx, opt->s[i].m, bytes);
        opf_ctx_free(ctx, opt->s[i].v, bytes);
    }
    opf_ctx_free(ctx, opt->s, sizeof *opt->s * (size_t)opt->cap);
    opf_ctx_free(ctx, opt->list, sizeof *opt->list * (size_t)opt->cap);
    opf_ctx_free(ctx, opt, sizeof *opt);
}

static opf_status check_options(opf_ctx *ctx, opf_optim_kind kind, const opf_optim_options *o)
{
    if (kind != OPF_OPTIM_SGD && kind != OPF_OPTIM_ADAMW)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "optim: kind %d", (int)kind);
    if (!(o->lr > 0) || !(o->momentum >= 0 && o->momentum < 1) || !(o->beta1 >= 0 && o->beta1 < 1) ||
        !(o->beta2 >= 0 && o->beta2 < 1) || !(o->eps > 0) || !(o->weight_decay >= 0))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "optim: options out of range (lr %g, momentum %g, betas %g %g, eps %g, "
                         "weight_decay %g)", (double)o->lr, (double)o->momentum, (double)o->beta1,
                         (double)o->beta2, (double)o->eps, (double)o->weight_decay);
    return OPF_OK;
}

static bool is_primary(const opf_param *p) { return p->primary_q.scaling != OPF_SCALING_NONE; }

/* The master's first value: the parameter's, decoded when it lives quantized. */
static opf_status init_master(opf_ctx *ctx, const opf_param *p, float *master)
{
    opf_spec sp = opf_spec_make(p->value.spec.ndim, p->value.spec.shape, OPF_F32);
    sp.device = opf_ctx_device(ctx);
    opf_tensor m;
    opf_tensor_wrap(&sp, master, &m);
    if (is_primary(p)) {
        bool row = p->qvalue.spec.usage & OPF_USAGE_ROWWISE;
        return opf_dequantize(ctx, &p->qvalue, row ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE, &m);
    }
    const opf_elem_kernels *k = opf_backend_kernels(ctx, "opf_optim_create", sp.device,
                                                    OPF_KERNELS_ELEM);
    return k ? k->cast(ctx, &p->value, &m) : OPF_ERR_UNSUPPORTED;
}

/* A device slot: master, m and v in one f32 tensor on the device, the
 * master cast from the parameter and m, v zeroed by the device's kernels. */
static opf_status device_slot(opf_ctx *ctx, slot *s, bool need_m, bool need_v)
{
    const opf_elem_kernels *k = opf_backend_kernels(ctx, "opf_optim_create", opf_ctx_device(ctx),
                                                    OPF_KERNELS_ELEM);
    if (!k) return OPF_ERR_UNSUPPORTED;
    int64_t parts = 1 + need_m + need_v;
    opf_spec sp = opf_spec_make(1, (int64_t[]){s->n * parts}, OPF_F32);
    sp.device = opf_ctx_device(ctx);
    opf_status st = opf_tensor_alloc(ctx, &sp, &s->mem);
    if (st) return st;
    s->master = s->mem.data[OPF_COMP_DATA];
    s->m = need_m ? s->master + s->n : NULL;
    s->v = need_v ? s->master + s->n * (1 + need_m) : NULL;
    opf_tensor state;
    sp.shape[0] = s->n * (parts - 1);
    opf_tensor_wrap(&sp, s->master + s->n, &state);
    st = init_master(ctx, s->p, s->master);
    if (!st && parts > 1) st = k->fill(ctx, 0.0, &state);
    return st;
}

opf_status opf_optim_create(opf_ctx *ctx, opf_seq *seq, opf_optim_kind kind,
                            const opf_optim_options *opts, opf_optim **out)
{
    OPF_CHECK_NULL(NULL, "opf_optim_create", ctx);
    OPF_CHECK_NULL(ctx, "opf_optim_create", seq);
    OPF_CHECK_NULL(ctx, "opf_optim_create", out);
    opf_optim_options o = opts ? *opts : opf_optim_options_default();
    opf_status st = check_options(ctx, kind, &o);
    if (st) return st;
    collect c = {NULL, 0};
    opf_seq_for_each_param(seq, count_param, &c);
    opf_optim *opt = opf_ctx_calloc(ctx, 1, sizeof *opt);
    if (!opt) return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_optim_create: out of memory");
    opt->ctx = ctx, opt->kind = kind, opt->o = o;
    opt->cap = c.n ? c.n : 1;
    c.p = opf_ctx_calloc(ctx, (size_t)opt->cap, sizeof *c.p);
    opt->s = opf_ctx_calloc(ctx, (size_t)opt->cap, sizeof *opt->s);
    opt->list = opf_ctx_calloc(ctx, (size_t)opt->cap, sizeof *opt->list);
    if (!c.p || !opt->s || !opt->list) goto oom;
    int total = c.n;
    c.n = 0;
    opf_seq_for_each_param(seq, count_param, &c);
    for (int i = 0; i < total; i++) {
        slot *s = &opt->s[opt->n++];
        s->p = c.p[i];
        s->n = opf_spec_numel(&s->p->value.spec);
        bool need_m = kind == OPF_OPTIM_ADAMW || o.momentum > 0;
        if (opf_ctx_device(ctx) != OPF_DEVICE_CPU) {
            if ((st = device_slot(ctx, s, need_m, kind == OPF_OPTIM_ADAMW))) goto fail;
            continue;
        }
        s->master = opf_ctx_alloc(ctx, sizeof(float) * (size_t)s->n);
        s->m = need_m ? opf_ctx_calloc(ctx, (size_t)s->n, sizeof(float)) : NULL;
        s->v = kind == OPF_OPTIM_ADAMW ? opf_ctx_calloc(ctx, (size_t)s->n, sizeof(float)) : NULL;
        if (!s->master || (need_m && !s->m) || (kind == OPF_OPTIM_ADAMW && !s->v)) goto oom;
        if ((st = init_master(ctx, s->p, s->master))) goto fail;
    }
    opf_ctx_free(ctx, c.p, sizeof *c.p * (size_t)opt->cap);
    link_seq(opt, seq);
    *out = opt;
    return OPF_OK;
oom:
    st = opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_optim_create: out of memory");
fail:
    opf_ctx_free(ctx, c.p, sizeof *c.p * (size_t)opt->cap);
    opf_optim_destroy(opt);
    return st;
}

/* The kernel's view of a slot; the gradient is main_grad when the op
 * accumulates there, else grad. A quantized primary parameter has no plain
 * value for the kernel to write: it writes f32 scratch `spare` instead. */
static opf_optim_tensor slot_tensor(const slot *s, float *spare)
{
    const opf_param *p = s->p;
    const opf_tensor *g = p->main_grad.data[0] ? &p->main_grad : &p->grad;
    return (opf_optim_tensor){.grad = g->data[0], .grad_dtype = g->spec.dtype,
                              .master = s->master, .m = s->m, .v = s->v,
                              .param = spare ? (void *)spare : p->value.data[0],
                              .param_dtype = spare ? OPF_F32 : p->value.spec.dtype, .n = s->n};
}

/* After the kernel: each stepped quantized primary parameter = its master,
 * quantized with the parameter's quantizer. */
static opf_status requantize(opf_optim *opt)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < opt->n && !st; i++) {
        opf_param *p = opt->s[i].p;
        if (!is_primary(p) || !p->requires_grad || (!p->has_grad && !p->main_grad.data[0])) continue;
        opf_spec sp = opf_spec_make(p->value.spec.ndim, p->value.spec.shape, OPF_F32);
        sp.device = opf_ctx_device(opt->ctx);
        opf_tensor m;
        opf_tensor_wrap(&sp, opt->s[i].master, &m);
        st = opf_quantize(opt->ctx, &p->primary_q, &m, &p->qvalue);
    }
    return st;
}

opf_status opf_optim_step(opf_optim *opt)
{
    OPF_CHECK_NULL(NULL, "opf_optim_step", opt);
    if (!opt->seq)
        return opf_error(opt->ctx, OPF_ERR_STATE, "opf_optim_step: the optimizer's seq was "
                         "destroyed; its parameters are gone");
    const opf_optim_kernels *k =
        opf_backend_kernels(opt->ctx, "optim", opf_ctx_device(opt->ctx), OPF_KERNELS_OPTIM);
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_ctx *ctx = opt->ctx;
    size_t mark = opf_ctx_scratch_mark(ctx);
    opt->step++;
    int count = 0;
    for (int i = 0; i < opt->n; i++) {
        opf_param *p = opt->s[i].p;
        if (!p->requires_grad || (!p->has_grad && !p->main_grad.data[0])) continue;
        float *spare = NULL;
        if (is_primary(p) && !(spare = opf_op_scratch(ctx, opt->s[i].n))) {
            opf_ctx_scratch_pop(ctx, mark);
            opt->step--;
            return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_optim_step: no scratch for %lld floats",
                             (long long)opt->s[i].n);
        }
        opt->list[count++] = slot_tensor(&opt->s[i], spare);
        if (!spare) p->qvalue_valid = false;  /* a cached quantized copy is stale after the step */
    }
    const opf_optim_options *o = &opt->o;
    opf_status st = opt->kind == OPF_OPTIM_SGD
                        ? k->sgd(ctx, opt->list, count, o->lr, o->momentum, o->weight_decay)
                        : k->adamw(ctx, opt->list, count, o->lr, o->beta1, o->beta2, o->eps,
                                   o->weight_decay, opt->step);
    if (!st) st = requantize(opt);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

opf_status opf_optim_set_lr(opf_optim *opt, float lr)
{
    OPF_CHECK_NULL(NULL, "opf_optim_set_lr", opt);
    if (!(lr > 0) || !isfinite(lr))
        return opf_error(opt->ctx, OPF_ERR_INVALID_ARG, "optim: learning rate %g, want > 0", (double)lr);
    opt->o.lr = lr;
    return OPF_OK;
}

opf_optim_kind opf_optim_kind_of(const opf_optim *opt) { return opt->kind; }
int opf_optim_num_slots(const opf_optim *opt) { return opt->n; }
int64_t opf_optim_step_count(const opf_optim *opt) { return opt->step; }
void opf_optim_set_step_count(opf_optim *opt, int64_t steps) { opt->step = steps; }

opf_status opf_optim_slot(opf_optim *opt, int i, opf_param **param, float **master, float **m,
                          float **v, int64_t *n)
{
    if (!opt || i < 0 || i >= opt->n)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_optim_slot: slot %d outside 0..%d", i,
                         opt ? opt->n - 1 : -1);
    slot *s = &opt->s[i];
    if (param) *param = s->p;
    if (master) *master = s->master;
    if (m) *m = s->m;
    if (v) *v = s->v;
    if (n) *n = s->n;
    return OPF_OK;
}
