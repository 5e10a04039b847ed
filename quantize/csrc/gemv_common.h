// Shared by the AVX-512 kernel sources (gemv_avx512.cpp, gemv_bf16.cpp, fp8_inputs.cpp):
// limits, input checks, and the decoders both float32 and bf16 kernels use.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace lowbit {

// Batch-1 loops prefetch the weight stream this far ahead: they run ~15 instructions per cache
// line, so out-of-order execution alone keeps too few lines in flight to fill one core's share
// of the memory bandwidth (2-core EPYC, from DRAM: +6-24% for int4, 1-2 threads). Prefetches
// never fault, so running past the end of a buffer is harmless.
constexpr int64_t kPrefetchBytes = 8192;

// Row n of the output for all M activation rows, in blocks of up to 4.
template <typename RowFn>
void for_row_blocks(int64_t M, RowFn&& fn) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) fn(std::integral_constant<int, 4>{}, m);
  if (M - m >= 2) { fn(std::integral_constant<int, 2>{}, m); m += 2; }
  if (M - m == 1) fn(std::integral_constant<int, 1>{}, m);
}

// x: contiguous float32 (..., K), any leading dims (M rows in all).
inline void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
}

// x as check_x; sb: (N, K/group, 2).
inline void check_inputs(const torch::Tensor& x, const torch::Tensor& sb, int64_t K, int64_t group, int64_t chunk) {
  check_x(x, K);
  TORCH_CHECK(K % chunk == 0 && group % 16 == 0 && K % group == 0, "K=", K, " group=", group, " unsupported");
  TORCH_CHECK(sb.scalar_type() == torch::kFloat && sb.is_contiguous() && sb.size(1) == K / group, "sb must be (N, K/group, 2) float32");
}

// y (..., N) for x (..., K): the caller's leading dims, so Python needs no reshapes.
inline torch::Tensor output_for(const torch::Tensor& x, int64_t N, bool zeroed) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return zeroed ? torch::zeros(sizes, x.options()) : torch::empty(sizes, x.options());
}

// ---- FP8 bytes (E4M3 or E5M2) -> float ----
// A byte becomes an fp16 bit pattern in one to three integer ops, and vcvtph2ps makes it an exact
// float (subnormals included). E5M2 is fp16's top byte. E4M3 moved up 7 bits lands its exponent
// and mantissa in fp16's fields (value * 2^-8: the bias differs by 8, folded into the scales) with
// the sign at bit 14; adding that bit to itself carries it into bit 15.
template <bool E4M3>
inline __m512 fp8_chunk(const uint8_t* w) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w));
  if (!E4M3) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  const __m256i t = _mm256_slli_epi16(b, 7);
  return _mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
}


bool has_avx512_bf16();

// x (groups * group floats) -> bf16 bits (round to nearest even) and each group's sum of the
// rounded values. Needs AVX512-BF16.
void round_to_bf16(const float* x, int64_t groups, int64_t group, uint16_t* xb, float* xsum);

// Batches of 2+ rows on AVX512-BF16 dot products (gemv_bf16.cpp); they write every y element.
void int8_rows_bf16(const float* x, int64_t M, const int8_t* w, const float* sb, int64_t N, int64_t K,
                    int64_t group, float* y);
void fp8_rows_bf16(const float* x, int64_t M, const uint8_t* w, const float* scales, int64_t N, int64_t K,
                   int64_t group, bool e4m3, float* y);

}  // namespace lowbit
