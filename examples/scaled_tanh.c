/* scaled_tanh.c: writing an op (docs/ops.md walks through it). Copy from here.
 *
 * The op is y = alpha * tanh(x) on f32 tensors, with alpha from its config;
 * its backward is dx = dy * alpha * (1 - tanh(x)^2). The program registers
 * the class, runs it behind a linear layer in a seq, eagerly and compiled,
 * and checks: the fakes read no data, the gradient matches a finite
 * difference, and the compiled graph gives the eager bits. It prints
 * "N passed, N failed". */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <opfuse.h>

/* ---- the class ------------------------------------------------------------------------ */

typedef struct scaled_tanh_config {
    double alpha;
} scaled_tanh_config;
static const scaled_tanh_config scaled_tanh_default = {1.0};

/* Forward args: everything forward_impl reads. Tensors and values only, so a
 * compiled graph can bake the values and route the tensors. */
typedef struct st_fwd {
    opf_tensor x;      /* f32 [.., n] */
    double     alpha;
} st_fwd;
static const opf_field st_fwd_fields[] = {OPF_F_TENSOR(st_fwd, x), OPF_F_FLOAT(st_fwd, alpha)};
OPF_SCHEMA(st_fwd_schema, st_fwd, st_fwd_fields);

typedef struct st_bwd {
    opf_tensor dy;     /* f32, x's shape */
    opf_tensor x;      /* the forward's input, saved by setup_context */
    double     alpha;
} st_bwd;
static const opf_field st_bwd_fields[] = {OPF_F_TENSOR(st_bwd, dy), OPF_F_TENSOR(st_bwd, x),
                                          OPF_F_FLOAT(st_bwd, alpha)};
OPF_SCHEMA(st_bwd_schema, st_bwd, st_bwd_fields);

static double alpha_of(opf_op *op) { return ((const scaled_tanh_config *)opf_op_config(op))->alpha; }

/* The traced half: reads the op (config, parameters, quantizers) and the env.
 * This example takes plain f32 only; other inputs are refused here, before
 * anything runs. */
static opf_status st_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    st_fwd *a = args;
    if (env->x->spec.dtype != OPF_F32 || env->x->spec.scaling != OPF_SCALING_NONE)
        return OPF_ERR_DTYPE;
    a->x = *env->x;
    a->alpha = alpha_of(op);
    return OPF_OK;
}

/* The pure half. The fake gives the output specs from the args' specs: it
 * never reads tensor data and never allocates (the compiler runs it on specs
 * alone). */
static opf_status st_forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const st_fwd *a = args;
    outs[0] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, OPF_F32);
    return OPF_OK;
}

/* The math, into outputs the caller allocated from the fake's specs. */
static opf_status st_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const st_fwd *a = args;
    const float *x = a->x.data[0];
    float *y = outs[0].data[0], alpha = (float)a->alpha;
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) y[i] = alpha * tanhf(x[i]);
    return OPF_OK;
}

/* What backward needs: the input, as a counted reference the context keeps. */
static opf_status st_setup_context(opf_op *op, opf_op_ctx *c, const void *args,
                                   const opf_tensor *outs, const opf_tensor *aux)
{
    opf_tensor_retain(&((const st_fwd *)args)->x, &c->saved[c->n_saved++]);
    return OPF_OK;
}

static opf_status st_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *args)
{
    st_bwd *a = args;
    if (env->dy->spec.dtype != OPF_F32 || env->dy->spec.scaling != OPF_SCALING_NONE)
        return OPF_ERR_DTYPE;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->alpha = alpha_of(op);
    return OPF_OK;
}

/* grads[0] is dx; a parameter's gradient would follow. */
static opf_status st_backward_fake(const void *args, opf_spec *grads)
{
    const st_bwd *a = args;
    grads[0] = opf_spec_make(a->dy.spec.ndim, a->dy.spec.shape, OPF_F32);
    return OPF_OK;
}

static opf_status st_backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const st_bwd *a = args;
    const float *dy = a->dy.data[0], *x = a->x.data[0];
    float *dx = grads[0].data[0], alpha = (float)a->alpha;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) {
        float t = tanhf(x[i]);
        dx[i] = dy[i] * (alpha * (1.0f - t * t));
    }
    return OPF_OK;
}

static const opf_op_class scaled_tanh_class = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "scaled_tanh",
    .config_size = sizeof(scaled_tanh_config), .config_default = &scaled_tanh_default,
    .fwd_schema = &st_fwd_schema, .bwd_schema = &st_bwd_schema, .fusible = true,
    .resolve_fwd = st_resolve_fwd, .forward_fake = st_forward_fake,
    .forward_impl = st_forward_impl, .setup_context = st_setup_context,
    .resolve_bwd = st_resolve_bwd, .backward_fake = st_backward_fake,
    .backward_impl = st_backward_impl,
    .inplace = true,  /* y[i] depends on x[i] alone: a graph may write y over x */
};

/* ---- checking it ------------------------------------------------------------------------ */

static int passed, failed;

