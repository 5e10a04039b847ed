// Weight-only low-bit GEMV / skinny GEMM for CPUs with AVX-512: y (..., N) = x (..., K) @ W^T,
// M rows of x in all.
// W is never materialised in float: each 16-weight chunk is dequantized in registers and
// multiplied into up to four activation rows at once, so the weight bytes (the bottleneck of
// batch-1 decode) are read from memory exactly once.
//
// Layouts (built in Python by quantize/cpu_kernels.py):
//   int4: (N, K/2) uint8. 32 weights per 16 bytes: byte i holds code+8 of weight i in its low
//         nibble and of weight i+16 in its high nibble.
//   int8: (N, K) int8, the signed codes as they are.
//   int4 tiles (gemv_int4_bf16): see that kernel below.
//   sb:   (N, G, 2) float32 per group: scale s and offset b, so that w = u * s + b, with u the
//         stored unsigned nibble (int4) or signed code (int8); b folds in the zero point.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kMaxRows = 4;  // activation rows sharing one dequantized weight chunk
// With several activation rows, columns run in tiles of this many, so that the rows' tile
// (8 rows: 16 KiB) stays in L1 while every output row uses it; one row needs no tiling.
constexpr int64_t kTileK = 512;
// Batch-1 loops prefetch the weight stream this far ahead: they run ~15 instructions per cache
// line, so out-of-order execution alone keeps too few lines in flight to fill one core's share
// of the memory bandwidth (2-core EPYC, from DRAM: +6-24% for int4, 1-2 threads). Prefetches
// never fault, so running past the end of a buffer is harmless.
constexpr int64_t kPrefetchBytes = 8192;

// int4 codes index a 16-entry table of dequantized values: vpermps reads the low 4 bits of
// each lane, so the low nibble needs no masking and one permute replaces convert + scale.
inline void int4_block(const uint8_t* w, const float* tables, const int32_t* lo_off, const int32_t* hi_off,
                       int64_t b, __m512& w_lo, __m512& w_hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + b * 16)));
  w_lo = _mm512_permutexvar_ps(q, _mm512_loadu_ps(tables + lo_off[b]));
  w_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), _mm512_loadu_ps(tables + hi_off[b]));
}

inline float reduce4(const __m512* a) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

// Four accumulators per activation row: one FMA chain would stall on FMA latency, not memory.
template <int MB>
void int4_row(const float* x, int64_t ldx, const uint8_t* w, const float* tables,
              const int32_t* lo_off, const int32_t* hi_off, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t b = 0;
  __m512 w0, w1, w2, w3;
  for (; b + 2 <= K / 32; b += 2) {
    int4_block(w, tables, lo_off, hi_off, b, w0, w1);
    int4_block(w, tables, lo_off, hi_off, b + 1, w2, w3);
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * ldx + b * 32;
      acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xm + 32), acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xm + 48), acc[m][3]);
    }
  }
  if (b < K / 32) {
    int4_block(w, tables, lo_off, hi_off, b, w0, w1);
    for (int m = 0; m < MB; ++m) {
      const float* xm = x + m * ldx + b * 32;
      acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] += reduce4(acc[m]);
}

inline __m512 int8_chunk(const int8_t* w, const float* sb, const int32_t* chunk_group, int64_t c) {
  const float* g = sb + 2 * chunk_group[c];
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + c * 16))));
  return _mm512_fmadd_ps(q, _mm512_set1_ps(g[0]), _mm512_set1_ps(g[1]));
}

// Four chunks per iteration into four accumulators (fixed indices keep them in registers).
template <int MB>
void int8_row(const float* x, int64_t ldx, const int8_t* w, const float* sb, const int32_t* chunk_group,
              int64_t K, float* y, int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 4 <= K / 16; c += 4) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = int8_chunk(w, sb, chunk_group, c + j);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < 4; ++j)
        acc[m][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(x + m * ldx + (c + j) * 16), acc[m][j]);
  }
  for (; c < K / 16; ++c) {
    const __m512 w0 = int8_chunk(w, sb, chunk_group, c);
    for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + c * 16), acc[m][0]);
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] += reduce4(acc[m]);
}

