/* test_dbias_q.c: the CPU's dbias_q entry (src/backend/elem.h), the bias's
 * backward with dx in the previous op's format, against its definition on
 * fresh random inputs: db byte for byte dbias's, and dx byte for byte what
 * opf_quantize makes of dy with the same quantizer (the bits a BasicLinear
 * got when it quantized dy itself), for the grad-output quantizer of every
 * recipe (NVFP4 without stochastic rounding, which the entry leaves to the
 * dispatcher) and every input dtype; delayed scaling's amax recorded once,
 * as opf_quantize records it. Also dy in a dtype other than hp (rounded to
 * hp first) and a plain dx (dy cast, or nothing when dx is dy). */
#include "backend/backend-impl.h"
#include "op/op-impl.h"
#include "op_cases.h"

static const opf_elem_kernels *K(void) { return opf_backend_get(OPF_DEVICE_CPU)->elem; }

/* Rows not a multiple of 32 (the lane sums' classes; MXFP8 rounds them up
 * to its 32), and a shape the kernels split over threads. */
static const int64_t shapes[][2] = {{48, 160}, {272, 256}};

/* The grad-output quantizer of recipe rk with its own delayed state. */
static opf_quantizer grad_q(opf_ctx *ctx, opf_recipe_kind rk, opf_delayed_state **ds)
{
    opf_recipe r = recipe_of(rk);
    opf_quantizer q;
    CHECK_OK(ctx, role_quantizer(ctx, &r, OPF_ROLE_GRAD_OUTPUT, &q, ds));
    q.stochastic = false;
    return q;
}

