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
#include "gemv_common.h"

using namespace lowbit;

torch::Tensor gemv_int4_bf16(torch::Tensor x, torch::Tensor tiles, torch::Tensor sb, int64_t group);

namespace {

constexpr int kMaxRows = 4;  // activation rows sharing one dequantized weight chunk
// With several activation rows, columns run in tiles of this many, so that the rows' tile
// (8 rows: 16 KiB) stays in L1 while every output row uses it; one row needs no tiling.
constexpr int64_t kTileK = 512;

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

}  // namespace

torch::Tensor lowbit::gemv_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sb, int64_t group) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / group;
  check_inputs(x, sb, K, group, 32);
  const int64_t M = x.numel() / K;
  check_int4(packed);
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

// bf16_batches: batches of 2+ rows round x to bf16 and use vdpbf16ps (where group % 32 == 0).
torch::Tensor lowbit::gemv_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor sb, int64_t group, bool bf16_batches) {
  const int64_t N = codes.size(0), K = codes.size(1), G = K / group;
  check_inputs(x, sb, K, group, 16);
  const int64_t M = x.numel() / K;
  check_int8(codes);
  std::vector<int32_t> chunk_group(K / 16);
  for (int64_t c = 0; c < K / 16; ++c) chunk_group[c] = (int32_t)(c * 16 / group);
  auto y = output_for(x, N, true);  // tiles add their partial sums
  const float* xp = x.data_ptr<float>();
  const float* sbp = sb.data_ptr<float>();
  const int8_t* wp = codes.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    const std::vector<float> xsum = group_sums(xp, G, group);
    const float* xs = xsum.data();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) int8_row_single(xp, xs, wp + n * K, sbp + n * G * 2, K, group, yp + n);
    });
    return y;
  }
  TORCH_CHECK(!bf16_batches || has_avx512_bf16(), "this CPU has no AVX512-BF16");
  if (bf16_batches && group % 32 == 0) {
    int8_rows_bf16(xp, M, wp, sbp, N, K, group, yp);
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

// ---- FP8 weights (E4M3 or E5M2) x float32 activations (decoder: gemv_common.h) ----
// Layout fp8: (N, K) uint8, the float8 bytes as they are; scales (N, G) float32 per group.
namespace {

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
// bf16_batches: batches of 2+ rows use vdpbf16ps, exact for FP8-coded x, else x rounds to bf16.
torch::Tensor lowbit::gemv_fp8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group, bool e4m3,
                       bool bf16_batches) {
  check_fp8(x, codes, scales, group);
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t M = x.numel() / K;
  auto y = output_for(x, N, false);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  TORCH_CHECK(!bf16_batches || has_avx512_bf16(), "this CPU has no AVX512-BF16");
  if (bf16_batches && M > 1 && group % 32 == 0)
    fp8_rows_bf16(xp, M, wp, sp, N, K, group, e4m3, y.data_ptr<float>());
  else if (e4m3) fp8_rows<true>(xp, wp, sp, M, N, K, group, y.data_ptr<float>());
  else fp8_rows<false>(xp, wp, sp, M, N, K, group, y.data_ptr<float>());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_common(m);
  m.def("gemv_int4_bf16", &gemv_int4_bf16, "y = x @ W^T, W in int4 tiles of four rows, x rounded to bf16");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs gemv_int4_bf16");
}
