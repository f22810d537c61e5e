/* recipe.c: recipe defaults and validation, the per-role quantizer rule of
 * each recipe (docs/numerics.md section 3), and the recipe state that holds
 * a module's quantizers and delayed-scaling state. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core-impl.h"
#include "opfuse/quant.h"
#include "quant/quant-impl.h"

static const char *const recipe_names[] = {
    [OPF_RECIPE_NONE] = "none",       [OPF_RECIPE_DELAYED] = "fp8-delayed",
    [OPF_RECIPE_CURRENT] = "fp8-current", [OPF_RECIPE_BLOCK] = "fp8-block",
    [OPF_RECIPE_MXFP8] = "mxfp8",     [OPF_RECIPE_NVFP4] = "nvfp4",
    [OPF_RECIPE_CUSTOM] = "custom",
};
_Static_assert(sizeof(recipe_names) / sizeof(recipe_names[0]) == OPF_RECIPE_COUNT,
               "recipe_names must list every recipe");

static const char *const role_names[] = {
    [OPF_ROLE_INPUT] = "input", [OPF_ROLE_WEIGHT] = "weight", [OPF_ROLE_OUTPUT] = "output",
    [OPF_ROLE_GRAD_OUTPUT] = "grad_output", [OPF_ROLE_GRAD_INPUT] = "grad_input",
};
_Static_assert(sizeof(role_names) / sizeof(role_names[0]) == OPF_ROLE_COUNT,
               "role_names must list every role");

static const char *const format_names[] = {
    [OPF_FORMAT_E4M3] = "e4m3", [OPF_FORMAT_E5M2] = "e5m2", [OPF_FORMAT_HYBRID] = "hybrid",
    [OPF_FORMAT_E2M1] = "e2m1",
};
_Static_assert(sizeof(format_names) / sizeof(format_names[0]) == OPF_FORMAT_COUNT,
               "format_names must list every format");

static const char *const algo_names[] = {
    [OPF_AMAX_MAX] = "max", [OPF_AMAX_MOST_RECENT] = "most_recent",
};
_Static_assert(sizeof(algo_names) / sizeof(algo_names[0]) == OPF_AMAX_ALGO_COUNT,
               "algo_names must list every amax algorithm");

static const char *const override_names[] = {
    [OPF_BACKWARD_NONE] = "none", [OPF_BACKWARD_HIGH_PRECISION] = "high_precision",
    [OPF_BACKWARD_DEQUANTIZED] = "dequantized",
};
_Static_assert(sizeof(override_names) / sizeof(override_names[0]) == OPF_BACKWARD_OVERRIDE_COUNT,
               "override_names must list every backward override");

const char *opf_recipe_name(opf_recipe_kind k)
{
    return (unsigned)k < OPF_RECIPE_COUNT ? recipe_names[k] : "invalid";
}

const char *opf_role_name(opf_tensor_role r)
{
    return (unsigned)r < OPF_ROLE_COUNT ? role_names[r] : "invalid";
}

const char *opf_format_name(opf_format f)
{
    return (unsigned)f < OPF_FORMAT_COUNT ? format_names[f] : "invalid";
}

const char *opf_amax_algo_name(opf_amax_algo a)
{
    return (unsigned)a < OPF_AMAX_ALGO_COUNT ? algo_names[a] : "invalid";
}

const char *opf_enum_label_of(opf_enum_label *buf, const char *name, int value)
{
    if (strcmp(name, "invalid")) snprintf(buf->s, sizeof buf->s, "%s", name);
    else snprintf(buf->s, sizeof buf->s, "%d (invalid)", value);
    return buf->s;
}

static bool is_backward(opf_tensor_role r) { return r == OPF_ROLE_GRAD_OUTPUT || r == OPF_ROLE_GRAD_INPUT; }

opf_recipe opf_recipe_default(opf_recipe_kind kind)
{
    opf_recipe r;
    memset(&r, 0, sizeof r);
    r.kind = kind;
    r.format = OPF_FORMAT_HYBRID;
    r.amax_history_len = 1024;
    r.amax_algo = OPF_AMAX_MAX;
    r.reduce_amax = true;
    r.x_block_dim = 1;
    r.w_block_dim = 2;
    r.grad_block_dim = 1;
    r.nvfp4_rht = true;
    r.nvfp4_stochastic = true;
    r.nvfp4_2d_weights = true;
    r.backward_override = OPF_BACKWARD_NONE;
    if (kind == OPF_RECIPE_BLOCK || kind == OPF_RECIPE_MXFP8) r.format = OPF_FORMAT_E4M3;
    if (kind == OPF_RECIPE_BLOCK) r.power_2_scales = true;
    if (kind == OPF_RECIPE_NVFP4) r.format = OPF_FORMAT_E2M1;
    return r;
}

/* 3.7: every recipe but delayed scaling takes a backward override; the
 * anchor refuses it there, so a delayed backward is always quantized. */
