/* test_op_memory.c: what an op instance costs. The op struct holds no
 * inline parameter or args arrays; an op's blocks (struct, config, args,
 * parameters) come from its context's counting allocator, so a thousand
 * small BasicLinear ops show their whole cost in opf_ctx_alloc_stats, and
 * destroying them gives every byte back. Parameters grow in place of a
 * fixed array and stay contiguous (GroupedLinear indexes them as one). */
#include "op/op-impl.h"
#include "test.h"

enum { N_OPS = 1000 };

static size_t live(opf_ctx *ctx)
{
    opf_alloc_stats s;
    opf_ctx_alloc_stats(ctx, &s);
    return s.bytes_live;
}

static uint64_t n_alloc(opf_ctx *ctx)
{
    opf_alloc_stats s;
    opf_ctx_alloc_stats(ctx, &s);
    return s.n_alloc;
}

static void test_sizeof(void)
{
    printf("sizeof(opf_op) = %zu bytes, sizeof(opf_param) = %zu\n", sizeof(opf_op),
           sizeof(opf_param));
    CHECK(sizeof(opf_op) < 2048, "sizeof(opf_op) = %zu", sizeof(opf_op));
}

/* Bytes live after creating N_OPS 8x8 BasicLinear ops into ops. */
static size_t create_linears(opf_ctx *ctx, opf_op **ops)
{
    opf_basic_linear_config c = {.in_features = 8, .out_features = 8, .dtype = OPF_F32};
    for (int i = 0; i < N_OPS; i++) CHECK_OK(ctx, opf_op_create(ctx, "basic_linear", &c, NULL, &ops[i]));
    return live(ctx);
}

static void test_basic_linear(opf_ctx *ctx)
{
    static opf_op *ops[N_OPS];
    opf_spec ws = opf_spec_make(2, (int64_t[]){8, 8}, OPF_F32);
    opf_layout L;
    CHECK_OK(NULL, opf_spec_layout(&ws, &L));
    size_t before = live(ctx);
    uint64_t allocs = n_alloc(ctx);
    size_t full = create_linears(ctx, ops);
    size_t per_op = (full - before) / N_OPS, weights = 2 * L.total_bytes;  /* value + grad */
    double per_alloc = (double)(n_alloc(ctx) - allocs) / N_OPS;
    printf("basic_linear 8x8 f32: %zu bytes per op (%zu of them value + grad), %.2f allocations\n",
           per_op, weights, per_alloc);
    CHECK(per_op - weights < 4096, "%zu bytes per op beyond the weights", per_op - weights);
    CHECK(per_alloc <= 5.0, "%.2f allocations per op", per_alloc);
    for (int i = 0; i < N_OPS; i++) opf_op_destroy(ops[i]);
    /* the context keeps the buffer headers' slabs; a second round reuses them */
    size_t kept = live(ctx);
    CHECK(kept - before < (full - before) / 8, "%zu of %zu bytes kept", kept - before, full - before);
    CHECK(create_linears(ctx, ops) <= full, "the second round grew past %zu bytes", full);
    for (int i = 0; i < N_OPS; i++) opf_op_destroy(ops[i]);
    CHECK(live(ctx) == kept, "%zu bytes live after the second round, %zu after the first",
          live(ctx), kept);
}

/* 32 groups with bias: 64 parameters, grown from two slots, contiguous. */
static void test_grouped_params(opf_ctx *ctx)
{
    size_t before = live(ctx);
    opf_grouped_linear_config c = {.groups = 32, .in_features = 4, .out_features = 4, .bias = true,
                                   .dtype = OPF_F32};
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "grouped_linear", &c, NULL, &op));
    CHECK(op && opf_op_num_params(op) == 64, "%d parameters", op ? opf_op_num_params(op) : -1);
    for (int i = 1; op && i < 64; i++) {
        CHECK(opf_op_param(op, i) == opf_op_param(op, 0) + i, "parameter %d not contiguous", i);
        CHECK(opf_op_param(op, i)->value.data[0], "parameter %d has no value", i);
    }
    CHECK(op && !strcmp(opf_op_param(op, 33)->name, "bias1"), "parameter 33 is %s",
          op ? opf_op_param(op, 33)->name : "?");
    opf_op_destroy(op);
    CHECK(live(ctx) <= before, "%zu bytes live after destroy, %zu before", live(ctx), before);
}

/* A fused op's block is counted and given back like a basic op's. */
static void test_fused(opf_ctx *ctx)
{
    opf_basic_linear_config lc = {.in_features = 8, .out_features = 8, .dtype = OPF_F32};
    opf_op *b[2] = {NULL, NULL}, *f = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "basic_linear", &lc, NULL, &b[0]));
    CHECK_OK(ctx, opf_op_create(ctx, "bias", &(opf_bias_config){.size = 8, .dtype = OPF_F32},
                                NULL, &b[1]));
    size_t before = live(ctx);
    CHECK_OK(ctx, opf_fused_op_create(ctx, "forward_linear_bias", b, 2, &f));
    size_t cost = live(ctx) - before;
    printf("forward_linear_bias fused op: %zu bytes\n", cost);
    CHECK(f && cost > 0 && cost < 4096, "fused op costs %zu bytes", cost);
    CHECK(f && opf_op_num_params(f) == 2, "fused op has %d parameters", f ? opf_op_num_params(f) : -1);
    opf_op_destroy(f);
    CHECK(live(ctx) == before, "%zu bytes live after destroy, %zu before", live(ctx), before);
    opf_op_destroy(b[0]);
    opf_op_destroy(b[1]);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_sizeof();
    test_basic_linear(ctx);
    test_grouped_params(ctx);
    test_fused(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
