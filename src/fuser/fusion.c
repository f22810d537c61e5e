/* fusion.c: the three fusion registries (joint, forward-only,
 * backward-only), plan building with identity mapping back to the basic ops,
 * and the scan helper behind sliding-window and anchor fusions
 * (as the anchor's fuser plans and fuses). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuser/fuser-impl.h"
#include "ops/ops-impl.h"

enum { MAX_FUSIONS = 64 };
typedef enum which { JOINT = 0, FORWARD = 1, BACKWARD = 2 } which;
static const char *const which_name[] = {"joint", "forward", "backward"};

typedef struct fusion {
    char          name[64];
    opf_fusion_fn fn;
    void         *user;
} fusion;

static fusion reg[3][MAX_FUSIONS];
static int n_reg[3];
static uint64_t reg_generation;  /* bumped by every change: cached plans of older ones are stale */
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;

static bool name_taken(const char *name)
{
    for (int w = 0; w < 3; w++)
        for (int i = 0; i < n_reg[w]; i++)
            if (!strcmp(reg[w][i].name, name)) return true;
    return false;
}

static opf_status add(which w, const char *name, opf_fusion_fn fn, void *user, bool prepend)
{
    const char *f = "opf_register_fusion";
    if (!name || !*name || strlen(name) >= sizeof reg[0][0].name || !fn)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: need a name of 1..63 chars and a function", f);
    pthread_mutex_lock(&reg_lock);
    opf_status st = OPF_OK;
    if (name_taken(name))
        st = opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: \"%s\" is already registered", f, name);
    else if (n_reg[w] == MAX_FUSIONS)
        st = opf_error(NULL, OPF_ERR_NO_MEMORY, "%s: %d %s fusions at most", f, MAX_FUSIONS, which_name[w]);
    if (!st) {
        fusion *r = reg[w];
        if (prepend) memmove(r + 1, r, sizeof *r * (size_t)n_reg[w]);
        fusion *slot = prepend ? &r[0] : &r[n_reg[w]];
        memset(slot, 0, sizeof *slot);
        snprintf(slot->name, sizeof slot->name, "%s", name);
        slot->fn = fn;
        slot->user = user;
        n_reg[w]++;
        reg_generation++;
    }
    pthread_mutex_unlock(&reg_lock);
    return st;
}

/* The built-in fusion functions of the ops layer, in the anchor's order. */
static void register_builtins(void)
{
    for (const opf_builtin_fusion *f = opf_builtin_fusions(); f->name; f++)
        OPF_ASSERT(add((which)f->which, f->name, f->fn, f->user, false) == OPF_OK);
}

opf_status opf_register_forward_fusion(const char *name, opf_fusion_fn fn, void *user, bool prepend)
{
    pthread_once(&builtin_once, register_builtins);
    return add(FORWARD, name, fn, user, prepend);
}

opf_status opf_register_backward_fusion(const char *name, opf_fusion_fn fn, void *user, bool prepend)
{
    pthread_once(&builtin_once, register_builtins);
    return add(BACKWARD, name, fn, user, prepend);
}

opf_status opf_register_joint_fusion(const char *name, opf_fusion_fn fn, void *user, bool prepend)
{
    pthread_once(&builtin_once, register_builtins);
    return add(JOINT, name, fn, user, prepend);
}

opf_status opf_unregister_fusion(const char *name)
{
    pthread_once(&builtin_once, register_builtins);
    pthread_mutex_lock(&reg_lock);
    for (int w = 0; w < 3; w++)
        for (int i = 0; i < n_reg[w]; i++)
            if (name && !strcmp(reg[w][i].name, name)) {
                memmove(&reg[w][i], &reg[w][i + 1], sizeof reg[w][0] * (size_t)(n_reg[w] - i - 1));
                n_reg[w]--;
                reg_generation++;
                pthread_mutex_unlock(&reg_lock);
                return OPF_OK;
            }
    pthread_mutex_unlock(&reg_lock);
    return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_unregister_fusion: no fusion \"%s\"",
                     name ? name : "(null)");
}

/* ---- running one registry over a list ------------------------------------------ */

/* Maps list[0..n) back to basic[0..nb): every op must be the next expected
 * basic op, or a fused op covering exactly the next ones. */
static opf_status map_back(opf_ctx *ctx, const char *fname, opf_op *const *list, int n,
                           opf_op *const *basic, int nb, int first, opf_plan_entry *entries)
{
    int at = 0;
    for (int i = 0; i < n; i++) {
        int k = opf_op_num_basic(list[i]);
        bool ok = list[i] && at + k <= nb;
        for (int j = 0; ok && j < k; j++) ok = opf_op_basic(list[i], j) == basic[at + j];
        if (!ok)
            return opf_error(ctx, OPF_ERR_INVALID_ARG,
                             "fusion \"%s\": its result does not map back to the basic ops (entry %d, "
                             "\"%s\", expected \"%s\"): a fusion may only replace contiguous runs, "
                             "never drop, duplicate or reorder ops", fname, i,
                             list[i] ? opf_op_name(list[i]) : "NULL",
                             at < nb ? opf_op_name(basic[at]) : "(end)");
        if (entries) entries[i] = (opf_plan_entry){list[i], first + at, k};
        at += k;
    }
    if (at != nb)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "fusion \"%s\": its result covers %d of %d basic ops", fname, at, nb);
    return OPF_OK;
}

