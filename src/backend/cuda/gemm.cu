/* gemm.cu: opf_gemm on the GPU through cuBLASLt (docs/numerics.md 5).
 *
 * opfuse's operands are row-major; cuBLASLt's are column-major. D [M, N]
 * row-major is D^T [N, M] column-major, so cuBLASLt computes
 *   D^T (N x M) = op(A) (N x K) * op(B) (K x M)
 * with A in the first slot. An operand stored [idx, K] (K contiguous: every
 * quantized copy the layout picks, and plain operands whose K is their last
 * dim) is a K x idx column-major matrix: A takes it transposed, B as is.
 * FP8 per-tensor operands are therefore always "TN" for cuBLASLt, the only
 * FP8 layout Hopper runs.
 *
 *   plain f32          fp32 compute (no TF32)
 *   plain bf16 / f16   fp32 compute
 *   FP8 per-tensor     A_SCALE / B_SCALE_POINTER = the copies' scale_inv,
 *                      FAST_ACCUM unless opts->split_accumulator
 *   FP8 block          the same pointers with A_SCALE_MODE / B_SCALE_MODE
 *                      VEC128_32F (1x128) or BLK128x128_32F (128x128 tiles);
 *                      the quantizer's scale layouts are the ones cuBLASLt
 *                      reads; always split accumulation (5.3, 5.4); 2D x 2D
 *                      refused, as cuBLASLt and the CPU GEMM do
 *   MXFP8, NVFP4       no cuBLASLt algorithm on Hopper: each operand's copy is
 *                      decoded to bf16 into scratch, exactly (an e4m3/e5m2
 *                      value times a power of two; an e2m1 value times its
 *                      e4m3 block scale), then the bf16 GEMM. MXFP8 copies
 *                      decode to the operand's own layout; NVFP4 copies are
 *                      stored [idx, K] whichever copy, so the GEMM on them is
 *                      TN, and their global scales enter alpha on the device
 *                      (alpha' = fl(fl(fl(alpha amax_A) amax_B) / (6*448)^2),
 *                      as the CPU: pointer mode DEVICE). A fused kernel
 *                      applying the block scales between wgmma steps (one FP8
 *                      wgmma is K = 32) would save the decode passes (13% of
 *                      the time at 8192^3) and run at the FP8 rate.
 * Epilogue: D = alpha * acc + beta * D_old (accumulate), plus bias[n] (the
 * BIAS epilogue, in D's dtype). Pairs cuBLASLt cannot write (plain f32 into
 * bf16/f16, bf16 into f16...) go through an fp32 D in scratch and a
 * conversion. An FP8 D is the per-tensor quantize kernel run on an fp32
 * result, as on the CPU (cuBLASLt's own FP8 output with D_SCALE/AMAX_D
 * would save that pass: not done yet).
 *
 * The algorithm for a shape comes from cublasLtMatmulAlgoGetHeuristic once
 * and is cached in the context's CUDA state, with the descriptors it was
 * asked for: a later call with the same key sets only the pointers that
 * change from call to call (the scale_inv and bias pointers) and runs, where
 * building and freeing the four descriptors cost about 0.6 us of host time
 * a GEMM. */
#include <string.h>

#include "backend/cuda/cuda-impl.h"

/* What decides the algorithm. Compared bytewise: built with memset first. */
typedef struct algo_key {
    int64_t          m, n, k, lda, ldb, ldd;
    cudaDataType_t   ta, tb, td, tbias;
    cublasOperation_t opa, opb;
    cublasLtEpilogue_t epi;
    int              fast_accum, beta_nonzero;
    int32_t          mode_a, mode_b;  /* cuBLASLt scale modes */
    int              dev_scalars;     /* alpha and beta in device memory */
    int64_t          batch, sa, sb, sd;  /* strided batch (0: one matrix) */
    uint64_t         rows_a, cols_a, rows_b, cols_b;
    int              scaled;          /* scale_inv pointers set (FP8) */
} algo_key;

/* The descriptors of one cuBLASLt call. */
typedef struct lt_descs {
    cublasLtMatmulDesc_t   op;
    cublasLtMatrixLayout_t a, b, d;
} lt_descs;

