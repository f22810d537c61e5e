/* test_nn.c: the language-model ops (opfuse/nn.h) against FP64 references:
 * embedding, causal attention and cross-entropy forward against a direct
 * double computation, their gradients against central finite differences of
 * that double forward, the fakes against the real outputs, bf16 inputs
 * (attention's bf16 gradient against an analytic FP64 one that takes the
 * saved bf16 o), attention's kernels on bf16 / f16 storage (the bits of f32
 * storage; a 16-bit o the f32 o rounded once, read back as stored),
 * thread-count independence, bad input, and global gradient-norm clipping. */
#include <omp.h>

#include "test.h"

#include "backend/nn.h"
#include "ops/ops-impl.h"

enum { B = 2, T = 7, H = 2, D = 4, C = H * D, V = 11, P = 8 };

static unsigned long long seed = 99;

static void fill(float *v, int64_t n, float sigma)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&seed, sigma);
}

static opf_tensor wrap(int ndim, const int64_t *shape, opf_dtype dt, void *p)
{
    opf_tensor t;
    opf_tensor_wrap(&(opf_spec){.ndim = ndim}, p, &t);
    t.spec = opf_spec_make(ndim, shape, dt);
    return t;
}

/* The fakes give the real outputs' specs and the real dx's spec. */
static void check_fakes(const opf_op *op, const opf_tensor *out, const opf_tensor *dx)
{
    opf_spec o[1 + OPF_OP_MAX_EXTRA], aux[OPF_OP_MAX_AUX], g[OPF_OP_MAX_GRADS];
    for (int i = 0; i < OPF_OP_MAX_GRADS; i++) g[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(op->cls->forward_fake(op->fwd_args, o, aux) == OPF_OK, "%s: forward fake", op->name);
    CHECK(opf_spec_equal(&o[0], &out->spec), "%s: fake output spec differs", op->name);
    CHECK(op->cls->backward_fake(op->bwd_args, g) == OPF_OK, "%s: backward fake", op->name);
    if (dx && dx->data[0]) CHECK(opf_spec_equal(&g[0], &dx->spec), "%s: fake dx spec differs", op->name);
    if (dx && !dx->data[0]) CHECK(g[0].ndim == OPF_SPEC_NONE_NDIM, "%s: fake promises a dx", op->name);
}

/* ---- FP64 references ------------------------------------------------------------- */

/* The softmax row of query i of head h in batch b: p[j] for j = 0..i. */
static void ref_softmax(const double *qkv, int b, int h, int i, double *p)
{
    const double *q = qkv + (b * T + i) * 3 * C + h * D;
    double m = -INFINITY, z = 0;
    for (int j = 0; j <= i; j++) {
        const double *k = qkv + (b * T + j) * 3 * C + C + h * D;
        p[j] = 0;
        for (int d = 0; d < D; d++) p[j] += q[d] * k[d];
        p[j] /= sqrt((double)D);
        m = fmax(m, p[j]);
    }
    for (int j = 0; j <= i; j++) z += exp(p[j] - m);
    for (int j = 0; j <= i; j++) p[j] = exp(p[j] - m) / z;
}

static void ref_attention(const double *qkv, double *o)
{
    double p[T];
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                ref_softmax(qkv, b, h, i, p);
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int j = 0; j <= i; j++)
                        acc += p[j] * qkv[(b * T + j) * 3 * C + 2 * C + h * D + d];
                    o[(b * T + i) * C + h * D + d] = acc;
                }
            }
}

/* The gradient of sum(o * dy) through ref_attention, analytically, with the
 * row terms D_i = dot(dy_i, ou_i) taken from ou: the exact gradient when ou
 * is ref_attention's o; with a rounded o, the gradient the kernels compute
 * from that saved o (nn.h: the backward reads o as stored). */
