// CRC-32C (Castagnoli) of a byte range: SSE4.2 instruction where the CPU has it, a table otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mobiuspipe {

// Standard CRC-32C (init and final xor 0xFFFFFFFF); crc32c(prev, ...) continues a running checksum,
// so crc32c(crc32c(0, a), b) == crc32c(0, a + b). crc32c(0, "123456789") == 0xE3069283.
uint32_t crc32c(uint32_t prev, const void* data, size_t n);
uint32_t crc32c_table(uint32_t prev, const void* data, size_t n);  // the scalar reference
bool crc32c_has_hw();

}  // namespace mobiuspipe
