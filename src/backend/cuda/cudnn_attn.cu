/* cudnn_attn.cu: causal self-attention (backend/nn.h's attn_fwd / attn_bwd)
 * through cuDNN's fused flash-attention engines (the default where the
 * library loads; OPF_CUDA_ATTENTION=cudnn and cudnn-atomic, nn.cu), by its
 * backend graph API (cudnn_graph.h). On an H200 with cuDNN 9.19 it passes
 * test_cuda_nn's bounds against the CPU and takes 0.445 ms forward +
 * backward at GPT-2 124M's shape (flash2: 1.316).
 *
 * The library is opened with dlopen("libcudnn.so.9") at first use and its
 * entries are taken into a table, so opfuse links no cuDNN and runs where
 * there is none; without cudnn_graph.h at configure time (CMake's
 * OPF_HAVE_CUDNN) this file compiles to entries that refuse with the reason.
 *
 * The graphs are the ones cuDNN's fused-attention engines recognize: the
 * cuDNN frontend's "composite" SDPA forward and backward for 16-bit inputs,
 * causal top-left mask, no bias, dropout or padding, as that frontend lowers
 * them for cuDNN 9.0 .. 9.20 (the op lists are at graph_fwd and graph_bwd).
 * Its layout here: Q, K and V are strided views of qkv [B, T, 3, H, D] as
 * [B, H, T, D] with strides [3TC, D, 3C, 1] (K at +C, V at +2C elements);
 * dQ, dK, dV the same views of dqkv; O and dO [B, H, T, D] with strides
 * [TC, D, C, 1]; Stats is nn.h's lse [B, H, T] (both the natural
 * max + log(sum exp(s - max)) of the scaled scores of a row). cuDNN wants O
 * and dO of Q's dtype: nn.h's o stored so (o_t = in_dt, what the attention
 * op passes) is O itself, written by the forward and read by the backward
 * in place; an o of another dtype goes through 16-bit scratch, cast after
 * the forward (each value then rounded twice unless o_t is f32) and before
 * the backward.
 *
 * Plans are built once per (B, T, H, D, dtype, direction) and kept in the
 * CUDA state (freed with it). A compiled graph's warm-up call, outside any
 * capture, builds them before its capture; a first use inside a capture
 * builds with the thread's capture mode relaxed (plan_get: cuDNN's
 * allocations then run at once, outside the graph) and fails with
 * OPF_ERR_STATE if that broke the capture, which a compiled graph takes as
 * "walk this segment instead" (compile/replay.c). Executing a built plan
 * inside a capture only queues kernels on the context's stream.
 *
 * The backward comes in two graphs. The deterministic one (the default,
 * and OPF_CUDA_ATTENTION=cudnn) writes dQ = dS K straight into dQ, which
 * cuDNN's Hopper engines run through a dP workspace (B H T T 16-bit values,
 * the plan's workspace): the same bits every run, as a compiled graph's
 * replay must give its eager run's. The default takes it up to a 1 GiB
 * workspace (AUTO_DP_MAX) and flash2's backward beyond. The atomic one
 * (OPF_CUDA_ATTENTION=cudnn-atomic, the frontend's default) sums dQ into an
 * fp32 accumulator with atomics across key blocks: less memory, its bits
 * may differ from run to run (test_cuda_nn checks it within bounds). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda-impl.h"

static const char *const FWD_FN = "attention forward (cuda cudnn)";
static const char *const BWD_FN = "attention backward (cuda cudnn)";
/* The largest dP workspace the default path's deterministic backward takes:
 * 1 GiB (GPT-2 124M's 16 x 12 x 1024^2 is 384 MiB; 24 x 2048's 8 x 16 x
 * 1024^2, 256 MiB). */
static const double AUTO_DP_MAX = 1024.0 * 1024.0 * 1024.0;

/* Whether cuDNN's engines take this call at all (else flash2 does): a
 * 16-bit logical dtype, D a multiple of 8 up to 128 (what the Hopper engines
 * take), T of at least 2 (cuDNN refuses a 1 x 1 score matrix backward), and
 * every array cuDNN reads or writes directly 16-byte aligned. */
static bool cudnn_fits(int64_t B, int64_t T, int64_t H, int64_t D, opf_dtype in_dt,
                       const void *const *p, int np)
{
    if ((in_dt != OPF_BF16 && in_dt != OPF_F16) || D <= 0 || D > 128 || D % 8 || T < 2 ||
        B <= 0 || H <= 0)
        return false;
    for (int i = 0; i < np; i++)
        if (p[i] && !opf_cuda_aligned16(p[i])) return false;
    return true;
}

#ifndef OPF_HAVE_CUDNN

static opf_status no_cudnn(opf_ctx *ctx, const char *fn)
{
    return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: this opfuse was built without cuDNN "
                     "(CMake found no cudnn_graph.h: set CUDNN_INCLUDE_DIR, or OPF_CUDNN was OFF)",
                     fn);
}

opf_status opf_cuda_cudnn_version(opf_ctx *ctx, size_t *version)
{
    *version = 0;
    return no_cudnn(ctx, "cudnn");
}

void opf_cudnn_state_free(struct opf_cudnn_state *c) { (void)c; }

opf_status opf_cuda_cudnn_graph_check(opf_ctx *ctx, bool bwd, bool atomic, int64_t B,
                                      int64_t T, int64_t H, int64_t D, opf_dtype dt, int *n_ops)
{
    (void)atomic, (void)B, (void)T, (void)H, (void)D, (void)dt;
    *n_ops = 0;
    return no_cudnn(ctx, bwd ? BWD_FN : FWD_FN);
}

static opf_status cudnn_usable(opf_ctx *ctx, const char *fn, int64_t T, bool bwd,
                               opf_cudnn_use mode, bool *use)
{
    (void)T, (void)bwd;
    *use = false;
    return mode == OPF_CUDNN_AUTO ? OPF_OK : no_cudnn(ctx, fn);
}

/* Never reached (cudnn_usable refuses first). */
static opf_status fwd_typed(opf_ctx *ctx, const void *, opf_dtype, void *, opf_dtype, float *,
                            int64_t, int64_t, int64_t, int64_t, opf_dtype)
{
    return no_cudnn(ctx, FWD_FN);
}
static opf_status bwd_typed(opf_ctx *ctx, const void *, opf_dtype, const void *, opf_dtype,
                            const float *, const void *, opf_dtype, void *, opf_dtype, int64_t,
                            int64_t, int64_t, int64_t, opf_dtype, bool)
{
    return no_cudnn(ctx, BWD_FN);
}

#else /* OPF_HAVE_CUDNN */

#include <dlfcn.h>
#include <pthread.h>

#include <cudnn_graph.h>

/* ---- the library, opened at first use ------------------------------------ */

#define CUDNN_ENTRIES(X)                                                                   \
    X(cudnnGetVersion) X(cudnnGetErrorString) X(cudnnCreate) X(cudnnDestroy)               \
    X(cudnnSetStream) X(cudnnBackendCreateDescriptor) X(cudnnBackendDestroyDescriptor)     \
    X(cudnnBackendFinalize) X(cudnnBackendSetAttribute) X(cudnnBackendGetAttribute)        \
    X(cudnnBackendExecute)

