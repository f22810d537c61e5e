/* norm.cu: LayerNorm, RMSNorm and L2 normalization on the GPU, forward and
 * backward, and the add + RMSNorm backward (backend/norm.h), bit for bit
 * with src/backend/cpu/norm.c.
 *
 * norm.h fixes every sum as a warp's tree: lane l adds the terms j = l,
 * l + 32, ... left to right, then the lanes fold in halves. So each row is
 * one warp. The warp stages its row (and dz's) in shared memory in the
 * input's own dtype (half the bytes of fp32 for bf16: more warps per SM),
 * with 16-byte asynchronous copies when the row allows them, and while it
 * computes one row the copy of its next row is in flight (two buffers when
 * they fit). The sums read the staged row lane-strided (no bank conflicts),
 * widening each value as it is read (and rounding it where the compute
 * dtype is not its own: seen_from); the outputs are written 8 elements a
 * lane, 16 bytes a store. Rows too long for shared memory are
 * read from global memory on every pass instead (the same values, the same
 * order). The all-bf16 call (x, dz, gamma) has kernels of its own with the
 * dtypes as constants, so no dtype branch stands between the loads of a
 * batch of terms.
 *
 * The column sums of dgamma and dbeta are two more kernels: lane class l
 * of a column holds the rows r = l mod 32 in order, as the CPU's; one
 * thread per (column or column pair, class) walks its rows, a batch of
 * rows' loads in flight before their adds, recomputing y from x, mu and
 * rsigma (cheaper than storing it); the 32 partials of a column go
 * through scratch to a thread that folds them in the header's order. No
 * atomics: every bit is fixed. Loads whose values are widened only after
 * the whole batch is loaded keep the mixed-dtype calls as fast.
 *
 * Built with -fmad=false (CMakeLists.txt) and IEEE division and square root,
 * so each operation rounds once as on the CPU. A NaN in a row makes that
 * row's outputs NaN on both devices; which NaN bits is each hardware's
 * own (the tests compare NaN with NaN).
 *
 * The device code is in norm.cuh, apart from the column sums of mixed
 * dtypes (col_kernel, fold_kernel, below); the column sums of plain x and
 * dz are compiled in norm_cols_<d>.cu, one translation unit a dtype, and
 * the backward of a few hundred bf16 rows in one launch in
 * norm_bwd_one.cu. */
#include "backend/cuda/norm.cuh"

/* ---- dgamma / dbeta ------------------------------------------------------
 * Thread (columns c .. c + CP - 1, class l) sums the terms of its columns
 * over the rows r = l, l + 32, ... in order: the class's partials. A warp
 * is 32 * CP consecutive columns of one class, a block COL_WARPS classes,
 * so the H x 32 chains spread over every SM (a block of all 32 classes
 * held the grid to H / 32 blocks). Each thread loads the bits of a batch
 * of rows (x and dz) before it widens any, so the batch's loads are in
 * flight together for any dtypes; the batch's mu and rsigma come one row
 * a lane and go round by shuffles. The partials go through scratch
 * ([sums][32][H]) to fold_kernel. */
