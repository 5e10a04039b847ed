// AVX512-BF16 kernels (vdpbf16ps): int4 tiles at any batch size, int8 and FP8 weights in batches
// of two or more rows. Compiled with the bf16 target only inside the functions that use it, so
// the module still loads on AVX-512 CPUs without it (has_avx512_bf16() says which).
#include "gemv_common.h"

namespace lowbit {

bool has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

__attribute__((target("avx512f,avx512bw,avx512bf16")))
void round_to_bf16(const float* x, int64_t groups, int64_t group, uint16_t* xb, float* xsum) {
  for (int64_t g = 0; g < groups; ++g) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
      _mm256_storeu_si256((__m256i*)(xb + k), b);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    xsum[g] = _mm512_reduce_add_ps(sum);
  }
}

}  // namespace lowbit

using namespace lowbit;

// ---- int4 weights x bf16 activations with AVX512-BF16 dot products (vdpbf16ps) ----
// A nibble u becomes the bf16 value 128 + u by OR-ing 0x4300 into its 16-bit lane (bf16 has 7
// mantissa bits, so 128..143 are exact): one zero-extension and two ALU ops decode 64 weights,
// with no table lookups, and one vdpbf16ps does 32 multiply-adds. Per group g the dot product
// D = sum (128 + u) x is corrected with the group's activation sum X (from the same bf16 x):
// sum w x = s (D - 128 X) + b X.
// Layout int4 tiles: (N/4, K/64, 4, 32) uint8. Four output rows form a tile; for each 64-column
// block their 32-byte blocks follow each other, so one activation load serves four rows (from
// cache 1.5-1.7x the speed of a one-row loop) and each tile is one sequential stream.
// In a 32-byte block byte j holds weight j (low nibble) and weight j + 32 (high nibble), as code + 8.
namespace {

constexpr int kTileRows = 4;

// Output rows n0..n0+3 for MB activation rows. w: the tile; sb: row n0's (G, 2), rows at stride 2G.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void int4_bf16_tile(const uint16_t* xb, int64_t ldx, const float* xsum, int64_t G, const uint8_t* w,
                    const float* sb, int64_t group, float* y, int64_t ldy) {
  constexpr int R = kTileRows;
  const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  __m512 total[MB][R];
  float corr[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) { total[m][r] = _mm512_setzero_ps(); corr[m][r] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MB][R][2];  // two chains per row and activation row: vdpbf16ps latency
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r][0] = acc[m][r][1] = _mm512_setzero_ps();
    for (int64_t blk = g * group / 64; blk < (g + 1) * group / 64; ++blk) {
      const char* ahead = (const char*)(w + blk * R * 32) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      __m512bh x_lo[MB], x_hi[MB];
      for (int m = 0; m < MB; ++m) {
        x_lo[m] = (__m512bh)_mm512_loadu_si512(xb + m * ldx + blk * 64);
        x_hi[m] = (__m512bh)_mm512_loadu_si512(xb + m * ldx + blk * 64 + 32);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + (blk * R + r) * 32)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, mask, bias, 0xEA);  // (a & b) | c
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), bias);
        for (int m = 0; m < MB; ++m) {
          acc[m][r][0] = _mm512_dpbf16_ps(acc[m][r][0], lo, x_lo[m]);
          acc[m][r][1] = _mm512_dpbf16_ps(acc[m][r][1], hi, x_hi[m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = sb[r * 2 * G + 2 * g], b = sb[r * 2 * G + 2 * g + 1];
      for (int m = 0; m < MB; ++m) {
        total[m][r] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][r][0], acc[m][r][1]), _mm512_set1_ps(s), total[m][r]);
        corr[m][r] += (b - 128.f * s) * xsum[m * G + g];
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(total[m][r]) + corr[m][r];
}

}  // namespace

torch::Tensor gemv_int4_bf16(torch::Tensor x, torch::Tensor tiles, torch::Tensor sb, int64_t group) {
  TORCH_CHECK(has_avx512_bf16(), "this CPU has no AVX512-BF16");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kTileRows && tiles.size(3) == 32, "tiles must be (ceil(N/4), K/64, 4, 32)");
  const int64_t N = sb.size(0), K = tiles.size(1) * 64, G = K / group;
  check_inputs(x, sb, K, group, 64);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(group % 64 == 0, "group ", group, " is not a multiple of 64");
  TORCH_CHECK(tiles.size(0) == (N + kTileRows - 1) / kTileRows, "sb has ", N, " rows, the tiles ", tiles.size(0) * kTileRows);
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous(), "tiles must be contiguous uint8");
  // x rounded to bf16 once per call (vcvtneps2bf16: round to nearest even), and its per-group
  // sums from those same rounded values; serial, so it must cost little next to the GEMV.
  std::vector<uint16_t> xb(M * K);
  std::vector<float> xsum(M * G);
  round_to_bf16(x.data_ptr<float>(), M * G, group, xb.data(), xsum.data());
  auto y = output_for(x, N, false);
  const uint16_t* xp = xb.data();
  const float* xs = xsum.data();
  const float* sbp = sb.data_ptr<float>();
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // A tile is 2K bytes: the passes for activation rows after the first read it from L1/L2.
  const auto tile = [&](int64_t n, const float* sbt, float* yt, int64_t ldy) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      int4_bf16_tile<2>(xp + m * K, K, xs + m * G, G, wp + n * (K / 2), sbt, group, yt + m * ldy, ldy);
    if (m < M) int4_bf16_tile<1>(xp + m * K, K, xs + m * G, G, wp + n * (K / 2), sbt, group, yt + m * ldy, ldy);
  };
  const int64_t full = N / kTileRows;
  at::parallel_for(0, full, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile(t * kTileRows, sbp + t * kTileRows * G * 2, yp + t * kTileRows, N);
  });
  if (N % kTileRows) {  // the last tile's rows past N have zero codes: run it on zero scales, keep rows < N
    const int64_t n = full * kTileRows, rows = N - n;
    std::vector<float> sb_pad(kTileRows * G * 2, 0.f), y_pad(M * kTileRows);
    std::copy(sbp + n * G * 2, sbp + N * G * 2, sb_pad.begin());
    tile(n, sb_pad.data(), y_pad.data(), kTileRows);
    for (int64_t m = 0; m < M; ++m) std::copy_n(&y_pad[m * kTileRows], rows, yp + m * N + n);
  }
  return y;
}