struct opf_cuda_algo_entry {
    algo_key                key;
    cublasLtMatmulAlgo_t    algo;
    lt_descs                descs;  /* owned; the pointers of the last call */
};

/* One operand in cuBLASLt terms. */
typedef struct lt_operand {
    const void       *p;
    cudaDataType_t    type;
    cublasOperation_t op;
    uint64_t          rows, cols;  /* the stored column-major matrix */
    int64_t           ld;
    const float      *scale;       /* FP8: device scale_inv; else NULL */
    int32_t           mode;        /* FP8: cublasLtMatmulMatrixScale_t */
} lt_operand;

static cudaDataType_t plain_type(opf_dtype dt)
{
    return dt == OPF_BF16 ? CUDA_R_16BF : dt == OPF_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* first: A's slot (needs op(X) = idx x K), else B's (op(X) = K x idx). */
static void make_operand(const opf_tensor *t, bool rowwise, bool kmajor, int64_t idx, int64_t K,
                         bool first, lt_operand *o)
{
    memset(o, 0, sizeof *o);
    if (t->spec.scaling == OPF_SCALING_NONE) {
        o->p = t->data[OPF_COMP_DATA];
        o->type = plain_type(t->spec.dtype);
    } else {  /* FP8 per-tensor or block: both copies are stored [idx, K] */
        o->p = t->data[rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
        o->type = t->spec.qdtype == OPF_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
        o->scale = (const float *)t->data[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV];
        o->mode = t->spec.scaling == OPF_SCALING_BLOCK_1D ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                  : t->spec.scaling == OPF_SCALING_BLOCK_2D ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                            : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
        kmajor = true;
    }
    o->rows = (uint64_t)(kmajor ? K : idx);
    o->cols = (uint64_t)(kmajor ? idx : K);
    o->ld = kmajor ? K : idx;
    o->op = kmajor == first ? CUBLAS_OP_T : CUBLAS_OP_N;
}

/* ---- bias in the epilogue's dtype ---------------------------------------- */

template <typename S, typename D> __global__ void convert_kernel(const S *x, int64_t n, D *y)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (D)opf_dev_widen<S>(x[i]);
}

template <typename S>
static void launch_convert(cudaStream_t st, const void *x, int64_t n, opf_dtype to, void *y)
{
    unsigned grid = (unsigned)((n + 255) / 256);
    if (to == OPF_BF16) convert_kernel<S, __nv_bfloat16><<<grid, 256, 0, st>>>((const S *)x, n, (__nv_bfloat16 *)y);
    else if (to == OPF_F16) convert_kernel<S, __half><<<grid, 256, 0, st>>>((const S *)x, n, (__half *)y);
    else convert_kernel<S, float><<<grid, 256, 0, st>>>((const S *)x, n, (float *)y);
}

static void launch_convert_any(cudaStream_t st, const void *x, opf_dtype from, int64_t n,
                               opf_dtype to, void *y)
{
    if (from == OPF_BF16) launch_convert<__nv_bfloat16>(st, x, n, to, y);
    else if (from == OPF_F16) launch_convert<__half>(st, x, n, to, y);
    else launch_convert<float>(st, x, n, to, y);
}

/* The bias as dtype `to`; the caller's memory when it already is. */
static opf_status bias_as(opf_ctx *ctx, opf_cuda_state *s, const opf_tensor *bias, int64_t n,
                          opf_dtype to, void *scratch, const void **out)
{
    opf_dtype from = bias->spec.dtype;
    if (from == to) {
        *out = bias->data[OPF_COMP_DATA];
        return OPF_OK;
    }
    launch_convert_any(s->stream, bias->data[OPF_COMP_DATA], from, n, to, scratch);
    OPF_CUDA_LAUNCHED(ctx, "gemm (bias conversion)");
    *out = scratch;
    return OPF_OK;
}

/* ---- cuBLASLt ------------------------------------------------------------ */

typedef struct lt_call {
    lt_operand  a, b;
    void       *d;
    cudaDataType_t td;
    int64_t     m, n, k;     /* cuBLASLt's: N, M, K of opfuse */
    float       alpha, beta;
    const void *bias;
    cudaDataType_t tbias;
    bool        fast_accum;
    const float *dev_ab;     /* NULL, or alpha and beta on the device (NVFP4) */
    int64_t     batch;       /* > 1: that many matrices, ... */
    int64_t     sa, sb, sd;  /* ... each operand's elements apart */
} lt_call;

static algo_key key_of(const lt_call *c, cublasLtEpilogue_t epi)
{
    algo_key k;
    memset(&k, 0, sizeof k);
    k.m = c->m, k.n = c->n, k.k = c->k;
    k.lda = c->a.ld, k.ldb = c->b.ld, k.ldd = c->m;
    k.ta = c->a.type, k.tb = c->b.type, k.td = c->td, k.tbias = c->tbias;
    k.opa = c->a.op, k.opb = c->b.op, k.epi = epi;
    k.fast_accum = c->fast_accum, k.beta_nonzero = c->beta != 0.0f;
    k.mode_a = c->a.mode, k.mode_b = c->b.mode;
    k.dev_scalars = c->dev_ab != NULL;
    if (c->batch > 1) k.batch = c->batch, k.sa = c->sa, k.sb = c->sb, k.sd = c->sd;
    k.rows_a = c->a.rows, k.cols_a = c->a.cols, k.rows_b = c->b.rows, k.cols_b = c->b.cols;
    k.scaled = c->a.scale != NULL;
    return k;
}

static opf_cuda_algo_entry *cached(const opf_cuda_state *s, const algo_key *k)
{
    for (int i = 0; i < s->n_algos; i++)
        if (!memcmp(&s->algos[i].key, k, sizeof *k)) return &s->algos[i];
    return NULL;
}

static void descs_destroy(lt_descs *x)
{
    if (x->d) cublasLtMatrixLayoutDestroy(x->d);
    if (x->b) cublasLtMatrixLayoutDestroy(x->b);
    if (x->a) cublasLtMatrixLayoutDestroy(x->a);
    if (x->op) cublasLtMatmulDescDestroy(x->op);
    memset(x, 0, sizeof *x);
}

/* Empties the cache, freeing its descriptors (cuda-impl.h). */
void opf_cuda_algo_cache_clear(opf_cuda_state *s)
{
    for (int i = 0; i < s->n_algos; i++) descs_destroy(&s->algos[i].descs);
    s->n_algos = 0;
}

/* The entry takes x's descriptors (x is left empty). */
static opf_status cache_algo(opf_ctx *ctx, opf_cuda_state *s, const algo_key *k,
                             const cublasLtMatmulAlgo_t *algo, lt_descs *x)
{
    if (s->n_algos == s->cap_algos) {
        int nc = s->cap_algos ? s->cap_algos * 2 : 32;
        opf_cuda_algo_entry *p =
            (opf_cuda_algo_entry *)realloc(s->algos, (size_t)nc * sizeof *p);
        if (!p) return opf_error(ctx, OPF_ERR_NO_MEMORY, "gemm: out of host memory");
        s->algos = p;
        s->cap_algos = nc;
    }
    s->algos[s->n_algos].key = *k;
    s->algos[s->n_algos].algo = *algo;
    s->algos[s->n_algos++].descs = *x;
    memset(x, 0, sizeof *x);
    return OPF_OK;
}

#define SET_ATTR(ctx, desc, attr, val) \
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatmulDescSetAttribute(desc, attr, &(val), sizeof(val)))