/* The entries (each named as cuDNN's function), what cudnnGetVersion gave,
 * and why the library is unusable when it is (ok false). */
typedef struct cudnn_lib {
#define CUDNN_MEMBER(f) decltype(&::f) f;
    CUDNN_ENTRIES(CUDNN_MEMBER)
#undef CUDNN_MEMBER
    void  (*last_error)(char *message, size_t max_size);  /* cudnnGetLastErrorString; NULL: none */
    size_t version;
    bool   ok;
    char   why[640];
} cudnn_lib;

static cudnn_lib lib;
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;
static const char LIB_NAME[] = "libcudnn.so.9";

static void lib_open(void)
{
    void *h = dlopen(LIB_NAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(lib.why, sizeof lib.why, "dlopen(\"%s\") failed: %s (put cuDNN 9's lib/ on "
                 "LD_LIBRARY_PATH)", LIB_NAME, e ? e : "no reason given");
        return;
    }
#define CUDNN_LOAD(f)                                                                      \
    lib.f = (decltype(&::f))dlsym(h, #f);                                                   \
    if (!lib.f) {                                                                          \
        snprintf(lib.why, sizeof lib.why, "%s has no %s (not cuDNN 9?)", LIB_NAME, #f);    \
        return;                                                                            \
    }
    CUDNN_ENTRIES(CUDNN_LOAD)
#undef CUDNN_LOAD
    lib.last_error = (void (*)(char *, size_t))dlsym(h, "cudnnGetLastErrorString");
    lib.version = lib.cudnnGetVersion();
    if (lib.version < 90000 || lib.version >= 100000) {
        snprintf(lib.why, sizeof lib.why, "%s is cuDNN %zu, not 9.x", LIB_NAME, lib.version);
        return;
    }
    lib.ok = true;  /* the handle stays open for the process's life */
}

/* OPF_OK when the library is open and usable, else OPF_ERR_UNSUPPORTED
 * naming fn and why. */
static opf_status lib_ready(opf_ctx *ctx, const char *fn)
{
    pthread_once(&lib_once, lib_open);
    if (lib.ok) return OPF_OK;
    return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: cuDNN is not usable: %s", fn, lib.why);
}

opf_status opf_cuda_cudnn_version(opf_ctx *ctx, size_t *version)
{
    opf_status st = lib_ready(ctx, "cudnn");
    *version = st ? 0 : lib.version;
    return st;
}

/* The status of a failed cuDNN call: fn (the op), the call, cuDNN's status
 * name and number, and cudnnGetLastErrorString's text (what cuDNN says is
 * wrong). NOT_SUPPORTED is OPF_ERR_UNSUPPORTED, allocation failures
 * OPF_ERR_NO_MEMORY, the rest OPF_ERR_DEVICE. */
static opf_status cudnn_fail(opf_ctx *ctx, const char *fn, const char *call, cudnnStatus_t e)
{
    char detail[1024] = "";
    if (lib.last_error) lib.last_error(detail, sizeof detail);
    int cat = (int)e / 1000 * 1000;
    opf_status st = cat == 3000 ? OPF_ERR_UNSUPPORTED
                    : e == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
                              e == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED
                        ? OPF_ERR_NO_MEMORY
                        : OPF_ERR_DEVICE;
    return opf_error(ctx, st, "%s: %s failed: %s (%d) (cuDNN %zu): %s", fn, call,
                     lib.cudnnGetErrorString(e), (int)e, lib.version,
                     detail[0] ? detail : "cuDNN gave no further detail");
}

/* ---- the graph builder -----------------------------------------------------
 * Every call below goes through gb: the first failure is kept (status and
 * message) and every later call does nothing, so the graphs read as lists.
 * Each descriptor made is kept in descs, destroyed with the plan. */

enum { GB_MAX_DESCS = 256, GB_MAX_OPS = 32 };

typedef struct gb {
    opf_ctx    *ctx;
    const char *fn;
    opf_status  st;
    cudnnBackendDescriptor_t descs[GB_MAX_DESCS];
    int         n_descs;
    cudnnBackendDescriptor_t ops[GB_MAX_OPS];
    int         n_ops;
    int64_t     next_virtual;  /* the UID of the next virtual tensor */
} gb;

static bool gb_try(gb *g, cudnnStatus_t e, const char *call)
{
    if (g->st) return false;
    if (e == CUDNN_STATUS_SUCCESS) return true;
    g->st = cudnn_fail(g->ctx, g->fn, call, e);
    return false;
}

/* A new descriptor of type (NULL after a failure); what names it in a
 * message. */
static cudnnBackendDescriptor_t gb_new(gb *g, cudnnBackendDescriptorType_t type, const char *what)
{
    if (g->st) return NULL;
    if (g->n_descs == GB_MAX_DESCS) {
        g->st = opf_error(g->ctx, OPF_ERR_STATE, "%s: more than %d cuDNN descriptors for one "
                          "plan (%s)", g->fn, GB_MAX_DESCS, what);
        return NULL;
    }
    cudnnBackendDescriptor_t d = NULL;
    char call[160];
    snprintf(call, sizeof call, "cudnnBackendCreateDescriptor(%s)", what);
    if (!gb_try(g, lib.cudnnBackendCreateDescriptor(type, &d), call)) return NULL;
    g->descs[g->n_descs++] = d;
    return d;
}

static void gb_set_named(gb *g, cudnnBackendDescriptor_t d, const char *what,
                         cudnnBackendAttributeName_t attr, const char *attr_name,
                         cudnnBackendAttributeType_t type, int64_t n, const void *v)
{
    if (g->st) return;
    char call[200];
    snprintf(call, sizeof call, "cudnnBackendSetAttribute(%s, %s)", what, attr_name);
    gb_try(g, lib.cudnnBackendSetAttribute(d, attr, type, n, v), call);
}
#define GB_SET(g, d, what, attr, type, n, v) gb_set_named(g, d, what, attr, #attr, type, n, v)

static void gb_finalize(gb *g, cudnnBackendDescriptor_t d, const char *what)
{
    if (g->st) return;
    char call[160];
    snprintf(call, sizeof call, "cudnnBackendFinalize(%s)", what);
    gb_try(g, lib.cudnnBackendFinalize(d), call);
}

static void gb_destroy_all(cudnnBackendDescriptor_t *d, int n)
{
    for (int i = n - 1; i >= 0; i--)
        if (d[i]) lib.cudnnBackendDestroyDescriptor(d[i]);
}

/* ---- tensors ---------------------------------------------------------------- */

/* A tensor of the graph: its descriptor and UID. */
typedef struct gt {
    cudnnBackendDescriptor_t d;
    int64_t uid;
} gt;

typedef struct shape4 {
    int64_t dim[4], stride[4];
} shape4;

static cudnnDataType_t cudnn_dtype(opf_dtype dt)
{
    return dt == OPF_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

/* A 4-d tensor: uid 0 gives the next virtual UID; alignment 16 bytes, as
 * the frontend declares every tensor. */
static gt gb_tensor(gb *g, const char *name, int64_t uid, cudnnDataType_t dt, const shape4 &s,
                    bool is_virtual, bool by_value)
{
    gt t = {gb_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, name), uid ? uid : g->next_virtual++};
    int64_t align = 16;
    GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, s.dim);
    GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, s.stride);
    GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid);
    GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    bool yes = true;
    if (is_virtual) GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    if (by_value) GB_SET(g, t.d, name, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    gb_finalize(g, t.d, name);
    return t;
}

