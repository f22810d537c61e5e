/* l2normalization.c: "l2normalization", y = x * rsqrt(sum(x^2) + eps) over
 * the last dim, no parameters (te-ops.md section 5). The input (plain or
 * quantized, logical dtype f32/bf16/f16) is decoded to fp32, every step is
 * fp32, and y and dx are plain in the input's dtype: like TE's op, it neither
 * quantizes its output for the next op nor dx for the previous one, so those
 * neighbours quantize the plain tensors themselves. Saved for backward: x and
 * rnorm ([rows] fp32).
 *
 * The exact fp32 order, per row of H values, no FMA. Every sum S(t_j) is
 * taken like a warp's reduction: lane l = j mod 32 adds its terms left to
 * right, then the 32 lanes fold in halves (lane i += lane i+16, then i+8,
 * i+4, i+2, i+1), as layernorm.c and rmsnorm.c do:
 *   s    = S(fl(x_j * x_j))
 *   r    = 1.0f / sqrtf(s + eps)              each operation rounded once
 *   y_j  = fl(x_j * r)
 * backward (d/dx of x * (s + eps)^-1/2):
 *   c    = S(fl(dy_j * y_j))
 *   dx_j = r * fl(dy_j - fl(c * y_j))
 * eps = 0 with an all-zero row gives r = inf and NaN outputs, as in TE. Rows
 * run in parallel and each row is sequential, so the bits never depend on the
 * thread count. */
#include <math.h>
#include <omp.h>

#include "ops/ops-impl.h"

typedef struct l2n_fwd {
    opf_tensor x;  /* [..., H], plain or quantized */
    double     eps;
} l2n_fwd;
static const opf_field l2n_fwd_fields[] = {OPF_F_TENSOR_Q(l2n_fwd, x), OPF_F_FLOAT(l2n_fwd, eps)};
OPF_SCHEMA(l2n_fwd_schema, l2n_fwd, l2n_fwd_fields);

typedef struct l2n_bwd {
    opf_tensor dy;     /* [..., H] */
    opf_tensor x;      /* the forward input */
    opf_tensor rnorm;  /* [rows] fp32 */
} l2n_bwd;
static const opf_field l2n_bwd_fields[] = {
    OPF_F_TENSOR_Q(l2n_bwd, dy), OPF_F_TENSOR_Q(l2n_bwd, x), OPF_F_TENSOR(l2n_bwd, rnorm)};
OPF_SCHEMA(l2n_bwd_schema, l2n_bwd, l2n_bwd_fields);

enum { L2N_PAR_MIN = 1 << 15, L2N_LANES = 32 };