// Batch 1: sum c·x per group (codes converted, no per-chunk scale), then scale once per group:
// sum w x = s·sum(c x) + b·X with X the group's activation sum. Two fewer ops per 16 weights.
void int8_row_single(const float* x, const float* xsum, const int8_t* w, const float* sb, int64_t K,
                     int64_t group, float* y) {
  __m512 total = _mm512_setzero_ps();
  float corr = 0.f;
  for (int64_t g = 0; g < K / group; ++g) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t c = g * group;
    const int64_t end = c + group;
    for (; c + 64 <= end; c += 64) {
      _mm_prefetch((const char*)(w + c) + kPrefetchBytes, _MM_HINT_T0);
      for (int j = 0; j < 4; ++j) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + c + 16 * j))));
        acc[j] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x + c + 16 * j), acc[j]);
      }
    }
    for (; c < end; c += 16) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + c))));
      acc[0] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x + c), acc[0]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    total = _mm512_fmadd_ps(sum, _mm512_set1_ps(sb[2 * g]), total);
    corr += sb[2 * g + 1] * xsum[g];
  }
  *y = _mm512_reduce_add_ps(total) + corr;
}

// Row n of the output for all M activation rows, in blocks of up to kMaxRows.
template <typename RowFn>
void for_row_blocks(int64_t M, RowFn&& fn) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) fn(std::integral_constant<int, 4>{}, m);
  if (M - m >= 2) { fn(std::integral_constant<int, 2>{}, m); m += 2; }
  if (M - m == 1) fn(std::integral_constant<int, 1>{}, m);
}

// x: contiguous float32 (..., K), any leading dims (M rows in all); sb: (N, K/group, 2).
void check_inputs(const torch::Tensor& x, const torch::Tensor& sb, int64_t K, int64_t group, int64_t chunk) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % chunk == 0 && group % 16 == 0 && K % group == 0, "K=", K, " group=", group, " unsupported");
  TORCH_CHECK(sb.scalar_type() == torch::kFloat && sb.is_contiguous() && sb.size(1) == K / group, "sb must be (N, K/group, 2) float32");
}

// y (..., N) for x (..., K): the caller's leading dims, so Python needs no reshapes.
torch::Tensor output_for(const torch::Tensor& x, int64_t N, bool zeroed) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return zeroed ? torch::zeros(sizes, x.options()) : torch::empty(sizes, x.options());
}

}  // namespace

torch::Tensor gemv_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sb, int64_t group) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / group;
  check_inputs(x, sb, K, group, 32);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  std::vector<int32_t> lo_off(K / 32), hi_off(K / 32);  // table of each half-block, as float offsets
  for (int64_t b = 0; b < K / 32; ++b) {
    lo_off[b] = (int32_t)((b * 32) / group * 16);
    hi_off[b] = (int32_t)((b * 32 + 16) / group * 16);
  }
  auto y = output_for(x, N, true);  // tiles add their partial sums
  const float* xp = x.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t KT = M > 1 ? kTileK : K;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tables(G * 16);  // only the tile's groups are filled, at their own slots
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = 0; k0 < K; k0 += KT) {
      const int64_t kt = std::min(KT, K - k0);
      for (int64_t n = begin; n < end; ++n) {
        const float* s = sbp + n * G * 2;
        for (int64_t g = k0 / group; g <= (k0 + kt - 1) / group; ++g)
          _mm512_storeu_ps(&tables[g * 16], _mm512_fmadd_ps(iota, _mm512_set1_ps(s[2 * g]), _mm512_set1_ps(s[2 * g + 1])));
        for_row_blocks(M, [&](auto mb, int64_t m) {
          int4_row<decltype(mb)::value>(xp + m * K + k0, K, wp + n * (K / 2) + k0 / 2, tables.data(),
                                        lo_off.data() + k0 / 32, hi_off.data() + k0 / 32, kt, yp + m * N + n, N);
        });
      }
    }
  });
  return y;
}

torch::Tensor gemv_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor sb, int64_t group) {
  const int64_t N = codes.size(0), K = codes.size(1), G = K / group;
  check_inputs(x, sb, K, group, 16);
  const int64_t M = x.numel() / K;
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.is_contiguous(), "codes must be contiguous int8");
  std::vector<int32_t> chunk_group(K / 16);
  for (int64_t c = 0; c < K / 16; ++c) chunk_group[c] = (int32_t)(c * 16 / group);
  auto y = output_for(x, N, true);  // tiles add their partial sums
  const float* xp = x.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const int8_t* wp = codes.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    std::vector<float> xsum(G, 0.f);  // a plain loop: a torch op here costs more in dispatch
    for (int64_t i = 0; i < K; ++i) xsum[i / group] += xp[i];
    const float* xs = xsum.data();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) int8_row_single(xp, xs, wp + n * K, sbp + n * G * 2, K, group, yp + n);
    });
    return y;
  }
  const int64_t KT = kTileK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += KT)
      for (int64_t n = begin; n < end; ++n)
        for_row_blocks(M, [&](auto mb, int64_t m) {
          int8_row<decltype(mb)::value>(xp + m * K + k0, K, wp + n * K + k0, sbp + n * G * 2,
                                        chunk_group.data() + k0 / 16, std::min(KT, K - k0), yp + m * N + n, N);
        });
  });
  return y;
}

