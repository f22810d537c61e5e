/* test_cuda_ops.c: every basic op class x recipe x dtype (the digest's
 * enumeration, tests/op_cases.h) run forward and backward on a CUDA context
 * and on a CPU context from the same inputs and parameters. Outputs, dx,
 * extra-input gradients, parameter gradients (and main_grad) and the
 * delayed-scaling state after the steps are compared bit for bit; the
 * GEMM-based classes within numerics.md 8's GEMM tolerance. Every failing
 * case is printed with what differs; a device lacking a kernel family says
 * "no <family> kernels on cuda" and counts as a failure. Exits 77 without a
 * GPU. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include <stdarg.h>

#include "cuda_test.h"
#include "op_cases.h"

static opf_ctx *cpu, *gpu;
static int n_cases, n_failed, n_unsupported, n_refused;

/* One context's half of a case: its op, neighbour quantizers and tensors. */
typedef struct side {
    opf_ctx           *ctx;
    opf_op            *op;
    opf_quantizer      nq, gq;
    opf_delayed_state *ds[2];
    op_quant           q;
    opf_op_ctx         octx;
    opf_tensor         x, ex, dy, dex[OPF_OP_MAX_EXTRA], outs[1 + OPF_OP_MAX_EXTRA], dx,
                       dxe[OPF_OP_MAX_EXTRA];
} side;

/* The per-case report: the first line names the case, then one per finding. */
typedef struct report {
    const char *name;
    int         bad;
} report;