static void ref_attention_bwd(const double *qkv, const double *dy, const double *ou, double *dq)
{
    double p[T];
    memset(dq, 0, sizeof(double) * B * T * 3 * C);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                int64_t r = (b * T + i) * C + h * D;
                const double *q = qkv + (b * T + i) * 3 * C + h * D, *g = dy + r;
                double di = 0;
                for (int d = 0; d < D; d++) di += g[d] * ou[r + d];
                ref_softmax(qkv, b, h, i, p);
                for (int j = 0; j <= i; j++) {
                    const double *k = qkv + (b * T + j) * 3 * C + C + h * D, *v = k + C;
                    double *dqi = dq + (b * T + i) * 3 * C + h * D;
                    double *dk = dq + (b * T + j) * 3 * C + C + h * D, *dv = dk + C, dp = 0;
                    for (int d = 0; d < D; d++) dp += g[d] * v[d];
                    double ds = p[j] * (dp - di) / sqrt((double)D);
                    for (int d = 0; d < D; d++) {
                        dqi[d] += ds * k[d];
                        dk[d] += ds * q[d];
                        dv[d] += p[j] * g[d];
                    }
                }
            }
}

static double ref_xent(const double *x, const int32_t *tgt, int rows)
{
    double s = 0;
    int n = 0;
    for (int r = 0; r < rows; r++) {
        if (tgt[r] < 0) continue;
        double m = x[r * V], z = 0;
        for (int j = 1; j < V; j++) m = fmax(m, x[r * V + j]);
        for (int j = 0; j < V; j++) z += exp(x[r * V + j] - m);
        s += m + log(z) - x[r * V + tgt[r]];
        n++;
    }
    return n ? s / n : 0;
}

/* ---- attention ------------------------------------------------------------------- */

static double attn_loss(const double *qkv, const float *dy)
{
    double o[B * T * C], l = 0;
    ref_attention(qkv, o);
    for (int i = 0; i < B * T * C; i++) l += o[i] * dy[i];
    return l;
}