static opf_status validate_override(const opf_recipe *r, const char *fn, const char *name)
{
    opf_backward_override o = r->backward_override;
    if ((unsigned)o >= OPF_BACKWARD_OVERRIDE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: backward_override %d outside 0..%d", fn,
                         name, (int)o, OPF_BACKWARD_OVERRIDE_COUNT - 1);
    if (o != OPF_BACKWARD_NONE && r->kind == OPF_RECIPE_DELAYED)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: backward_override %s: "
                         "backward_override must be none for fp8-delayed", fn, name,
                         override_names[o]);
    return OPF_OK;
}

opf_status opf_recipe_validate(const opf_recipe *r)
{
    const char *fn = "recipe";
    OPF_CHECK_NULL(NULL, fn, r);
    opf_enum_label kl, fl, al;
    if ((unsigned)r->kind >= OPF_RECIPE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: kind %s", fn,
                         opf_enum_label_of(&kl, "invalid", (int)r->kind));
    const char *name = opf_recipe_name(r->kind);
    const char *format = opf_enum_label_of(&fl, opf_format_name(r->format), (int)r->format);
    bool fp8 = r->kind == OPF_RECIPE_DELAYED || r->kind == OPF_RECIPE_CURRENT ||
               r->kind == OPF_RECIPE_BLOCK || r->kind == OPF_RECIPE_MXFP8 ||
               r->kind == OPF_RECIPE_CUSTOM;
    if (fp8 && r->format != OPF_FORMAT_E4M3 && r->format != OPF_FORMAT_HYBRID)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s %s: format %s must be e4m3 or hybrid (e5m2 forward tensors do not "
                         "train)", fn, name, format);
    if (r->kind == OPF_RECIPE_NVFP4 && r->format != OPF_FORMAT_E2M1)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s nvfp4: format %s must be e2m1", fn,
                         format);
    if (r->kind == OPF_RECIPE_DELAYED) {
        if (r->amax_history_len < 1)
            return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: amax_history_len %d < 1", fn, name,
                             r->amax_history_len);
        if ((unsigned)r->amax_algo >= OPF_AMAX_ALGO_COUNT)
            return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: amax_algo %s is neither max nor "
                             "most_recent", fn, name,
                             opf_enum_label_of(&al, "invalid", (int)r->amax_algo));
        if (!(fabsf(r->margin) <= OPF_MAX_MARGIN))
            return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: margin %g outside -%d..%d", fn,
                             name, (double)r->margin, OPF_MAX_MARGIN, OPF_MAX_MARGIN);
    }
    if (!(r->amax_epsilon >= 0.0f))
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s %s: amax_epsilon %g must be >= 0", fn,
                         name, (double)r->amax_epsilon);
    if (r->kind == OPF_RECIPE_BLOCK) {
        int d[3] = {r->x_block_dim, r->w_block_dim, r->grad_block_dim};
        for (int i = 0; i < 3; i++)
            if (d[i] != 1 && d[i] != 2)
                return opf_error(NULL, OPF_ERR_INVALID_ARG,
                                 "%s %s: block dims (x %d, w %d, grad %d) must be 1 or 2", fn,
                                 name, d[0], d[1], d[2]);
        if (d[0] + d[1] + d[2] > 4)
            return opf_error(NULL, OPF_ERR_INVALID_ARG,
                             "%s %s: block dims (x %d, w %d, grad %d) put two 2D operands in one "
                             "GEMM; 2D x 2D is not supported", fn, name, d[0], d[1], d[2]);
    }
    if (r->kind == OPF_RECIPE_CUSTOM && !r->factory)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s custom: no quantizer factory", fn);
    return validate_override(r, fn, name);
}