static void fail(report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(report *r, const char *fmt, ...)
{
    if (!r->bad++) printf("FAIL %s\n", r->name);
    va_list ap;
    va_start(ap, fmt);
    printf("    ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

/* A refusal of the device: "no <family> kernels on cuda" when the kernel
 * table lacks the family, else the status and message. */
static void device_refused(report *r, const char *stage, opf_status st)
{
    const char *msg = opf_last_error(gpu), *no = strstr(msg, "no ");
    const char *k = no ? strstr(no, " kernels") : NULL;
    if (st == OPF_ERR_UNSUPPORTED) n_unsupported++;
    if (st == OPF_ERR_UNSUPPORTED && k)
        fail(r, "%s: %.*s kernels on cuda (%s)", stage, (int)(k - no), no, msg);
    else
        fail(r, "%s: %s on cuda: %s", stage, opf_status_str(st), msg);
}

static bool is_gemm_class(const op_row *row)
{
    return !strcmp(row->cls, "basic_linear") || !strcmp(row->cls, "grouped_linear");
}

/* ---- comparing a device tensor with the CPU's ------------------------------- */

/* The values of t (host) as fp32: the rowwise copy decoded when quantized. */
static float *values_f32(const opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
    opf_tensor w;
    opf_tensor_wrap(&s, v, &w);
    opf_status st = t->spec.scaling == OPF_SCALING_NONE
                  ? opf_convert(t->data[0], t->spec.dtype, v, OPF_F32, (size_t)n)
                  : opf_dequantize(cpu, t, t->spec.usage & OPF_USAGE_ROWWISE
                                                   ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE, &w);
    if (st) memset(v, 0xFF, sizeof(float) * (size_t)(n ? n : 1));  /* NaN: reported below */
    return v;
}

/* Byte for byte, component by component; the first differing byte of each. */
static void compare_bytes(report *r, const char *what, const opf_tensor *c, const opf_tensor *g)
{
    opf_layout L;
    opf_spec_layout(&c->spec, &L);
    for (int k = 0; k < OPF_COMP_COUNT; k++) {
        const unsigned char *a = c->data[k], *b = g->data[k];
        if (!L.comp[k].present || !a || !b) continue;
        size_t n = L.comp[k].nbytes, diff = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if (a[i] != b[i] && !diff++) first = i;
        if (diff)
            fail(r, "%s: component %d: %zu of %zu bytes differ, first at byte %zu: cpu 0x%02x, "
                 "cuda 0x%02x", what, k, diff, n, first, a[first], b[first]);
    }
}

/* Within tol: ||g - c|| / ||c|| over the decoded values. */
static void compare_values(report *r, const char *what, const opf_tensor *c, const opf_tensor *g,
                           double tol)
{
    int64_t n = opf_spec_numel(&c->spec);
    float *a = values_f32(c), *b = values_f32(g);
    double err = cuda_test_rel_err(b, a, n);
    if (!(err <= tol)) {
        int64_t worst = 0;
        for (int64_t i = 1; i < n; i++)
            if (fabs((double)b[i] - a[i]) > fabs((double)b[worst] - a[worst])) worst = i;
        fail(r, "%s: rel err %.3e > tol %.1e (worst element %lld: cpu %g, cuda %g)", what, err,
             tol, (long long)worst, (double)a[worst], (double)b[worst]);
    }
    free(a);
    free(b);
}

/* GEMM tolerance (numerics.md 8): fp32 sums in another order then the
 * output's rounding; a quantized output may round one step apart. */
static double gemm_tol(const opf_spec *s, bool quantized_recipe)
{
    if (s->scaling != OPF_SCALING_NONE) return 0.07;
    double t = s->dtype == OPF_BF16 ? 8e-3 : s->dtype == OPF_F16 ? 1e-3 : 1e-5;
    return quantized_recipe && t < 1e-3 ? 1e-3 : t;
}

static void compare(report *r, const char *what, const opf_tensor *c, const opf_tensor *g,
                    bool gemm, bool quantized_recipe)
{
    bool hc = c->data[0] || c->data[OPF_COMP_COL_DATA];
    bool hg = g->data[0] || g->data[OPF_COMP_COL_DATA];
    if (hc != hg) {
        fail(r, "%s: present on %s only", what, hc ? "cpu" : "cuda");
        return;
    }
    if (!hc) return;
    opf_spec a = c->spec, b = g->spec;
    b.device = OPF_DEVICE_CPU;
    if (!opf_spec_equal(&a, &b)) {
        char x[160], y[160];
        opf_spec_str(&a, x, sizeof x), opf_spec_str(&b, y, sizeof y);
        fail(r, "%s: spec %s on cpu, %s on cuda", what, x, y);
        return;
    }
    opf_tensor h;
    opf_status st = cuda_test_download(gpu, g, &h);
    if (st) {
        fail(r, "%s: download: %s", what, opf_last_error(gpu));
        return;
    }
    if (gemm) compare_values(r, what, c, &h, gemm_tol(&a, quantized_recipe));
    else compare_bytes(r, what, c, &h);
    opf_tensor_release(&h);
}

/* Scales and histories of two delayed states, read explicitly from each. */
static void compare_delayed(report *r, const char *what, opf_delayed_state *c,
                            opf_delayed_state *g, bool gemm)
{
    if (!c || !g) return;
    int n = opf_delayed_state_slots(c), L = opf_delayed_state_history_len(c);
    size_t bytes = sizeof(float) * (size_t)(n * (L + 1));
    float *a = malloc(bytes), *b = malloc(bytes);
    opf_status st = opf_delayed_state_read(cpu, c, a, a + n);
    if (!st) st = opf_delayed_state_read(gpu, g, b, b + n);
    if (st) fail(r, "%s: read: %s", what, opf_last_error(gpu));
    else if (gemm && cuda_test_rel_err(b, a, n * (L + 1)) > 0.07)
        fail(r, "%s: rel err %.3e", what, cuda_test_rel_err(b, a, n * (L + 1)));
    else if (!gemm && memcmp(a, b, bytes))
        fail(r, "%s: scales or amax history differ (slot 0: cpu scale %g amax %g, cuda %g %g)",
             what, (double)a[0], (double)a[n], (double)b[0], (double)b[n]);
    free(a);
    free(b);
}

/* ---- running one case on both contexts -------------------------------------- */

static opf_status side_create(side *sd, opf_ctx *ctx, const op_row *row, opf_dtype dt,
                              const opf_recipe *r)
{
    memset(sd, 0, sizeof *sd);
    sd->ctx = ctx;
    unsigned char cfg[256];
    opf_status st = opf_op_create(ctx, row->cls, row_config(row, dt, cfg, sizeof cfg), row->name,
                                  &sd->op);
    if (st || r->kind == OPF_RECIPE_NONE) return st;
    if (opf_op_class_of(sd->op)->n_gemms) st = opf_op_reset_recipe(ctx, sd->op, r);
    if (!st) st = role_quantizer(ctx, r, OPF_ROLE_INPUT, &sd->nq, &sd->ds[0]);
    if (!st) st = role_quantizer(ctx, r, OPF_ROLE_GRAD_OUTPUT, &sd->gq, &sd->ds[1]);
    sd->q = (op_quant){&sd->nq, &sd->gq};
    return st;
}

static void side_clear_step(side *sd)
{
    opf_op_ctx_clear(&sd->octx);
    opf_tensor *t[] = {&sd->x, &sd->ex, &sd->dy, &sd->dx};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) opf_tensor_release(t[i]);
    for (int i = 0; i < OPF_OP_MAX_EXTRA; i++)
        opf_tensor_release(&sd->dex[i]), opf_tensor_release(&sd->dxe[i]);
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&sd->outs[i]);
}

static void side_destroy(side *sd)
{
    side_clear_step(sd);
    opf_delayed_state_destroy(sd->ds[0]), opf_delayed_state_destroy(sd->ds[1]);
    opf_op_destroy(sd->op);
}

/* The GPU op's parameters take the CPU op's values. */
static opf_status copy_params(side *c, side *g)
{
    opf_status st = OPF_OK;
    for (int i = 0; !st && i < opf_op_num_params(c->op); i++)
        st = opf_tensor_copy(gpu, &opf_op_param(c->op, i)->value, &opf_op_param(g->op, i)->value);
    return st;
}

static opf_status forward(side *sd, const op_row *row, const opf_recipe *r)
{
    const opf_op_class *cls = opf_op_class_of(sd->op);
    opf_dropout_kwargs dk = {.training = true};
    opf_fwd_env env = {.ctx = sd->ctx, .x = &sd->x, .requires_grad = true,
                       .recipe = r->kind == OPF_RECIPE_NONE ? NULL : r,
                       .next_input_q = cls->n_gemms ? NULL : sd->q.next_input,
                       .kwargs = strcmp(cls->name, "dropout") ? NULL : &dk};
    if (row->extra != EX_NONE) env.extra_in[0] = &sd->ex;
    opf_ctx_set_rng(sd->ctx, 0x5EED, 0);  /* dropout draws the same stream on both */
    return opf_op_forward(sd->op, &env, &sd->octx, sd->outs);
}

static opf_status backward(side *sd)
{
    opf_bwd_env benv = {.ctx = sd->ctx, .dy = &sd->dy, .prev_grad_q = sd->q.grad};
    for (int i = 0; i < opf_op_class_of(sd->op)->n_extra_out; i++) benv.dextra_out[i] = &sd->dex[i];
    return opf_op_backward(sd->op, &sd->octx, &benv, &sd->dx, sd->dxe);
}

static opf_status upload(const opf_tensor *h, opf_tensor *d)
{
    return h->data[0] ? cuda_test_upload(gpu, h, d) : OPF_OK;
}

/* The delayed update both sides run between steps (the fuser's). */
static opf_status update(side *sd)
{
    opf_recipe_state *rs = opf_op_recipe_state(sd->op);
    opf_status st = OPF_OK;
    for (int bwd = 0; rs && !st && bwd < 2; bwd++)
        st = opf_recipe_state_update(sd->ctx, rs, bwd, NULL, NULL);
    for (int i = 0; !st && i < 2; i++)
        if (sd->ds[i]) st = opf_delayed_state_update(sd->ctx, sd->ds[i], NULL, NULL);
    return st;
}

/* One step: inputs on the CPU, copied to the GPU; forward and backward on
 * both; everything the step produced compared. Returns false when the case
 * cannot go on (a refusal). */
static bool step(report *rp, side *c, side *g, const op_row *row, opf_dtype dt,
                 const opf_recipe *r, unsigned long long *s)
{
    const opf_op_class *cls = opf_op_class_of(c->op);
    bool gemm = is_gemm_class(row), q = r->kind != OPF_RECIPE_NONE;
    c->x = rand2(cpu, s, ROWS, COLS, dt), c->ex = make_extra(cpu, row->extra, dt, r->kind, s);
    opf_status st = upload(&c->x, &g->x);
    if (!st) st = upload(&c->ex, &g->ex);
    if (st) return device_refused(rp, "inputs", st), false;
    if ((st = forward(c, row, r))) return n_refused++, false;  /* the CPU refuses it too: no case */
    if ((st = forward(g, row, r))) return device_refused(rp, "forward", st), false;
    for (int i = 0; i < 1 + cls->n_extra_out; i++)
        compare(rp, i ? "extra output" : "output", &c->outs[i], &g->outs[i], gemm, q);
    c->dy = rand_like(cpu, s, &c->outs[0], dt);
    st = upload(&c->dy, &g->dy);
    for (int i = 0; !st && i < cls->n_extra_out; i++)
        c->dex[i] = rand_like(cpu, s, &c->outs[1 + i], dt), st = upload(&c->dex[i], &g->dex[i]);
    if (st) return device_refused(rp, "gradients in", st), false;
    if ((st = backward(c))) return n_refused++, false;
    if ((st = backward(g))) return device_refused(rp, "backward", st), false;
    compare(rp, "dx", &c->dx, &g->dx, gemm, q);
    for (int i = 0; i < cls->n_extra_in; i++)
        compare(rp, "extra-input gradient", &c->dxe[i], &g->dxe[i], gemm, q);
    if (r->kind != OPF_RECIPE_DELAYED) return true;
    if ((st = update(c))) return n_refused++, false;
    if ((st = update(g))) return device_refused(rp, "delayed update", st), false;
    return true;
}

static void compare_state(report *rp, side *c, side *g, bool gemm)
{
    for (int i = 0; i < opf_op_num_params(c->op); i++) {
        const opf_param *pc = opf_op_param_const(c->op, i), *pg = opf_op_param_const(g->op, i);
        char what[64];
        snprintf(what, sizeof what, "grad of %s", pc->name);
        compare(rp, what, &pc->grad, &pg->grad, gemm, true);
        snprintf(what, sizeof what, "main_grad of %s", pc->name);
        compare(rp, what, &pc->main_grad, &pg->main_grad, gemm, true);
    }
    opf_recipe_state *rc = opf_op_recipe_state(c->op), *rg = opf_op_recipe_state(g->op);
    for (int b = 0; rc && rg && b < 2; b++)
        compare_delayed(rp, b ? "op's backward delayed state" : "op's forward delayed state",
                        opf_recipe_state_delayed(rc, b), opf_recipe_state_delayed(rg, b), gemm);
    compare_delayed(rp, "input quantizer's state", c->ds[0], g->ds[0], gemm);
    compare_delayed(rp, "gradient quantizer's state", c->ds[1], g->ds[1], gemm);
}

static void run_case(const op_row *row, opf_dtype dt, opf_recipe_kind rk)
{
    char name[96];
    snprintf(name, sizeof name, "op/%s/%s/%s", row->name, opf_recipe_name(rk), opf_dtype_name(dt));
    report rp = {name, 0};
    unsigned long long s = 0x9E3779B97F4A7C15ull;
    for (const char *p = name; *p; p++) s = (s ^ (unsigned char)*p) * 0x100000001B3ull;
    opf_recipe r = recipe_of(rk);
    side c, g;
    opf_status st = side_create(&c, cpu, row, dt, &r);
    if (st) {  /* the CPU refuses the combination: nothing to compare */
        n_refused++;
        side_destroy(&c);
        return;
    }
    n_cases++;
    randomize_params(c.op, &s);
    if ((st = side_create(&g, gpu, row, dt, &r)) || (st = copy_params(&c, &g)))
        device_refused(&rp, "create", st);
    bool ok = !st;
    for (int i = 0; ok && i < steps_for(rk); i++) {
        ok = step(&rp, &c, &g, row, dt, &r, &s);
        side_clear_step(&c), side_clear_step(&g);
    }
    if (ok) compare_state(&rp, &c, &g, is_gemm_class(row));
    side_destroy(&c), side_destroy(&g);
    n_failed += rp.bad > 0;
    CHECK(rp.bad == 0, "%s differs between cpu and cuda (above)", name);
}

int main(void)
{
    gpu = cuda_test_ctx();
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 0x5EED;
    CHECK_OK(NULL, opf_ctx_create(&o, &cpu));
    for (int i = 0; i < N_OP_ROWS; i++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < NDT; d++) run_case(&op_rows[i], dtypes[d], recipes[k]);
    printf("cuda ops: %d cases, %d differ or fail on cuda (%d for want of a kernel), %d refused "
           "on the cpu too\n", n_cases, n_failed, n_unsupported, n_refused);
    opf_ctx_destroy(cpu);
    cuda_test_done(gpu);
    TEST_DONE();
}
#endif