static opf_status descs_make(opf_ctx *ctx, const lt_call *c, cublasLtEpilogue_t epi, lt_descs *x)
{
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatmulDescCreate(&x->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_TRANSA, c->a.op);
    SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_TRANSB, c->b.op);
    if (c->a.scale) {
        int8_t fast = c->fast_accum ? 1 : 0;
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, c->a.scale);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, c->b.scale);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    }
    if (c->a.mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, c->a.mode);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, c->b.mode);
    }
    if (c->dev_ab) {
        cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_POINTER_MODE, pm);
    }
    if (c->bias) {
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c->bias);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, c->tbias);
    }
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatrixLayoutCreate(&x->a, c->a.type, c->a.rows, c->a.cols, c->a.ld));
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatrixLayoutCreate(&x->b, c->b.type, c->b.rows, c->b.cols, c->b.ld));
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatrixLayoutCreate(&x->d, c->td, (uint64_t)c->m, (uint64_t)c->n, c->m));
    if (c->batch > 1) {
        int32_t n = (int32_t)c->batch;
        cublasLtMatrixLayout_t L[3] = {x->a, x->b, x->d};
        int64_t stride[3] = {c->sa, c->sb, c->sd};
        for (int i = 0; i < 3; i++) {
            OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatrixLayoutSetAttribute(
                L[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
            OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatrixLayoutSetAttribute(
                L[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride[i], sizeof stride[i]));
        }
    }
    return OPF_OK;
}

/* The heuristic's algorithm for x's descriptors, cached under k with them. */
static opf_status pick_algo(opf_ctx *ctx, opf_cuda_state *s, lt_descs *x, const algo_key *k,
                            opf_cuda_algo_entry **out)
{
    cublasLtMatmulPreference_t pref;
    OPF_CUBLAS_TRY(ctx, "gemm", cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = s->lt_ws_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof ws);
    cublasLtMatmulHeuristicResult_t r;
    int found = 0;
    cublasStatus_t e = cublasLtMatmulAlgoGetHeuristic(s->lt, x->op, x->a, x->b, x->d, x->d, pref,
                                                      1, &r, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (e != CUBLAS_STATUS_SUCCESS || found == 0)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "gemm: cuBLASLt has no algorithm for M=%lld "
                         "N=%lld K=%lld with A type %d, B type %d, D type %d, scale modes %d x %d "
                         "(%s)", (long long)k->n, (long long)k->m, (long long)k->k, (int)k->ta,
                         (int)k->tb, (int)k->td, (int)k->mode_a, (int)k->mode_b,
                         e != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(e) : "none found");
    opf_status st = cache_algo(ctx, s, k, &r.algo, x);
    if (st) return st;
    *out = &s->algos[s->n_algos - 1];
    return OPF_OK;
}

/* A cached entry's per-call pointers: the scale_inv and bias pointers. */
static opf_status descs_point(opf_ctx *ctx, const lt_call *c, lt_descs *x)
{
    if (c->a.scale) {
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, c->a.scale);
        SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, c->b.scale);
    }
    if (c->bias) SET_ATTR(ctx, x->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c->bias);
    return OPF_OK;
}

