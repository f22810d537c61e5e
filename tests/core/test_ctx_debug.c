/* test_ctx_debug.c: the debug aids of debug and sanitizer builds. A context
 * warns once when a second thread allocates through it; under
 * AddressSanitizer the blocks its caching allocator keeps are poisoned, so a
 * use after opf_ctx_free is reported, and unpoisoned when handed out again.
 * In a build without them (Release, no ASan) the test is skipped. */
#include <pthread.h>

#include "test.h"
#include "core/context-impl.h"

#if OPF_ASAN
#include <sanitizer/asan_interface.h>
#endif

static char warned[2048];
static int n_warned;
static void on_warn(void *user, const char *msg)
{
    (void)user;
    n_warned++;
    snprintf(warned, sizeof warned, "%s", msg);
}

static void *use_ctx(void *arg)
{
    opf_ctx *ctx = arg;
    opf_ctx_free(ctx, opf_ctx_alloc(ctx, 100), 100);
    return NULL;
}

static void in_thread(opf_ctx *ctx)
{
    pthread_t t;
    CHECK(pthread_create(&t, NULL, use_ctx, ctx) == 0, "pthread_create");
    pthread_join(t, NULL);
}

static void test_second_thread(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.warn = on_warn;
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    use_ctx(ctx);
    use_ctx(ctx);
    CHECK(n_warned == 0, "one thread warned: %s", warned);
    in_thread(ctx);
    CHECK(n_warned == 1 && strstr(warned, "second thread") && strstr(warned, "one thread"),
          "no warning about the second thread (%d): %s", n_warned, warned);
    use_ctx(ctx);
    in_thread(ctx);
    CHECK(n_warned == 1, "warned %d times", n_warned);
    opf_ctx_destroy(ctx);
}

static void test_poison(void)
{
#if OPF_ASAN
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    size_t n = 20000;
    char *p = opf_ctx_alloc(ctx, n);
    memset(p, 1, n);
    CHECK(!__asan_region_is_poisoned(p, n), "a fresh block is poisoned");
    opf_ctx_free(ctx, p, n);
    /* all but the cache's link in the first word */
    CHECK(__asan_address_is_poisoned(p + sizeof(void *)) && __asan_address_is_poisoned(p + n / 2) &&
          __asan_address_is_poisoned(p + n - 1), "a cached block is not poisoned");
    char *q = opf_ctx_alloc(ctx, n);
    CHECK(q == p, "the cache did not hand the block back");
    CHECK(!__asan_region_is_poisoned(q, n), "a block handed out again is still poisoned");
    opf_ctx_free(ctx, q, n);
    opf_ctx_destroy(ctx);  /* drains poisoned blocks */
#endif
}

int main(void)
{
    if (!OPF_CTX_THREAD_CHECK && !OPF_ASAN) {
        printf("skipped: a build without debug checks or AddressSanitizer\n");
        return 77;
    }
    if (OPF_CTX_THREAD_CHECK) test_second_thread();
    test_poison();
    TEST_DONE();
}
