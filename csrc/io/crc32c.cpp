// CRC-32C: byte-table reference and the SSE4.2 crc32 instruction path, chosen at run time.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace mobiuspipe {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli polynomial, bit-reflected

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
  }
};
const Table kTable;

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t prev, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~prev;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); --n) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  for (; n; --n) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}

// Three independent streams over thirds of the range hide the crc32 instruction's 3-cycle latency; the
// three CRCs are then joined with crc32c_combine.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw3(uint32_t prev, const void* data, size_t n) {
  constexpr size_t kMin = 3 * 4096;  // below this the joins cost more than they save
  if (n < kMin) return crc32c_hw(prev, data, n);
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t part = (n / 3) & ~static_cast<size_t>(7);
  uint64_t ca = ~prev, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
  for (size_t i = 0; i < part; i += 8) {
    uint64_t wa, wb, wc;
    std::memcpy(&wa, p + i, 8);
    std::memcpy(&wb, p + part + i, 8);
    std::memcpy(&wc, p + 2 * part + i, 8);
    ca = _mm_crc32_u64(ca, wa);
    cb = _mm_crc32_u64(cb, wb);
    cc = _mm_crc32_u64(cc, wc);
  }
  const uint32_t crc_c = crc32c_hw(~static_cast<uint32_t>(cc), p + 3 * part, n - 3 * part);
  const uint32_t ab = crc32c_combine(~static_cast<uint32_t>(ca), ~static_cast<uint32_t>(cb), part);
  return crc32c_combine(ab, crc_c, n - 2 * part);
}
#endif

// Powers x^(2^k) mod P for k = 0..63 (bit-reflected: bit 31 is x^0), by repeated squaring.
struct Powers {
  uint32_t p[64];
  Powers() {
    p[0] = 1u << 30;  // x^1
    for (int k = 1; k < 64; ++k) p[k] = crc32c_mulmod(p[k - 1], p[k - 1]);
  }
};

}  // namespace

uint32_t crc32c_mulmod(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (uint32_t bit = 1u << 31; bit; bit >>= 1) {  // from x^0 upward in a
    if (a & bit) prod ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return prod;
}

uint32_t crc32c_shift(size_t n) {
  static const Powers powers;
  uint32_t r = 1u << 31;                        // x^0
  for (int k = 3; n && k < 64; n >>= 1, ++k) {  // 8 n = n * 2^3
    if (n & 1) r = crc32c_mulmod(powers.p[k], r);
  }
  return r;
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
  return crc32c_mulmod(crc32c_shift(len2), crc1) ^ crc2;
}

uint32_t crc32c_table(uint32_t prev, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~prev;
  while (n--) c = kTable.t[(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

bool crc32c_has_hw() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

uint32_t crc32c(uint32_t prev, const void* data, size_t n) {
#if defined(__x86_64__)
  static const bool hw = crc32c_has_hw();
  if (hw) return crc32c_hw3(prev, data, n);
#endif
  return crc32c_table(prev, data, n);
}

}  // namespace mobiuspipe
