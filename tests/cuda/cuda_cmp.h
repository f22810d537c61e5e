/* cuda_cmp.h: what the bit-exact GPU family tests (elem, optim, scale)
 * share: host/device buffer pairs, inputs with chosen kinds of edge values,
 * and a byte comparison that prints every differing case with its first
 * differing elements (a GPU run is rare: one run must say everything). */
#ifndef OPFUSE_CUDA_CMP_H
#define OPFUSE_CUDA_CMP_H

#include "cuda_test.h"

enum { CMP_SHOW = 4 };  /* differing elements printed per case */

/* Which edge values an input gets: the finite ones (huge values overflow
 * into infinities, whose NaNs are all x86's 0xFFC00000); the quiet NaN
 * 0x7FC00000 and no other edge (so no second kind of NaN); both kinds and
 * +-inf. Where every NaN has the same bits, x86 and the GPU agree on any
 * NaN result whatever operand order the CPU compiler chose; where two
 * kinds meet in one operation, the CPU's bits depend on that order. */
typedef enum cmp_edges { EDGES_FINITE = 0, EDGES_NAN = 1, EDGES_INF = 2, EDGES_NONE = 3 } cmp_edges;

static inline void cmp_fill(float *x, int64_t n, float scale, cmp_edges e)
{
    cuda_test_fill(x, n, scale, e == EDGES_NAN || e == EDGES_NONE ? 0 : 9, e == EDGES_INF);
    if (e != EDGES_NAN) return;
    for (int64_t i = 0; i < n; i++)
        if (cuda_test_u32() % 17 == 0) x[i] = NAN;
}

/* Compares n elements of es bytes; prints the case and up to CMP_SHOW
 * differing elements (index, reference bits, GPU bits). */
static inline bool cmp_bytes(const void *ref, const void *got, int64_t n, size_t es,
                             const char *what)
{
    if (!memcmp(ref, got, (size_t)n * es)) {
        CHECK(true, "%s", what);
        return true;
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *a = (const unsigned char *)ref + i * es, *b = (const unsigned char *)got + i * es;
        if (!memcmp(a, b, es)) continue;
        if (bad++ < CMP_SHOW) {
            uint64_t ra = 0, rb = 0;
            memcpy(&ra, a, es);
            memcpy(&rb, b, es);
            fprintf(stderr, "  %s: element %lld: cpu 0x%0*llx gpu 0x%0*llx\n", what, (long long)i,
                    (int)(2 * es), (unsigned long long)ra, (int)(2 * es), (unsigned long long)rb);
        }
    }
    CHECK(false, "%s: %lld of %lld elements differ", what, (long long)bad, (long long)n);
    return false;
}

/* Device bytes against host bytes. */
static inline bool cmp_device(opf_ctx *ctx, const void *ref, const void *dev, int64_t n, size_t es,
                              const char *what)
{
    void *got = malloc((size_t)n * es + 1);
    CHECK_OK(ctx, opf_cuda_copy(ctx, got, dev, (size_t)n * es, OPF_CUDA_D2H));
    bool ok = cmp_bytes(ref, got, n, es, what);
    free(got);
    return ok;
}

/* A device tensor's bytes against a host tensor's (same spec). */
static inline bool cmp_tensor(opf_ctx *ctx, const opf_tensor *ref, const opf_tensor *dev,
                              const char *what)
{
    return cmp_device(ctx, ref->data[OPF_COMP_DATA], dev->data[OPF_COMP_DATA],
                      opf_spec_numel(&ref->spec), opf_dtype_nbytes(ref->spec.dtype, 1), what);
}

/* A host tensor and its device copy. */
typedef struct cmp_pair { opf_tensor h, d; } cmp_pair;

static inline cmp_pair cmp_pair_of(opf_ctx *ctx, int nd, const int64_t *shape, opf_dtype dt,
                                   const float *vals)
{
    cmp_pair p;
    opf_spec s = opf_spec_make(nd, shape, dt);
    if (vals) {
        CHECK_OK(ctx, cuda_test_host_tensor(ctx, &s, vals, &p.h));
        CHECK_OK(ctx, cuda_test_upload(ctx, &p.h, &p.d));
    } else {  /* an output: zeros on both */
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &p.h));
        memset(p.h.data[OPF_COMP_DATA], 0, opf_dtype_nbytes(dt, (size_t)opf_spec_numel(&s)));
        CHECK_OK(ctx, cuda_test_upload(ctx, &p.h, &p.d));
    }
    return p;
}

static inline void cmp_pair_release(cmp_pair *p)
{
    opf_tensor_release(&p->h);
    opf_tensor_release(&p->d);
}

/* Device memory holding n bytes copied from host. */
static inline void *cmp_upload(opf_ctx *ctx, const void *host, size_t n)
{
    void *d = NULL;
    CHECK_OK(ctx, opf_cuda_alloc(ctx, n ? n : 1, &d));
    if (n) CHECK_OK(ctx, opf_cuda_copy(ctx, d, host, n, OPF_CUDA_H2D));
    return d;
}

#endif