// ---- int8 and FP8 weights, batches of 2+ rows ----
// Both are exact in bf16 (int8 codes have 8 significant bits, FP8 values at most 4), so only
// the activations round (int8: to bf16, as W4A16 does; FP8 activations are FP8 codes already,
// exact too). One vdpbf16ps does 32 multiply-adds per activation row where float32 FMAs do 16,
// which pays once several rows share each decoded weight. Needs group % 32 == 0.
namespace {

struct Int8Weights {  // signed codes; per group (s, b): w = c s + b
  static constexpr bool kOffset = true;
  __attribute__((target("avx512f,avx512bw,avx512bf16")))
  static __m512bh decode(const uint8_t* w) {
    const __m128i* p = (const __m128i*)w;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lo fills lanes 0-15
  }
};

template <bool E4M3>
struct Fp8Weights {  // per group s: w = decoded byte * s
  static constexpr bool kOffset = false;
  __attribute__((target("avx512f,avx512bw,avx512bf16")))
  static __m512bh decode(const uint8_t* w) {
    return _mm512_cvtne2ps_pbh(fp8_chunk<E4M3>(w + 16), fp8_chunk<E4M3>(w));
  }
};

// One output row for MB activation rows. sb: per group s (and b with kOffset), stride 1 or 2.
template <typename W, int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void dot_bf16_row(const uint16_t* xb, int64_t ldx, const float* xsum, int64_t G, const uint8_t* w,
                  const float* sb, int64_t group, float* y, int64_t ldy) {
  constexpr int stride = W::kOffset ? 2 : 1;
  __m512 total[MB];
  float corr[MB];
  for (int m = 0; m < MB; ++m) { total[m] = _mm512_setzero_ps(); corr[m] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c = g * group, j = 0; c < (g + 1) * group; c += 32, j ^= 1) {
      const __m512bh wv = W::decode(w + c);
      for (int m = 0; m < MB; ++m)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, (__m512bh)_mm512_loadu_si512(xb + m * ldx + c));
    }
    const __m512 s = _mm512_set1_ps(sb[stride * g]);
    for (int m = 0; m < MB; ++m) {
      total[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][0], acc[m][1]), s, total[m]);
      if (W::kOffset) corr[m] += sb[stride * g + 1] * xsum[m * G + g];
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = _mm512_reduce_add_ps(total[m]) + corr[m];
}

template <typename W>
void dot_bf16_rows(const float* x, int64_t M, const uint8_t* w, const float* sb, int64_t N, int64_t K,
                   int64_t group, float* y) {
  const int64_t G = K / group, stride = W::kOffset ? 2 : 1;
  std::vector<uint16_t> xb(M * K);
  std::vector<float> xsum(M * G);
  round_to_bf16(x, M * G, group, xb.data(), xsum.data());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {  // the row (K bytes) stays in L1/L2 across row blocks
      const auto rows = [&](auto mb, int64_t m) {
        dot_bf16_row<W, decltype(mb)::value>(xb.data() + m * K, K, xsum.data() + m * G, G, w + n * K,
                                             sb + n * G * stride, group, y + m * N + n, N);
      };
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) rows(std::integral_constant<int, 8>{}, m);  // one decode serves 8 rows
      if (m < M) for_row_blocks(M - m, [&](auto mb, int64_t i) { rows(mb, m + i); });
    }
  });
}

}  // namespace

namespace lowbit {

void int8_rows_bf16(const float* x, int64_t M, const int8_t* w, const float* sb, int64_t N, int64_t K,
                    int64_t group, float* y) {
  dot_bf16_rows<Int8Weights>(x, M, (const uint8_t*)w, sb, N, K, group, y);
}

void fp8_rows_bf16(const float* x, int64_t M, const uint8_t* w, const float* scales, int64_t N, int64_t K,
                   int64_t group, bool e4m3, float* y) {
  if (e4m3) dot_bf16_rows<Fp8Weights<true>>(x, M, w, scales, N, K, group, y);
  else dot_bf16_rows<Fp8Weights<false>>(x, M, w, scales, N, K, group, y);
}

}  // namespace lowbit