template <bool LN, int CP>
__global__ void __launch_bounds__(COL_WARPS *LANES) col_kernel(norm_args a, float *part)
{
    constexpr int B = LANES / CP;  /* rows a batch: 32 elements of x and of dz in flight */
    int lane = threadIdx.x % LANES, l = (int)blockIdx.y * COL_WARPS + (int)threadIdx.x / LANES;
    int64_t H = a.H, c = ((int64_t)blockIdx.x * LANES + lane) * CP;
    bool in = c < H;  /* with CP = 2 H is even: c + 1 < H too */
    float ag[CP] = {}, ab[CP] = {};
    for (int64_t r0 = l; r0 < a.rows; r0 += B * LANES) {
        int n = (int)min((int64_t)B, (a.rows - r0 + LANES - 1) / LANES);  /* rows of the batch */
        uint32_t xb[B][CP], db[B][CP];
#pragma unroll
        for (int u = 0; u < B; u++)
            if (u < n && in) {
                int64_t i = (r0 + (int64_t)u * LANES) * H + c;
                ld_bits_n<CP>(a.x, a.xt, i, xb[u]);
                ld_bits_n<CP>(a.dz, a.dzt, i, db[u]);
            }
        int64_t rl = r0 + (int64_t)lane * LANES;
        float rs_l = lane < n ? a.rs[rl] : 0.0f, mu_l = LN && lane < n ? a.mu[rl] : 0.0f;
#pragma unroll
        for (int u = 0; u < B; u++) {
            if (u >= n) break;  /* n is the warp's */
            float rs = __shfl_sync(0xFFFFFFFFu, rs_l, u), mu = __shfl_sync(0xFFFFFFFFu, mu_l, u);
#pragma unroll
            for (int k = 0; k < CP && in; k++) {
                float x = seen_from(widen_bits(xb[u][k], a.xt), a.xt, a.act);
                float d = seen_from(widen_bits(db[u][k], a.dzt), a.dzt, a.act);
                float y = LN ? rs * (x - mu) : rs * x;
                ag[k] = ag[k] + d * y;
                if (LN) ab[k] = ab[k] + d;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < CP && in; k++) {
        part[l * H + c + k] = ag[k];
        if (LN) part[(LANES + l) * H + c + k] = ab[k];
    }
}

/* The 32 class partials p[0], p[H], ... of a column folded in halves
 * (class i += class i + off, norm.h). */
__device__ __forceinline__ float fold_classes(const float *p, int64_t H)
{
    float v[LANES];
#pragma unroll
    for (int i = 0; i < LANES; i++) v[i] = p[i * H];
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2)
#pragma unroll
        for (int i = 0; i < LANES / 2; i++)
            if (i < off) v[i] = v[i] + v[i + off];
    return v[0];
}

/* One thread a column: dgamma, and dbeta when db, from their partials. */
static __global__ void fold_kernel(const float *part, int64_t H, void *dg, opf_dtype dgt, void *db,
                            opf_dtype dbt)
{
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    st1(dg, dgt, c, fold_classes(part + c, H));
    if (db) st1(db, dbt, c, fold_classes(part + LANES * H + c, H));
}

/* ---- host side ----------------------------------------------------------- */

static bool plain_dtype(opf_dtype t) { return t == OPF_F32 || t == OPF_BF16 || t == OPF_F16; }

/* OPF_ERR_DTYPE naming the entry and the tensor when t is not f32/bf16/f16. */
static opf_status check_dtype(opf_ctx *ctx, const char *fn, const char *what, const opf_tensor *t)
{
    if (!t || plain_dtype(t->spec.dtype)) return OPF_OK;
    return opf_error(ctx, OPF_ERR_DTYPE, "%s: %s is %s, expected f32/bf16/f16", fn, what,
                     opf_dtype_name(t->spec.dtype));
}

static const void *data_of(const opf_tensor *t) { return t ? t->data[0] : NULL; }
static opf_dtype dtype_of(const opf_tensor *t) { return t ? t->spec.dtype : OPF_F32; }

/* The arguments common to every mode: x's rows of H, the compute dtype act,
 * the output, and whether every given tensor allows 16-byte accesses. */
static norm_args args_of(const opf_tensor *x, int64_t H, opf_dtype act, opf_tensor *out)
{
    norm_args a = {};
    a.x = x->data[0];
    a.xt = x->spec.dtype;
    a.act = a.dact = act;
    a.out = out->data[0];
    a.outt = out->spec.dtype;
    a.H = H;
    a.rows = H ? opf_spec_numel(&x->spec) / H : 0;
    a.rn = H ? 1.0f / (float)H : 0.0f;
    return a;
}

/* args_of for LayerNorm / RMSNorm: H and the compute dtype are gamma's. */
static norm_args gamma_args(const opf_tensor *x, const opf_tensor *gamma, bool zero_centered,
                            opf_tensor *out)
{
    norm_args a = args_of(x, gamma->spec.shape[0], gamma->spec.dtype, out);
    a.gamma = gamma->data[0], a.gt = gamma->spec.dtype, a.zc = zero_centered;
    return a;
}

/* The warps a block (1..MAX_WARPS) that fit the most warps on an SM when
 * each stages per_warp bytes, and how many such blocks fit. */
static int block_warps(size_t per_warp, int *blocks_per_sm)
{
    int best = 0, warps = 1;
    for (int w = 1; w <= MAX_WARPS && w * per_warp <= BLOCK_SMEM_MAX; w++) {
        int blocks = (int)(SM_SMEM / (w * per_warp + BLOCK_RESERVED));
        if (blocks > 64 / w) blocks = 64 / w;  /* 2048 threads an SM */
        if (blocks * w >= best) best = blocks * w, warps = w, *blocks_per_sm = blocks;
    }
    return warps;
}

/* Launches the row kernel of mode M over a's rows: rows staged twice (the
 * next in flight) when that fits DOUBLE_MAX and leaves MIN_WARPS warps an
 * SM, once up to CACHE_MAX, else read from global memory; as many warps an
 * SM as the staging allows, and a grid of as many blocks as fit at once
 * (each warp walks several rows). */
template <int M> static opf_status launch_rows(opf_ctx *ctx, opf_cuda_state *s, norm_args a,
                                               const char *fn)
{
    if (a.rows == 0) return OPF_OK;
    a.vec = vec_ok(a);
    a.prefetch = prefetch_ok(a);
    size_t slot = (size_t)row_bytes(a.H, a.xt) + (is_bwd(M) ? (size_t)row_bytes(a.H, a.dzt) : 0);
    int slots = 2 * slot <= DOUBLE_MAX ? 2 : slot <= CACHE_MAX ? 1 : 0;
    int warps = 4, per_sm = 16;
    if (slots) warps = block_warps(slots * slot, &per_sm);
    /* A second buffer hides a warp's own wait for its next row; more warps
     * an SM hide that as well, and the latency of the sums' add chains
     * besides: at [.., 4096] bf16, 7 warps an SM double-buffered, 13 not. */
    if (slots == 2 && warps * per_sm < MIN_WARPS) slots = 1, warps = block_warps(slot, &per_sm);
    size_t smem = slots * slot * (size_t)warps;
    /* Once per kernel and device (the attributes are the current device's):
     * allow up to the most shared memory a block may have, and ask for the
     * largest shared-memory carveout (a hint). */
    bool bf16 = one_dtype(a, OPF_BF16, is_bwd(M));
    void (*kernel)(norm_args, int) = bf16 ? row_kernel<M, OPF_BF16> : row_kernel<M, ANY>;
    static unsigned long long attrs_set[2];  /* a bit per device */
    if (opf_cuda_once_needed(&attrs_set[bf16], s->device)) {
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(kernel,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)BLOCK_SMEM_MAX));
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(kernel,
                                                   cudaFuncAttributePreferredSharedMemoryCarveout,
                                                   (int)cudaSharedmemCarveoutMaxShared));
        opf_cuda_once_done(&attrs_set[bf16], s->device);
    }
    int64_t want = (a.rows + warps - 1) / warps, cap = (int64_t)s->sm_count * per_sm;
    unsigned grid = (unsigned)(want < cap ? want : cap);
    kernel<<<grid, warps * LANES, smem, s->stream>>>(a, slots);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* dgamma (and dbeta unless NULL) from the rows of a (x, dz seen as a.act).
 * Two columns a thread (one 4- or 8-byte load a tensor and row, half the
 * loads) once single columns would give every SM COL_PAIRS_WARPS warps;
 * below that, one a thread and twice the rows in flight. */
