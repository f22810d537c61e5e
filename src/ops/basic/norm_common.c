/* norm_common.c: the pieces layernorm.c, rmsnorm.c and l2normalization.c
 * share (declared in norm-impl.h): the fp32 sums whose order their file
 * comments specify, the loads that see a tensor as the op's dtype does, and
 * the checks of configs, inputs and saved contexts. Messages start with the
 * op's class name, so each reads as if its op had written it. */
#include <math.h>
#include <omp.h>

#include "ops/basic/norm-impl.h"

static const char *class_name(const opf_op *op) { return opf_op_class_of(op)->name; }

static bool is_act_dtype(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

/* ---- the fp32 math ------------------------------------------------------------ */

int opf_norm_threads(opf_ctx *ctx, int64_t work)
{
    int t = opf_ctx_num_threads(ctx);
    if (work < OPF_NORM_PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

float opf_norm_lane_sum(const float *t, int64_t n)
{
    float p[OPF_NORM_LANES] = {0};
    int64_t j0 = 0;
    for (; j0 + OPF_NORM_LANES <= n; j0 += OPF_NORM_LANES)
        for (int l = 0; l < OPF_NORM_LANES; l++) p[l] += t[j0 + l];
    for (int64_t l = 0; j0 + l < n; l++) p[l] += t[j0 + l];
    for (int off = OPF_NORM_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

float opf_norm_row_m2(const float *x, int64_t n, float rn, float *t, float *mu_out)
{
    float mu = opf_norm_lane_sum(x, n) * rn;
    for (int64_t j = 0; j < n; j++) {
        float d = x[j] - mu;
        t[j] = d * d;
    }
    *mu_out = mu;
    return opf_norm_lane_sum(t, n);
}

/* Folds the lane rows of acc in halves into acc[0] (w columns). */
static void fold_columns(float (*acc)[OPF_NORM_COL_BLOCK], int64_t w)
{
    for (int off = OPF_NORM_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++)
            for (int64_t j = 0; j < w; j++) acc[l][j] += acc[l + off][j];
}

void opf_norm_param_grads(const float *dz, const float *y, int64_t rows, int64_t H, float *dg,
                          float *db, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j0 = 0; j0 < H; j0 += OPF_NORM_COL_BLOCK) {
        int64_t w = j0 + OPF_NORM_COL_BLOCK < H ? OPF_NORM_COL_BLOCK : H - j0;
        float ag[OPF_NORM_LANES][OPF_NORM_COL_BLOCK], ab[OPF_NORM_LANES][OPF_NORM_COL_BLOCK];
        memset(ag, 0, sizeof ag);
        if (db) memset(ab, 0, sizeof ab);
        for (int64_t r = 0; r < rows; r++) {
            const float *dr = dz + r * H + j0, *yr = y + r * H + j0;
            float *qg = ag[r % OPF_NORM_LANES], *qb = ab[r % OPF_NORM_LANES];
            for (int64_t j = 0; j < w; j++) qg[j] += dr[j] * yr[j];
            if (db)
                for (int64_t j = 0; j < w; j++) qb[j] += dr[j];
        }
        fold_columns(ag, w);
        memcpy(dg + j0, ag[0], (size_t)w * sizeof(float));
        if (db) {
            fold_columns(ab, w);
            memcpy(db + j0, ab[0], (size_t)w * sizeof(float));
        }
    }
}

/* ---- loads ----------------------------------------------------------------------- */

opf_status opf_norm_load_as(opf_ctx *ctx, const opf_tensor *t, opf_dtype act, float *ws,
                            const float **out)
{
    opf_status st = opf_op_load_f32(ctx, t, ws, out);
    if (st || act == OPF_F32 || (t->spec.scaling == OPF_SCALING_NONE && t->spec.dtype == act))
        return st;
    const float *v = *out;
    int64_t n = opf_spec_numel(&t->spec);
    for (int64_t i = 0; i < n; i++)
        ws[i] = act == OPF_BF16 ? opf_bf16_to_f32(opf_f32_to_bf16(v[i]))
                                : opf_f16_to_f32(opf_f32_to_f16(v[i]));
    *out = ws;
    return OPF_OK;
}

opf_status opf_norm_load_gamma(opf_ctx *ctx, const opf_tensor *w, bool zero_centered, float *g)
{
    int64_t n = w->spec.shape[0];
    opf_status st = opf_convert(w->data[0], w->spec.dtype, g, OPF_F32, (size_t)n);
    if (!st && zero_centered)
        for (int64_t j = 0; j < n; j++) g[j] = g[j] + 1.0f;
    return st;
}

/* ---- the class hooks' checks ------------------------------------------------------- */

/* Sets every element of a plain f32/bf16/f16 tensor to 1. */
static void fill_one(opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    if (t->spec.dtype == OPF_F32) {
        float *p = t->data[0];
        for (int64_t i = 0; i < n; i++) p[i] = 1.0f;
    } else {
        uint16_t one = t->spec.dtype == OPF_BF16 ? opf_f32_to_bf16(1.0f) : opf_f32_to_f16(1.0f);
        uint16_t *p = t->data[0];
        for (int64_t i = 0; i < n; i++) p[i] = one;
    }
}

opf_status opf_norm_init(opf_ctx *ctx, opf_op *op, bool with_bias)
{
    const opf_norm_config *c = opf_op_config(op);
    const char *cls = class_name(op), *n = opf_op_name(op);
    if (c->hidden < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": hidden size %lld < 1", cls, n,
                         (long long)c->hidden);
    opf_status st = opf_norm_check_eps(ctx, op, c->eps);
    if (st) return st;
    if (!is_act_dtype(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": dtype %s, expected f32, bf16 or f16",
                         cls, n, opf_dtype_name(c->dtype));
    opf_spec s = opf_spec_make(1, &c->hidden, c->dtype);
    int iw = opf_op_add_param(ctx, op, "weight", &s);
    if (iw < 0) return (opf_status)-iw;
    int ib = with_bias ? opf_op_add_param(ctx, op, "bias", &s) : 0;
    if (ib < 0) return (opf_status)-ib;
    if (!c->zero_centered_gamma) fill_one(&opf_op_param(op, iw)->value);  /* params start at 0 */
    return OPF_OK;
}

opf_status opf_norm_check_eps(opf_ctx *ctx, const opf_op *op, double eps)
{
    if (!(eps >= 0.0) || !isfinite(eps))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": eps %g must be finite and >= 0",
                         class_name(op), opf_op_name(op), eps);
    return OPF_OK;
}

opf_status opf_norm_check_dtype(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t)
{
    if (!is_act_dtype(t->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         class_name(op), opf_op_name(op), what, opf_dtype_name(t->spec.dtype));
    return OPF_OK;
}

opf_status opf_norm_check_input(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t, int64_t H)
{
    const opf_spec *s = &t->spec;
    if (s->ndim < 1 || s->shape[s->ndim - 1] != H)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": %s has %lld features, hidden size is %lld",
                         class_name(op), opf_op_name(op), what,
                         (long long)(s->ndim ? s->shape[s->ndim - 1] : 0), (long long)H);
    return opf_norm_check_dtype(ctx, op, what, t);
}

opf_status opf_norm_check_saved(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx, int want)
{
    if (octx->n_saved != want)
        return opf_error(ctx, OPF_ERR_STATE, "%s \"%s\": context holds %d tensors, want %d",
                         class_name(op), opf_op_name(op), octx->n_saved, want);
    return OPF_OK;
}

opf_status opf_norm_check_bwd(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx,
                              const opf_tensor *dy, int64_t H, int n_saved)
{
    opf_status st = opf_norm_check_saved(ctx, op, octx, n_saved);
    if (!st) st = opf_norm_check_input(ctx, op, "gradient", dy, H);
    if (st) return st;
    int64_t nd = opf_spec_numel(&dy->spec), nx = opf_spec_numel(&octx->saved[0].spec);
    if (nd != nx)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": gradient has %lld elements, the input had %lld",
                         class_name(op), opf_op_name(op), (long long)nd, (long long)nx);
    return OPF_OK;
}

void opf_norm_save(opf_op_ctx *octx, const opf_tensor *x, const opf_tensor *aux, int n_aux)
{
    opf_tensor_retain(x, &octx->saved[0]);
    for (int i = 0; i < n_aux; i++) opf_tensor_retain(&aux[i], &octx->saved[1 + i]);
    octx->n_saved = 1 + n_aux;
}
