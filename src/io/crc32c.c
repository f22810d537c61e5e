/* crc32c.c: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial
 * value and final xor 0xFFFFFFFF; the check value of "123456789" is
 * 0xE3069283), the checksum of iSCSI, ext4 and SSE4.2's crc32 instruction.
 * Byte-wise with a 256-entry table, built once per call: it costs 2,048
 * shifts, nothing beside a checkpoint's bytes, and needs no shared state. */
#include "io/io-impl.h"

static void crc32c_table(uint32_t t[256])
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        t[i] = c;
    }
}

uint32_t opf_crc32c(uint32_t crc, const void *data, size_t n)
{
    uint32_t t[256];
    crc32c_table(t);
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}