static bool in_list(opf_op *const *list, int n, const opf_op *op)
{
    for (int i = 0; i < n; i++)
        if (list[i] == op) return true;
    return false;
}

/* Applies the registry w to *list (n ops, capacity nb); fused ops created
 * are recorded in the seq for destruction with the plans. */
static opf_status apply(opf_seq *seq, which w, opf_op **list, int *n, opf_op *const *basic, int nb,
                        int first)
{
    opf_op *out[OPF_MAX_GROUP_OPS];
    const opf_recipe *r = seq->has_recipe ? &seq->recipe : NULL;
    pthread_mutex_lock(&reg_lock);
    int count = n_reg[w];
    fusion f[MAX_FUSIONS];
    memcpy(f, reg[w], sizeof f[0] * (size_t)count);
    pthread_mutex_unlock(&reg_lock);
    for (int i = 0; i < count; i++) {
        int n_out = 0;
        opf_status st = f[i].fn(seq->ctx, list, *n, r, f[i].user, out, &n_out);
        if (!st && (n_out < 0 || n_out > *n))
            st = opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\" returned %d ops for %d",
                           f[i].name, n_out, *n);
        if (!st) st = map_back(seq->ctx, f[i].name, out, n_out, basic, nb, first, NULL);
        /* new fused ops belong to the plans from here, kept or not */
        opf_plan_slot *sl = &seq->slots[seq->cur_slot];
        for (int j = 0; j < n_out && j < *n; j++)
            if (out[j] && opf_op_is_fused(out[j]) && !in_list(list, *n, out[j]) &&
                !in_list(sl->fused, sl->n_fused, out[j]))
                sl->fused[sl->n_fused++] = out[j];
        if (st) return st;
        memcpy(list, out, sizeof *out * (size_t)n_out);
        *n = n_out;
    }
    return OPF_OK;
}

/* ---- the plan cache: a few plan sets by first_req ------------------------------- */

static void drop_slot(opf_plan_slot *sl)
{
    for (int i = 0; i < sl->n_fused; i++) opf_op_destroy(sl->fused[i]);
    sl->n_fused = 0;
    sl->used = false;
}

void opf_seq_drop_plans(opf_seq *seq, bool free_slots)
{
    for (int k = 0; k < OPF_PLAN_SLOTS; k++) {
        opf_plan_slot *sl = &seq->slots[k];
        drop_slot(sl);
        if (!free_slots) continue;
        size_t n = (size_t)(seq->n ? seq->n : 1);  /* as claim_slot sized them */
        opf_ctx_free(seq->ctx, sl->entries, 2 * n * sizeof *sl->entries);
        opf_ctx_free(seq->ctx, sl->counts, 2 * n * sizeof *sl->counts);
        opf_ctx_free(seq->ctx, sl->fused, 3 * n * sizeof *sl->fused);
        memset(sl, 0, sizeof *sl);
    }
    for (int g = 0; g < seq->n_groups; g++) {
        seq->groups[g].fwd = seq->groups[g].bwd = NULL;
        seq->groups[g].n_fwd = seq->groups[g].n_bwd = 0;
    }
    seq->planned = seq->plans_stale = false;
}

int opf_seq_take_fused(opf_seq *seq, opf_op ***ops)
{
    opf_plan_slot *sl = &seq->slots[seq->cur_slot];
    int n = seq->planned ? sl->n_fused : 0;
    *ops = NULL;
    if (n) {
        *ops = malloc(sizeof **ops * (size_t)n);
        if (!*ops) return -1;
        memcpy(*ops, sl->fused, sizeof **ops * (size_t)n);
    }
    sl->n_fused = 0;
    sl->used = false;  /* its plans point at ops the caller owns now */
    seq->planned = false;
    return n;
}

