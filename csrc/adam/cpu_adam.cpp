// AdamW kernels: scalar reference, AVX2+FMA+F16C and AVX-512 spans, run-time dispatch, at::parallel_for.
#include "cpu_adam.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace mobiuspipe {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task at least (128 KiB of fp32)

inline float load_grad(const void* g, GradT gt, int64_t i) {
  switch (gt) {
    case GradT::BF16: return static_cast<float>(static_cast<const c10::BFloat16*>(g)[i]);
    case GradT::F16: return static_cast<float>(static_cast<const c10::Half*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

inline void store_out(void* out, OutT ot, int64_t i, float x) {
  if (ot == OutT::BF16) static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(x);  // round to nearest even
  else if (ot == OutT::F16) static_cast<c10::Half*>(out)[i] = c10::Half(x);
}

}  // namespace

void adam_span_scalar(const AdamParams& a, float* p, float* m, float* v, const void* g, GradT gt, void* out, OutT ot,
                      int64_t begin, int64_t end) {
  const float b1c = a.b1c, b2c = a.b2c;
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load_grad(g, gt, i);
    // The same operations, in the same order and with the same fused multiply-adds, as the SIMD spans:
    // an element rounds alike whether it falls in a vector body or a scalar tail.
    const float mi = std::fma(a.beta1, m[i], b1c * gi);
    const float vi = std::fma(a.beta2, v[i], (b2c * gi) * gi);
    const float denom = std::fma(std::sqrt(vi), a.inv_bc2_sqrt, a.eps);
    const float pi = std::fma(-a.step_size, mi / denom, p[i] * a.decay);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (ot != OutT::NONE) store_out(out, ot, i, pi);
  }
}

// ---------------------------------------------------------------- AVX2 + FMA + F16C (8 lanes)
namespace {
#define MP_AVX2 __attribute__((target("avx2,fma,f16c")))

MP_AVX2 inline __m256 load_grad8(const void* g, GradT gt, int64_t i) {
  if (gt == GradT::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (gt == GradT::F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(g) + i);
}

MP_AVX2 inline __m256i bf16_round8(__m256 x) {  // fp32 -> bf16 bits in the low half of each lane (RNE, NaN kept)
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}

MP_AVX2 inline void store_out8(void* out, OutT ot, int64_t i, __m256 x) {
  auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if (ot == OutT::F16) {
    _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else if (ot == OutT::BF16) {
    __m256i r = bf16_round8(x);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
  }
}
}  // namespace

MP_AVX2 void adam_span_avx2(const AdamParams& a, float* p, float* m, float* v, const void* g, GradT gt, void* out,
                            OutT ot, int64_t begin, int64_t end) {
  const __m256 b1 = _mm256_set1_ps(a.beta1), b1c = _mm256_set1_ps(a.b1c);
  const __m256 b2 = _mm256_set1_ps(a.beta2), b2c = _mm256_set1_ps(a.b2c);
  const __m256 eps = _mm256_set1_ps(a.eps), decay = _mm256_set1_ps(a.decay);
  const __m256 nstep = _mm256_set1_ps(-a.step_size), ibc2 = _mm256_set1_ps(a.inv_bc2_sqrt);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = load_grad8(g, gt, i);
    const __m256 mi = _mm256_fmadd_ps(b1, _mm256_loadu_ps(m + i), _mm256_mul_ps(b1c, gi));
    const __m256 vi = _mm256_fmadd_ps(b2, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_mul_ps(b2c, gi), gi));
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), ibc2, eps);
    const __m256 pi = _mm256_fmadd_ps(nstep, _mm256_div_ps(mi, denom), _mm256_mul_ps(_mm256_loadu_ps(p + i), decay));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
    if (ot != OutT::NONE) store_out8(out, ot, i, pi);
  }
  adam_span_scalar(a, p, m, v, g, gt, out, ot, i, end);
}

// ---------------------------------------------------------------- AVX-512F (16 lanes)
namespace {
#define MP_AVX512 __attribute__((target("avx512f")))

MP_AVX512 inline __m512 load_grad16(const void* g, GradT gt, int64_t i) {
  if (gt == GradT::BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (gt == GradT::F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(g) + i);
}

MP_AVX512 inline void store_out16(void* out, OutT ot, int64_t i, __m512 x) {
  auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
  if (ot == OutT::F16) {
    _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else if (ot == OutT::BF16) {
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(r));
  }
}
}  // namespace

MP_AVX512 void adam_span_avx512(const AdamParams& a, float* p, float* m, float* v, const void* g, GradT gt, void* out,
                                OutT ot, int64_t begin, int64_t end) {
  const __m512 b1 = _mm512_set1_ps(a.beta1), b1c = _mm512_set1_ps(a.b1c);
  const __m512 b2 = _mm512_set1_ps(a.beta2), b2c = _mm512_set1_ps(a.b2c);
  const __m512 eps = _mm512_set1_ps(a.eps), decay = _mm512_set1_ps(a.decay);
  const __m512 nstep = _mm512_set1_ps(-a.step_size), ibc2 = _mm512_set1_ps(a.inv_bc2_sqrt);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 gi = load_grad16(g, gt, i);
    const __m512 mi = _mm512_fmadd_ps(b1, _mm512_loadu_ps(m + i), _mm512_mul_ps(b1c, gi));
    const __m512 vi = _mm512_fmadd_ps(b2, _mm512_loadu_ps(v + i), _mm512_mul_ps(_mm512_mul_ps(b2c, gi), gi));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), ibc2, eps);
    const __m512 pi = _mm512_fmadd_ps(nstep, _mm512_div_ps(mi, denom), _mm512_mul_ps(_mm512_loadu_ps(p + i), decay));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, pi);
    if (ot != OutT::NONE) store_out16(out, ot, i, pi);
  }
  adam_span_avx2(a, p, m, v, g, gt, out, ot, i, end);  // AVX-512F implies AVX2/FMA/F16C
}

