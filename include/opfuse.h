/* opfuse.h: everything public. */
#ifndef OPFUSE_H
#define OPFUSE_H
#include "opfuse/export.h"
#include "opfuse/status.h"
#include "opfuse/dtype.h"
#include "opfuse/tensor.h"
#include "opfuse/context.h"
#include "opfuse/quant.h"
#include "opfuse/gemm.h"
#include "opfuse/op.h"
#include "opfuse/ops.h"
#include "opfuse/fuser.h"
#include "opfuse/compile.h"
#include "opfuse/io.h"
#endif