static opf_status run_lt_epi(opf_ctx *ctx, opf_cuda_state *s, const lt_call *c,
                             cublasLtEpilogue_t epi)
{
    algo_key k = key_of(c, epi);
    opf_cuda_algo_entry *en = cached(s, &k);
    opf_status st;
    if (en) {
        st = descs_point(ctx, c, &en->descs);
    } else {
        lt_descs x;
        memset(&x, 0, sizeof x);
        st = descs_make(ctx, c, epi, &x);
        if (st == OPF_OK) st = pick_algo(ctx, s, &x, &k, &en);
        descs_destroy(&x);  /* what the cache did not take */
    }
    if (st) return st;
    const float *alpha = c->dev_ab ? c->dev_ab : &c->alpha;
    const float *beta = c->dev_ab ? c->dev_ab + 1 : &c->beta;
    const lt_descs *x = &en->descs;
    cublasStatus_t e = cublasLtMatmul(s->lt, x->op, alpha, c->a.p, x->a, c->b.p, x->b, beta, c->d,
                                      x->d, c->d, x->d, &en->algo, s->lt_ws, s->lt_ws_bytes,
                                      s->stream);
    return e == CUBLAS_STATUS_SUCCESS ? OPF_OK : opf_cublas_fail(ctx, e, "gemm", "cublasLtMatmul");
}

/* d[r, j] += bias[j] in fp32 over a column-major [ld = m] x n cuBLASLt D. */
__global__ void add_bias_f32_kernel(float *d, const float *bias, int64_t m, int64_t n)
{
    int64_t total = m * n, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride)
        d[i] = __fadd_rn(d[i], bias[i % m]);
}

