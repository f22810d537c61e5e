/* value_schemas.c: the field tables of the library's value structs that are
 * compared, hashed and printed outside their own layer: the recipe (the
 * fuser's plan cache compares it, the compile guard hashes it, checkpoints
 * print it). One table each, so a new field is one row. */
#include "op/op-impl.h"

static const opf_field recipe_kinds[] = {
    {.name = "none"}, {.name = "fp8-delayed"}, {.name = "fp8-current"}, {.name = "fp8-block"},
    {.name = "mxfp8"}, {.name = "nvfp4"}, {.name = "custom"}};
OPF_ENUM_VALUES(recipe_kind_enum, opf_recipe_kind, recipe_kinds);
_Static_assert(sizeof recipe_kinds / sizeof recipe_kinds[0] == OPF_RECIPE_COUNT, "every recipe kind");

static const opf_field formats[] = {
    {.name = "e4m3"}, {.name = "e5m2"}, {.name = "hybrid"}, {.name = "e2m1"}};
OPF_ENUM_VALUES(format_enum, opf_format, formats);
_Static_assert(sizeof formats / sizeof formats[0] == OPF_FORMAT_COUNT, "every format");

static const opf_field amax_algos[] = {{.name = "max"}, {.name = "most_recent"}};
OPF_ENUM_VALUES(amax_algo_enum, opf_amax_algo, amax_algos);
_Static_assert(sizeof amax_algos / sizeof amax_algos[0] == OPF_AMAX_ALGO_COUNT, "every amax algo");

static const opf_field overrides[] = {
    {.name = "none"}, {.name = "high_precision"}, {.name = "dequantized"}};
OPF_ENUM_VALUES(override_enum, opf_backward_override, overrides);
_Static_assert(sizeof overrides / sizeof overrides[0] == OPF_BACKWARD_OVERRIDE_COUNT,
               "every backward override");

/* Every field of opf_recipe (quant.h), in declaration order; the factory and
 * its user pointer by identity. */
static const opf_field recipe_fields[] = {
    OPF_F_ENUM_OF(opf_recipe, kind, recipe_kind_enum),
    OPF_F_ENUM_OF(opf_recipe, format, format_enum),
    OPF_F_F32(opf_recipe, margin),
    OPF_F_I32(opf_recipe, amax_history_len),
    OPF_F_ENUM_OF(opf_recipe, amax_algo, amax_algo_enum),
    OPF_F_BOOL(opf_recipe, reduce_amax),
    OPF_F_BOOL(opf_recipe, reject_nonfinite_amax),
    OPF_F_BOOL(opf_recipe, power_2_scales),
    OPF_F_F32(opf_recipe, amax_epsilon),
    OPF_F_I32(opf_recipe, x_block_dim),
    OPF_F_I32(opf_recipe, w_block_dim),
    OPF_F_I32(opf_recipe, grad_block_dim),
    OPF_F_BOOL(opf_recipe, mxfp8_2d_weights),
    OPF_F_BOOL(opf_recipe, nvfp4_rht),
    OPF_F_BOOL(opf_recipe, nvfp4_stochastic),
    OPF_F_BOOL(opf_recipe, nvfp4_2d_weights),
    OPF_F_REF(opf_recipe, factory),
    OPF_F_REF(opf_recipe, factory_user),
    OPF_F_ENUM_OF(opf_recipe, backward_override, override_enum),
};
const opf_schema opf_recipe_schema = {"recipe", sizeof(opf_recipe),
                                      (int)(sizeof recipe_fields / sizeof recipe_fields[0]),
                                      recipe_fields};