template <bool LN>
static opf_status launch_cols(opf_ctx *ctx, opf_cuda_state *s, const norm_args &a,
                              opf_tensor *dgamma, opf_tensor *dbeta, const char *fn)
{
    if (a.H == 0) return OPF_OK;
    if (a.xt == a.dzt && (!dbeta || dbeta->spec.dtype == dgamma->spec.dtype))
        return opf_dev_with_dtype(a.xt, [&](auto d) {
            return norm_cols_plain<LN, decltype(d)::value>(ctx, s, a, dgamma, dbeta, fn);
        });
    size_t mark = opf_ctx_scratch_mark(ctx);
    size_t sums = LN ? 2 : 1;
    float *part = (float *)opf_ctx_scratch_push_on(ctx, dgamma->spec.device,
                                                   sums * LANES * (size_t)a.H * sizeof(float));
    if (!part)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %zu x 32 x %lld partials", fn,
                         sums, (long long)a.H);
    bool pairs = a.H % 2 == 0 && opf_cuda_aligned16(a.x) && opf_cuda_aligned16(a.dz) &&
                 a.H >= (int64_t)s->sm_count * COL_PAIRS_WARPS;  /* H single-column warps */
    int cp = pairs ? 2 : 1;
    dim3 grid((unsigned)((a.H + LANES * cp - 1) / (LANES * cp)), LANES / COL_WARPS);
    void (*kernel)(norm_args, float *) = pairs ? col_kernel<LN, 2> : col_kernel<LN, 1>;
    kernel<<<grid, COL_WARPS * LANES, 0, s->stream>>>(a, part);
    fold_kernel<<<(unsigned)((a.H + 255) / 256), 256, 0, s->stream>>>(
        part, a.H, dgamma->data[0], dgamma->spec.dtype, dbeta ? dbeta->data[0] : NULL,
        dtype_of(dbeta));
    opf_ctx_scratch_pop(ctx, mark);  /* stream-ordered: later work reuses it after these */
    OPF_CUDA_LAUNCHED(ctx, fn);     /* either launch's error */
    return OPF_OK;
}

