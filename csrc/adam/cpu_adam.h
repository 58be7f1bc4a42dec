// AdamW step over contiguous fp32 params/moments with fp32, bf16 or fp16 grads (SIMD with a scalar reference).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

namespace mobiuspipe {

// Hyper-parameters of one step, bias corrections precomputed in double on the caller's side.
struct AdamParams {
  float lr, beta1, beta2, eps, decay;  // decay = 1 - lr * weight_decay
  float b1c, b2c;                      // 1 - beta1, 1 - beta2 (rounded from double: 1 - 0.999f is off by 1e-5)
  float step_size;                     // lr / (1 - beta1^step)
  float inv_bc2_sqrt;                  // 1 / sqrt(1 - beta2^step)
};

enum class GradT { F32 = 0, BF16 = 1, F16 = 2 };
enum class OutT { NONE = 0, BF16 = 1, F16 = 2 };

// One span [begin, end) of the update; the three SIMD levels share this signature.
using AdamSpan = void (*)(const AdamParams&, float* p, float* m, float* v, const void* g, GradT gt, void* out, OutT ot,
                          int64_t begin, int64_t end);

void adam_span_scalar(const AdamParams&, float*, float*, float*, const void*, GradT, void*, OutT, int64_t, int64_t);
void adam_span_avx2(const AdamParams&, float*, float*, float*, const void*, GradT, void*, OutT, int64_t, int64_t);
void adam_span_avx512(const AdamParams&, float*, float*, float*, const void*, GradT, void*, OutT, int64_t, int64_t);

std::vector<std::string> simd_paths();  // the paths this CPU can run, best first
std::string resolve_simd(const std::string& requested);

void adamw_step(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                c10::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay, const std::string& simd);

// The memory floor of the update: reads p, m, v, g and writes p, m, v (and out) with no arithmetic.
void copy_floor(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                c10::optional<torch::Tensor> out);

}  // namespace mobiuspipe
