/* quant-impl.h: what the quant layer's files share: how a quantizer's
 * mutable state reaches a kernel. */
#ifndef OPFUSE_QUANT_IMPL_H
#define OPFUSE_QUANT_IMPL_H

#include "backend/backend-impl.h"

/* Row 0 of s's amax history (the amaxes recorded since the last update)
 * kept in the state's own arrays, and put back: a call that records amaxes
 * and is then refused forgets what it recorded (all-or-nothing). Neither
 * allocates nor waits for the device. */
void opf_delayed_state_keep_row0(opf_delayed_state *s);
void opf_delayed_state_rollback_row0(opf_delayed_state *s);

/* opf_delayed_state_update without a reduction for each non-NULL state of
 * states[0..count), those of one device and context batched into one
 * kernel call; ctx NULL: each state's own. Returns the first error (the
 * other states still update). */
opf_status opf_delayed_states_update(opf_ctx *ctx, opf_delayed_state *const *states, int count);

/* Sets qs's delayed-scaling pointers to q's slot of its delayed state (the
 * scale, and the slot's entry of amax-history row 0); leaves qs untouched
 * when q is NULL or has no delayed state. q must be validated. */
void opf_quantize_state_delayed(const opf_quantizer *q, opf_quantize_state *qs);
/* OPF_ERR_INVALID_ARG naming fn when q (may be NULL) has a delayed state in
 * the memory of another device than dev, the device of the tensors. */
opf_status opf_quantize_check_state_device(opf_ctx *ctx, const char *fn, const opf_quantizer *q,
                                           opf_device dev);

/* An enum value for a message: its name (from an opf_*_name function, which
 * gives "invalid" outside the enum), or "<value> (invalid)"; in buf. */
typedef struct opf_enum_label { char s[32]; } opf_enum_label;
const char *opf_enum_label_of(opf_enum_label *buf, const char *name, int value);

#endif