/* Counts a check; prints the message of a failed one. */
static void expect(bool ok, const char *fmt, ...)
{
    if (ok) {
        passed++;
        return;
    }
    failed++;
    va_list ap;
    va_start(ap, fmt);
    fputs("scaled_tanh: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

enum { ROWS = 8, IN = 16, OUT = 12 };

static void fill(float *v, int n, float step)
{
    for (int i = 0; i < n; i++) v[i] = sinf(step * (float)(i + 1));
}

/* The fakes on args whose tensors point at nothing: a fake that read data
 * would crash here. */
static void check_fakes(void)
{
    opf_spec sp = opf_spec_make(2, (int64_t[]){ROWS, OUT}, OPF_F32), out;
    st_fwd a = {.x = {.spec = sp}, .alpha = 2.0};
    st_bwd b = {.dy = a.x, .x = a.x, .alpha = 2.0};
    expect(st_forward_fake(&a, &out, NULL) == OPF_OK && opf_spec_equal(&out, &sp), "forward fake");
    expect(st_backward_fake(&b, &out) == OPF_OK && opf_spec_equal(&out, &sp), "backward fake");
    char text[256];
    opf_schema_print(&st_fwd_schema, &a, text, sizeof text);
    printf("%s\n", text);  /* the args as dumps show them */
}

/* One op through the eager runner: dx against a central difference of the
 * forward at a few points. */
static void check_gradient(opf_ctx *ctx, opf_op *op)
{
    float x[ROWS * OUT], dy[ROWS * OUT];
    fill(x, ROWS * OUT, 0.37f);
    fill(dy, ROWS * OUT, 0.11f);
    opf_spec sp = opf_spec_make(2, (int64_t[]){ROWS, OUT}, OPF_F32);
    opf_tensor xt, dyt, y, dx;
    opf_tensor_wrap(&sp, x, &xt);
    opf_tensor_wrap(&sp, dy, &dyt);
    opf_fwd_env fe = {.ctx = ctx, .x = &xt, .requires_grad = true};
    opf_op_ctx octx = {0};
    opf_status st = opf_op_forward(op, &fe, &octx, &y);
    opf_bwd_env be = {.ctx = ctx, .dy = &dyt};
    if (!st) st = opf_op_backward(op, &octx, &be, &dx, NULL);
    expect(st == OPF_OK, "eager op: %s", opf_last_error(ctx));
    if (st) return;
    const float *dxv = dx.data[0], alpha = 2.0f, h = 1e-3f;
    for (int i = 0; i < ROWS * OUT; i += 13) {
        float fd = alpha * (tanhf(x[i] + h) - tanhf(x[i] - h)) / (2 * h) * dy[i];
        expect(fabsf(fd - dxv[i]) < 1e-3f, "dx[%d] %g, finite difference %g", i, dxv[i], fd);
    }
    opf_tensor_release(&y);
    opf_tensor_release(&dx);
}

/* linear(+bias) -> scaled_tanh, eager then compiled: the same bits. */
static opf_seq *model(opf_ctx *ctx)
{
    opf_seq *seq;
    opf_op *op;
    scaled_tanh_config cfg = {2.0};
    opf_seq_create(ctx, &seq);
    opf_seq_append_linear(seq, IN, OUT, true, OPF_F32, "fc");
    opf_op_create(ctx, "scaled_tanh", &cfg, "act", &op);
    opf_seq_append(seq, op);
    opf_param *w = opf_op_param(opf_seq_at(seq, 0), 0);
    fill(w->value.data[0], IN * OUT, 0.05f);
    return seq;
}

static void check_seq(opf_ctx *ctx)
{
    float x[ROWS * IN], dy[ROWS * OUT], y0[ROWS * OUT], dx0[ROWS * IN], dw0[IN * OUT];
    fill(x, ROWS * IN, 0.3f);
    fill(dy, ROWS * OUT, 0.7f);
    opf_spec xs = opf_spec_make(2, (int64_t[]){ROWS, IN}, OPF_F32);
    opf_spec ys = opf_spec_make(2, (int64_t[]){ROWS, OUT}, OPF_F32);
    opf_tensor xt, dyt, y, dx;
    opf_tensor_wrap(&xs, x, &xt);
    opf_tensor_wrap(&ys, dy, &dyt);
    opf_seq *seq = model(ctx);
    opf_seq_call call = opf_seq_call_default();
    opf_status st = opf_seq_forward(seq, &xt, &call, &y, NULL);
    if (!st) st = opf_seq_backward(seq, &dyt, NULL, &dx, NULL);
    expect(st == OPF_OK, "eager seq: %s", opf_last_error(ctx));
    if (st) return;
    const opf_param *w = opf_op_param(opf_seq_at(seq, 0), 0);
    memcpy(y0, y.data[0], sizeof y0);
    memcpy(dx0, dx.data[0], sizeof dx0);
    memcpy(dw0, w->grad.data[0], sizeof dw0);
    opf_tensor_release(&y);
    opf_tensor_release(&dx);

    opf_graph *g = NULL;
    opf_seq_zero_grad(seq);
    st = opf_compile(seq, &xs, &call, NULL, &g);
    if (!st) st = opf_graph_forward(g, &xt, &call, &y, NULL);
    if (!st) st = opf_graph_backward(g, &dyt, NULL, &dx, NULL);
    expect(st == OPF_OK, "compiled seq: %s", opf_last_error(ctx));
    if (!st) {
        expect(!memcmp(y0, y.data[0], sizeof y0), "compiled y differs from eager");
        expect(!memcmp(dx0, dx.data[0], sizeof dx0), "compiled dx differs from eager");
        expect(!memcmp(dw0, w->grad.data[0], sizeof dw0), "compiled dW differs from eager");
        expect(opf_graph_reasons(g, NULL, 0) == 0, "scaled_tanh ran as an eager node");
    }
    opf_graph_destroy(g);
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    expect(opf_op_class_register(&scaled_tanh_class) == OPF_OK, "register scaled_tanh");
    check_fakes();
    opf_op *op;
    scaled_tanh_config cfg = {2.0};
    expect(opf_op_create(ctx, "scaled_tanh", &cfg, "act", &op) == OPF_OK, "create: %s",
           opf_last_error(ctx));
    check_gradient(ctx, op);
    opf_op_destroy(op);
    check_seq(ctx);
    opf_ctx_destroy(ctx);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