static opf_dtype fp8_dtype(opf_format f, opf_tensor_role role)
{
    return f == OPF_FORMAT_E4M3 || (f == OPF_FORMAT_HYBRID && !is_backward(role)) ? OPF_E4M3
                                                                                 : OPF_E5M2;
}

static bool is_linear(const char *module_type)
{
    return module_type && (!strcmp(module_type, "linear") || !strcmp(module_type, "grouped_linear"));
}

/* The rule of 3.x for one role; *wants_delayed tells whether the quantizer
 * must be attached to the direction's delayed state. */
static opf_status role_quantizer(const opf_recipe *r, const opf_quantizer_role *role,
                                 opf_quantizer *out, bool *wants_delayed)
{
    opf_status st = opf_recipe_validate(r);
    if (st) return st;
    OPF_CHECK_NULL(NULL, "opf_recipe_quantizer", role);
    OPF_CHECK_NULL(NULL, "opf_recipe_quantizer", out);
    if ((unsigned)role->tensor >= OPF_ROLE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_recipe_quantizer: role %d (invalid)",
                         (int)role->tensor);
    opf_tensor_role t = role->tensor;
    bool grad = is_backward(t);
    *wants_delayed = r->kind == OPF_RECIPE_DELAYED;
    opf_quantizer q = opf_quantizer_default();
    q.qdtype = fp8_dtype(r->format, t);
    switch (r->kind) {
    case OPF_RECIPE_NONE:
        break;
    case OPF_RECIPE_DELAYED:
        q.scaling = OPF_SCALING_TENSOR;
        break;
    case OPF_RECIPE_CURRENT:
        q.scaling = OPF_SCALING_TENSOR;
        q.pow2_scales = r->power_2_scales;
        q.amax_epsilon = r->amax_epsilon;
        break;
    case OPF_RECIPE_BLOCK: {
        int dim = t == OPF_ROLE_WEIGHT ? r->w_block_dim : grad ? r->grad_block_dim : r->x_block_dim;
        q.scaling = dim == 2 ? OPF_SCALING_BLOCK_2D : OPF_SCALING_BLOCK_1D;
        q.pow2_scales = r->power_2_scales;
        q.amax_epsilon = r->amax_epsilon;
        break;
    }
    case OPF_RECIPE_MXFP8:
        q.scaling = OPF_SCALING_MXFP8;
        q.mxfp8_2d = r->mxfp8_2d_weights && t == OPF_ROLE_WEIGHT && is_linear(role->module_type);
        break;
    case OPF_RECIPE_NVFP4:
        q.qdtype = OPF_E2M1;
        q.scaling = t == OPF_ROLE_WEIGHT && r->nvfp4_2d_weights ? OPF_SCALING_NVFP4_2D
                                                                : OPF_SCALING_NVFP4_1D;
        q.rht = r->nvfp4_rht && t != OPF_ROLE_WEIGHT;
        q.stochastic = r->nvfp4_stochastic && grad;
        break;
    case OPF_RECIPE_CUSTOM: {
        opf_quantizer_request req;
        memset(&req, 0, sizeof req);
        req.quantizer = opf_quantizer_default();
        if ((st = r->factory(r->factory_user, role, &req)))
            return opf_error(NULL, st, "custom recipe: the factory failed for %s %s of \"%s\"",
                             role->module_type ? role->module_type : "module", opf_role_name(t),
                             role->name ? role->name : "");
        if (req.delayed) {
            *wants_delayed = true;
            q.scaling = OPF_SCALING_TENSOR;
            q.qdtype = fp8_dtype(req.format, t);
        } else {
            q = req.quantizer;
        }
        break;
    }
    default:
        break;
    }
    *out = q;
    return OPF_OK;
}

opf_status opf_recipe_quantizer(const opf_recipe *r, const opf_quantizer_role *role,
                                opf_quantizer *out)
{
    bool delayed;
    return role_quantizer(r, role, out, &delayed);
}