/* An output tensor of q's format for dy's shape. */
static opf_tensor q_out(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *dy)
{
    opf_spec s;
    opf_tensor t;
    CHECK_OK(ctx, opf_quantizer_spec(q, &dy->spec, &s));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

static opf_tensor zeros(opf_ctx *ctx, int64_t n, opf_dtype dt)
{
    opf_spec s = opf_spec_make(1, &n, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

/* After one quantization each: the two delayed states agree (history and
 * scale) once updated. */
static void same_delayed(opf_ctx *ctx, opf_delayed_state *a, opf_delayed_state *b, const char *w)
{
    if (!a) return;
    CHECK_OK(ctx, opf_delayed_state_update(ctx, a, NULL, NULL));
    CHECK_OK(ctx, opf_delayed_state_update(ctx, b, NULL, NULL));
    int n = opf_delayed_state_history_len(a);
    CHECK(!memcmp(opf_delayed_state_history(a), opf_delayed_state_history(b), sizeof(float) * (size_t)n) &&
              !memcmp(opf_delayed_state_scale(a), opf_delayed_state_scale(b), sizeof(float)),
          "%s: the delayed state differs from one opf_quantize's", w);
}

/* dy [rows, cols] of dtype dt (values within +-2, or tiny ones with
 * power-of-2 scales off: FP8 block scaling's value for an infinite scale
 * is the input dtype's largest, so widening a bf16 dy to f32 would change
 * it), quantized with hp = act (opf_op_qout's rule: f32 for delayed), db
 * in db_dt. */
static void q_case(opf_ctx *ctx, opf_recipe_kind rk, opf_dtype dt, opf_dtype act, opf_dtype db_dt,
                   int si, bool tiny, unsigned long long *s)
{
    int64_t rows = shapes[si][0], cols = shapes[si][1];
    if (rk == OPF_RECIPE_MXFP8) rows = (rows + 31) / 32 * 32;
    char w[160];
    snprintf(w, sizeof w, "dbias_q %s dy %s hp-from %s db %s [%lld, %lld]%s", opf_recipe_name(rk),
             opf_dtype_name(dt), opf_dtype_name(act), opf_dtype_name(db_dt), (long long)rows,
             (long long)cols, tiny ? " tiny" : "");
    opf_delayed_state *ds_ref, *ds;
    opf_quantizer q_ref = grad_q(ctx, rk, &ds_ref), q = grad_q(ctx, rk, &ds);
    if (tiny) q_ref.pow2_scales = q.pow2_scales = false;  /* else both maxima give 2^127 */
    float lim = tiny ? 1e-38f : 2.0f;
    opf_tensor dy = rand_tensor(ctx, s, 2, (int64_t[]){rows, cols}, dt, -lim, lim);
    opf_tensor db_ref = zeros(ctx, cols, db_dt), db = zeros(ctx, cols, db_dt);
    opf_tensor dx_ref = q_out(ctx, &q_ref, &dy), dx = q_out(ctx, &q, &dy), hp_dy;
    memset(&hp_dy, 0, sizeof hp_dy);
    /* the reference: dbias, and opf_quantize of dy's values in hp */
    CHECK_OK(ctx, K()->dbias(ctx, &dy, &db_ref));
    opf_quantize_state qs;
    opf_qout o;
    CHECK(opf_op_qout(&q, act, &dx, &qs, &o), "%s: the op would not use the entry", w);
    const opf_tensor *src = &dy;
    if (!opf_qout_reads_as_is(&o, dt)) {
        opf_spec hs = opf_spec_make(2, (int64_t[]){rows, cols}, o.hp);
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &hs, &hp_dy));
        CHECK_OK(ctx, K()->cast(ctx, &dy, &hp_dy));
        src = &hp_dy;
    }
    dx_ref.spec.dtype = src->spec.dtype;  /* the logical dtype; the same layout */
    CHECK_OK(ctx, opf_quantize(ctx, &q_ref, src, &dx_ref));
    CHECK_OK(ctx, K()->dbias_q(ctx, &dy, &db, &o));
    CHECK(opf_test_same_bytes(&db, &db_ref), "%s: db differs from dbias's", w);
    CHECK(opf_test_same_qbytes(&dx, &dx_ref), "%s: dx differs from opf_quantize's", w);
    same_delayed(ctx, ds, ds_ref, w);
    opf_tensor *ts[] = {&dy, &db_ref, &db, &dx_ref, &dx, &hp_dy};
    for (int i = 0; i < 6; i++) opf_tensor_release(ts[i]);
    opf_delayed_state_destroy(ds_ref), opf_delayed_state_destroy(ds);
}

static void test_recipes(opf_ctx *ctx)
{
    unsigned long long s = 0xDB1A5ull;
    for (int k = 1; k < NREC; k++)
        for (int d = 0; d < NDT; d++)
            for (int si = 0; si < 2; si++) {
                q_case(ctx, recipes[k], dtypes[d], dtypes[d], dtypes[d], si, false, &s);
                q_case(ctx, recipes[k], dtypes[d], dtypes[d], OPF_F32, si, true, &s);
            }
    /* hp other than dy's dtype: f32 dy rounded to bf16 first; bf16 dy with
     * an f32 hp (taken as it is for the per-tensor formats) */
    for (int k = 1; k < NREC; k++) {
        q_case(ctx, recipes[k], OPF_F32, OPF_BF16, OPF_F32, 0, false, &s);
        q_case(ctx, recipes[k], OPF_BF16, OPF_F32, OPF_BF16, 1, false, &s);
    }
}

/* A plain dx: dy cast into it; dx = dy itself writes nothing. */
static void test_plain(opf_ctx *ctx)
{
    unsigned long long s = 0x9141ull;
    opf_tensor dy = rand2(ctx, &s, 33, 40, OPF_F32), dx = rand2(ctx, &s, 33, 40, OPF_BF16);
    opf_tensor want = rand2(ctx, &s, 33, 40, OPF_BF16), copy = rand2(ctx, &s, 33, 40, OPF_F32);
    opf_tensor db = zeros(ctx, 40, OPF_F32), db_ref = zeros(ctx, 40, OPF_F32);
    memcpy(copy.data[0], dy.data[0], 33 * 40 * sizeof(float));
    CHECK_OK(ctx, K()->cast(ctx, &dy, &want));
    CHECK_OK(ctx, K()->dbias(ctx, &dy, &db_ref));
    opf_qout o = {&dx, NULL, NULL, OPF_BF16}, self = {&dy, NULL, NULL, OPF_F32};
    CHECK_OK(ctx, K()->dbias_q(ctx, &dy, &db, &o));
    CHECK(opf_test_same_bytes(&dx, &want) && opf_test_same_bytes(&db, &db_ref),
          "dbias_q plain: dx is not dy cast, or db not dbias's");
    CHECK_OK(ctx, K()->dbias_q(ctx, &dy, &db, &self));
    CHECK(opf_test_same_bytes(&dy, &copy), "dbias_q into dy itself changed dy");
    opf_tensor *ts[] = {&dy, &dx, &want, &copy, &db, &db_ref};
    for (int i = 0; i < 6; i++) opf_tensor_release(ts[i]);
}

int main(void)
{
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    test_recipes(ctx);
    test_plain(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
