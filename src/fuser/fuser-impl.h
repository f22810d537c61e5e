/* fuser-impl.h: the private layout of opf_seq, its groups and channels. */
#ifndef OPFUSE_FUSER_IMPL_H
#define OPFUSE_FUSER_IMPL_H

#include "core/core-impl.h"
#include "op/op-impl.h"
#include "opfuse/fuser.h"

/* Where an extra input comes from: a producer's extra output in the same
 * group, or the caller's public list. */
typedef struct opf_src {
    int op, slot;    /* producer (op index in the seq, extra-output slot); op < 0: public */
    int pub;         /* public input index when op < 0 */
} opf_src;

typedef struct opf_group {
    int             first, count;  /* basic ops [first, first + count) */
    opf_plan_entry *fwd, *bwd;     /* plans (count entries at most): the current slot's */
    int             n_fwd, n_bwd;
    /* activation recompute (recompute.c): rc the span it is, or -1 */
    int             rc;
    opf_tensor      rc_x;          /* the span's input, kept from forward to backward */
    uint64_t        rc_rng[2];     /* Philox offset at the span's forward; at the re-run */
    float          *rc_state;      /* delayed-scaling state: [2][rc_floats], the forward's, the current */
    size_t          rc_floats;
} opf_group;

/* A recompute span, by its first and last op (recompute.c). */
enum { OPF_RC_MAX = 64 };
typedef struct opf_rc_span {
    opf_op *first, *last;
} opf_rc_span;

/* One cached set of plans (every group's forward and backward) and the
 * fused ops they use. The plan cache keeps a few, keyed by the first op
 * needing backward, so flipping grad mode (activation recompute) switches
 * plans instead of re-running the fusion functions. */
enum { OPF_PLAN_SLOTS = 4 };
typedef struct opf_plan_slot {
    bool            used;
    int             key;        /* first_req the plans were made for */
    uint64_t        registry;   /* the fusion registries' generation they saw */
    uint64_t        tick;       /* last use, for eviction */
    opf_plan_entry *entries;    /* [2 * n]: group g's forward at g->first, backward at n + g->first */
    int            *counts;     /* [2 * n_groups]: entries of each group's forward, backward */
    opf_op        **fused;      /* [3 * n] fused ops the plans use, owned */
    int             n_fused;
} opf_plan_slot;

struct opf_seq {
    opf_ctx    *ctx;
    opf_op    **ops;
    int         n, cap;
    /* built on first use after a mutation */
    bool        built;
    opf_group  *groups;
    int         n_groups;
    opf_op_ctx *octx;                         /* [n] */
    opf_src    *in_src;                       /* [n][OPF_OP_MAX_EXTRA] */
    int        *out_pub;                      /* [n][OPF_OP_MAX_EXTRA]: public index or -1 */
    int         n_pub_in, n_pub_out;
    /* per-call state */
    opf_tensor *chan;                         /* [n][OPF_OP_MAX_EXTRA] extra outputs of the forward */
    opf_tensor *chan_grad;                    /* [n][OPF_OP_MAX_EXTRA] gradients flowing back */
    bool        pending;                      /* a forward awaits its backward */
    /* the backward's parameter gradients, staged until the whole backward
     * has run (exec.c): op i's at pgrad[param_off[i]] */
    opf_tensor *pgrad;                        /* [param_off[n]] */
    int        *param_off;                    /* [n + 1] */
    opf_spec    y_spec;                       /* its main output: what dy must match */
    int         first_req;
    /* plan cache */
    bool            planned;                  /* the groups point at a valid slot */
    bool            plans_stale;              /* drop every slot before the next use */
    opf_plan_slot   slots[OPF_PLAN_SLOTS];
    int             cur_slot;
    uint64_t        plan_tick;
    bool            key_valid;                /* recipe states match `recipe` */
    int             key_first_req;
    opf_recipe      recipe;                   /* the recipe of the last forward */
    bool            has_recipe;
    /* fusions */
    bool            fusions;                  /* on unless opf_seq_set_fusions(false) */
    bool            check_finite;             /* opf_seq_check_finite */
    bool            first_forward_done;       /* pre_first_forward ran */
    /* activation recompute */
    opf_rc_span     rc[OPF_RC_MAX];
    int             n_rc;
    int            *rc_of;                    /* [n] span of each op, or -1 (built) */
    const void    **rc_kw;                    /* [n] the kwargs of the forward a span re-runs */
    /* bumped whenever the ops' recipe state is rebuilt or the seq changes:
     * a compiled graph that baked quantizer state checks it */
    uint64_t        epoch;
    /* the optimizers over the seq's parameters, linked through them: while
     * there is one the ops are frozen (optim.c) */
    opf_optim      *optims;
};

