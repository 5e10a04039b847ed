// Weight-only low-bit GEMV / skinny GEMM for x86 CPUs with AVX2 + FMA + F16C and no AVX-512
// (AMD Zen 2/3, Intel Haswell to Comet Lake): the functions, layouts and float32 activations of
// gemv_avx512.cpp, 8 floats per register. Built as its own module with only -mavx2 -mfma -mf16c,
// so it never executes an AVX-512 instruction.
//
// One loop serves every weight type: per group, the stored values u (int4: the nibble 0..15,
// int8: the signed code, FP8: the decoded byte) are multiplied into the activations, and the
// group's sum is scaled once: sum w x = s sum(u x) + b X, X the group's activation sum (int4 and
// int8 carry the offset b; FP8 has none). That leaves convert + FMA per 8 weights, no per-chunk
// dequantization, and each output row's weights are read once for up to 4 activation rows.
#include "gemv_common.h"

using namespace lowbit;

namespace {

inline __m256 bytes_to_floats(__m128i i8) {  // the low 8 signed bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i8));
}

// Decoders: u for 16 weights from column c (a multiple of 16) of one output row's weights, and
// for 32 from c (a multiple of 32). kLine: columns per 64-byte cache line.
// int4 without shuffles (AVX2 has one shuffle port on Intel; pmovzx per 8 weights made the
// kernel shuffle-bound at ~9 GB/s per core): 8 bytes are broadcast to all four 64-bit lanes by
// a load, and one AND per 8 weights keeps in lane L the nibble of byte kByte[L] in place, at bit
// 8 * (L / 2); cvtdq2ps makes it u * 2^(8 * (L / 2)), exactly. prepare_x moves each activation
// to its weight's lane and scales it by the inverse power of two (exact), so the FMAs see u x.
// pack_int4 blocks: 32 weights in 16 bytes, weight i in byte i's low nibble, i + 16 in the high.
struct Int4 {
  static constexpr bool kOffset = true, kPrepareX = true;
  static constexpr int64_t kLine = 128;
  static constexpr int kByte[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // lane -> byte of the 8 loaded
  static const uint8_t* row(const uint8_t* w, int64_t n, int64_t K) { return w + n * (K / 2); }
  static const uint8_t* at(const uint8_t* row, int64_t c) { return row + c / 2; }
  static __m256i mask() { return _mm256_setr_epi32(0xF, 0xF, 0xF00, 0xF00, 0xF0000, 0xF0000, 0xF000000, 0xF000000); }
  // x (rows * K) -> xp: within each 32-column block, position 16h + 8p + L holds weight
  // 16h + 8p + kByte[L] (h: high nibbles, p: bytes 8-15) times 2^-(8 * (L / 2)).
  static void prepare_x(const float* x, int64_t n, float* xp) {
    constexpr float kScale[8] = {1.f, 1.f, 0x1p-8f, 0x1p-8f, 0x1p-16f, 0x1p-16f, 0x1p-24f, 0x1p-24f};
    for (int64_t base = 0; base < n; base += 32)
      for (int hp = 0; hp < 4; ++hp)
        for (int L = 0; L < 8; ++L) xp[base + 8 * hp + L] = x[base + 8 * hp + kByte[L]] * kScale[L];
  }
  static void decode8x2(const uint8_t* bytes, __m256* u) {  // u: the low nibbles, the high ones
    const __m256i q = _mm256_castpd_si256(_mm256_broadcast_sd((const double*)bytes));
    u[0] = _mm256_cvtepi32_ps(_mm256_and_si256(q, mask()));
    u[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q, 4), mask()));
  }
  static void decode16(const uint8_t* row, int64_t c, __m256* u) {
    const uint8_t* block = row + c / 32 * 16;
    __m256 t[2];
    for (int p = 0; p < 2; ++p) {
      decode8x2(block + 8 * p, t);
      u[p] = t[c % 32 != 0];
    }
  }
  static void decode32(const uint8_t* row, int64_t c, __m256* u) {
    __m256 t[4];
    decode8x2(row + c / 2, t);
    decode8x2(row + c / 2 + 8, t + 2);
    u[0] = t[0], u[1] = t[2], u[2] = t[1], u[3] = t[3];  // lo 0-7, lo 8-15, hi 0-7, hi 8-15
  }
};

struct Int8 {  // signed codes, one byte per weight
  static constexpr bool kOffset = true, kPrepareX = false;
  static constexpr int64_t kLine = 64;
  static const uint8_t* row(const uint8_t* w, int64_t n, int64_t K) { return w + n * K; }
  static const uint8_t* at(const uint8_t* row, int64_t c) { return row + c; }
  static void decode16(const uint8_t* row, int64_t c, __m256* u) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(row + c));
    u[0] = bytes_to_floats(b);
    u[1] = bytes_to_floats(_mm_srli_si128(b, 8));
  }
  static void decode32(const uint8_t* row, int64_t c, __m256* u) { decode16(row, c, u), decode16(row, c + 16, u + 2); }
};