/* ---- recipe state ------------------------------------------------------------ */

/* One block from the context's allocator: the struct, then its quantizers. */
struct opf_recipe_state {
    opf_ctx           *ctx;
    size_t             bytes;      /* of the block */
    opf_recipe         recipe;
    int                num_gemms;
    opf_quantizer     *q;          /* [num_gemms][OPF_ROLE_COUNT], in the block */
    opf_delayed_state *delayed[2]; /* forward, backward */
};

/* Slot of a role in its direction's state: [input, weight, output] per GEMM
 * forward, [grad_output, grad_input] per GEMM backward (numerics.md 3). */
static int slot_of(opf_tensor_role role, int gemm)
{
    return is_backward(role) ? 2 * gemm + (role - OPF_ROLE_GRAD_OUTPUT) : 3 * gemm + role;
}

/* Delayed parameters of one direction: the recipe's, or for a custom recipe
 * those of its first delayed request (later ones must agree). */
typedef struct delayed_params {
    bool used;
    opf_format format;
    float margin;
    int history;
    opf_amax_algo algo;
} delayed_params;

static opf_status note_delayed(const opf_quantizer_request *req, delayed_params *p,
                               const char *role)
{
    delayed_params n = {true, req->format, req->margin, req->amax_history_len, req->amax_algo};
    if (!p->used) {
        *p = n;
        return OPF_OK;
    }
    if (p->format != n.format || p->margin != n.margin || p->history != n.history || p->algo != n.algo)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "custom recipe: delayed-scaling request for %s differs from the first "
                         "request of its direction (they share one state)", role);
    return OPF_OK;
}

/* For a custom recipe: which directions asked for delayed state, and with what. */
static opf_status custom_delayed_params(const opf_recipe *r, const char *mt, const char *name,
                                        int num_gemms, delayed_params p[2])
{
    for (int g = 0; g < num_gemms; g++)
        for (int t = 0; t < OPF_ROLE_COUNT; t++) {
            opf_quantizer_role role = {mt, (opf_tensor_role)t, name};
            opf_quantizer_request req;
            memset(&req, 0, sizeof req);
            req.quantizer = opf_quantizer_default();
            opf_status st = r->factory(r->factory_user, &role, &req);
            if (st)
                return opf_error(NULL, st, "custom recipe: the factory failed for %s of \"%s\"",
                                 opf_role_name((opf_tensor_role)t), name ? name : "");
            if (req.delayed && (st = note_delayed(&req, &p[is_backward((opf_tensor_role)t)],
                                                  opf_role_name((opf_tensor_role)t))))
                return st;
        }
    return OPF_OK;
}

static opf_status make_states(opf_ctx *ctx, opf_recipe_state *rs, const char *mt, const char *name)
{
    const opf_recipe *r = &rs->recipe;
    delayed_params p[2] = {{0}, {0}};
    if (r->kind == OPF_RECIPE_DELAYED) {
        for (int d = 0; d < 2; d++)
            p[d] = (delayed_params){true, r->format, r->margin, r->amax_history_len, r->amax_algo};
    } else if (r->kind == OPF_RECIPE_CUSTOM) {
        opf_status st = custom_delayed_params(r, mt, name, rs->num_gemms, p);
        if (st) return opf_error(ctx, st, "%s", opf_last_error(NULL));
    }
    for (int d = 0; d < 2; d++) {
        if (!p[d].used) continue;
        opf_status st = opf_delayed_state_create(ctx, p[d].format, p[d].margin, p[d].history,
                                                 p[d].algo, d == 1,
                                                 (d ? 2 : 3) * rs->num_gemms, &rs->delayed[d]);
        if (st) return st;
        opf_delayed_state_set_reject_nonfinite(rs->delayed[d], r->reject_nonfinite_amax);
    }
    return OPF_OK;
}

