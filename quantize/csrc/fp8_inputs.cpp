// FP8 activation quantization for the CPU FP8 kernel, in one pass instead of ~6 torch calls:
// x / scale clamped to the format's range and rounded to the nearest FP8 value (ties to even),
// as quantize.fp8.saturating_cast does. The scale is per row (dynamic: the row's absolute
// maximum over the format's maximum, 1 for an all-zero row) or one given value (static).
#include "gemv_common.h"

namespace {

struct Fp8Grid {
  float max;           // largest finite value
  int mantissa_bits;   // 3 (E4M3) or 2 (E5M2)
  int min_normal_exp;  // -6 (E4M3) or -14 (E5M2); below it values are multiples of 2^(exp - bits)
};

// Nearest FP8 value of v (|v| <= max): the float32 mantissa rounded to the format's bits (ties
// to even, by adding just under half a unit plus the kept lowest bit), or below the normal range
// a multiple of the subnormal step.
inline __m512 round_to_grid(__m512 v, const Fp8Grid& f) {
  const int drop = 23 - f.mantissa_bits;
  __m512i bits = _mm512_castps_si512(v);
  const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(bits, drop), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), kept_lsb));
  const __m512 normal = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(~((1 << drop) - 1))));
  const int q = f.mantissa_bits - f.min_normal_exp;  // subnormal step 2^-q
  const __m512 steps = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(std::ldexp(1.f, q))),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 subnormal = _mm512_mul_ps(steps, _mm512_set1_ps(std::ldexp(1.f, -q)));
  const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(std::ldexp(1.f, f.min_normal_exp)),
                                             _CMP_LT_OQ);
  return _mm512_mask_blend_ps(small, normal, subnormal);
}

float row_absmax(const float* x, int64_t K) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  return _mm512_reduce_max_ps(m);
}

}  // namespace

// (codes: x's shape, float32 FP8 values; scales: x's leading dims + (1,)). static_scale > 0 is
// used for every row; otherwise each row gets its own.
std::vector<torch::Tensor> quantize_fp8_inputs(torch::Tensor x, double static_scale, bool e4m3) {
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
  float* cp = codes.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float scale = static_cast<float>(static_scale);
    if (static_scale <= 0) {
      scale = row_absmax(xp + m * K, K) / f.max;
      scale = scale > 0 ? scale : 1.f;
    }
    sp[m] = scale;
    const __m512 s = _mm512_set1_ps(scale), hi = _mm512_set1_ps(f.max), lo = _mm512_set1_ps(-f.max);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(xp + m * K + k), s), lo), hi);
      _mm512_storeu_ps(cp + m * K + k, round_to_grid(v, f));
    }
  }
  return {codes, scales};
}