static void test_attention(opf_ctx *ctx)
{
    enum { NX = B * T * 3 * C, NY = B * T * C };
    static float qkv[NX], dyv[NY];
    static double qd[NX], ref[NY], dyd[NY], gref[NX];
    fill(qkv, NX, 1.0f), fill(dyv, NY, 1.0f);
    for (int i = 0; i < NX; i++) qd[i] = qkv[i];
    for (int i = 0; i < NY; i++) dyd[i] = dyv[i];
    ref_attention(qd, ref);
    opf_attention_config ac = {H};
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "attention", &ac, "attn", &op));
    opf_tensor x = wrap(3, (int64_t[]){B, T, 3 * C}, OPF_F32, qkv);
    opf_tensor dy = wrap(3, (int64_t[]){B, T, C}, OPF_F32, dyv);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true};
    opf_op_ctx octx = {0};
    opf_tensor out[1 + OPF_OP_MAX_EXTRA], dx, dxe[OPF_OP_MAX_EXTRA];
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, out));
    double err = 0;
    for (int i = 0; i < NY; i++) err = fmax(err, fabs(((float *)out[0].data[0])[i] - ref[i]));
    CHECK(err < 2e-6, "attention forward vs FP64: max error %g", err);
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, dxe));
    check_fakes(op, &out[0], &dx);
    double worst = 0;
    for (int i = 0; i < NX; i++) {
        double h = 1e-5, keep = qd[i];
        qd[i] = keep + h;
        double lp = attn_loss(qd, dyv);
        qd[i] = keep - h;
        double lm = attn_loss(qd, dyv);
        qd[i] = keep;
        double fd = (lp - lm) / (2 * h), g = ((float *)dx.data[0])[i];
        worst = fmax(worst, fabs(fd - g) / (1 + fabs(fd)));
    }
    CHECK(worst < 1e-5, "attention dqkv vs FP64 finite differences: worst relative error %g", worst);
    ref_attention_bwd(qd, dyd, ref, gref);  /* the analytic reference the bf16 case takes */
    worst = 0;
    for (int i = 0; i < NX; i++)
        worst = fmax(worst, fabs(((float *)dx.data[0])[i] - gref[i]) / (1 + fabs(gref[i])));
    CHECK(worst < 1e-5, "attention dqkv vs the analytic FP64 gradient: worst relative error %g", worst);

    /* the same bits on one thread */
    opf_tensor out1[1 + OPF_OP_MAX_EXTRA];
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    env.requires_grad = false;
    CHECK_OK(ctx, opf_op_forward(op, &env, NULL, out1));
    omp_set_num_threads(nt);
    CHECK(opf_test_same_bytes(&out[0], &out1[0]), "attention: bits depend on the thread count");
    opf_tensor_release(&out1[0]), opf_tensor_release(&out[0]), opf_tensor_release(&dx);

    /* bf16 qkv and dy, fresh values: a bf16 output close to the reference,
     * saved as the bf16 o the fake declares (y its copy), and dqkv within
     * bf16's rounding of the FP64 gradient whose row terms take that saved,
     * rounded o (as the kernels' do) */
    static uint16_t qb[NX], db[NY];
    static double ob[NY];
    fill(qkv, NX, 1.0f), fill(dyv, NY, 1.0f);
    opf_convert(qkv, OPF_F32, qb, OPF_BF16, NX), opf_convert(qb, OPF_BF16, qkv, OPF_F32, NX);
    opf_convert(dyv, OPF_F32, db, OPF_BF16, NY), opf_convert(db, OPF_BF16, dyv, OPF_F32, NY);
    for (int i = 0; i < NX; i++) qd[i] = qkv[i];
    for (int i = 0; i < NY; i++) dyd[i] = dyv[i];
    ref_attention(qd, ref);
    opf_tensor xb = wrap(3, (int64_t[]){B, T, 3 * C}, OPF_BF16, qb);
    opf_tensor dyb = wrap(3, (int64_t[]){B, T, C}, OPF_BF16, db);
    env.x = &xb, env.requires_grad = true;
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, out));
    CHECK(out[0].spec.dtype == OPF_BF16, "attention: bf16 in, %s out", opf_dtype_name(out[0].spec.dtype));
    opf_spec fo[1 + OPF_OP_MAX_EXTRA], faux[OPF_OP_MAX_AUX];
    CHECK_OK(ctx, op->cls->forward_fake(op->fwd_args, fo, faux));
    CHECK(octx.saved[1].spec.dtype == OPF_BF16 && opf_spec_equal(&faux[1], &octx.saved[1].spec),
          "attention: saved o is %s, the fake's %s", opf_dtype_name(octx.saved[1].spec.dtype),
          opf_dtype_name(faux[1].dtype));
    CHECK(opf_test_same_bytes(&out[0], &octx.saved[1]), "attention: y is not a copy of the saved o");
    float yb[NY];
    opf_convert(out[0].data[0], OPF_BF16, yb, OPF_F32, NY);
    err = 0;
    for (int i = 0; i < NY; i++) err = fmax(err, fabs(yb[i] - ref[i])), ob[i] = yb[i];
    CHECK(err < 0.05, "attention bf16 vs FP64: max error %g", err);
    benv.dy = &dyb;
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, dxe));
    CHECK(dx.spec.dtype == OPF_BF16, "attention: bf16 in, %s dx", opf_dtype_name(dx.spec.dtype));
    static float gb[NX];
    opf_convert(dx.data[0], OPF_BF16, gb, OPF_F32, NX);
    ref_attention_bwd(qd, dyd, ob, gref);
    worst = 0;
    for (int i = 0; i < NX; i++)  /* bf16's rounding (half an ulp, 2^-8 relative) and fp32's */
        worst = fmax(worst, fabs(gb[i] - gref[i]) / (0x1p-8 * fabs(gref[i]) + 2e-5));
    CHECK(worst <= 1, "attention bf16 dqkv vs FP64 from the saved o: %g of the bound", worst);
    opf_tensor_release(&out[0]), opf_tensor_release(&dx);

    /* width not divisible by the heads */
    opf_attention_config bad = {3};
    opf_op *op3;
    CHECK_OK(ctx, opf_op_create(ctx, "attention", &bad, "attn3", &op3));
    env.x = &x;
    CHECK_FAILS(ctx, opf_op_forward(op3, &env, NULL, out), OPF_ERR_SHAPE, "attn3", "3 heads");
    opf_op_destroy(op3), opf_op_destroy(op);
}

