/* builtins.c: registers every built-in op class once. */
#include "ops/ops-impl.h"

void opf_ops_register_builtins(void)
{
#define OPF_REGISTER(n) \
    OPF_ASSERT(opf_op_class_register_builtin(&opf_op_class_##n) == OPF_OK);
    OPF_BUILTIN_OPS(OPF_REGISTER)
    OPF_BUILTIN_FUSED_OPS(OPF_REGISTER)
#undef OPF_REGISTER
}