/* A virtual intermediate of shape s and type dt. */
static gt gb_virtual(gb *g, const char *name, cudnnDataType_t dt, const shape4 &s)
{
    return gb_tensor(g, name, 0, dt, s, true, false);
}

/* A by-value fp32 scalar ([1, 1, 1, 1]); its value goes in the variant
 * pack as a host pointer. */
static gt gb_scalar(gb *g, const char *name, int64_t uid)
{
    shape4 one = {{1, 1, 1, 1}, {1, 1, 1, 1}};
    return gb_tensor(g, name, uid, CUDNN_DATA_FLOAT, one, false, true);
}

/* ---- operations --------------------------------------------------------------- */

static void gb_op(gb *g, cudnnBackendDescriptor_t op, const char *what)
{
    gb_finalize(g, op, what);
    if (g->st) return;
    if (g->n_ops == GB_MAX_OPS) {
        g->st = opf_error(g->ctx, OPF_ERR_STATE, "%s: more than %d operations (%s)", g->fn,
                          GB_MAX_OPS, what);
        return;
    }
    g->ops[g->n_ops++] = op;
}

/* y = mode(x[, b[, t]]) computed in prec (GEN_INDEX along axis); alpha1 and
 * alpha2 1, as the frontend sets them. b, t: NULL when the mode takes none. */
static void gb_pointwise(gb *g, const char *what, cudnnPointwiseMode_t mode, cudnnDataType_t prec,
                         const gt &x, const gt *b, const gt *t, const gt &y, int64_t axis = -1)
{
    cudnnBackendDescriptor_t pw = gb_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    GB_SET(g, pw, what, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    GB_SET(g, pw, what, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
        GB_SET(g, pw, what, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    gb_finalize(g, pw, what);
    cudnnBackendDescriptor_t op = gb_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
           CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
           &x.d);
    if (b)
        GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR,
               1, &b->d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
           &y.d);
    if (t)
        GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR,
               1, &t->d);
    float one = 1.0f;
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    gb_op(g, op, what);
}

/* The unary and binary shapes of gb_pointwise, computed in fp32. */
static void gb_pw1(gb *g, const char *what, cudnnPointwiseMode_t mode, const gt &x, const gt &y)
{
    gb_pointwise(g, what, mode, CUDNN_DATA_FLOAT, x, NULL, NULL, y);
}
static void gb_pw2(gb *g, const char *what, cudnnPointwiseMode_t mode, const gt &x, const gt &b,
                   const gt &y)
{
    gb_pointwise(g, what, mode, CUDNN_DATA_FLOAT, x, &b, NULL, y);
}

/* A new fp32 virtual of shape s, named what, = mode(x[, b]). */
static gt gb_pw_new(gb *g, const char *what, cudnnPointwiseMode_t mode, const gt &x, const gt *b,
                    const shape4 &s)
{
    gt y = gb_virtual(g, what, CUDNN_DATA_FLOAT, s);
    gb_pointwise(g, what, mode, CUDNN_DATA_FLOAT, x, b, NULL, y);
    return y;
}