// ---- FP8 weights (E4M3 or E5M2) x float32 activations ----
// A byte becomes an fp16 bit pattern in one to three integer ops, and vcvtph2ps makes it an exact
// float (subnormals included). E5M2 is fp16's top byte. E4M3 moved up 7 bits lands its exponent
// and mantissa in fp16's fields (value * 2^-8: the bias differs by 8, folded into the scales) with
// the sign at bit 14; adding that bit to itself carries it into bit 15.
// Layout fp8: (N, K) uint8, the float8 bytes as they are; scales (N, G) float32 per group.
namespace {

template <bool E4M3>
inline __m512 fp8_chunk(const uint8_t* w) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w));
  if (!E4M3) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  const __m256i t = _mm256_slli_epi16(b, 7);
  return _mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
}

// One output row for MB activation rows; the row (K bytes) stays in L1/L2 across row blocks.
template <int MB, bool E4M3>
void fp8_row(const float* x, int64_t ldx, const uint8_t* w, const float* scales, int64_t K, int64_t group,
             float* y, int64_t ldy) {
  __m512 total[MB];
  for (int m = 0; m < MB; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / group; ++g) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t c = g * group;
    const int64_t end = c + group;
    for (; c + 32 <= end; c += 32) {
      _mm_prefetch((const char*)(w + c) + kPrefetchBytes, _MM_HINT_T0);
      const __m512 w0 = fp8_chunk<E4M3>(w + c), w1 = fp8_chunk<E4M3>(w + c + 16);
      for (int m = 0; m < MB; ++m) {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + c), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + c + 16), acc[m][1]);
      }
    }
    if (c < end) {  // group % 32 == 16
      const __m512 w0 = fp8_chunk<E4M3>(w + c);
      for (int m = 0; m < MB; ++m) acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + c), acc[m][0]);
    }
    const __m512 s = _mm512_set1_ps(scales[g]);
    for (int m = 0; m < MB; ++m) total[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[m][0], acc[m][1]), s, total[m]);
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = _mm512_reduce_add_ps(total[m]);
}

template <bool E4M3>
void fp8_rows(const float* xp, const uint8_t* wp, const float* sp, int64_t M, int64_t N, int64_t K, int64_t group,
              float* yp) {
  const int64_t G = K / group;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for_row_blocks(M, [&](auto mb, int64_t m) {
        fp8_row<decltype(mb)::value, E4M3>(xp + m * K, K, wp + n * K, sp + n * G, K, group, yp + m * N + n, N);
      });
  });
}

}  // namespace

// y = x @ (W * scales)^T, W's float8 bytes as uint8. E4M3 scales must include the factor 2^8.
torch::Tensor gemv_fp8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group, bool e4m3) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % group == 0 && group % 16 == 0, "K=", K, " group=", group, " unsupported");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales must be (N, K/group) float32");
  const int64_t M = x.numel() / K;
  auto y = output_for(x, N, false);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  if (e4m3) fp8_rows<true>(xp, wp, sp, M, N, K, group, y.data_ptr<float>());
  else fp8_rows<false>(xp, wp, sp, M, N, K, group, y.data_ptr<float>());
  return y;
}

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

// x (rows * group floats, in groups) -> bf16 bits and each group's sum of the rounded values.
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

bool has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_int4", &gemv_int4, "y = x @ W^T with W packed int4 (per-group scale and offset)");
  m.def("gemv_int8", &gemv_int8, "y = x @ W^T with W int8 codes (per-group scale and offset)");
  m.def("gemv_int4_bf16", &gemv_int4_bf16, "y = x @ W^T, W in int4 tiles of four rows, x rounded to bf16");
  m.def("gemv_fp8", &gemv_fp8, "y = x @ W^T, W float8 bytes (E4M3 or E5M2) with per-group scales");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs gemv_int4_bf16");
}