/* The seq is going: its optimizers forget it (and refuse to step). */
void opf_optim_detach_seq(opf_seq *seq);

/* fusion.c */
/* Drops every cached plan and destroys their fused ops; free_slots also
 * frees the slots' arrays (the seq's shape changes). */
void opf_seq_drop_plans(opf_seq *seq, bool free_slots);
/* Hands the fused ops of the current plans to the caller (a compiled graph
 * keeps them alive); the seq rebuilds those plans on next use. Returns the
 * count; *ops is a malloc'ed array the caller frees (NULL when 0). */
int opf_seq_take_fused(opf_seq *seq, opf_op ***ops);
/* Points the groups at the plans for first_req: cached, or built now. */
opf_status opf_seq_use_plans(opf_seq *seq, int first_req);

/* recompute.c */
typedef enum opf_rc_phase {
    OPF_RC_MARK = 0,   /* forward, at the span's start: keep the Philox offset and scales */
    OPF_RC_ENTER = 1,  /* backward, before the re-run: put them back, keep the current ones */
    OPF_RC_LEAVE = 2,  /* backward, after the re-run: restore the current ones */
    OPF_RC_DROP = 3,   /* forward, after the span: drop what its ops saved (visitors only) */
} opf_rc_phase;
/* The state part of a phase of group g's recompute (eager and compiled;
 * nothing for OPF_RC_DROP). */
opf_status opf_seq_recompute_state(opf_seq *seq, int g, opf_rc_phase phase);
/* rc_of from the spans (-1 everywhere without one); refuses a span that
 * holds a non-fusible op. At build, before the groups. */
opf_status opf_seq_resolve_recompute(opf_seq *seq);
/* Refuses a span that reads a public extra input. At build, after the
 * groups (and their channels); sets each group's rc. */
opf_status opf_seq_check_recompute(opf_seq *seq);
/* True when basic ops a and b (adjacent) lie in different spans or one in none. */
bool opf_seq_rc_edge(const opf_seq *seq, int a, int b);
/* Releases the recompute state of every group (at unbuild). */
void opf_seq_rc_release(opf_seq *seq);
/* Drops the spans that name op (it leaves the seq). */
void opf_seq_rc_forget(opf_seq *seq, const opf_op *op);

/* seq.c: groups, channels, plans. */
opf_status opf_seq_build(opf_seq *seq);
void opf_seq_unbuild(opf_seq *seq);

/* exec.c, shared with the compiler (src/compile/). */
/* Recipes equal in every value field (the factory by identity); NULL == NULL. */
bool opf_recipe_same(const opf_recipe *a, const opf_recipe *b);
/* The first basic op whose backward must run for this call (n: none). */
int opf_seq_first_req(const opf_seq *seq, const opf_seq_call *call);
/* The recipe state and plans for a call (plan cache, as the anchor's). */
opf_status opf_seq_prepare_plans(opf_seq *seq, const opf_seq_call *call, int first_req);
/* Releases the parameter gradients a backward staged (pgrad). */
void opf_seq_release_staged(opf_seq *seq);
/* Delayed-scaling updates of every op after a forward or a backward. */
void opf_seq_update_delayed(opf_seq *seq, bool backward);
/* Channel gradients: the spec of a sum (acc's shape; acc's dtype when plain,
 * else f32) and out = a + b summed in fp32. */
opf_spec opf_grad_sum_spec(const opf_spec *acc);
opf_status opf_grad_sum(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_tensor *out);

#endif