/* y = the op over x's last dimension (y [.., 1]), in fp32. */
static void gb_reduction(gb *g, const char *what, cudnnReduceTensorOp_t red, const gt &x,
                         const gt &y)
{
    cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t r = gb_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    GB_SET(g, r, what, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    GB_SET(g, r, what, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
#if CUDNN_VERSION >= 91100
    bool deterministic = false;  /* the frontend says so from 9.11, where the attribute exists */
    if (lib.version >= 91100)
        GB_SET(g, r, what, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1,
               &deterministic);
#endif
    gb_finalize(g, r, what);
    cudnnBackendDescriptor_t op = gb_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
           &x.d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
           &y.d);
    gb_op(g, op, what);
}

/* c = a b (batched over the first two dimensions), fp32 compute. */
static void gb_matmul(gb *g, const char *what, const gt &a, const gt &b, const gt &c)
{
    cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm = gb_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    GB_SET(g, mm, what, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    gb_finalize(g, mm, what);
    cudnnBackendDescriptor_t op = gb_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b.d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c.d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    gb_op(g, op, what);
}

/* y = x viewed with y's dimensions and strides (a transpose, or a dtype
 * change the next matmul reads). */
static void gb_reshape(gb *g, const char *what, const gt &x, const gt &y)
{
    cudnnBackendDescriptor_t op = gb_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.d);
    GB_SET(g, op, what, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.d);
#if CUDNN_VERSION >= 92200
    /* from 9.22 a reshape has a mode, and the frontend says view-only (a
     * transposed view, no data moved), as every reshape was before */
    cudnnBackendReshapeMode_t view = CUDNN_RESHAPE_VIEW_ONLY;
    if (lib.version >= 92200)
        GB_SET(g, op, what, CUDNN_ATTR_OPERATION_RESHAPE_MODE, CUDNN_TYPE_RESHAPE_MODE, 1, &view);
#endif
    gb_op(g, op, what);
}

/* The causal top-left mask as the frontend lowers it before cuDNN 9.21:
 * row = GEN_INDEX(x, axis 2), col = GEN_INDEX(x, axis 3) (int32, computed
 * in fp32), keep = row >= col (boolean), y = keep ? x : neg_inf. */
static gt gb_causal_mask(gb *g, const gt &x, const gt &neg_inf, const shape4 &s)
{
    gt row = gb_virtual(g, "causal row index", CUDNN_DATA_INT32, s);
    gt col = gb_virtual(g, "causal column index", CUDNN_DATA_INT32, s);
    gt keep = gb_virtual(g, "causal keep", CUDNN_DATA_BOOLEAN, s);
    gt y = gb_virtual(g, "masked scores", CUDNN_DATA_FLOAT, s);
    gb_pointwise(g, "gen_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, NULL, NULL,
                 row, 2);
    gb_pointwise(g, "gen_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, NULL, NULL,
                 col, 3);
    gb_pointwise(g, "row >= col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, &col, NULL,
                 keep);
    gb_pointwise(g, "causal binary_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x,
                 &neg_inf, &keep, y);
    return y;
}

/* ---- the two graphs ------------------------------------------------------------ */

/* The UIDs of the tensors the variant pack binds (the frontend samples'
 * numbers for the first nine). */
enum {
    UID_Q = 1, UID_K = 2, UID_V = 3, UID_O = 4, UID_STATS = 5,
    UID_DO = 101, UID_DQ = 102, UID_DK = 103, UID_DV = 104,
    UID_SCALE = 201, UID_NEG_INF = 202, UID_ONE = 203,
    UID_SOFTMAX_SUM = 301, UID_DQ_ACCUM = 302,
    UID_FIRST_VIRTUAL = 1001,
};

/* The shapes of one call. */
typedef struct attn_shapes {
    shape4 q;      /* Q (and dQ, dK, dV, and K, V untransposed) in qkv: [B, H, T, D] */
    shape4 kt;     /* K^T and V^T: [B, H, D, T] */
    shape4 o;      /* O and dO: [B, H, T, D], strides [TC, D, C, 1] */
    shape4 s;      /* the scores: [B, H, T, T] packed */
    shape4 st;     /* the scores transposed: strides [HTT, TT, 1, T] */
    shape4 row;    /* a value per row: [B, H, T, 1] (Stats) */
    shape4 acc;    /* [B, H, T, D] packed (dQ's fp32 accumulator) */
    shape4 do_o;   /* dO * O before its row sum, as the frontend declares it */
} attn_shapes;

static attn_shapes shapes_of(int64_t B, int64_t T, int64_t H, int64_t D)
{
    int64_t C = H * D, q3 = 3 * C;
    attn_shapes a = {
        {{B, H, T, D}, {T * q3, D, q3, 1}},
        {{B, H, D, T}, {T * q3, D, 1, q3}},
        {{B, H, T, D}, {T * C, D, C, 1}},
        {{B, H, T, T}, {H * T * T, T * T, T, 1}},
        {{B, H, T, T}, {H * T * T, T * T, 1, T}},
        {{B, H, T, 1}, {H * T, T, 1, 1}},
        {{B, H, T, D}, {H * T * D, T * D, D, 1}},
        {{B, H, T, D}, {H * T * D, T * D, H * D, 1}},
    };
    return a;
}

/* The forward (the frontend's CompositeSDPANode with causal mask and
 * Stats):
 *   S = Q K^T (fp32), S *= scale, causal mask (-inf above the diagonal),
 *   M = max_row S, E = exp(S - M), Z = sum_row E, Stats = M + log Z,
 *   P = E / Z (as Q's dtype), O = P V. */
/* The tensors both graphs bind: Q, K^T, V (V^T for the backward), O,
 * Stats and the by-value scale and -inf. */
typedef struct attn_tensors {
    gt q, kt, v, o, stats, scale, neg_inf;
} attn_tensors;

static attn_tensors gb_attn_tensors(gb *g, const attn_shapes &a, cudnnDataType_t io, bool bwd)
{
    attn_tensors t;
    t.q = gb_tensor(g, "Q", UID_Q, io, a.q, false, false);
    t.kt = gb_tensor(g, "K^T", UID_K, io, a.kt, false, false);
    t.v = gb_tensor(g, bwd ? "V^T" : "V", UID_V, io, bwd ? a.kt : a.q, false, false);
    t.o = gb_tensor(g, "O", UID_O, io, a.o, false, false);
    t.stats = gb_tensor(g, "Stats", UID_STATS, CUDNN_DATA_FLOAT, a.row, false, false);
    t.scale = gb_scalar(g, "attn_scale", UID_SCALE);
    t.neg_inf = gb_scalar(g, "-inf", UID_NEG_INF);
    return t;
}

static void graph_fwd(gb *g, const attn_shapes &a, cudnnDataType_t io)
{
    const cudnnDataType_t F = CUDNN_DATA_FLOAT;
    attn_tensors t = gb_attn_tensors(g, a, io, false);
    gt s = gb_virtual(g, "S = Q K^T", F, a.s);
    gb_matmul(g, "bmm1 (Q K^T)", t.q, t.kt, s);
    gt s1 = gb_pw_new(g, "attn_scale", CUDNN_POINTWISE_MUL, s, &t.scale, a.s);
    gt s2 = gb_causal_mask(g, s1, t.neg_inf, a.s);
    gt m = gb_virtual(g, "softmax max", F, a.row);
    gb_reduction(g, "softmax max", CUDNN_REDUCE_TENSOR_MAX, s2, m);
    gt sub = gb_pw_new(g, "softmax sub (S - max)", CUDNN_POINTWISE_SUB, s2, &m, a.s);
    gt e = gb_pw_new(g, "softmax exp", CUDNN_POINTWISE_EXP, sub, NULL, a.s);
    gt z = gb_virtual(g, "softmax sum", F, a.row);
    gb_reduction(g, "softmax sum", CUDNN_REDUCE_TENSOR_ADD, e, z);
    gt logz = gb_pw_new(g, "softmax log", CUDNN_POINTWISE_LOG, z, NULL, a.row);
    gb_pw2(g, "Stats = max + log sum", CUDNN_POINTWISE_ADD, m, logz, t.stats);
    gt p = gb_virtual(g, "P", io, a.s);
    gb_pw2(g, "softmax div", CUDNN_POINTWISE_DIV, e, z, p);
    gb_matmul(g, "bmm2 (P V)", p, t.v, t.o);
}

/* The backward (the frontend's CompositeSDPABackwardNode, causal, no
 * dropout; atomic: dQ through an fp32 accumulator, else straight into dQ,
 * which the engines take as the deterministic dP-workspace kernel):
 *   softmax_sum = sum_row(dO * O) * 1 (fp32, kept in our scratch),
 *   S = Q K^T * scale, P = exp(causal mask(S - Stats)),
 *   dV = P^T dO (P as Q's dtype), dP = dO V^T,
 *   dS = (dP - softmax_sum) * P * scale,
 *   dK = dS^T Q (dS as Q's dtype), dQ_accum = dS K (fp32, K's view fp32),
 *   dQ = dQ_accum; or dQ = dS K. */
static void graph_bwd(gb *g, const attn_shapes &a, cudnnDataType_t io, bool atomic)
{
    const cudnnDataType_t F = CUDNN_DATA_FLOAT;
    attn_tensors t = gb_attn_tensors(g, a, io, true);
    gt dO = gb_tensor(g, "dO", UID_DO, io, a.o, false, false);
    gt dq = gb_tensor(g, "dQ", UID_DQ, io, a.q, false, false);
    gt dk = gb_tensor(g, "dK", UID_DK, io, a.q, false, false);
    gt dv = gb_tensor(g, "dV", UID_DV, io, a.q, false, false);
    gt one = gb_scalar(g, "one", UID_ONE);
    gt ssum = gb_tensor(g, "softmax_sum", UID_SOFTMAX_SUM, F, a.row, false, false);
    gt dq_acc = atomic ? gb_tensor(g, "dQ_accum", UID_DQ_ACCUM, F, a.acc, false, false) : dq;

    /* dO * O => softmax_sum */
    gt t1 = gb_pw_new(g, "mul_dO_O", CUDNN_POINTWISE_MUL, dO, &t.o, a.do_o);
    gt t2 = gb_virtual(g, "sum_row(dO * O)", F, a.row);
    gb_reduction(g, "reduce_dO_o", CUDNN_REDUCE_TENSOR_ADD, t1, t2);
    gb_pw2(g, "scale_dropout_inv (* 1)", CUDNN_POINTWISE_MUL, t2, one, ssum);
    /* Q K^T => P => dV */
    gt s = gb_virtual(g, "S = Q K^T", F, a.s);
    gb_matmul(g, "matmul_Q_KT", t.q, t.kt, s);
    gt s1 = gb_pw_new(g, "mul_s_attn_scale", CUDNN_POINTWISE_MUL, s, &t.scale, a.s);
    gt s2 = gb_pw_new(g, "sub_s_m (S - Stats)", CUDNN_POINTWISE_SUB, s1, &t.stats, a.s);
    gt s3 = gb_causal_mask(g, s2, t.neg_inf, a.s);
    gt p = gb_pw_new(g, "exp_s (P)", CUDNN_POINTWISE_EXP, s3, NULL, a.s);
    gt pt = gb_virtual(g, "P^T", io, a.st);
    gb_reshape(g, "reshape_p", p, pt);
    gb_matmul(g, "matmul_pT_dO", pt, dO, dv);
    /* dO V^T => dS => dK */
    gt dp = gb_virtual(g, "dP = dO V^T", F, a.s);
    gb_matmul(g, "matmul_dO_VT", dO, t.v, dp);
    gt t3 = gb_pw_new(g, "sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, dp, &ssum, a.s);
    gt t4 = gb_pw_new(g, "mul_dP_exp_s", CUDNN_POINTWISE_MUL, t3, &p, a.s);
    gt ds = gb_pw_new(g, "mul_dS_attn_scale (dS)", CUDNN_POINTWISE_MUL, t4, &t.scale, a.s);
    gt dst = gb_virtual(g, "dS^T", io, a.st);
    gb_reshape(g, "reshape_dS", ds, dst);
    gb_matmul(g, "matmul_dST_Q", dst, t.q, dk);
    /* dS K => dQ; the frontend leaves K's view to its intermediate type
     * (fp32), unlike P^T and dS^T, which it sets to Q's */
    gt k = gb_virtual(g, "K", F, a.q);
    gb_reshape(g, "reshape_k", t.kt, k);
    gb_matmul(g, "matmul_dS_K", ds, k, dq_acc);
    if (atomic) gb_pw1(g, "identity_dQ", CUDNN_POINTWISE_IDENTITY, dq_acc, dq);
}

/* ---- plans ------------------------------------------------------------------------ */

typedef struct cudnn_key {
    int64_t   B, T, H, D;
    opf_dtype dt;
    bool      bwd;
    bool      atomic;  /* the backward's dQ through the atomic fp32 accumulator */
} cudnn_key;

/* A finalized execution plan and everything it was built from. */
typedef struct cudnn_plan {
    cudnn_key key;
    cudnnBackendDescriptor_t plan;
    cudnnBackendDescriptor_t descs[GB_MAX_DESCS];
    int       n_descs;
    int64_t   ws_bytes;  /* cuDNN's workspace for this plan */
    char      engine[80];  /* which heuristic result and engine it is, for messages */
} cudnn_plan;

struct opf_cudnn_state {
    cudnnHandle_t handle;
    cudnn_plan  **plans;
    int           n_plans, cap_plans;
};

void opf_cudnn_state_free(struct opf_cudnn_state *c)
{
    if (!c) return;
    for (int i = 0; i < c->n_plans; i++) {
        gb_destroy_all(c->plans[i]->descs, c->plans[i]->n_descs);
        free(c->plans[i]);
    }
    free(c->plans);
    if (c->handle) lib.cudnnDestroy(c->handle);
    free(c);
}

static bool key_eq(const cudnn_key &a, const cudnn_key &b)
{
    return a.B == b.B && a.T == b.T && a.H == b.H && a.D == b.D && a.dt == b.dt &&
           a.bwd == b.bwd && a.atomic == b.atomic;
}

/* The operation graph of gb's ops on handle h, finalized. */
static cudnnBackendDescriptor_t gb_op_graph(gb *g, cudnnHandle_t h)
{
    cudnnBackendDescriptor_t og = gb_new(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
                                         "operation graph");
    GB_SET(g, og, "operation graph", CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
           g->n_ops, g->ops);
    /* deprecated since 9.8 (the device comes from the engine then) but still
     * read, and needed before: the frontend sets it whenever it has a handle
     * (NULL: none, opf_cuda_cudnn_graph_check's) */
    if (h)
        GB_SET(g, og, "operation graph", CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
               &h);
    gb_finalize(g, og, "operation graph");
    return og;
}

/* The engine configurations heuristics mode `mode` gives for og, best
 * first, into cfgs (at most max; kept in gb); their number, 0 on failure. */
static int gb_heuristics(gb *g, cudnnBackendDescriptor_t og, cudnnBackendHeurMode_t mode,
                         const char *mode_name, cudnnBackendDescriptor_t *cfgs, int max)
{
    char what[64];
    snprintf(what, sizeof what, "engine heuristics (%s)", mode_name);
    cudnnBackendDescriptor_t h = gb_new(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what);
    GB_SET(g, h, what, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
           &og);
    GB_SET(g, h, what, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    gb_finalize(g, h, what);
    if (g->st) return 0;
    int64_t count = 0;
    char call[160];
    snprintf(call, sizeof call, "cudnnBackendGetAttribute(%s, CUDNN_ATTR_ENGINEHEUR_RESULTS, "
             "count)", what);
    if (!gb_try(g, lib.cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL),
                call))
        return 0;
    int n = count < max ? (int)count : max;
    for (int i = 0; i < n; i++) cfgs[i] = gb_new(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, what);
    if (g->st || n == 0) return 0;
    int64_t got = 0;
    snprintf(call, sizeof call, "cudnnBackendGetAttribute(%s, CUDNN_ATTR_ENGINEHEUR_RESULTS)",
             what);
    if (!gb_try(g, lib.cudnnBackendGetAttribute(h, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfgs),
                call))
        return 0;
    return got < n ? (int)got : n;
}

enum { MAX_CFGS = 16 };

/* The global index of cfg's engine (for messages: which of cuDNN's engines
 * runs the graph), -1 when cuDNN does not say. */
static int64_t engine_index(cudnnBackendDescriptor_t cfg)
{
    cudnnBackendDescriptor_t eng = NULL;
    int64_t n = 0, index = -1;
    if (lib.cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng)) return -1;
    if (lib.cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &eng) ||
        lib.cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                     &index))
        index = -1;
    lib.cudnnBackendDestroyDescriptor(eng);
    return index;
}