// ---------------------------------------------------------------- dispatch
std::vector<std::string> simd_paths() {
  std::vector<std::string> out;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    out.push_back("avx2");
  out.push_back("scalar");
  return out;
}

std::string resolve_simd(const std::string& requested) {
  std::string want = requested;
  if (want.empty() || want == "auto") {
    const char* env = std::getenv("MOBIUSPIPE_ADAM_SIMD");
    want = (env && *env) ? env : "auto";
  }
  const auto paths = simd_paths();
  if (want == "auto") return paths.front();
  for (const auto& p : paths)
    if (p == want) return p;
  TORCH_CHECK(false, "SIMD path '", want, "' is not supported on this CPU (supported: ", c10::Join(", ", paths), ")");
}

namespace {
AdamSpan span_for(const std::string& path) {
  if (path == "avx512") return adam_span_avx512;
  if (path == "avx2") return adam_span_avx2;
  return adam_span_scalar;
}

void check_f32(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, param has ", n);
}
}  // namespace

void adamw_step(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                c10::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay, const std::string& simd) {
  const int64_t n = param.numel();
  check_f32(param, "param", n);
  check_f32(exp_avg, "exp_avg", n);
  check_f32(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "step must be >= 1");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n,
              "grad must be contiguous, CPU, same size");
  GradT gt = GradT::F32;
  if (grad.scalar_type() == at::kBFloat16) gt = GradT::BF16;
  else if (grad.scalar_type() == at::kHalf) gt = GradT::F16;
  else TORCH_CHECK(grad.scalar_type() == at::kFloat, "grad must be fp32, bf16 or fp16");
  OutT ot = OutT::NONE;
  void* outp = nullptr;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->device().is_cpu() && out->is_contiguous() && out->numel() == n,
                "out must be contiguous, CPU, same size");
    TORCH_CHECK(out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf, "out must be bf16 or fp16");
    ot = out->scalar_type() == at::kBFloat16 ? OutT::BF16 : OutT::F16;
    outp = out->data_ptr();
  }
  AdamParams a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.eps = static_cast<float>(eps);
  a.b1c = static_cast<float>(1.0 - beta1);
  a.b2c = static_cast<float>(1.0 - beta2);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  const AdamSpan span = span_for(resolve_simd(simd));
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const void* g = grad.data_ptr();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { span(a, p, m, v, g, gt, outp, ot, b, e); });
}

namespace {
// Rotates p -> v, m -> p, v -> m and mixes g's bits in (values are meaningless: it only moves the bytes).
template <typename G>
void floor_span(uint32_t* p, uint32_t* m, uint32_t* v, const G* g, uint16_t* o, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const uint32_t pi = p[i], mi = m[i], vi = v[i];
    p[i] = mi;
    m[i] = vi;
    v[i] = pi ^ static_cast<uint32_t>(g[i]);
    if (o) o[i] = static_cast<uint16_t>(pi);
  }
}
}  // namespace

void copy_floor(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                c10::optional<torch::Tensor> out) {
  const int64_t n = param.numel();
  check_f32(param, "param", n);
  check_f32(exp_avg, "exp_avg", n);
  check_f32(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(grad.is_cpu() && grad.is_contiguous() && grad.numel() == n && grad.element_size() >= 2,
              "grad must be a contiguous CPU tensor of param's size");
  TORCH_CHECK(!out.has_value() || !out->defined() ||
                  (out->is_cpu() && out->is_contiguous() && out->numel() == n && out->element_size() == 2),
              "out must be a contiguous 16-bit CPU tensor");
  auto* p = static_cast<uint32_t*>(param.data_ptr());
  auto* m = static_cast<uint32_t*>(exp_avg.data_ptr());
  auto* v = static_cast<uint32_t*>(exp_avg_sq.data_ptr());
  uint16_t* o = (out.has_value() && out->defined()) ? static_cast<uint16_t*>(out->data_ptr()) : nullptr;
  const bool wide = grad.element_size() == 4;
  const void* g = grad.data_ptr();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    if (wide) floor_span(p, m, v, static_cast<const uint32_t*>(g), o, b, e);
    else floor_span(p, m, v, static_cast<const uint16_t*>(g), o, b, e);
  });
}

}  // namespace mobiuspipe