/* The kernels with qkv, do and dqkv stored as dt (values exact in dt) give
 * the bits of the fp32 storage, dqkv being the fp32 result rounded once;
 * likewise with one of them 16-bit and the others fp32. o stored as dt is
 * the fp32 o rounded once, and the backward from it gives the bits of the
 * fp32 backward from that rounded o (which differ from the unrounded o's). */
static void attention_storage_case(opf_ctx *ctx, opf_dtype dt)
{
    enum { NX = B * T * 3 * C, NY = B * T * C, NL = B * H * T };
    static float qkv[NX], dout[NY], o[NY], lse[NL], o2[NY], lse2[NL], dq[NX], dq2[NX], orw[NY];
    static uint16_t q16[NX], d16[NY], dq16[NX], want16[NX], o16[NY], owant16[NY];
    const opf_dtype F = OPF_F32;
    fill(qkv, NX, 1.0f), fill(dout, NY, 1.0f);
    opf_convert(qkv, OPF_F32, q16, dt, NX), opf_convert(q16, dt, qkv, OPF_F32, NX);
    opf_convert(dout, OPF_F32, d16, dt, NY), opf_convert(d16, dt, dout, OPF_F32, NY);
    const opf_nn_kernels *k = &opf_cpu_nn;
    CHECK_OK(ctx, k->attn_fwd(ctx, qkv, F, o, F, lse, B, T, H, D, dt));
    CHECK_OK(ctx, k->attn_bwd(ctx, qkv, F, o, F, lse, dout, F, dq, F, B, T, H, D, dt));
    opf_convert(dq, OPF_F32, want16, dt, NX);

    CHECK_OK(ctx, k->attn_fwd(ctx, q16, dt, o2, F, lse2, B, T, H, D, dt));
    CHECK(!memcmp(o, o2, sizeof o) && !memcmp(lse, lse2, sizeof lse),
          "attention forward: %s qkv gives other bits than f32", opf_dtype_name(dt));
    CHECK_OK(ctx, k->attn_bwd(ctx, q16, dt, o, F, lse, d16, dt, dq16, dt, B, T, H, D, dt));
    CHECK(!memcmp(dq16, want16, sizeof dq16), "attention backward: %s storage, other bits than "
          "the f32 run rounded", opf_dtype_name(dt));
    CHECK_OK(ctx, k->attn_bwd(ctx, q16, dt, o, F, lse, dout, F, dq2, F, B, T, H, D, dt));
    CHECK(!memcmp(dq, dq2, sizeof dq), "attention backward: %s qkv alone", opf_dtype_name(dt));
    CHECK_OK(ctx, k->attn_bwd(ctx, qkv, F, o, F, lse, d16, dt, dq2, F, B, T, H, D, dt));
    CHECK(!memcmp(dq, dq2, sizeof dq), "attention backward: %s do alone", opf_dtype_name(dt));

    CHECK_OK(ctx, k->attn_fwd(ctx, q16, dt, o16, dt, lse2, B, T, H, D, dt));
    opf_convert(o, OPF_F32, owant16, dt, NY);
    CHECK(!memcmp(o16, owant16, sizeof o16) && !memcmp(lse, lse2, sizeof lse),
          "attention forward: o stored as %s is not the f32 o rounded once", opf_dtype_name(dt));
    opf_convert(o16, dt, orw, OPF_F32, NY);
    CHECK_OK(ctx, k->attn_bwd(ctx, qkv, F, orw, F, lse, dout, F, dq2, F, B, T, H, D, dt));
    CHECK(memcmp(dq, dq2, sizeof dq), "attention backward: o's rounding to %s left dqkv alone",
          opf_dtype_name(dt));
    opf_convert(dq2, OPF_F32, want16, dt, NX);
    CHECK_OK(ctx, k->attn_bwd(ctx, q16, dt, o16, dt, lse, d16, dt, dq16, dt, B, T, H, D, dt));
    CHECK(!memcmp(dq16, want16, sizeof dq16), "attention backward: o stored as %s, other bits "
          "than the f32 run from the rounded o", opf_dtype_name(dt));
}