/* The first engine configuration of mode A's list, then mode B's, that
 * finalizes into an execution plan for og. A configuration cuDNN refuses
 * (finalize fails) is skipped; when all are refused the last refusal is the
 * message, with how many were tried. */
static void gb_plan(gb *g, cudnnBackendDescriptor_t og, cudnnHandle_t h, cudnn_plan *out)
{
    static const cudnnBackendHeurMode_t modes[] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B};
    static const char *const names[] = {"mode A", "mode B"};
    char last[900] = "";
    int tried = 0;
    for (int m = 0; m < 2 && !g->st; m++) {
        cudnnBackendDescriptor_t cfgs[MAX_CFGS];
        int n = gb_heuristics(g, og, modes[m], names[m], cfgs, MAX_CFGS);
        if (g->st) {  /* a mode heuristics cannot run: remember it, try the next */
            snprintf(last, sizeof last, "%s", opf_last_error(g->ctx));
            g->st = OPF_OK;
            continue;
        }
        if (!n && lib.last_error) {  /* none viable: cuDNN's own last word on it */
            char why[700] = "";
            lib.last_error(why, sizeof why);
            snprintf(last, sizeof last, "%s gave no viable configuration%s%s", names[m],
                     why[0] ? "; cuDNN's last message: " : "", why);
        }
        for (int i = 0; i < n && !out->plan; i++, tried++) {
            cudnnBackendDescriptor_t p = gb_new(g, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
                                                "execution plan");
            GB_SET(g, p, "execution plan", CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
            if (lib.version < 90800)  /* the frontend sets it only before 9.8 */
                GB_SET(g, p, "execution plan", CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                       CUDNN_TYPE_HANDLE, 1, &h);
            char what[96];
            snprintf(what, sizeof what, "execution plan of %s result %d", names[m], i);
            gb_finalize(g, p, what);
            if (g->st) {
                snprintf(last, sizeof last, "%s", opf_last_error(g->ctx));
                g->st = OPF_OK;
                continue;
            }
            out->plan = p;
            snprintf(out->engine, sizeof out->engine, "%s result %d, engine %lld", names[m], i,
                     (long long)engine_index(cfgs[i]));
        }
        if (out->plan) return;
    }
    if (g->st || out->plan) return;
    g->st = opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "%s: no cuDNN engine takes the graph (%d "
                      "engine configurations of heuristics modes A and B tried; "
                      "CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr shows cuDNN's reasons); "
                      "the last refusal: %s", g->fn, tried,
                      last[0] ? last : "none (no configuration)");
}