static bool is_fp8_type(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

/* cuBLASLt's epilogue takes no fp32 bias for FP8 operands with an fp32 D (it
 * wants bf16, which would round the bias): there the GEMM runs without the
 * epilogue and the same fp32 add follows, decided up front so no call asks
 * the heuristic for an algorithm that does not exist. */
static opf_status run_lt(opf_ctx *ctx, opf_cuda_state *s, const lt_call *c)
{
    if (!c->bias) return run_lt_epi(ctx, s, c, CUBLASLT_EPILOGUE_DEFAULT);
    if (!(is_fp8_type(c->a.type) && c->td == CUDA_R_32F))
        return run_lt_epi(ctx, s, c, CUBLASLT_EPILOGUE_BIAS);
    lt_call plain = *c;
    plain.bias = NULL;
    opf_status st = run_lt_epi(ctx, s, &plain, CUBLASLT_EPILOGUE_DEFAULT);
    if (st) return st;
    add_bias_f32_kernel<<<opf_cuda_grid(s, c->m * c->n, 256), 256, 0, s->stream>>>(
        (float *)c->d, (const float *)c->bias, c->m, c->n);
    OPF_CUDA_LAUNCHED(ctx, "gemm (bias after the GEMM)");
    return OPF_OK;
}

/* ---- the entry ----------------------------------------------------------- */

static opf_status check_formats(opf_ctx *ctx, const opf_gemm_args *g)
{
    opf_scaling sc = g->a->spec.scaling;
    if (sc == OPF_SCALING_BLOCK_2D && g->b->spec.scaling == OPF_SCALING_BLOCK_2D)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "gemm (cuda): A and B are both %s (128x128 "
                         "tiles); cuBLASLt has no 2D x 2D block GEMM, quantize one operand in 1D "
                         "blocks", opf_scaling_name(sc));
    if (sc == OPF_SCALING_NONE && g->a->spec.dtype != g->b->spec.dtype)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "gemm (cuda): plain A is %s and B is %s; the "
                         "GPU GEMM takes one dtype", opf_dtype_name(g->a->spec.dtype),
                         opf_dtype_name(g->b->spec.dtype));
    return OPF_OK;
}

static opf_status quantize_d(opf_ctx *ctx, const opf_gemm_args *g, float *y)
{
    opf_tensor in;
    memset(&in, 0, sizeof in);
    int64_t shape[2] = {g->m, g->n};
    in.spec = opf_spec_make(2, shape, OPF_F32);
    in.spec.device = OPF_DEVICE_CUDA;
    in.data[OPF_COMP_DATA] = y;
    opf_tensor out = *g->d;
    out.spec.dtype = OPF_F32;
    return opf_cuda_quantize_tensor_fp8(ctx, g->opts->out_quantizer, &in, &out, &g->out_state);
}

static bool is_nvfp4(const opf_tensor *t)
{
    return t->spec.scaling == OPF_SCALING_NVFP4_1D || t->spec.scaling == OPF_SCALING_NVFP4_2D;
}

/* Operands cuBLASLt cannot multiply on Hopper: decoded to bf16 first. */
static bool decoded(const opf_tensor *t)
{
    return t->spec.scaling == OPF_SCALING_MXFP8 || is_nvfp4(t);
}

/* Whether cuBLASLt writes D's dtype straight from these operands: plain
 * operands (decoded ones are bf16) only into their own dtype or fp32 (f32
 * into f32 only). */
static bool direct_output(const opf_gemm_args *g)
{
    opf_dtype in = decoded(g->a) ? OPF_BF16 : g->a->spec.dtype, out = g->d->spec.dtype;
    if (g->opts->out_quantizer) return false;
    if (g->a->spec.scaling != OPF_SCALING_NONE && !decoded(g->a)) return true;
    return in == out || (out == OPF_F32 && in != OPF_F32);
}

/* Runs cuBLASLt into D, or into the fp32 y (then D_old goes in first and
 * the result is converted back, or quantized for an FP8 D). */