/* The LayerNorm / RMSNorm backward (M): one launch for a few hundred rows
 * of bf16 (norm_bwd_one.cu), else the rows, then the column sums. */
template <int M>
static opf_status launch_bwd(opf_ctx *ctx, opf_cuda_state *s, const norm_args &a,
                             opf_tensor *dgamma, opf_tensor *dbeta, const char *fn)
{
    if (norm_bwd_one_takes(s, a, M == LN_BWD, dgamma, dbeta))
        return norm_bwd_one(ctx, s, a, M == LN_BWD, dgamma, dbeta, fn);
    opf_status st = launch_rows<M>(ctx, s, a, fn);
    return st ? st : launch_cols<M == LN_BWD>(ctx, s, a, dgamma, dbeta, fn);
}

/* The state and the dtype checks of an entry; NULL tensors are skipped. */
static opf_cuda_state *begin(opf_ctx *ctx, const char *fn, opf_status *st,
                             const opf_tensor *t0, const opf_tensor *t1, const opf_tensor *t2,
                             const opf_tensor *t3, const opf_tensor *t4)
{
    const opf_tensor *ts[] = {t0, t1, t2, t3, t4};
    static const char *names[] = {"input", "gradient", "gamma", "second input", "output"};
    for (int i = 0; i < 5; i++)
        if ((*st = check_dtype(ctx, fn, names[i], ts[i]))) return NULL;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    *st = s ? OPF_OK : OPF_ERR_STATE;
    return s;
}

/* LayerNorm (beta given) or RMSNorm forward into z; amax as norm_args'. */
static opf_status norm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                           const opf_tensor *beta, float eps, bool zero_centered, opf_tensor *z,
                           opf_tensor *mu, opf_tensor *rsigma, unsigned *amax)
{
    const char *fn = beta ? "layernorm_fwd (cuda)" : "rmsnorm_fwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, NULL, gamma, beta, z);
    if (!s) return st;
    norm_args a = gamma_args(x, gamma, zero_centered, z);
    a.rs = (float *)rsigma->data[0], a.eps = eps, a.amax = amax;
    if (!beta) return launch_rows<RMS_FWD>(ctx, s, a, fn);
    a.beta = beta->data[0], a.bt = beta->spec.dtype, a.mu = (float *)mu->data[0];
    return launch_rows<LN_FWD>(ctx, s, a, fn);
}

static opf_status cuda_layernorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                     const opf_tensor *beta, float eps, bool zero_centered,
                                     opf_tensor *z, opf_tensor *mu, opf_tensor *rsigma)
{
    return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, z, mu, rsigma, NULL);
}

static opf_status cuda_rmsnorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                   float eps, bool zero_centered, opf_tensor *z,
                                   opf_tensor *rsigma)
{
    return norm_fwd(ctx, x, gamma, NULL, eps, zero_centered, z, NULL, rsigma, NULL);
}

extern "C" bool opf_cuda_fused(void)
{
    const char *v = getenv("OPF_CUDA_UNFUSED");
    return !(v && v[0] == '1');
}

/* The *_q entries: a plain z is the plain entry's; current-scaling FP8 is
 * fused (z in hp into scratch with its amax in the same kernel, then the
 * cast pass); other formats, or OPF_CUDA_UNFUSED=1, the composition. */