/* Builds the plan of key on handle h into *out (descs moved there). */
/* A builder holding key's graph and its finalized operation graph *og on
 * handle h (NULL: none); NULL when out of host memory. */
static gb *gb_graph(opf_ctx *ctx, cudnnHandle_t h, const cudnn_key &key, const char *fn,
                    cudnnBackendDescriptor_t *og)
{
    gb *g = (gb *)calloc(1, sizeof *g);
    if (!g) return NULL;
    g->ctx = ctx;
    g->fn = fn;
    g->next_virtual = UID_FIRST_VIRTUAL;
    attn_shapes a = shapes_of(key.B, key.T, key.H, key.D);
    if (key.bwd) graph_bwd(g, a, cudnn_dtype(key.dt), key.atomic);
    else graph_fwd(g, a, cudnn_dtype(key.dt));
    *og = gb_op_graph(g, h);
    return g;
}

static opf_status plan_build(opf_ctx *ctx, cudnnHandle_t h, const cudnn_key &key, const char *fn,
                             cudnn_plan *out)
{
    cudnnBackendDescriptor_t og;
    gb *g = gb_graph(ctx, h, key, fn, &og);
    if (!g) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    if (!g->st) gb_plan(g, og, h, out);
    if (!g->st) {
        char call[224];
        snprintf(call, sizeof call, "cudnnBackendGetAttribute(execution plan of %s, "
                 "CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)", out->engine);
        int64_t n = 0;
        gb_try(g, lib.cudnnBackendGetAttribute(out->plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                               CUDNN_TYPE_INT64, 1, &n, &out->ws_bytes),
               call);
    }
    opf_status st = g->st;
    if (st) {
        gb_destroy_all(g->descs, g->n_descs);
        out->plan = NULL;
    } else {
        memcpy(out->descs, g->descs, sizeof(g->descs[0]) * (size_t)g->n_descs);
        out->n_descs = g->n_descs;
    }
    free(g);
    return st;
}

/* A new plan of key (and the handle, at the first), added to s's cache. */
static opf_status plan_new(opf_ctx *ctx, opf_cuda_state *s, const cudnn_key &key, const char *fn,
                           const cudnn_plan **out)
{
    opf_cudnn_state *c = s->cudnn;
    if (!c) {
        if (!(c = (opf_cudnn_state *)calloc(1, sizeof *c)))
            return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
        s->cudnn = c;
    }
    if (!c->handle) {
        cudnnStatus_t e = lib.cudnnCreate(&c->handle);
        if (e != CUDNN_STATUS_SUCCESS) {
            c->handle = NULL;
            return cudnn_fail(ctx, fn, "cudnnCreate", e);
        }
    }
    if (c->n_plans == c->cap_plans) {
        int cap = c->cap_plans ? 2 * c->cap_plans : 8;
        cudnn_plan **p = (cudnn_plan **)realloc(c->plans, sizeof *p * (size_t)cap);
        if (!p) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
        c->plans = p;
        c->cap_plans = cap;
    }
    cudnn_plan *p = (cudnn_plan *)calloc(1, sizeof *p);
    if (!p) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    p->key = key;
    opf_status st = plan_build(ctx, c->handle, key, fn, p);
    if (st == OPF_ERR_UNSUPPORTED) {  /* kept, plan NULL: asked again, refused at once */
        p->plan = NULL;
        c->plans[c->n_plans++] = p;
        return st;
    }
    if (st) {
        free(p);
        return st;
    }
    c->plans[c->n_plans++] = p;
    *out = p;
    return OPF_OK;
}

/* The cached plan of key, built (with the handle) at its first use. A first
 * use inside a capture (graph.cu's, thread-local mode, which refuses the
 * allocations cuDNN's build may make) builds with this thread relaxed, so
 * those run at once, outside the graph; if the build still broke the
 * capture (cuDNN synchronized), the call fails saying so and the capture's
 * end reports it too (a compiled graph then walks the segment). */
static opf_status plan_get(opf_ctx *ctx, opf_cuda_state *s, const cudnn_key &key, const char *fn,
                           const cudnn_plan **out)
{
    opf_cudnn_state *c = s->cudnn;
    for (int i = 0; c && i < c->n_plans; i++)
        if (key_eq(c->plans[i]->key, key)) {
            if (!c->plans[i]->plan)
                return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: cuDNN refused this call's graph "
                                 "at its first use (B %lld T %lld H %lld D %lld %s)", fn,
                                 (long long)key.B, (long long)key.T, (long long)key.H,
                                 (long long)key.D, opf_dtype_name(key.dt));
            *out = c->plans[i];
            return OPF_OK;
        }
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    OPF_CUDA_TRY(ctx, fn, cudaStreamIsCapturing(s->stream, &cs));
    if (cs == cudaStreamCaptureStatusNone) return plan_new(ctx, s, key, fn, out);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    OPF_CUDA_TRY(ctx, fn, cudaThreadExchangeStreamCaptureMode(&mode));
    opf_status st = plan_new(ctx, s, key, fn, out);
    OPF_CUDA_TRY(ctx, fn, cudaThreadExchangeStreamCaptureMode(&mode));  /* back to the caller's */
    cudaError_t e = cudaStreamIsCapturing(s->stream, &cs);
    if (e != cudaSuccess || cs != cudaStreamCaptureStatusActive) {  /* refused or built */
        cudaGetLastError();
        return opf_error(ctx, OPF_ERR_STATE, "%s: building cuDNN's plan inside a CUDA graph "
                         "capture broke the capture (cuDNN synchronized or launched outside "
                         "it): run the call once uncaptured first, as a compiled graph's "
                         "warm-up does", fn);
    }
    return st;
}

