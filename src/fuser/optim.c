/* optim.c: SGD (with momentum) and AdamW over a seq's parameters, with FP32
 * master weights written back in each parameter's dtype. The state lives
 * here, in the memory of the context's device; one step is one call of the
 * device's multi-tensor kernel (backend/optim.h) over every parameter that
 * has a gradient. A quantized primary parameter (its value is qvalue) gets
 * its master from the decoded qvalue, and after each step the master
 * quantized again with the parameter's quantizer.
 *
 * Non-finite gradients (as PyTorch's gradient scaler): a step whose
 * gradients hold a NaN or an infinity changes nothing (master weights,
 * moments, parameters, step count) and is counted; the check is the
 * kernel table's read-only pass before the step (backend/optim.h says why
 * it is a pass of its own). On the CPU the host reads the verdict and warns
 * at once; on a device the verdict, the count and the skip stay there (no
 * host wait) and the host learns of them when it reads the count
 * (opf_optim_skipped_steps, opf_optim_step_count), warning then. */
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
    int64_t           step;    /* on a device: the steps run less the skips the host has seen */
    int64_t           skipped; /* CPU: steps skipped; device: the count as last read */
    opf_tensor        guard;   /* on a device: int32 verdict, pad, int64 count (opf_optim_guard) */
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
    opf_tensor_release(&opt->guard);
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

/* A device optimizer's guard words (opf_optim_guard), zeroed. */
static opf_status device_guard(opf_ctx *ctx, opf_tensor *t)
{
    opf_spec sp = opf_spec_make(1, (int64_t[]){4}, OPF_F32);  /* 16 bytes: int32, pad, int64 */
    sp.device = opf_ctx_device(ctx);
    const opf_elem_kernels *k = opf_backend_kernels(ctx, "opf_optim_create", sp.device,
                                                    OPF_KERNELS_ELEM);
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_tensor_alloc(ctx, &sp, t);
    return st ? st : k->fill(ctx, 0.0, t);  /* 0.0f: all bits zero */
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
    if (opf_ctx_device(ctx) != OPF_DEVICE_CPU && (st = device_guard(ctx, &opt->guard))) goto fail;
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

static const char NONFINITE_KEY[] = "opf_optim_step: non-finite gradient";

static void warn_skipped(opf_optim *opt, int64_t skipped)
{
    opf_ctx_warn_once(opt->ctx, NONFINITE_KEY, "opf_optim_step: %lld step(s) skipped so far: a "
                      "gradient held a NaN or an infinity (parameters, moments and step count "
                      "left as they were; opf_optim_skipped_steps counts them)", (long long)skipped);
}

/* The device's count of skipped steps (a counted read; the CPU's is here). */
static int64_t device_skipped(const opf_optim *opt)
{
    if (!opt->guard.buf) return opt->skipped;
    int64_t words[2] = {0, 0};
    opf_tensor host;
    opf_tensor_wrap(&opt->guard.spec, words, &host);
    if (opf_tensor_copy(opt->ctx, &opt->guard, &host)) return opt->skipped;
    return words[1];
}

/* The kernels' list of the slots with a gradient; a quantized primary
 * parameter takes f32 scratch (popped by the caller). */
static opf_status gather(opf_optim *opt, int *count)
{
    opf_ctx *ctx = opt->ctx;
    *count = 0;
    for (int i = 0; i < opt->n; i++) {
        opf_param *p = opt->s[i].p;
        if (!p->requires_grad || (!p->has_grad && !p->main_grad.data[0])) continue;
        float *spare = NULL;
        if (is_primary(p) && !(spare = opf_op_scratch(ctx, opt->s[i].n)))
            return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_optim_step: no scratch for %lld floats",
                             (long long)opt->s[i].n);
        opt->list[(*count)++] = slot_tensor(&opt->s[i], spare);
    }
    return OPF_OK;
}

/* A cached quantized copy is stale after a step that ran. */
static void mark_stale(opf_optim *opt)
{
    for (int i = 0; i < opt->n; i++) {
        opf_param *p = opt->s[i].p;
        if (p->requires_grad && (p->has_grad || p->main_grad.data[0]) && !is_primary(p))
            p->qvalue_valid = false;
    }
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
    int count;
    opf_status st = gather(opt, &count);
    int32_t found = 0;
    opf_optim_guard guard = {0}, *g = NULL;
    if (opt->guard.buf) {  /* the verdict stays on the device */
        guard.found = opt->guard.data[OPF_COMP_DATA];
        guard.skipped = (int64_t *)guard.found + 1;
        guard.known = opt->skipped;
        g = &guard;
    }
    if (!st) st = k->check(ctx, opt->list, count, g ? guard.found : &found);
    if (!st && found) {  /* the CPU: nothing changes */
        warn_skipped(opt, ++opt->skipped);
        opf_ctx_scratch_pop(ctx, mark);
        return OPF_OK;
    }
    const opf_optim_options *o = &opt->o;
    if (!st) {
        opt->step++;
        st = opt->kind == OPF_OPTIM_SGD
                 ? k->sgd(ctx, opt->list, count, o->lr, o->momentum, o->weight_decay, g)
                 : k->adamw(ctx, opt->list, count, o->lr, o->beta1, o->beta2, o->eps,
                            o->weight_decay, opt->step, g);
        if (st) opt->step--;
    }
    if (!st) mark_stale(opt);
    if (!st) st = requantize(opt);  /* on a device after a skip: the same master, the same bits */
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

int64_t opf_optim_skipped_steps(opf_optim *opt)
{
    if (!opt) return 0;
    int64_t now = device_skipped(opt);
    if (opt->guard.buf) {  /* the host catches up: the skips it had not seen */
        opt->step -= now - opt->skipped;
        opt->skipped = now;
    }
    if (now) warn_skipped(opt, now);
    return now;
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
int64_t opf_optim_step_count(const opf_optim *opt)
{
    return opt->guard.buf ? opt->step - (device_skipped(opt) - opt->skipped) : opt->step;
}

void opf_optim_set_step_count(opf_optim *opt, int64_t steps)
{
    if (opt->guard.buf) opt->skipped = device_skipped(opt);
    opt->step = steps;
}

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