static void test_attention_storage(opf_ctx *ctx)
{
    attention_storage_case(ctx, OPF_BF16);
    attention_storage_case(ctx, OPF_F16);
    /* a copy past what scratch can hold: refused before any value is read */
    float o[1], lse[1];
    uint16_t q[1];
    CHECK_FAILS(ctx, opf_cpu_nn.attn_fwd(ctx, q, OPF_BF16, o, OPF_F32, lse, 1, 1 << 20, 1, 1 << 12,
                                         OPF_BF16),
                OPF_ERR_NO_MEMORY, "attention", "qkv", "bytes");
}

/* ---- embedding ------------------------------------------------------------------- */

static void test_embedding(opf_ctx *ctx)
{
    opf_embedding_config ec = {V, P, C, OPF_F32};
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "embedding", &ec, "emb", &op));
    float *wte = opf_op_param(op, 0)->value.data[0], *wpe = opf_op_param(op, 1)->value.data[0];
    fill(wte, V * C, 1.0f), fill(wpe, P * C, 1.0f);
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (i * 7 + 3) % V;
    tok[3] = tok[5];  /* a repeated id: its gradient rows add up */
    static float dyv[B * T * C];
    fill(dyv, B * T * C, 1.0f);
    opf_tensor x = wrap(2, (int64_t[]){B, T}, OPF_I32, tok);
    opf_tensor dy = wrap(3, (int64_t[]){B, T, C}, OPF_F32, dyv);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true};
    opf_op_ctx octx = {0};
    opf_tensor out[1 + OPF_OP_MAX_EXTRA], dx, dxe[OPF_OP_MAX_EXTRA];
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, out));
    bool same = true;
    for (int r = 0; r < B * T; r++)
        for (int c = 0; c < C; c++)
            same &= ((float *)out[0].data[0])[r * C + c] ==
                    (float)((double)wte[tok[r] * C + c] + wpe[(r % T) * C + c]);
    CHECK(same, "embedding forward differs from wte[id] + wpe[t]");
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, dxe));
    check_fakes(op, &out[0], &dx);
    double gte[V * C] = {0}, gpe[P * C] = {0}, err = 0;
    for (int r = 0; r < B * T; r++)
        for (int c = 0; c < C; c++) gte[tok[r] * C + c] += dyv[r * C + c], gpe[(r % T) * C + c] += dyv[r * C + c];
    const float *dte = opf_op_param(op, 0)->grad.data[0], *dpe = opf_op_param(op, 1)->grad.data[0];
    for (int i = 0; i < V * C; i++) err = fmax(err, fabs(dte[i] - gte[i]));
    for (int i = 0; i < P * C; i++) err = fmax(err, fabs(dpe[i] - gpe[i]));
    CHECK(err < 1e-5, "embedding gradients vs FP64: max error %g", err);
    opf_tensor_release(&out[0]);

    tok[4] = V;  /* out of the vocabulary */
    env.requires_grad = false;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, NULL, out), OPF_ERR_INVALID_ARG, "token 11", "row 4");
    int32_t longer[P + 1] = {0};
    opf_tensor xl = wrap(1, (int64_t[]){P + 1}, OPF_I32, longer);
    env.x = &xl;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, NULL, out), OPF_ERR_SHAPE, "emb", "9 positions", "8");
    opf_op_destroy(op);
}

