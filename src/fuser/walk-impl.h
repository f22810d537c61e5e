/* walk-impl.h: the one interpreter of a seq's topology, shared by the eager
 * fuser (fuser/exec.c: real tensors, impls) and the compiler's tracer
 * (compile/trace.c: tagged tensors, fakes). It walks the plans, builds each
 * entry's env (neighbours' quantizers, recipe, grad flags, kwargs), routes
 * extra inputs and outputs through the group's channels and their gradients
 * back, and stops the backward early where nothing needs gradients
 * (the anchor's rule). What runs for an entry is the visitor's business. */
#ifndef OPFUSE_WALK_IMPL_H
#define OPFUSE_WALK_IMPL_H

#include "fuser/fuser-impl.h"

typedef struct opf_walker opf_walker;

/* What differs between executing and tracing. Every tensor handed out
 * (outs, dx, dextra_in, a new acc) becomes the walker's: it releases it
 * when replaced (tagged tensors have no buffer, so that is a no-op). */
typedef struct opf_walk_i {
    /* Runs entry e forward: outs[0] the main output, outs[1 + k] the k-th
     * extra output of the covered ops in order. */
    opf_status (*forward)(opf_walker *w, const opf_plan_entry *e, const opf_fwd_env *env,
                          opf_tensor *outs);
    /* Runs entry e backward: *dx the input gradient (empty: none),
     * dextra_in[k] the gradient of the k-th extra input (empty: none). */
    opf_status (*backward)(opf_walker *w, const opf_plan_entry *e, const opf_bwd_env *env,
                           opf_tensor *dx, opf_tensor *dextra_in);
    /* *acc += *g for channel gradients (acc empty: it takes g). */
    opf_status (*add_grad)(opf_walker *w, opf_tensor *acc, const opf_tensor *g);
    /* A phase of recompute group g (fuser-impl.h): the state part
     * (opf_seq_recompute_state, now or as a graph node), and for DROP what
     * the span's ops saved. MARK also keeps the kwargs of the forward. */
    opf_status (*recompute)(opf_walker *w, int g, opf_rc_phase phase);
} opf_walk_i;

struct opf_walker {
    opf_seq              *seq;
    const opf_walk_i     *vt;
    void                 *user;       /* the visitor's state */
    int                   first_req;  /* the first basic op whose backward runs */
    int                   save_from;  /* the first whose forward saves: set by the walks (walk.c) */
    const void *const    *kwargs;     /* [seq->n] per-op kwargs, or NULL */
    const opf_tensor     *extra_in;   /* [seq->n_pub_in] the public extra inputs */
    opf_tensor           *chan;       /* [seq->n][OPF_OP_MAX_EXTRA] extra outputs of the forward */
    opf_tensor           *chan_grad;  /* [seq->n][OPF_OP_MAX_EXTRA] their gradients */
};

/* The neighbours' quantizers of basic ops [first, last]: p[0] the previous
 * op's grad-output quantizer, p[1] the next op's input quantizer (copies in q). */
void opf_seq_neighbour_quantizers(const opf_seq *seq, int first, int last, opf_quantizer q[2],
                                  const opf_quantizer *p[2]);
/* The env of plan entry e except x and extra_in: neighbours' quantizers
 * (copies in qv), the seq's recipe, requires_grad (e reaches save_from, the
 * first op that must save: first_req or before it, walk.c's save_first) and
 * first_requires_grad (first_req's place in e, when inside it), and
 * kwargs (kw: the covered ops' entries of `kwargs`, which may be NULL). */
void opf_seq_entry_env(const opf_seq *seq, const opf_plan_entry *e, int first_req, int save_from,
                       const void *const *kwargs, opf_quantizer qv[2], const void *kw[OPF_FUSED_MAX],
                       opf_fwd_env *env);

/* The kwargs an entry's env carries: kw[k] the k-th covered op's entry of
 * kwargs (NULL when kwargs is NULL); an array for a fused op, else kw[0]. */
const void *opf_entry_kwargs(const opf_plan_entry *e, const void *const *kwargs,
                             const void *kw[OPF_FUSED_MAX]);

/* The forward plans from input x: *y the output (a reference the caller
 * owns); the extra outputs stay in w->chan. On error nothing is returned. */
opf_status opf_walk_forward(opf_walker *w, const opf_tensor *x, opf_tensor *y);
/* References to the public extra outputs of the last forward. */
void opf_walk_extra_out(const opf_walker *w, opf_tensor *extra_out);
/* The backward plans in reverse from dy and the public extra outputs'
 * gradients (dextra_out: [n_pub_out] or NULL). *dx gets the input gradient
 * (empty when the walk stopped early), dextra_in (may be NULL; [n_pub_in],
 * zeroed first) the public extra inputs' gradients. */
opf_status opf_walk_backward(opf_walker *w, const opf_tensor *dy, const opf_tensor *dextra_out,
                             opf_tensor *dx, opf_tensor *dextra_in);

#endif
