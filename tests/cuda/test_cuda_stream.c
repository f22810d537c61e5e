/* test_cuda_stream.c: opf_ctx_set_stream. A CUDA context queues its work
 * on the caller's stream once it is set: a quantize + GEMM whose input the
 * caller writes on that stream behind a host callback that sleeps (work on
 * any other stream would read the memory before it is written) gives the
 * CPU's bytes (quantization) and its GEMM within numerics.md's tolerance;
 * back on the context's own stream, blocks freed on the caller's stream are
 * reused safely; the legacy default stream (a framework's default, (void *)1)
 * is taken; a switch makes the host wait for nothing; a switch to or away
 * from a stream that is capturing a graph is refused and leaves the capture
 * intact; the side queue of device-impl.h switches and joins without a host
 * wait and refuses a misplaced end. A CPU context refuses the entry with a message (this part runs
 * without a GPU too). Exits 77 (skipped) without a GPU. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include "test.h"

#ifdef OPF_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <time.h>

#include "core/device-impl.h"
#include "cuda_test.h"
#endif

enum { M = 128, N = 96, K = 256 };

static opf_ctx *gpu, *cpu;

static void test_cpu_refuses(void)
{
    CHECK_FAILS(cpu, opf_ctx_set_stream(cpu, NULL), OPF_ERR_UNSUPPORTED, "opf_ctx_set_stream",
                "cpu context has no stream");
    CHECK(opf_ctx_stream(cpu) == NULL, "a CPU context's stream %p", opf_ctx_stream(cpu));
    CHECK(opf_ctx_set_stream(NULL, NULL) == OPF_ERR_INVALID_ARG, "NULL ctx");
    CHECK(opf_ctx_stream(NULL) == NULL, "NULL ctx's stream");
}

#ifdef OPF_HAVE_CUDA

/* A host bf16 [r, c] tensor of values spread over magnitudes. */
static opf_tensor host_bf16(int64_t r, int64_t c)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, OPF_BF16);
    float *v = malloc((size_t)(r * c) * sizeof *v);
    cuda_test_fill(v, r * c, 1.0f, 0, false);
    opf_tensor t;
    CHECK_OK(cpu, cuda_test_host_tensor(cpu, &s, v, &t));
    free(v);
    return t;
}

static void CUDART_CB sleep_on_stream(void *unused)
{
    (void)unused;
    struct timespec t = {0, 100 * 1000 * 1000};
    nanosleep(&t, NULL);
}

/* A device copy of h written by the caller on stream st, late: behind a
 * host callback that sleeps, from pinned memory (*pinned: free it after
 * the stream is done). */
static opf_tensor late_device_copy(cudaStream_t st, const opf_tensor *h, void **pinned)
{
    opf_spec s = h->spec;
    s.device = OPF_DEVICE_CUDA;
    opf_tensor g;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &s, &g));
    size_t bytes = opf_tensor_buffer_bytes(h);
    CHECK(cudaMallocHost(pinned, bytes) == cudaSuccess, "cudaMallocHost");
    memcpy(*pinned, h->data[0], bytes);
    CHECK(cudaLaunchHostFunc(st, sleep_on_stream, NULL) == cudaSuccess, "cudaLaunchHostFunc");
    CHECK(cudaMemcpyAsync(g.data[0], *pinned, bytes, cudaMemcpyHostToDevice, st) == cudaSuccess,
          "cudaMemcpyAsync");
    return g;
}

/* Quantizes (per-tensor FP8, both copies) and multiplies (TN, bf16 out) the
 * caller's late copies on the context's current stream; checks the
 * quantized bytes against the CPU's and the GEMM within tolerance. */