/* ---- cross-entropy --------------------------------------------------------------- */

static void test_cross_entropy(opf_ctx *ctx)
{
    enum { R = 6 };
    float xv[R * V];
    double xd[R * V];
    fill(xv, R * V, 2.0f);
    for (int i = 0; i < R * V; i++) xd[i] = xv[i];
    int32_t tgt[R] = {3, 0, -1, 10, 7, 3};
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "cross_entropy", NULL, "xent", &op));
    opf_tensor x = wrap(2, (int64_t[]){R, V}, OPF_F32, xv), t = wrap(1, (int64_t[]){R}, OPF_I32, tgt);
    float g = 1.5f;
    opf_tensor dy = wrap(1, (int64_t[]){1}, OPF_F32, &g);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true, .extra_in = {&t}};
    opf_op_ctx octx = {0};
    opf_tensor out[1 + OPF_OP_MAX_EXTRA], dx, dxe[OPF_OP_MAX_EXTRA];
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, out));
    double want = ref_xent(xd, tgt, R), got = *(float *)out[0].data[0];
    CHECK(fabs(got - want) < 1e-6 * (1 + want), "cross-entropy %.9g vs FP64 %.9g", got, want);
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, dxe));
    check_fakes(op, &out[0], &dx);
    double worst = 0;
    for (int i = 0; i < R * V; i++) {
        double h = 1e-6, keep = xd[i];
        xd[i] = keep + h;
        double lp = ref_xent(xd, tgt, R);
        xd[i] = keep - h;
        double lm = ref_xent(xd, tgt, R);
        xd[i] = keep;
        worst = fmax(worst, fabs(g * (lp - lm) / (2 * h) - ((float *)dx.data[0])[i]));
    }
    CHECK(worst < 1e-6, "cross-entropy dlogits vs FP64 finite differences: worst error %g", worst);
    CHECK(dxe[0].data[0] == NULL, "cross-entropy: the targets got a gradient");
    opf_tensor_release(&out[0]), opf_tensor_release(&dx);

    opf_tensor t5 = wrap(1, (int64_t[]){R - 1}, OPF_I32, tgt);
    env.extra_in[0] = &t5;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, NULL, out), OPF_ERR_SHAPE, "xent", "5 targets", "6 rows");
    opf_op_destroy(op);
}

/* ---- gradient-norm clipping --------------------------------------------------------- */

static void test_clip(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, 4, 3, true, OPF_F32, "fc"));
    double want = 0;
    for (int i = 0; i < opf_seq_len(seq); i++) {
        opf_param *p = opf_op_param(opf_seq_at(seq, i), 0);
        float *g = p->grad.data[0];
        for (int64_t k = 0; k < opf_spec_numel(&p->grad.spec); k++) g[k] = (float)(k + i), want += (double)(k + i) * (k + i);
        p->has_grad = true;
    }
    want = sqrt(want);
    double norm;
    CHECK_OK(ctx, opf_clip_grad_norm(ctx, &seq, 1, 1e9, &norm));
    CHECK(norm == want, "grad norm %.17g, want %.17g", norm, want);
    CHECK_OK(ctx, opf_clip_grad_norm(ctx, &seq, 1, 1.0, &norm));
    CHECK_OK(ctx, opf_clip_grad_norm(ctx, &seq, 1, 1e9, &norm));
    CHECK(fabs(norm - 1.0) < 1e-6, "clipped norm %.9g, want 1", norm);
    CHECK_FAILS(ctx, opf_clip_grad_norm(ctx, &seq, 1, 0.0, &norm), OPF_ERR_INVALID_ARG, "max_norm 0");
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx) || opf_nn_register()) return 1;
    CHECK(opf_nn_register() == OPF_OK, "a second registration is a no-op");
    test_attention(ctx);
    test_attention_storage(ctx);
    test_embedding(ctx);
    test_cross_entropy(ctx);
    test_clip(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
