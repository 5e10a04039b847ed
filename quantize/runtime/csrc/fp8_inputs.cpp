// FP8 activation quantization for the CPU FP8 kernel, in one pass instead of ~6 torch calls:
// x / scale clamped to the format's range and rounded to the nearest FP8 value (ties to even),
// as quantize.fp8.saturating_cast does. The scale is per row (dynamic: the row's absolute
// maximum over the format's maximum, 1 for an all-zero row) or one given value (static).
// Plain C++ that the compiler vectorises for each module's flags (AVX-512 or AVX2): branch-free
// bit operations, so both modules give the same bits.
#include "gemv_common.h"

#include <cmath>
#include <cstring>

namespace {

struct Fp8Grid {
  float max;           // largest finite value
  int mantissa_bits;   // 3 (E4M3) or 2 (E5M2)
  int min_normal_exp;  // -6 (E4M3) or -14 (E5M2); below it values are multiples of 2^(exp - bits)
};

// codes[k] = nearest FP8 value of clamp(x[k] / scale): the float32 mantissa rounded to the
// format's bits (ties to even, by adding just under half a unit plus the kept lowest bit), or
// below the normal range a multiple of the subnormal step.
void round_row(const float* x, float scale, const Fp8Grid& f, int64_t K, float* codes) {
  const int drop = 23 - f.mantissa_bits;
  const uint32_t half = (1u << (drop - 1)) - 1, keep = ~((1u << drop) - 1);
  const int q = f.mantissa_bits - f.min_normal_exp;  // subnormal step 2^-q
  const float up = std::ldexp(1.f, q), down = std::ldexp(1.f, -q), min_normal = std::ldexp(1.f, f.min_normal_exp);
  for (int64_t k = 0; k < K; ++k) {
    float v = x[k] / scale;
    v = v < -f.max ? -f.max : v;
    v = v > f.max ? f.max : v;
    uint32_t bits, subnormal;
    std::memcpy(&bits, &v, 4);
    const uint32_t normal = (bits + half + ((bits >> drop) & 1u)) & keep;
    const float steps = std::nearbyint(v * up) * down;
    std::memcpy(&subnormal, &steps, 4);
    const uint32_t small = 0u - (uint32_t)(std::fabs(v) < min_normal);  // a mask: a branch would stop vectorising
    bits = (subnormal & small) | (normal & ~small);
    std::memcpy(&codes[k], &bits, 4);
  }
}

// Non-negative floats order as their bit patterns do: an integer max, which vectorises.
float row_absmax(const float* x, int64_t K) {
  uint32_t m = 0;
  for (int64_t k = 0; k < K; ++k) {
    uint32_t bits;
    std::memcpy(&bits, &x[k], 4);
    m = std::max(m, bits & 0x7fffffffu);
  }
  float out;
  std::memcpy(&out, &m, 4);
  return out;
}

}  // namespace

// (codes: x's shape, float32 FP8 values; scales: x's leading dims + (1,)). static_scale > 0 is
// used for every row; otherwise each row gets its own.
std::vector<torch::Tensor> lowbit::quantize_fp8_inputs(torch::Tensor x, double static_scale, bool e4m3) {
  const int64_t K = x.dim() >= 1 ? x.size(-1) : 0;  // a 0-dim x fails the check below
  lowbit::check_x(x, K);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(K % 16 == 0, "x has ", K, " features, not a multiple of 16");
  const Fp8Grid f = e4m3 ? Fp8Grid{448.f, 3, -6} : Fp8Grid{57344.f, 2, -14};
  auto codes = torch::empty_like(x);
  auto sizes = x.sizes().vec();
  sizes.back() = 1;
  auto scales = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float scale = static_cast<float>(static_scale);
    if (static_scale <= 0) {
      scale = row_absmax(xp + m * K, K) / f.max;
      scale = scale > 0 ? scale : 1.f;
    }
    sp[m] = scale;
    round_row(xp + m * K, scale, f, K, codes.data_ptr<float>() + m * K);
  }
  return {codes, scales};
}
