/* philox.c: Philox4x32-10, the counter-based generator shared by CPU and
 * CUDA (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011). */
#include "opfuse/context.h"

enum {
    PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u,  /* round multipliers */
    PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u,  /* key schedule (Weyl) */
};

void opf_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