static opf_status gemm_into(opf_ctx *ctx, opf_cuda_state *s, const opf_gemm_args *g, bool direct,
                            const float *dev_ab, float *y, void *bias_buf)
{
    const opf_gemm_options *o = g->opts;
    opf_dtype dt = direct ? g->d->spec.dtype : OPF_F32;
    lt_call c;
    memset(&c, 0, sizeof c);
    bool a_row = g->layout == OPF_GEMM_TN, b_row = g->layout != OPF_GEMM_NT;  /* 5.1 */
    make_operand(g->a, a_row, a_row, g->n, g->k, true, &c.a);
    make_operand(g->b, b_row, b_row, g->m, g->k, false, &c.b);
    c.d = direct ? g->d->data[OPF_COMP_DATA] : (void *)y;
    c.td = plain_type(dt);
    c.m = g->n, c.n = g->m, c.k = g->k;
    c.alpha = o->alpha;
    c.beta = o->accumulate ? o->beta : 0.0f;
    c.dev_ab = dev_ab;
    /* block scaling always accumulates split (5.4) */
    c.fast_accum = !o->split_accumulator && c.a.mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    opf_status st;
    if (o->bias) {
        c.tbias = c.td;
        if ((st = bias_as(ctx, s, o->bias, g->n, dt, bias_buf, &c.bias))) return st;
    }
    int64_t mn = g->m * g->n;
    if (!direct && o->accumulate) {
        launch_convert_any(s->stream, g->d->data[OPF_COMP_DATA], g->d->spec.dtype, mn, OPF_F32, y);
        OPF_CUDA_LAUNCHED(ctx, "gemm (D to fp32)");
    }
    if ((st = run_lt(ctx, s, &c))) return st;
    if (direct || o->out_quantizer) return OPF_OK;
    launch_convert_any(s->stream, y, OPF_F32, mn, g->d->spec.dtype, g->d->data[OPF_COMP_DATA]);
    OPF_CUDA_LAUNCHED(ctx, "gemm (fp32 to D)");
    return OPF_OK;
}


/* Copy `rowwise` of t (the slot's idx x K operand) decoded to bf16 at buf,
 * as the plain tensor *out: MXFP8 in t's logical layout, NVFP4 as stored,
 * [idx, K]. */
static opf_status decode_operand(opf_ctx *ctx, const opf_tensor *t, bool rowwise, int64_t idx,
                                 int64_t K, void *buf, opf_tensor *out)
{
    unsigned which = rowwise ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
    int64_t stored[2] = {idx, K};
    memset(out, 0, sizeof *out);
    out->spec = is_nvfp4(t) ? opf_spec_make(2, stored, OPF_BF16)
                            : opf_spec_make(t->spec.ndim, t->spec.shape, OPF_BF16);
    out->spec.device = OPF_DEVICE_CUDA;
    out->data[OPF_COMP_DATA] = buf;
    return is_nvfp4(t) ? opf_cuda_dequantize_nvfp4_bf16(ctx, t, which, buf)
                       : opf_cuda_dequantize_mxfp8_bf16(ctx, t, which, buf);
}

/* ab = {fl(fl(fl(alpha * amax_a) * amax_b) * fl32(1/7225344)), beta}: the
 * NVFP4 alpha of numerics.md 5.3 from the copies' amaxes, on the device. */
__global__ void nvfp4_alpha_kernel(const float *amax_a, const float *amax_b, float alpha,
                                   float beta, float *ab)
{
    ab[0] = __fmul_rn(__fmul_rn(__fmul_rn(alpha, *amax_a), *amax_b), __uint_as_float(0x34149B93u));
    ab[1] = beta;
}

/* MXFP8 / NVFP4: both operands decoded into scratch (a_bytes, then B) and
 * g re-pointed at them; NVFP4 also gets its device alpha at *dev_ab. */
static opf_status decode_operands(opf_ctx *ctx, opf_cuda_state *s, const opf_gemm_args *g_in,
                                  opf_gemm_args *g, opf_tensor *pa, opf_tensor *pb, char *scratch,
                                  size_t a_bytes, size_t b_bytes, float **dev_ab)
{
    bool a_row = g_in->layout == OPF_GEMM_TN, b_row = g_in->layout != OPF_GEMM_NT;  /* 5.1 */
    opf_status st;
    if ((st = decode_operand(ctx, g_in->a, a_row, g_in->n, g_in->k, scratch, pa)) ||
        (st = decode_operand(ctx, g_in->b, b_row, g_in->m, g_in->k, scratch + a_bytes, pb)))
        return st;
    g->a = pa, g->b = pb;
    if (!is_nvfp4(g_in->a)) return OPF_OK;
    g->layout = OPF_GEMM_TN;
    *dev_ab = (float *)(scratch + a_bytes + b_bytes);
    const opf_gemm_options *o = g_in->opts;
    nvfp4_alpha_kernel<<<1, 1, 0, s->stream>>>(
        (const float *)g_in->a->data[a_row ? OPF_COMP_AMAX : OPF_COMP_COL_AMAX],
        (const float *)g_in->b->data[b_row ? OPF_COMP_AMAX : OPF_COMP_COL_AMAX], o->alpha,
        o->accumulate ? o->beta : 0.0f, *dev_ab);
    OPF_CUDA_LAUNCHED(ctx, "gemm (nvfp4 alpha)");
    return OPF_OK;
}

