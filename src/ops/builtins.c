/* builtins.c: registers every built-in op class once. */
#include "ops/ops-impl.h"

/* Fused classes land one file at a time while in flight. */
#define OPF_DO_PRAGMA(x) _Pragma(#x)
#define OPF_WEAK_CLASS(n) OPF_DO_PRAGMA(weak opf_op_class_##n)
OPF_BUILTIN_FUSED_OPS(OPF_WEAK_CLASS)

void opf_ops_register_builtins(void)
{
#define OPF_REGISTER(n) \
    OPF_ASSERT(opf_op_class_register_builtin(&opf_op_class_##n) == OPF_OK);
    OPF_BUILTIN_OPS(OPF_REGISTER)
#undef OPF_REGISTER
#define OPF_REGISTER_IF(n) \
    if (&opf_op_class_##n) OPF_ASSERT(opf_op_class_register_builtin(&opf_op_class_##n) == OPF_OK);
    OPF_BUILTIN_FUSED_OPS(OPF_REGISTER_IF)
#undef OPF_REGISTER_IF
}
