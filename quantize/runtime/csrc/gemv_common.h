// Shared by both kernel variants, each its own extension module (quantize/cpu_kernels.py):
//   avx512: gemv_avx512.cpp, gemv_bf16.cpp, fp8_inputs.cpp, fake_quant.cpp (-mavx512f/bw/vl/dq -mfma -mf16c)
//   avx2:   gemv_avx2.cpp, fp8_inputs.cpp, fake_quant.cpp                  (-mavx2 -mfma -mf16c, no AVX-512)
// Limits, input checks, the FP8 decoder and the functions both modules export. Anything that
// needs AVX-512 sits under __AVX512F__, so the avx2 module cannot reach it.
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

// Sum of each run of `group` floats of x (groups runs): the activation sums that per-group
// offsets multiply. A plain loop: a torch op here costs more in dispatch than it saves.
inline std::vector<float> group_sums(const float* x, int64_t groups, int64_t group) {
  std::vector<float> sums(groups, 0.f);
  for (int64_t i = 0; i < groups; ++i)
    for (int64_t k = i * group; k < (i + 1) * group; ++k) sums[i] += x[k];
  return sums;
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

inline void check_int4(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
}

inline void check_int8(const torch::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.is_contiguous(), "codes must be contiguous int8");
}

// codes (N, K) uint8 FP8 bytes; scales (N, K/group) float32.
inline void check_fp8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales, int64_t group) {
  const int64_t N = codes.size(0), K = codes.size(1);
  check_x(x, K);
  TORCH_CHECK(K % group == 0 && group % 16 == 0, "K=", K, " group=", group, " unsupported");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales must be (N, K/group) float32");
}

// y (..., N) for x (..., K): the caller's leading dims, so Python needs no reshapes.
inline torch::Tensor output_for(const torch::Tensor& x, int64_t N, bool zeroed) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return zeroed ? torch::zeros(sizes, x.options()) : torch::empty(sizes, x.options());
}

// ---- FP8 bytes (E4M3 or E5M2) -> float ----
// A byte becomes an fp16 bit pattern in one to three integer ops, and vcvtph2ps (F16C) makes it
// an exact float (subnormals included). E5M2 is fp16's top byte. E4M3 moved up 7 bits lands its
// exponent and mantissa in fp16's fields (value * 2^-8: the bias differs by 8, folded into the
// scales) with the sign at bit 14; adding that bit to itself carries it into bit 15.
// b: 16 bytes zero-extended to 16-bit lanes.
template <bool E4M3>
inline __m256i fp8_to_half(__m256i b) {
  if (!E4M3) return _mm256_slli_epi16(b, 8);
  const __m256i t = _mm256_slli_epi16(b, 7);
  return _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
}

inline __m256i widen_bytes(const uint8_t* w) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w)); }

// The functions both modules export, with the same signatures and layouts (gemv_avx512.cpp
// describes them); bf16_batches is only ever true on the avx512 module.
torch::Tensor gemv_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sb, int64_t group);
torch::Tensor gemv_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor sb, int64_t group, bool bf16_batches);
torch::Tensor gemv_fp8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group, bool e4m3,
                       bool bf16_batches);
std::vector<torch::Tensor> quantize_fp8_inputs(torch::Tensor x, double static_scale, bool e4m3);

// fake_quant.cpp: the integer grid's learned-rounding weight and its gradients (signround)
torch::Tensor fake_quant_int(torch::Tensor g, torch::Tensor v, torch::Tensor s, c10::optional<torch::Tensor> z,
                             double qmin, double qmax);
std::vector<torch::Tensor> fake_quant_int_backward(torch::Tensor dw, torch::Tensor g, torch::Tensor v,
                                                   torch::Tensor s, c10::optional<torch::Tensor> z,
                                                   double qmin, double qmax);

inline void def_common(pybind11::module& m) {
  m.def("gemv_int4", &gemv_int4, "y = x @ W^T with W packed int4 (per-group scale and offset)");
  m.def("gemv_int8", &gemv_int8, "y = x @ W^T with W int8 codes (per-group scale and offset)");
  m.def("gemv_fp8", &gemv_fp8, "y = x @ W^T, W float8 bytes (E4M3 or E5M2) with per-group scales");
  m.def("quantize_fp8_inputs", &quantize_fp8_inputs, "x / scale on the FP8 grid (as float32) and the scales");
  m.def("fake_quant_int", &fake_quant_int, "the integer grid's learned-rounding weight, (c - z) * s");
  m.def("fake_quant_int_backward", &fake_quant_int_backward, "its gradients for the offsets and the scales");
}

#ifdef __AVX512F__
template <bool E4M3>
inline __m512 fp8_chunk(const uint8_t* w) {
  return _mm512_cvtph_ps(fp8_to_half<E4M3>(widen_bytes(w)));
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
#endif  // __AVX512F__

}  // namespace lowbit