opf_status opf_recipe_state_create(opf_ctx *ctx, const opf_recipe *r, const char *module_type,
                                   const char *name, int num_gemms, opf_recipe_state **out)
{
    const char *fn = "opf_recipe_state_create";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, r);
    OPF_CHECK_NULL(ctx, fn, out);
    *out = NULL;
    opf_status st = opf_recipe_validate(r);
    if (st) return opf_error(ctx, st, "%s", opf_last_error(NULL));
    if (num_gemms < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: num_gemms %d < 1", fn, num_gemms);
    size_t head = (sizeof(opf_recipe_state) + _Alignof(opf_quantizer) - 1) /
                  _Alignof(opf_quantizer) * _Alignof(opf_quantizer);
    size_t bytes = head + (size_t)num_gemms * OPF_ROLE_COUNT * sizeof(opf_quantizer);
    opf_recipe_state *rs = opf_ctx_calloc(ctx, 1, bytes);
    if (!rs) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of memory (%zu bytes)", fn, bytes);
    opf_quantizer *q = (opf_quantizer *)((char *)rs + head);
    rs->ctx = ctx;
    rs->bytes = bytes;
    rs->recipe = *r;
    rs->num_gemms = num_gemms;
    rs->q = q;
    if ((st = make_states(ctx, rs, module_type, name))) goto fail;
    for (int g = 0; g < num_gemms; g++)
        for (int t = 0; t < OPF_ROLE_COUNT; t++) {
            opf_quantizer_role role = {module_type, (opf_tensor_role)t, name};
            opf_quantizer *qq = &q[g * OPF_ROLE_COUNT + t];
            bool wants_delayed;
            if ((st = role_quantizer(r, &role, qq, &wants_delayed))) {
                opf_error(ctx, st, "%s", opf_last_error(NULL));
                goto fail;
            }
            opf_delayed_state *ds = rs->delayed[is_backward((opf_tensor_role)t)];
            if (wants_delayed && ds) {
                qq->delayed = ds;
                qq->slot = slot_of((opf_tensor_role)t, g);
            }
        }
    *out = rs;
    return OPF_OK;
fail:
    opf_recipe_state_destroy(rs);
    return st;
}

void opf_recipe_state_destroy(opf_recipe_state *rs)
{
    if (!rs) return;
    opf_delayed_state_destroy(rs->delayed[0]);
    opf_delayed_state_destroy(rs->delayed[1]);
    opf_ctx_free(rs->ctx, rs, rs->bytes);
}

const opf_recipe *opf_recipe_state_recipe(const opf_recipe_state *rs) { return &rs->recipe; }

opf_status opf_recipe_state_quantizer(const opf_recipe_state *rs, opf_tensor_role role, int gemm,
                                      opf_quantizer *out)
{
    OPF_CHECK_NULL(NULL, "opf_recipe_state_quantizer", rs);
    OPF_CHECK_NULL(NULL, "opf_recipe_state_quantizer", out);
    opf_enum_label rl;
    if ((unsigned)role >= OPF_ROLE_COUNT || gemm < 0 || gemm >= rs->num_gemms)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "opf_recipe_state_quantizer: role %s gemm %d outside %d roles x %d gemms",
                         opf_enum_label_of(&rl, opf_role_name(role), (int)role), gemm,
                         OPF_ROLE_COUNT, rs->num_gemms);
    *out = rs->q[gemm * OPF_ROLE_COUNT + role];
    return OPF_OK;
}

opf_delayed_state *opf_recipe_state_delayed(opf_recipe_state *rs, bool backward)
{
    return rs ? rs->delayed[backward ? 1 : 0] : NULL;
}

opf_status opf_recipe_state_update(opf_ctx *ctx, opf_recipe_state *rs, bool backward,
                                   opf_amax_reduce_fn reduce, void *reduce_user)
{
    OPF_CHECK_NULL(ctx, "opf_recipe_state_update", rs);
    opf_delayed_state *ds = rs->delayed[backward ? 1 : 0];
    return ds ? opf_delayed_state_update(ctx, ds, reduce, reduce_user) : OPF_OK;
}

int64_t opf_recipe_state_nonfinite_amaxes(opf_recipe_state *rs)
{
    return rs ? opf_delayed_state_nonfinite_amaxes(rs->delayed[0]) +
                    opf_delayed_state_nonfinite_amaxes(rs->delayed[1])
              : 0;
}