static bool is_act_dtype(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

static int l2n_threads(opf_ctx *ctx, int64_t work)
{
    int t = opf_ctx_num_threads(ctx);
    if (work < L2N_PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

/* S(t_0 .. t_{n-1}) as in the file comment: 32 lanes, lane l adds t_l,
 * t_{l+32}, ... left to right, then the lanes fold in halves. */
static float lane_sum(const float *t, int64_t n)
{
    float p[L2N_LANES] = {0};
    int64_t j0 = 0;
    for (; j0 + L2N_LANES <= n; j0 += L2N_LANES)
        for (int l = 0; l < L2N_LANES; l++) p[l] += t[j0 + l];
    for (int64_t l = 0; j0 + l < n; l++) p[l] += t[j0 + l];
    for (int off = L2N_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

/* A quantized input is seen as TE's dequantize returns it: decoded to fp32,
 * then rounded to its logical dtype. */
static opf_status load_x(opf_ctx *ctx, const opf_tensor *t, float *ws, const float **out)
{
    opf_status st = opf_op_load_f32(ctx, t, ws, out);
    opf_dtype dt = t->spec.dtype;
    if (st || dt == OPF_F32 || t->spec.scaling == OPF_SCALING_NONE) return st;
    int64_t n = opf_spec_numel(&t->spec);
    for (int64_t i = 0; i < n; i++)
        ws[i] = dt == OPF_BF16 ? opf_bf16_to_f32(opf_f32_to_bf16(ws[i]))
                               : opf_f16_to_f32(opf_f32_to_f16(ws[i]));
    return OPF_OK;
}

/* The output row doubles as the buffer of the terms being summed. */
static void l2n_row_fwd(const float *x, int64_t H, float eps, float *y, float *r_out)
{
    for (int64_t j = 0; j < H; j++) y[j] = x[j] * x[j];
    float r = 1.0f / sqrtf(lane_sum(y, H) + eps);
    for (int64_t j = 0; j < H; j++) y[j] = x[j] * r;
    *r_out = r;
}

static void l2n_row_bwd(const float *x, const float *dy, int64_t H, float r, float *dx)
{
    for (int64_t j = 0; j < H; j++) {
        float y = x[j] * r;
        dx[j] = dy[j] * y;
    }
    float c = lane_sum(dx, H);
    for (int64_t j = 0; j < H; j++) {
        float y = x[j] * r;
        float cy = c * y;
        dx[j] = r * (dy[j] - cy);
    }
}

/* ---- the class -------------------------------------------------------------- */

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_l2norm_config *c = opf_op_config(op);
    if (!(c->eps >= 0.0) || !isfinite(c->eps))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "l2normalization \"%s\": eps %g must be finite and >= 0", opf_op_name(op),
                         c->eps);
    return OPF_OK;
}

/* t: at least 1-D with a float logical dtype. */
static opf_status check_input(opf_ctx *ctx, const opf_op *op, const char *what, const opf_tensor *t)
{
    if (t->spec.ndim < 1)
        return opf_error(ctx, OPF_ERR_SHAPE, "l2normalization \"%s\": %s is a scalar (0-D), "
                         "need at least one dim", opf_op_name(op), what);
    if (!is_act_dtype(t->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE,
                         "l2normalization \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         opf_op_name(op), what, opf_dtype_name(t->spec.dtype));
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    l2n_fwd *a = args;
    opf_status st = check_input(env->ctx, op, "input", env->x);
    if (st) return st;
    a->x = *env->x;
    a->eps = ((const opf_l2norm_config *)opf_op_config_const(op))->eps;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const opf_spec *x = &((const l2n_fwd *)args)->x.spec;
    int64_t H = x->shape[x->ndim - 1], rows = H ? opf_spec_numel(x) / H : 0;
    outs[0] = opf_spec_make(x->ndim, x->shape, x->dtype);
    aux[0] = opf_spec_make(1, &rows, OPF_F32);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const l2n_fwd *a = args;
    int64_t H = a->x.spec.shape[a->x.spec.ndim - 1], n = opf_spec_numel(&a->x.spec);
    int64_t rows = H ? n / H : 0;
    float *xs = opf_op_scratch(ctx, n), *y = opf_op_scratch(ctx, n);
    if (!xs || !y) return opf_error(ctx, OPF_ERR_NO_MEMORY, "l2normalization: no scratch");
    const float *x;
    opf_status st = load_x(ctx, &a->x, xs, &x);
    if (st) return st;
    float eps = (float)a->eps, *r = aux[0].data[0];
    int nt = l2n_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) l2n_row_fwd(x + i * H, H, eps, y + i * H, &r[i]);
    return opf_op_store_f32(ctx, y, a->x.spec.dtype, NULL, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    opf_tensor_retain(&((const l2n_fwd *)args)->x, &octx->saved[0]);
    opf_tensor_retain(&aux[0], &octx->saved[1]);
    octx->n_saved = 2;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    l2n_bwd *a = args;
    if (octx->n_saved != 2)
        return opf_error(env->ctx, OPF_ERR_STATE,
                         "l2normalization \"%s\": context holds %d tensors, want 2",
                         opf_op_name(op), octx->n_saved);
    const opf_tensor *x = &octx->saved[0];
    opf_status st = check_input(env->ctx, op, "gradient", env->dy);
    if (st) return st;
    const opf_spec *ds = &env->dy->spec, *xs = &x->spec;
    if (ds->shape[ds->ndim - 1] != xs->shape[xs->ndim - 1] || opf_spec_numel(ds) != opf_spec_numel(xs))
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "l2normalization \"%s\": gradient has %lld elements of %lld features, "
                         "the input had %lld of %lld", opf_op_name(op), (long long)opf_spec_numel(ds),
                         (long long)ds->shape[ds->ndim - 1], (long long)opf_spec_numel(xs),
                         (long long)xs->shape[xs->ndim - 1]);
    a->dy = *env->dy;
    a->x = *x;
    a->rnorm = octx->saved[1];
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const opf_spec *x = &((const l2n_bwd *)args)->x.spec;
    grads[0] = opf_spec_make(x->ndim, x->shape, x->dtype);
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const l2n_bwd *a = args;
    int64_t H = a->x.spec.shape[a->x.spec.ndim - 1], n = opf_spec_numel(&a->x.spec);
    int64_t rows = H ? n / H : 0;
    float *xs = opf_op_scratch(ctx, n), *dys = opf_op_scratch(ctx, n), *dx = opf_op_scratch(ctx, n);
    if (!xs || !dys || !dx) return opf_error(ctx, OPF_ERR_NO_MEMORY, "l2normalization: no scratch");
    const float *x, *dy;
    opf_status st = load_x(ctx, &a->x, xs, &x);
    if (!st) st = opf_op_load_f32(ctx, &a->dy, dys, &dy);
    if (st) return st;
    const float *r = a->rnorm.data[0];
    int nt = l2n_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < rows; i++) l2n_row_bwd(x + i * H, dy + i * H, H, r[i], dx + i * H);
    return opf_op_store_f32(ctx, dx, a->x.spec.dtype, NULL, &grads[0]);
}

const opf_op_class opf_op_class_l2normalization = {
    .abi_version = OPF_OP_ABI_VERSION,
    .name = "l2normalization",
    .module_type = "l2normalization",
    .config_size = sizeof(opf_l2norm_config),
    .fwd_schema = &l2n_fwd_schema,
    .bwd_schema = &l2n_bwd_schema,
    .fusible = true,
    .init = init,
    .resolve_fwd = resolve_fwd,
    .setup_context = setup_context,
    .resolve_bwd = resolve_bwd,
    .forward_fake = forward_fake,
    .forward_impl = forward_impl,
    .backward_fake = backward_fake,
    .backward_impl = backward_impl,
};