template <bool E4M3>
struct Fp8 : Int8 {  // float8 bytes; E4M3 decodes to value * 2^-8 (the scales carry 2^8)
  static constexpr bool kOffset = false;
  static void decode16(const uint8_t* row, int64_t c, __m256* u) {
    const __m256i h = fp8_to_half<E4M3>(widen_bytes(row + c));
    u[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    u[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  static void decode32(const uint8_t* row, int64_t c, __m256* u) { decode16(row, c, u), decode16(row, c + 16, u + 2); }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One output row for MB activation rows (x at stride ldx, y at stride ldy). sb: the row's
// per-group s (and b with kOffset); xsum: X per activation row and group (stride G).
// 16 ymm registers: four accumulator chains in all (FMA latency), four decoded vectors.
template <typename W, int MB>
void weighted_row(const float* x, int64_t ldx, const float* xsum, const uint8_t* row, const float* sb,
                  int64_t K, int64_t group, float* y, int64_t ldy) {
  constexpr int kAcc = MB == 1 ? 4 : MB == 2 ? 2 : 1, stride = W::kOffset ? 2 : 1;
  const int64_t G = K / group;
  __m256 total[MB];
  float corr[MB] = {};
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MB][kAcc], u[4];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < kAcc; ++j) acc[m][j] = _mm256_setzero_ps();
    const auto fma = [&](int64_t c, int count) {  // count vectors of u from column c
      for (int m = 0; m < MB; ++m)
        for (int j = 0; j < count; ++j)
          acc[m][j % kAcc] = _mm256_fmadd_ps(u[j], _mm256_loadu_ps(x + m * ldx + c + 8 * j), acc[m][j % kAcc]);
    };
    int64_t c = g * group;
    const int64_t end = c + group;
    if (c % 32) { W::decode16(row, c, u); fma(c, 2); c += 16; }  // group % 32 == 16
    for (; c + 32 <= end; c += 32) {
      if (c % W::kLine == 0) _mm_prefetch((const char*)W::at(row, c) + kPrefetchBytes, _MM_HINT_T0);
      W::decode32(row, c, u);
      fma(c, 4);
    }
    if (c < end) { W::decode16(row, c, u); fma(c, 2); }
    const __m256 s = _mm256_set1_ps(sb[stride * g]);
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[m][0];
      for (int j = 1; j < kAcc; ++j) sum = _mm256_add_ps(sum, acc[m][j]);
      total[m] = _mm256_fmadd_ps(sum, s, total[m]);
      if (W::kOffset) corr[m] += sb[stride * g + 1] * xsum[m * G + g];
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = hsum(total[m]) + corr[m];
}

// y (M, N) = x (M, K) @ W^T; every y element written. The row's weights stay in L1/L2 while
// the activation rows pass in blocks of up to 4.
template <typename W>
void weighted_rows(const float* x, int64_t M, const uint8_t* w, const float* sb, int64_t N, int64_t K,
                   int64_t group, float* y) {
  const int64_t G = K / group, stride = W::kOffset ? 2 : 1;
  const std::vector<float> xsum = group_sums(x, W::kOffset ? M * G : 0, group);
  std::vector<float> prepared(W::kPrepareX ? M * K : 0);
  if constexpr (W::kPrepareX) {
    W::prepare_x(x, M * K, prepared.data());
    x = prepared.data();
  }
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for_row_blocks(M, [&](auto mb, int64_t m) {
        weighted_row<W, decltype(mb)::value>(x + m * K, K, xsum.data() + m * G, W::row(w, n, K), sb + n * G * stride,
                                             K, group, y + m * N + n, N);
      });
  });
}

}  // namespace

torch::Tensor lowbit::gemv_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sb, int64_t group) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_inputs(x, sb, K, group, 32);
  check_int4(packed);
  auto y = output_for(x, N, false);
  weighted_rows<Int4>(x.data_ptr<float>(), x.numel() / K, packed.data_ptr<uint8_t>(), sb.data_ptr<float>(), N, K,
                      group, y.data_ptr<float>());
  return y;
}

torch::Tensor lowbit::gemv_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor sb, int64_t group,
                                bool bf16_batches) {
  TORCH_CHECK(!bf16_batches, "the avx2 kernels have no bf16 dot products");
  const int64_t N = codes.size(0), K = codes.size(1);
  check_inputs(x, sb, K, group, 16);
  check_int8(codes);
  auto y = output_for(x, N, false);
  weighted_rows<Int8>(x.data_ptr<float>(), x.numel() / K, (const uint8_t*)codes.data_ptr<int8_t>(),
                      sb.data_ptr<float>(), N, K, group, y.data_ptr<float>());
  return y;
}

// y = x @ (W * scales)^T, W's float8 bytes as uint8. E4M3 scales must include the factor 2^8.
torch::Tensor lowbit::gemv_fp8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group, bool e4m3,
                               bool bf16_batches) {
  TORCH_CHECK(!bf16_batches, "the avx2 kernels have no bf16 dot products");
  check_fp8(x, codes, scales, group);
  const int64_t N = codes.size(0), K = codes.size(1), M = x.numel() / K;
  auto y = output_for(x, N, false);
  const auto run = e4m3 ? weighted_rows<Fp8<true>> : weighted_rows<Fp8<false>>;
  run(x.data_ptr<float>(), M, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K, group, y.data_ptr<float>());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { def_common(m); }
