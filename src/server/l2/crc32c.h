/* CRC32C (Castagnoli), the checksum of the fs adapter's file trailer: SSE4.2 crc32 instructions
 * when the CPU has them, a slicing-by-8 table otherwise. Same result either way. */
#ifndef LMCACHE_SERVER_L2_CRC32C_H
#define LMCACHE_SERVER_L2_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continues a CRC: start with crc = 0; crc32c(crc32c(0, a), b) == crc32c(0, a ‖ b). */
uint32_t crc32c(uint32_t crc, const void *data, size_t len);

#endif