/* ---- execution ---------------------------------------------------------------------- */

/* Runs plan p on s's stream with the n tensors (uids, ptrs) and workspace
 * ws (p->ws_bytes, or more). */
static opf_status plan_run(opf_ctx *ctx, opf_cuda_state *s, const cudnn_plan *p,
                           const int64_t *uids, void *const *ptrs, int n, void *ws,
                           const char *fn)
{
    cudnnStatus_t e = lib.cudnnSetStream(s->cudnn->handle, s->stream);
    if (e) return cudnn_fail(ctx, fn, "cudnnSetStream", e);
    cudnnBackendDescriptor_t vp = NULL;
    if ((e = lib.cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp)))
        return cudnn_fail(ctx, fn, "cudnnBackendCreateDescriptor(variant pack)", e);
    const char *call = "cudnnBackendSetAttribute(variant pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS)";
    e = lib.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n,
                                     uids);
    if (!e) {
        call = "cudnnBackendSetAttribute(variant pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS)";
        e = lib.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                         CUDNN_TYPE_VOID_PTR, n, ptrs);
    }
    if (!e) {
        call = "cudnnBackendSetAttribute(variant pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE)";
        e = lib.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                         CUDNN_TYPE_VOID_PTR, 1, &ws);
    }
    if (!e) call = "cudnnBackendFinalize(variant pack)", e = lib.cudnnBackendFinalize(vp);
    char exec[160];
    snprintf(exec, sizeof exec, "cudnnBackendExecute(execution plan of %s)", p->engine);
    if (!e) call = exec, e = lib.cudnnBackendExecute(s->cudnn->handle, p->plan, vp);
    lib.cudnnBackendDestroyDescriptor(vp);
    if (e) return cudnn_fail(ctx, fn, call, e);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* The by-value scalars' host values (read by cudnnBackendExecute, or baked
 * into a captured graph's kernel parameters): scale 1/sqrt(D) as every path
 * computes it, -inf for the mask (-FLT_MAX before cuDNN 9.10, as the
 * frontend gives it there) and one. */
typedef struct scalars {
    float scale, neg_inf, one;
} scalars;

static scalars scalars_of(int64_t D)
{
    return {1.0f / sqrtf((float)D), lib.version < 91000 ? -3.402823466e38f : -INFINITY, 1.0f};
}

/* The forward on qkv of in_dt (io's): O into o when o_t is that dtype, else
 * into scratch cast into o. */
static opf_status fwd_run(opf_ctx *ctx, const void *qkv, void *o, opf_dtype o_t, float *lse,
                          int64_t B, int64_t T, int64_t H, int64_t D, opf_dtype dt)
{
    const char *fn = FWD_FN;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    const cudnn_plan *p;
    opf_status st = plan_get(ctx, s, {B, T, H, D, dt, false, false}, fn, &p);
    if (st) return st;
    int64_t C = H * D, n_o = B * T * C;
    bool in_place = o_t == dt;
    size_t es = opf_dtype_nbytes(dt, 1);
    size_t o_bytes = in_place ? 0 : opf_cuda_pad256(es * (size_t)n_o);
    void *ws;
    if ((st = opf_cuda_scratch(ctx, s, o_bytes + (size_t)p->ws_bytes, &ws))) return st;
    char *o16 = in_place ? (char *)o : (char *)ws, *base = (char *)qkv;
    scalars v = scalars_of(D);
    const int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF};
    void *const ptrs[] = {base, base + es * C, base + es * 2 * C, o16, lse, &v.scale, &v.neg_inf};
    if ((st = plan_run(ctx, s, p, uids, ptrs, 7, (char *)ws + o_bytes, fn))) return st;
    return in_place ? OPF_OK : opf_cuda_attn_cast(ctx, o16, dt, o, o_t, n_o);
}

/* The backward on qkv, do and dqkv of in_dt (io's), O being o when o_t is
 * that dtype, else o cast into scratch; atomic: dQ through the fp32
 * accumulator (in our scratch). */
static opf_status bwd_run(opf_ctx *ctx, const void *qkv, const void *o, opf_dtype o_t,
                          const float *lse, const void *dout, void *dqkv, int64_t B, int64_t T,
                          int64_t H, int64_t D, opf_dtype dt, bool atomic)
{
    const char *fn = BWD_FN;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    const cudnn_plan *p;
    opf_status st = plan_get(ctx, s, {B, T, H, D, dt, true, atomic}, fn, &p);
    if (st) return st;
    int64_t C = H * D, n_o = B * T * C, rows = B * H * T;
    bool in_place = o_t == dt;
    size_t es = opf_dtype_nbytes(dt, 1);
    size_t o_bytes = in_place ? 0 : opf_cuda_pad256(es * (size_t)n_o);
    size_t sum_bytes = opf_cuda_pad256(sizeof(float) * (size_t)rows);
    size_t acc_bytes = atomic ? opf_cuda_pad256(sizeof(float) * (size_t)(rows * D)) : 0;
    void *ws;
    if ((st = opf_cuda_scratch(ctx, s, o_bytes + sum_bytes + acc_bytes + (size_t)p->ws_bytes, &ws)))
        return st;
    char *o16 = in_place ? (char *)o : (char *)ws;
    char *ssum = (char *)ws + o_bytes, *acc = ssum + sum_bytes;
    if (!in_place && (st = opf_cuda_attn_cast(ctx, o, o_t, o16, dt, n_o))) return st;
    if (atomic && lib.version < 90600)  /* the frontend zeroes dQ_accum itself before 9.6 */
        OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(acc, 0, sizeof(float) * (size_t)(rows * D),
                                              s->stream));
    char *q = (char *)qkv, *dq = (char *)dqkv;
    scalars v = scalars_of(D);
    const int64_t uids[] = {UID_Q,     UID_K,     UID_V,           UID_O,        UID_STATS,
                            UID_DO,    UID_DQ,    UID_DK,          UID_DV,       UID_SCALE,
                            UID_NEG_INF, UID_ONE, UID_SOFTMAX_SUM, UID_DQ_ACCUM};
    void *const ptrs[] = {q,        q + es * C,  q + es * 2 * C, o16,      (void *)lse,
                          (void *)dout, dq,      dq + es * C,    dq + es * 2 * C, &v.scale,
                          &v.neg_inf, &v.one,    ssum,           acc};
    return plan_run(ctx, s, p, uids, ptrs, atomic ? 14 : 13, acc + acc_bytes, fn);
}