extern "C" opf_status opf_cuda_gemm(opf_ctx *ctx, const opf_gemm_args *g_in)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "gemm (cuda)");
    if (!s) return OPF_ERR_STATE;
    opf_status st = check_formats(ctx, g_in);
    if (st) return st;
    /* scratch: the bf16 operands of an MXFP8 / NVFP4 GEMM and NVFP4's alpha,
     * an fp32 D when cuBLASLt cannot write D itself, then the bias */
    bool dq = decoded(g_in->a);
    size_t a_bytes = dq ? opf_cuda_pad256((size_t)(g_in->n * g_in->k) * 2) : 0;
    size_t b_bytes = dq ? opf_cuda_pad256((size_t)(g_in->m * g_in->k) * 2) : 0;
    size_t ab_bytes = dq ? 256 : 0;
    opf_gemm_args gm = *g_in;
    const opf_gemm_args *g = &gm;
    bool direct = direct_output(g), fp8_out = g->opts->out_quantizer != NULL;
    size_t y_pad = direct ? 0 : opf_cuda_pad256((size_t)(g->m * g->n) * sizeof(float));
    void *scratch = NULL;
    if ((st = opf_cuda_scratch(ctx, s, a_bytes + b_bytes + ab_bytes + y_pad +
                                       (size_t)g->n * sizeof(float) + 256, &scratch)))
        return st;
    opf_tensor pa, pb;
    float *dev_ab = NULL;
    if (dq) {
        if ((st = decode_operands(ctx, s, g_in, &gm, &pa, &pb, (char *)scratch, a_bytes, b_bytes,
                                  &dev_ab)))
            return st;
        scratch = (char *)scratch + a_bytes + b_bytes + ab_bytes;
    }
    float *y = (float *)scratch;
    if (g->m != 0 && g->n != 0 &&
        (st = gemm_into(ctx, s, g, direct, dev_ab, y, (char *)scratch + y_pad)))
        return st;
    return fp8_out ? quantize_d(ctx, g, y) : OPF_OK;
}

opf_status opf_cuda_sgemm_batched(opf_ctx *ctx, opf_cuda_state *s, bool ta, bool tb, int64_t m,
                                  int64_t n, int64_t k, float alpha, const float *A, int64_t lda,
                                  int64_t sa, const float *B, int64_t ldb, int64_t sb, float *D,
                                  int64_t sd, int64_t batch)
{
    if (batch > INT32_MAX)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "batched gemm: %lld matrices (at most %d)",
                         (long long)batch, INT32_MAX);
    lt_call c;
    memset(&c, 0, sizeof c);
    c.a = {A, CUDA_R_32F, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (uint64_t)(ta ? k : m),
           (uint64_t)(ta ? m : k), lda, NULL, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
    c.b = {B, CUDA_R_32F, tb ? CUBLAS_OP_T : CUBLAS_OP_N, (uint64_t)(tb ? n : k),
           (uint64_t)(tb ? k : n), ldb, NULL, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F};
    c.d = D, c.td = CUDA_R_32F, c.m = m, c.n = n, c.k = k, c.alpha = alpha, c.beta = 0.0f;
    c.batch = batch, c.sa = sa, c.sb = sb, c.sd = sd;
    return run_lt(ctx, s, &c);
}

extern "C" void opf_cuda_gemm_clear_cache(opf_ctx *ctx)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "opf_cuda_gemm_clear_cache");
    if (s) opf_cuda_algo_cache_clear(s);
}
