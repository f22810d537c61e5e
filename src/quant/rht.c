/* rht.c: opf_rht16, the 16-point random Hadamard transform of numerics.md
 * 3.4.3 on one vector; the transform itself (and its fixed summation order)
 * is the backend's opf_rht16_cols (src/backend/cpu/scale_math.c). */
#include "backend/scale-math.h"
#include "opfuse/quant.h"

void opf_rht16(const float *x, float *y, uint16_t sign_mask)
{
    opf_rht16_cols(x, 1, y, 1, 1, sign_mask);
}