opf_status opf_cuda_cudnn_graph_check(opf_ctx *ctx, bool bwd, bool atomic, int64_t B,
                                      int64_t T, int64_t H, int64_t D, opf_dtype dt, int *n_ops)
{
    const char *fn = bwd ? BWD_FN : FWD_FN;
    *n_ops = 0;
    opf_status st = lib_ready(ctx, fn);
    if (st) return st;
    if (lib.version < 90800)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: cuDNN %zu finalizes an operation graph "
                         "only with a handle (a GPU) before 9.8", fn, lib.version);
    if (dt != OPF_BF16 && dt != OPF_F16)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: the cuDNN graphs are bf16 or f16, not %s", fn,
                         opf_dtype_name(dt));
    cudnnBackendDescriptor_t og;
    gb *g = gb_graph(ctx, NULL, {B, T, H, D, dt, bwd, bwd && atomic}, fn, &og);
    if (!g) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    st = g->st;
    *n_ops = g->n_ops;
    gb_destroy_all(g->descs, g->n_descs);
    free(g);
    return st;
}

/* Whether this cuDNN takes the call for known faults (the frontend refuses
 * the same): 9.10.0 and 9.10.1 in both directions; before 9.16 the backward
 * of a T not a multiple of 128 (the frontend adds a padding mask there,
 * which this graph does not have). */
static bool cudnn_version_fits(int64_t T, bool bwd)
{
    if (lib.version == 91000 || lib.version == 91001) return false;
    return !bwd || lib.version > 91500 || T % 128 == 0;
}

/* OPF_OK with *use whether cuDNN runs the call (false: a known fault of this
 * version, or OPF_CUDNN_AUTO where the library does not load: flash2 runs
 * it); OPF_ERR_UNSUPPORTED when cuDNN is not usable and was asked for. */
static opf_status cudnn_usable(opf_ctx *ctx, const char *fn, int64_t T, bool bwd,
                               opf_cudnn_use mode, bool *use)
{
    pthread_once(&lib_once, lib_open);
    opf_status st = mode == OPF_CUDNN_AUTO && !lib.ok ? OPF_OK : lib_ready(ctx, fn);
    *use = !st && lib.ok && cudnn_version_fits(T, bwd);
    return st;
}

/* The forward with qkv cast to in_dt where stored otherwise (attn.cu's io). */
static opf_status fwd_typed(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, void *o,
                            opf_dtype o_t, float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                            opf_dtype in_dt)
{
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, FWD_FN, &io, qkv, qkv_t, NULL, in_dt, NULL, in_dt,
                                          in_dt, in_dt, B * T * 3 * H * D);
    if (st) return st;
    st = fwd_run(ctx, io.qkv, o, o_t, lse, B, T, H, D, in_dt);
    return opf_cuda_attn_io_close(ctx, &io, st);
}

/* The backward with qkv and do cast to in_dt where stored otherwise, dqkv
 * written as in_dt and cast into the caller's dtype after. */
static opf_status bwd_typed(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const void *o,
                            opf_dtype o_t, const float *lse, const void *dout, opf_dtype dout_t,
                            void *dqkv, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                            int64_t D, opf_dtype in_dt, bool atomic)
{
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, BWD_FN, &io, qkv, qkv_t, dout, dout_t, dqkv,
                                          dqkv_t, in_dt, in_dt, B * T * 3 * H * D);
    if (st) return st;
    st = bwd_run(ctx, io.qkv, o, o_t, lse, io.dout, io.dqkv, B, T, H, D, in_dt, atomic);
    return opf_cuda_attn_io_close(ctx, &io, st);
}

#endif /* OPF_HAVE_CUDNN */

/* ---- the entries ------------------------------------------------------------ */

/* Whether the default path (OPF_CUDNN_AUTO) hands a call cuDNN refused
 * (OPF_ERR_UNSUPPORTED: no engine takes the graph on this GPU and cuDNN) or
 * whose workspace did not fit (OPF_ERR_NO_MEMORY, before anything ran) to
 * flash2: then once a warning naming the reason, and the error cleared.
 * Any other mode or error stays the caller's. */
static bool auto_falls_back(opf_ctx *ctx, opf_cudnn_use mode, opf_status st)
{
    if (mode != OPF_CUDNN_AUTO || (st != OPF_ERR_UNSUPPORTED && st != OPF_ERR_NO_MEMORY))
        return false;
    char why[512];
    snprintf(why, sizeof why, "%s", opf_last_error(ctx));
    opf_ctx_warn_once(ctx, "cuda: cuDNN attention refused", "%s; flash2's kernels run "
                      "attention instead (OPF_CUDA_ATTENTION=flash2 picks them outright)", why);
    opf_clear_error(ctx);
    return true;
}

/* cuDNN reads and writes o itself only when it is stored as in_dt (then
 * it must be aligned as the others); any other o is scratch's. */
opf_status opf_cuda_attn_fwd_cudnn(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, void *o,
                                   opf_dtype o_t, float *lse, int64_t B, int64_t T, int64_t H,
                                   int64_t D, opf_dtype in_dt, opf_cudnn_use mode)
{
    const void *p[] = {qkv, lse, o_t == in_dt ? o : NULL};
    bool use = cudnn_fits(B, T, H, D, in_dt, p, 3);
    opf_status st = use ? cudnn_usable(ctx, FWD_FN, T, false, mode, &use) : OPF_OK;
    if (st) return st;
    if (use) st = fwd_typed(ctx, qkv, qkv_t, o, o_t, lse, B, T, H, D, in_dt);
    if (use && !auto_falls_back(ctx, mode, st)) return st;
    return opf_cuda_attn_fwd_typed_o(ctx, FWD_FN, opf_cuda_attn_fwd_flash2, qkv, qkv_t, o, o_t,
                                     lse, B, T, H, D, in_dt);
}

opf_status opf_cuda_attn_bwd_cudnn(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                   const void *o, opf_dtype o_t, const float *lse,
                                   const void *dout, opf_dtype dout_t, void *dqkv,
                                   opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                   opf_dtype in_dt, opf_cudnn_use mode)
{
    const void *p[] = {qkv, lse, dout, dqkv, o_t == in_dt ? o : NULL};
    bool use = cudnn_fits(B, T, H, D, in_dt, p, 5);
    /* the default keeps the deterministic backward's dP workspace (B H T T
     * 16-bit values, held by the scratch once grown) within AUTO_DP_MAX:
     * longer contexts take flash2, whose memory grows with T, not T^2 */
    double dp_bytes = 2.0 * (double)B * (double)H * (double)T * (double)T;
    if (mode == OPF_CUDNN_AUTO && dp_bytes > AUTO_DP_MAX) use = false;
    opf_status st = use ? cudnn_usable(ctx, BWD_FN, T, true, mode, &use) : OPF_OK;
    if (st) return st;
    if (use)
        st = bwd_typed(ctx, qkv, qkv_t, o, o_t, lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D, in_dt,
                       mode == OPF_CUDNN_ATOMIC);
    if (use && !auto_falls_back(ctx, mode, st)) return st;
    return opf_cuda_attn_bwd_typed_o(ctx, BWD_FN, opf_cuda_attn_bwd_flash2, qkv, qkv_t, o, o_t,
                                     lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D, in_dt);
}
