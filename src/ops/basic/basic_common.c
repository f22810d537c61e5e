/* basic_common.c: the args schemas and checks several basic ops share
 * (declared in ops-impl.h). Messages start with the op's class name, so each
 * reads as if its op had written it. */
#include "ops/ops-impl.h"

static const opf_field x_args_fields[] = {OPF_F_TENSOR_Q(opf_x_args, x)};
OPF_SHARED_SCHEMA(opf_x_args_schema, opf_x_args, x_args_fields);

static const opf_field dy_args_fields[] = {OPF_F_TENSOR_Q(opf_dy_args, dy)};
OPF_SHARED_SCHEMA(opf_dy_args_schema, opf_dy_args, dy_args_fields);

static bool same_shape(const opf_spec *a, const opf_spec *b)
{
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

opf_status opf_op_check_addends(opf_ctx *ctx, const opf_op *op, const char *what_a,
                                const opf_tensor *a, const char *what_b, const opf_tensor *b)
{
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    if (!opf_is_act_dtype(a->spec.dtype) || !opf_is_act_dtype(b->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": %s dtype %s, %s dtype %s, both must be "
                         "f32/bf16/f16", cls, name, what_a, opf_dtype_name(a->spec.dtype), what_b,
                         opf_dtype_name(b->spec.dtype));
    if (same_shape(&a->spec, &b->spec)) return OPF_OK;
    char sa[160], sb[160];
    opf_spec_str(&a->spec, sa, sizeof sa);
    opf_spec_str(&b->spec, sb, sizeof sb);
    return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": %s is %s, %s is %s; shapes must match", cls,
                     name, what_a, sa, what_b, sb);
}
