/* graph.cu: CUDA graphs for the compiler: stream capture on the context's
 * stream, instantiation, launch, and the kernels' scratch sized ahead of a
 * capture (growing it inside one would synchronize the stream, which a
 * capture forbids).
 *
 * The capture runs in thread-local mode: a call on this thread that a
 * captured stream cannot take (a synchronization, cudaMalloc, a host copy
 * that waits) fails and invalidates the capture instead of racing it, and
 * opf_cuda_capture_end reports it. Other threads' contexts are unaffected. */
#include <stdlib.h>

#include "backend/cuda/cuda-impl.h"

struct opf_cuda_graph {
    cudaGraphExec_t exec;
    size_t          n_nodes;  /* kernels, copies and fills captured */
};

opf_status opf_cuda_capture_begin(opf_ctx *ctx)
{
    const char *fn = "opf_cuda_capture_begin";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    cudaStreamCaptureStatus cs;
    OPF_CUDA_TRY(ctx, fn, cudaStreamIsCapturing(s->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone)
        return opf_error(ctx, OPF_ERR_STATE, "%s: the context's stream is already capturing", fn);
    OPF_CUDA_TRY(ctx, fn, cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal));
    s->captured = true;  /* from now on outgrown scratch is kept (runtime.cu) */
    return OPF_OK;
}

/* Ends the capture begun on ctx's stream (always, also after a failed node)
 * and instantiates what it recorded. */
opf_status opf_cuda_capture_end(opf_ctx *ctx, opf_cuda_graph **out)
{
    const char *fn = "opf_cuda_capture_end";
    OPF_CHECK_NULL(ctx, fn, out);
    *out = NULL;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(s->stream, &graph);
    if (e != cudaSuccess) {
        if (graph) cudaGraphDestroy(graph);
        return opf_cuda_fail(ctx, e, fn, "cudaStreamEndCapture (a call inside the capture "
                             "synchronized, allocated or copied to the host)");
    }
    opf_cuda_graph *g = (opf_cuda_graph *)calloc(1, sizeof *g);
    if (!g) {
        cudaGraphDestroy(graph);
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    }
    e = cudaGraphGetNodes(graph, NULL, &g->n_nodes);
    if (e == cudaSuccess) e = cudaGraphInstantiateWithFlags(&g->exec, graph, 0);
    cudaGraphDestroy(graph);  /* the executable graph keeps its own copy */
    if (e != cudaSuccess) {
        free(g);
        return opf_cuda_fail(ctx, e, fn, "cudaGraphInstantiateWithFlags");
    }
    *out = g;
    return OPF_OK;
}

opf_status opf_cuda_graph_launch(opf_ctx *ctx, opf_cuda_graph *g)
{
    const char *fn = "opf_cuda_graph_launch";
    OPF_CHECK_NULL(ctx, fn, g);
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (g->n_nodes) OPF_CUDA_TRY(ctx, fn, cudaGraphLaunch(g->exec, s->stream));
    return OPF_OK;
}

void opf_cuda_graph_free(opf_ctx *ctx, opf_cuda_graph *g)
{
    (void)ctx;
    if (!g) return;
    cudaGraphExecDestroy(g->exec);
    free(g);
}

size_t opf_cuda_graph_num_nodes(const opf_cuda_graph *g) { return g ? g->n_nodes : 0; }

opf_status opf_cuda_scratch_reserve(opf_ctx *ctx, size_t bytes)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "opf_cuda_scratch_reserve");
    if (!s) return OPF_ERR_STATE;
    void *p;
    if (!bytes) return OPF_OK;
    opf_status st = opf_cuda_scratch(ctx, s, bytes, &p);
    if (st || !s->other.stream || s->on_side) return st;
    opf_cuda_swap_lanes(s);  /* the side queue's scratch too (opf_cuda_side_fork) */
    st = opf_cuda_scratch(ctx, s, bytes, &p);
    opf_cuda_swap_lanes(s);
    return st;
}