/* Plans of one group: joint, then forward and backward on the joint list. */
static opf_status plan_group(opf_seq *seq, opf_group *g)
{
    opf_op *const *basic = seq->ops + g->first;
    opf_op *joint[OPF_MAX_GROUP_OPS], *fw[OPF_MAX_GROUP_OPS], *bw[OPF_MAX_GROUP_OPS];
    int nj = g->count;
    if (nj > OPF_MAX_GROUP_OPS)
        return opf_error(seq->ctx, OPF_ERR_UNSUPPORTED, "seq: ops %d..%d form a fusible group of %d "
                         "ops, more than OPF_MAX_GROUP_OPS = %d; end the group earlier with a "
                         "callback step or a recompute span", g->first, g->first + nj - 1, nj,
                         OPF_MAX_GROUP_OPS);
    memcpy(joint, basic, sizeof *joint * (size_t)nj);
    opf_status st = OPF_OK;
    if (seq->fusions && g->count > 1 && seq->ops[g->first]->cls->fusible)
        st = apply(seq, JOINT, joint, &nj, basic, g->count, g->first);
    int nf = nj, nbw = nj;
    memcpy(fw, joint, sizeof *fw * (size_t)nj);
    memcpy(bw, joint, sizeof *bw * (size_t)nj);
    if (!st && seq->fusions && g->count > 1 && seq->ops[g->first]->cls->fusible) {
        st = apply(seq, FORWARD, fw, &nf, basic, g->count, g->first);
        if (!st) st = apply(seq, BACKWARD, bw, &nbw, basic, g->count, g->first);
    }
    /* a fused op must be able to run the pass it is planned in */
    for (int i = 0; i < nf && !st; i++)
        if (!fw[i]->cls->forward_impl)
            st = opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "seq: \"%s\" has no forward but was "
                           "planned in the forward pass", opf_op_name(fw[i]));
    for (int i = 0; i < nbw && !st; i++)
        if (!bw[i]->cls->backward_impl && bw[i]->cls->covers > 0)
            st = opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "seq: \"%s\" has no backward but was "
                           "planned in the backward pass", opf_op_name(bw[i]));
    if (!st) st = map_back(seq->ctx, "(plan)", fw, nf, basic, g->count, g->first, g->fwd);
    if (!st) st = map_back(seq->ctx, "(plan)", bw, nbw, basic, g->count, g->first, g->bwd);
    if (st) return st;
    g->n_fwd = nf;
    g->n_bwd = nbw;
    return OPF_OK;
}

/* Points the groups at slot k's plans. */
static void point_groups(opf_seq *seq, int k)
{
    opf_plan_slot *sl = &seq->slots[k];
    for (int g = 0; g < seq->n_groups; g++) {
        opf_group *gr = &seq->groups[g];
        gr->fwd = sl->entries + gr->first;
        gr->bwd = sl->entries + seq->n + gr->first;
        gr->n_fwd = sl->counts[2 * g];
        gr->n_bwd = sl->counts[2 * g + 1];
    }
    seq->cur_slot = k;
    sl->tick = ++seq->plan_tick;
}

/* A free slot, else the least recently used one (dropped), with its arrays. */
static opf_status claim_slot(opf_seq *seq, int *out)
{
    int k = 0;
    for (int i = 1; i < OPF_PLAN_SLOTS; i++)
        if (seq->slots[k].used && (!seq->slots[i].used || seq->slots[i].tick < seq->slots[k].tick)) k = i;
    opf_plan_slot *sl = &seq->slots[k];
    drop_slot(sl);
    size_t n = (size_t)(seq->n ? seq->n : 1);
    if (!sl->entries) sl->entries = opf_ctx_calloc(seq->ctx, 2 * n, sizeof *sl->entries);
    if (!sl->counts) sl->counts = opf_ctx_calloc(seq->ctx, 2 * n, sizeof *sl->counts);
    if (!sl->fused) sl->fused = opf_ctx_calloc(seq->ctx, 3 * n, sizeof *sl->fused);
    if (!sl->entries || !sl->counts || !sl->fused)
        return opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "seq: out of memory");
    *out = k;
    return OPF_OK;
}

/* Runs the fusion registries over every group into slot k. */
static opf_status build_slot(opf_seq *seq, int k)
{
    point_groups(seq, k);
    for (int g = 0; g < seq->n_groups; g++) {
        opf_group *gr = &seq->groups[g];
        opf_status st = plan_group(seq, gr);
        if (st) return st;
        seq->slots[k].counts[2 * g] = gr->n_fwd;
        seq->slots[k].counts[2 * g + 1] = gr->n_bwd;
    }
    return OPF_OK;
}

opf_status opf_seq_use_plans(opf_seq *seq, int first_req)
{
    pthread_once(&builtin_once, register_builtins);
    if (seq->plans_stale) opf_seq_drop_plans(seq, false);
    seq->planned = false;
    pthread_mutex_lock(&reg_lock);
    uint64_t gen = reg_generation;
    pthread_mutex_unlock(&reg_lock);
    for (int k = 0; k < OPF_PLAN_SLOTS; k++)
        if (seq->slots[k].used && seq->slots[k].key == first_req && seq->slots[k].registry == gen) {
            point_groups(seq, k);
            seq->planned = true;
            return OPF_OK;
        }
    if (!seq->first_forward_done) {
        for (int i = 0; i < seq->n; i++)
            if (seq->ops[i]->cls->pre_first_forward) seq->ops[i]->cls->pre_first_forward(seq->ops[i]);
        seq->first_forward_done = true;
    }
    int k = 0;
    opf_status st = claim_slot(seq, &k);
    if (!st && (st = build_slot(seq, k))) drop_slot(&seq->slots[k]);
    if (st) return st;
    seq->slots[k].used = true;
    seq->slots[k].key = first_req;
    seq->slots[k].registry = gen;
    seq->planned = true;
    return OPF_OK;
}

void opf_seq_set_fusions(opf_seq *seq, bool enabled)
{
    if (seq->fusions != enabled) {
        seq->planned = false;
        seq->plans_stale = true;  /* every cached plan saw the other setting */
        seq->epoch++;             /* compiled graphs hold the other plans */
    }
    seq->fusions = enabled;
}

