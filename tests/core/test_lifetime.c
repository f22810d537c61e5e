/* test_lifetime.c: buffers that outlive their context, buffer headers from
 * the context's allocator (reused, not one malloc per tensor), and the
 * assert hook that cannot return into a broken invariant. */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

/* A user allocator that counts its calls and the blocks it has out. */
typedef struct counting {
    int calls, live;
} counting;

static void *count_alloc(void *user, size_t bytes, size_t align)
{
    counting *c = user;
    c->calls++;
    c->live++;
    return aligned_alloc(align, (bytes + align - 1) / align * align);
}

static void count_free(void *user, void *p)
{
    if (!p) return;
    ((counting *)user)->live--;
    free(p);
}

static opf_ctx *counted_ctx(counting *c)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.allocator = (opf_allocator){count_alloc, count_free, c};
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    return ctx;
}

static const opf_spec *small_spec(void)
{
    static opf_spec s;
    s = opf_spec_make(2, (int64_t[]){4, 8}, OPF_F32);
    return &s;
}

static void test_outlive(void)
{
    counting c = {0};
    opf_ctx *ctx = counted_ctx(&c);
    opf_tensor t, u;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, small_spec(), &t));
    opf_tensor_retain(&t, &u);
    opf_ctx_destroy(ctx);
    CHECK(c.live > 0, "destroy with a live buffer keeps what the buffer needs");
    ((float *)t.data[OPF_COMP_DATA])[31] = 1.0f;
    opf_tensor_release(&t);
    CHECK(c.live > 0, "one reference left: %d blocks out", c.live);
    opf_tensor_release(&u);
    CHECK(c.live == 0, "the last release frees the context: %d blocks left", c.live);

    ctx = counted_ctx(&c);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, small_spec(), &t));
    opf_tensor_release(&t);
    opf_ctx_destroy(ctx);
    CHECK(c.live == 0, "no live buffer: destroy frees everything, %d blocks left", c.live);
}

static void test_headers(void)
{
    enum { HELD = 300, CYCLES = 1000 };
    counting c = {0};
    opf_ctx *ctx = counted_ctx(&c);
    static opf_tensor held[HELD];
    int before = c.calls;
    for (int i = 0; i < HELD; i++) CHECK_OK(ctx, opf_tensor_alloc(ctx, small_spec(), &held[i]));
    int first = c.calls - before;
    CHECK(first > HELD && first <= HELD + 4,
          "%d tensors: %d allocator calls (their bytes and a few header slabs)", HELD, first);
    for (int i = 0; i < HELD; i++) opf_tensor_release(&held[i]);

    before = c.calls;
    for (int i = 0; i < CYCLES; i++) {
        opf_tensor t;
        CHECK_OK(ctx, opf_tensor_alloc(ctx, small_spec(), &t));
        opf_tensor_release(&t);
    }
    for (int i = 0; i < HELD; i++) CHECK_OK(ctx, opf_tensor_alloc(ctx, small_spec(), &held[i]));
    CHECK(c.calls - before == CYCLES + HELD,
          "headers come back from the free list: %d calls for %d tensors", c.calls - before,
          CYCLES + HELD);
    for (int i = 0; i < HELD; i++) opf_tensor_release(&held[i]);
    opf_ctx_destroy(ctx);
    CHECK(c.live == 0, "destroy returns the slabs: %d blocks left", c.live);
}

static int hook_fd = -1;

static void returning_hook(const char *file, int line, const char *expr)
{
    (void)file, (void)line;
    if (write(hook_fd, expr, strlen(expr)) < 0) _exit(3);
}

/* A failed assertion whose hook returns must still end the process. */
static void test_assert_aborts(void)
{
    int fds[2];
    CHECK(pipe(fds) == 0, "pipe");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        setrlimit(RLIMIT_CORE, &(struct rlimit){0, 0});      /* no core file */
        dup2(open("/dev/null", O_WRONLY), STDERR_FILENO);    /* the expected message */
        hook_fd = fds[1];
        opf_set_abort_hook(returning_hook);
        OPF_ASSERT(1 == 2);
        _exit(0);  /* reached only when the failed assertion returned */
    }
    close(fds[1]);
    char buf[64] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    CHECK(n > 0 && strcmp(buf, "1 == 2") == 0, "the hook saw the expression: \"%s\"", buf);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
          "the process aborted after the hook returned (status %#x)", status);
}

int main(void)
{
    test_assert_aborts();
    test_outlive();
    test_headers();
    TEST_DONE();
}
