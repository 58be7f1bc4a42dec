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
// crc32c of A + B from crc32c(A), crc32c(B) and B's length: crc1 * x^(8 len2) mod P, xor crc2.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2);
// x^(8 n) mod P, the operator that crc32c_combine applies for a length n (reuse it for equal lengths).
uint32_t crc32c_shift(size_t n);
uint32_t crc32c_mulmod(uint32_t a, uint32_t b);  // a * b mod P, bit-reflected as the CRC itself

}  // namespace mobiuspipe