static void quantize_gemm_on(cudaStream_t st, const char *where)
{
    opf_tensor x = host_bf16(M, K), w = host_bf16(N, K);
    void *px, *pw;
    opf_tensor gx = late_device_copy(st, &x, &px), gw = late_device_copy(st, &w, &pw);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR, q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor hqx, hqw, gqx, gqw, back;
    CHECK_OK(cpu, opf_quantize_alloc(cpu, &q, &x, &hqx));
    CHECK_OK(cpu, opf_quantize_alloc(cpu, &q, &w, &hqw));
    CHECK_OK(gpu, opf_quantize_alloc(gpu, &q, &gx, &gqx));
    CHECK_OK(gpu, opf_quantize_alloc(gpu, &q, &gw, &gqw));
    CHECK_OK(gpu, cuda_test_download(gpu, &gqx, &back));
    CHECK(cuda_test_same_bytes(&hqx, &back, where), "%s: quantize differs from the CPU (its "
          "input read before the caller's copy?)", where);
    opf_tensor_release(&back);
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_BF16);
    opf_tensor hd, gd;
    CHECK_OK(cpu, opf_tensor_alloc(cpu, &ds, &hd));
    ds.device = OPF_DEVICE_CUDA;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &ds, &gd));
    CHECK_OK(cpu, opf_gemm(cpu, &hqw, &hqx, OPF_GEMM_TN, NULL, &hd));
    CHECK_OK(gpu, opf_gemm(gpu, &gqw, &gqx, OPF_GEMM_TN, NULL, &gd));
    CHECK_OK(gpu, cuda_test_download(gpu, &gd, &back));
    static float ref[M * N], got[M * N];
    opf_convert(hd.data[0], OPF_BF16, ref, OPF_F32, M * N);
    opf_convert(back.data[0], OPF_BF16, got, OPF_F32, M * N);
    double e = cuda_test_rel_err(got, ref, M * N);
    printf("%s: fp8 gemm TN rel err %.2e\n", where, e);
    CHECK(e <= 8e-3, "%s: fp8 gemm rel err %.3e", where, e);
    CHECK(cudaStreamSynchronize(st) == cudaSuccess, "sync");
    cudaFreeHost(px);
    cudaFreeHost(pw);
    opf_tensor *ts[] = {&x, &w, &gx, &gw, &hqx, &hqw, &gqx, &gqw, &hd, &gd, &back};
    for (int i = 0; i < 11; i++) opf_tensor_release(ts[i]);
}

static uint64_t n_sync(void)
{
    opf_sync_stats s;
    opf_ctx_sync_stats(gpu, &s);
    return s.n_sync;
}

static void test_user_stream(void)
{
    void *own = opf_ctx_stream(gpu);
    CHECK(own != NULL, "a CUDA context has a stream of its own");
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, NULL));
    CHECK(opf_ctx_stream(gpu) == own, "NULL keeps the context's own stream");
    cudaStream_t us;
    CHECK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking) == cudaSuccess, "stream");
    uint64_t s0 = n_sync();
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, us));
    CHECK(n_sync() == s0, "a switch made the host wait");
    CHECK(opf_ctx_stream(gpu) == (void *)us, "the stream set is %p, not %p", opf_ctx_stream(gpu),
          (void *)us);
    quantize_gemm_on(us, "caller's stream");
    /* back on the context's own stream, the blocks freed above come back */
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, NULL));
    CHECK(opf_ctx_stream(gpu) == own, "back to the own stream");
    quantize_gemm_on((cudaStream_t)own, "own stream after a switch");
    /* the legacy default stream: what a framework's default stream is */
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, (void *)cudaStreamLegacy));
    quantize_gemm_on(cudaStreamLegacy, "legacy default stream");
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, NULL));
    CHECK_OK(gpu, opf_ctx_sync(gpu));
    CHECK(cudaStreamDestroy(us) == cudaSuccess, "stream destroy");
}

/* y = x w^T (bf16, TN) on the side queue: x and w written late on the
 * context's stream before the fork, so a side that did not wait for the
 * fork would read them unwritten. Eager, then captured and replayed; the
 * product against the CPU's, the host never waiting. */
static void side_gemm(cudaStream_t main_st, bool capture, const char *where)
{
    opf_tensor x = host_bf16(M, K), w = host_bf16(N, K);
    void *px, *pw;
    opf_tensor gx = late_device_copy(main_st, &x, &px), gw = late_device_copy(main_st, &w, &pw);
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_BF16);
    opf_tensor hd, gd, back;
    CHECK_OK(cpu, opf_tensor_alloc(cpu, &ds, &hd));
    ds.device = OPF_DEVICE_CUDA;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &ds, &gd));
    CHECK_OK(cpu, opf_gemm(cpu, &w, &x, OPF_GEMM_TN, NULL, &hd));
    uint64_t s0 = n_sync();
    opf_cuda_graph *g = NULL;
    if (capture) CHECK_OK(gpu, opf_cuda_capture_begin(gpu));
    bool forked = false;
    CHECK_OK(gpu, opf_device_side_fork(gpu, 4096, &forked));
    CHECK(forked, "%s: auto kept work of 4096 outputs off the side queue", where);
    CHECK(opf_ctx_stream(gpu) == (void *)main_st, "%s: the fork switched streams", where);
    if (forked) {
        CHECK_OK(gpu, opf_device_side_enter(gpu));
        CHECK(opf_ctx_stream(gpu) != (void *)main_st, "%s: on the side queue, work still goes "
              "to the context's stream", where);
        CHECK_FAILS(gpu, opf_ctx_set_stream(gpu, NULL), OPF_ERR_STATE, "opf_ctx_set_stream",
                    "side-queue work");
        CHECK_OK(gpu, opf_gemm(gpu, &gw, &gx, OPF_GEMM_TN, NULL, &gd));
        CHECK_OK(gpu, opf_device_side_join(gpu));
        CHECK(opf_ctx_stream(gpu) == (void *)main_st, "%s: the join left the side queue", where);
    }
    if (capture) {
        CHECK_OK(gpu, opf_cuda_capture_end(gpu, &g));
        CHECK_OK(gpu, opf_cuda_graph_launch(gpu, g));
    }
    CHECK(n_sync() == s0, "%s: the side queue made the host wait", where);
    CHECK_OK(gpu, cuda_test_download(gpu, &gd, &back));
    static float ref[M * N], got[M * N];
    opf_convert(hd.data[0], OPF_BF16, ref, OPF_F32, M * N);
    opf_convert(back.data[0], OPF_BF16, got, OPF_F32, M * N);
    double e = cuda_test_rel_err(got, ref, M * N);
    printf("%s: bf16 gemm TN rel err %.2e\n", where, e);
    CHECK(e <= 8e-3, "%s: bf16 gemm rel err %.3e (read x and w before they were written?)", where, e);
    CHECK_OK(gpu, opf_ctx_sync(gpu));
    opf_cuda_graph_free(gpu, g);
    cudaFreeHost(px);
    cudaFreeHost(pw);
    opf_tensor *ts[] = {&x, &w, &gx, &gw, &hd, &gd, &back};
    for (int i = 0; i < 7; i++) opf_tensor_release(ts[i]);
}