static opf_status norm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                             const opf_tensor *beta, float eps, bool zero_centered,
                             const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma)
{
    if (!opf_qout_quantized(z))
        return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, z->out, mu, rsigma, NULL);
    if (!opf_cuda_fused() || !opf_qout_current_fp8(z))
        return opf_norm_fwd_q_composed(ctx, opf_backend_get(OPF_DEVICE_CUDA), x, gamma, beta, eps,
                                       zero_centered, z, mu, rsigma);
    const char *fn = "norm_fwd_q (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_tensor t;
    opf_status st = opf_qout_begin(ctx, z, &t);
    if (!st)
        st = opf_cuda_qout_run(ctx, s, fn, z, &t, [&](unsigned *amax) {
            return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, &t, mu, rsigma, amax);
        });
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status cuda_layernorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                       const opf_tensor *beta, float eps, bool zero_centered,
                                       const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma)
{
    return norm_fwd_q(ctx, x, gamma, beta, eps, zero_centered, z, mu, rsigma);
}

static opf_status cuda_rmsnorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                     float eps, bool zero_centered, const opf_qout *z,
                                     opf_tensor *rsigma)
{
    return norm_fwd_q(ctx, x, gamma, NULL, eps, zero_centered, z, NULL, rsigma);
}

static norm_args bwd_args(const opf_tensor *dz, const opf_tensor *x, const opf_tensor *mu,
                          const opf_tensor *rsigma, const opf_tensor *gamma, bool zero_centered,
                          opf_tensor *dx)
{
    norm_args a = gamma_args(x, gamma, zero_centered, dx);
    a.dz = dz->data[0], a.dzt = dz->spec.dtype;
    a.mu = mu ? (float *)mu->data[0] : NULL, a.rs = (float *)rsigma->data[0];
    return a;
}

static opf_status cuda_layernorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                     const opf_tensor *mu, const opf_tensor *rsigma,
                                     const opf_tensor *gamma, bool zero_centered,
                                     const opf_tensor *dadd, opf_tensor *dx, opf_tensor *dgamma,
                                     opf_tensor *dbeta)
{
    const char *fn = "layernorm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dz, gamma, dadd, dx);
    if (!s) return st;
    norm_args a = bwd_args(dz, x, mu, rsigma, gamma, zero_centered, dx);
    a.dadd = data_of(dadd), a.addt = dtype_of(dadd);
    return launch_bwd<LN_BWD>(ctx, s, a, dgamma, dbeta, fn);
}

static opf_status cuda_rmsnorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                   const opf_tensor *rsigma, const opf_tensor *gamma,
                                   bool zero_centered, const opf_tensor *dadd, opf_tensor *dx,
                                   opf_tensor *dgamma)
{
    const char *fn = "rmsnorm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dz, gamma, dadd, dx);
    if (!s) return st;
    norm_args a = bwd_args(dz, x, NULL, rsigma, gamma, zero_centered, dx);
    a.dadd = data_of(dadd), a.addt = dtype_of(dadd);
    return launch_bwd<RMS_BWD>(ctx, s, a, dgamma, NULL, fn);
}

static int64_t last_dim(const opf_tensor *t) { return t->spec.shape[t->spec.ndim - 1]; }

/* L2: x is seen as the output's dtype (y forward, dx backward). */
static opf_status cuda_l2norm_fwd(opf_ctx *ctx, const opf_tensor *x, float eps, opf_tensor *y,
                                  opf_tensor *rnorm)
{
    const char *fn = "l2norm_fwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, NULL, NULL, NULL, y);
    if (!s) return st;
    norm_args a = args_of(x, last_dim(x), y->spec.dtype, y);
    a.rs = (float *)rnorm->data[0], a.eps = eps;
    return launch_rows<L2_FWD>(ctx, s, a, fn);
}

/* dy is read unrounded (seen as f32). */
static opf_status cuda_l2norm_bwd(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *x,
                                  const opf_tensor *rnorm, opf_tensor *dx)
{
    const char *fn = "l2norm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dy, NULL, NULL, dx);
    if (!s) return st;
    norm_args a = args_of(x, last_dim(x), dx->spec.dtype, dx);
    a.dz = dy->data[0], a.dzt = dy->spec.dtype, a.dact = OPF_F32;
    a.rs = (float *)rnorm->data[0];
    return launch_rows<L2_BWD>(ctx, s, a, fn);
}

extern "C" const opf_norm_kernels opf_cuda_norm = {
    cuda_layernorm_fwd, cuda_layernorm_bwd, cuda_rmsnorm_fwd,
    cuda_rmsnorm_bwd,   cuda_l2norm_fwd,    cuda_l2norm_bwd,
    cuda_layernorm_fwd_q, cuda_rmsnorm_fwd_q,
};
