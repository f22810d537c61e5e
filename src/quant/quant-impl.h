/* quant-impl.h: what the quant layer's files share: how a quantizer's
 * mutable state reaches a kernel. */
#ifndef OPFUSE_QUANT_IMPL_H
#define OPFUSE_QUANT_IMPL_H

#include "backend/backend-impl.h"

/* Sets qs's delayed-scaling pointers to q's slot of its delayed state (the
 * scale, and the slot's entry of amax-history row 0); leaves qs untouched
 * when q is NULL or has no delayed state. q must be validated. */
void opf_quantize_state_delayed(const opf_quantizer *q, opf_quantize_state *qs);

#endif