/* The side queue (device-impl.h): auto takes small work only; a GEMM there
 * waits for the work before the fork and the context's stream waits for it
 * at the join, eager and in a capture; misplaced calls are refused. */
static void test_side_queue(void)
{
    CHECK_FAILS(gpu, opf_device_side_enter(gpu), OPF_ERR_STATE, "opf_cuda_side_enter",
                "no fork before it");
    bool forked = true;
    CHECK_OK(gpu, opf_device_side_fork(gpu, (int64_t)1 << 40, &forked));
    CHECK(!forked, "auto took work of 2^40 outputs to the side queue");
    CHECK_OK(gpu, opf_device_side_join(gpu));  /* nothing entered: nothing to join */
    cudaStream_t main_st = (cudaStream_t)opf_ctx_stream(gpu);
    side_gemm(main_st, false, "side queue, eager");
    side_gemm(main_st, true, "side queue, captured");
}

/* Ends the capture on st, which must still be valid after `after`. */
static void end_capture(cudaStream_t st, const char *after)
{
    cudaGraph_t g = NULL;
    CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess, "end capture after %s", after);
    if (g) cudaGraphDestroy(g);
}

static void test_capture_refused(void)
{
    cudaStream_t us;
    CHECK(cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking) == cudaSuccess, "stream");
    CHECK(cudaStreamBeginCapture(us, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
    void *before = opf_ctx_stream(gpu);
    CHECK_FAILS(gpu, opf_ctx_set_stream(gpu, us), OPF_ERR_STATE, "opf_ctx_set_stream",
                "the new stream is capturing");
    CHECK(opf_ctx_stream(gpu) == before, "a refused switch changed the stream");
    /* the refusal left the capture intact: no query that breaks one ran */
    end_capture(us, "a refused switch to the capturing stream");
    /* the context's current stream capturing: no switch away from it either */
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, us));
    CHECK(cudaStreamBeginCapture(us, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
    CHECK_FAILS(gpu, opf_ctx_set_stream(gpu, NULL), OPF_ERR_STATE, "opf_ctx_set_stream",
                "the current stream is capturing");
    CHECK(opf_ctx_stream(gpu) == (void *)us, "a refused switch changed the stream");
    end_capture(us, "a refused switch away from the capturing stream");
    CHECK_OK(gpu, opf_ctx_set_stream(gpu, NULL));
    CHECK(opf_ctx_stream(gpu) == before, "back to the own stream after the capture");
    CHECK_OK(gpu, opf_ctx_sync(gpu));
    cudaStreamDestroy(us);
}

#endif

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);  /* as cuda_test_ctx: output survives a crash */
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu));
    test_cpu_refuses();
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    setenv("OPF_CUDA_SIDE", "auto", 1);  /* the side queue by size (off by default) */
    opf_status st = opf_ctx_create(&o, &gpu);
    if (st == OPF_ERR_UNSUPPORTED) {
        printf("SKIP: %s (the CPU context's refusal passed: %d checks)\n", opf_last_error(NULL),
               opf_test_pass);
        opf_ctx_destroy(cpu);
        return opf_test_fail ? 1 : 77;
    }
    CHECK_OK(NULL, st);
#ifdef OPF_HAVE_CUDA
    if (!st) {
        test_user_stream();
        test_capture_refused();
        test_side_queue();
    }
#endif
    opf_ctx_destroy(gpu);
    opf_ctx_destroy(cpu);
    TEST_DONE();
}
