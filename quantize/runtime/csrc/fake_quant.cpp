// The integer grid's learned-rounding weight (quantize/grids/integer_learned.py) forward and
// backward, each one pass over the weight instead of the ~25 torch calls of its autograd graph:
// on smollm2 those calls took 23 ms of a 60 ms one-sample SignRound step on a 2-core CPU, these
// passes 6 ms. Per group of K weights g with offsets v, scale s and zero point z:
//   forward   c = clamp(round(g / s + v) + z, qmin, qmax),  w = (c - z) * s
//   backward  the straight-through round: dv = dw * s where round(g / s + v) + z lies inside
//             [qmin, qmax] (clamp passes the gradient there), else 0; and
//             ds = sum(dw * (c - z)) - sum(dv * g / s^2) (the scale in w and in g / s)
// The forward does the torch graph's operations in its order, so w has the same bits; the
// backward's sums run in another order than torch's (same values to float rounding). Plain C++
// that each module's flags vectorise; no sum is reassociated, so both modules agree.
#include "gemv_common.h"

#include <cmath>
#include <cstring>

namespace {

struct Groups {
  const float *g, *v, *s, *z;  // z is null for a symmetric grid
  int64_t M, K;                // M groups of K weights
  float qmin, qmax;
};

Groups groups_of(const torch::Tensor& g, const torch::Tensor& v, const torch::Tensor& s,
                 const c10::optional<torch::Tensor>& z, double qmin, double qmax) {
  for (const auto* t : {&g, &v, &s}) {
    TORCH_CHECK(t->is_cpu() && t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "fake_quant_int takes contiguous float32 CPU tensors");
  }
  TORCH_CHECK(g.sizes() == v.sizes(), "groups and offsets differ in shape");
  const int64_t M = s.numel();
  TORCH_CHECK(M > 0 && g.numel() % M == 0, "the weights are not whole groups of the scales");
  const float* zp = nullptr;
  if (z.has_value()) {
    TORCH_CHECK(z->is_cpu() && z->scalar_type() == torch::kFloat32 && z->is_contiguous() && z->numel() == M,
                "zero points must be contiguous float32, one per scale");
    zp = z->data_ptr<float>();
  }
  return {g.data_ptr<float>(), v.data_ptr<float>(), s.data_ptr<float>(), zp, M, g.numel() / M,
          static_cast<float>(qmin), static_cast<float>(qmax)};
}

template <bool kZero>
void group_forward(const float* __restrict g, const float* __restrict v, float scale, float zero, float qmin,
                   float qmax, int64_t K, float* __restrict w) {
  for (int64_t k = 0; k < K; ++k) {
    // + 0.f as the straight-through round's "+ (x - x)": round(-0.3) is -0.0, and torch's weight has +0.0
    float c = std::nearbyint(g[k] / scale + v[k]) + 0.f;
    if (kZero) c = c + zero;
    c = std::min(std::max(c, qmin), qmax);
    w[k] = (kZero ? c - zero : c) * scale;
  }
}

// x where mask is all ones, +0.0 where it is 0: a select the compiler vectorises for AVX2 too (a
// conditional expression there leaves the loop scalar)
inline float masked(float x, uint32_t mask) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits &= mask;
  std::memcpy(&x, &bits, 4);
  return x;
}

// One group's offsets' gradient into dv, and its scale's gradient. A run of kRun weights at a time:
// each weight's term of the scale's gradient, then the run's terms summed in kLanes float sums side
// by side (an order the compiler vectorises without reassociating anything), and the runs in
// double: a per-tensor scale sums the whole weight.
template <bool kZero>
float group_backward(const float* __restrict dw, const float* __restrict g, const float* __restrict v, float scale,
                     float zero, float qmin, float qmax, int64_t K, float* __restrict dv) {
  constexpr int64_t kLanes = 16, kRun = 256;
  const float scale2 = scale * scale;
  float terms[kRun];
  double total = 0.;
  for (int64_t start = 0; start < K; start += kRun) {
    const int64_t n = std::min(kRun, K - start);
    const float *dw_r = dw + start, *g_r = g + start, *v_r = v + start;
    float* dv_r = dv + start;
    for (int64_t k = 0; k < n; ++k) {
      float c = std::nearbyint(g_r[k] / scale + v_r[k]) + 0.f;
      if (kZero) c = c + zero;
      const uint32_t inside = 0u - static_cast<uint32_t>((c >= qmin) & (c <= qmax));
      c = std::min(std::max(c, qmin), qmax);
      const float dv_k = masked(dw_r[k] * scale, inside);
      dv_r[k] = dv_k;
      terms[k] = dw_r[k] * (kZero ? c - zero : c) - dv_k * g_r[k] / scale2;
    }
    for (int64_t k = n; k % kLanes; ++k) terms[k] = 0.f;
    float lanes[kLanes] = {};
    for (int64_t k = 0; k < n; k += kLanes)
      for (int64_t lane = 0; lane < kLanes; ++lane) lanes[lane] += terms[k + lane];
    for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  }
  return static_cast<float>(total);
}

}  // namespace

torch::Tensor lowbit::fake_quant_int(torch::Tensor g, torch::Tensor v, torch::Tensor s,
                                     c10::optional<torch::Tensor> z, double qmin, double qmax) {
  const Groups q = groups_of(g, v, s, z, qmin, qmax);
  auto w = torch::empty_like(g);
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, q.M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t at = m * q.K;
      if (q.z) group_forward<true>(q.g + at, q.v + at, q.s[m], q.z[m], q.qmin, q.qmax, q.K, wp + at);
      else group_forward<false>(q.g + at, q.v + at, q.s[m], 0.f, q.qmin, q.qmax, q.K, wp + at);
    }
  });
  return w;
}

std::vector<torch::Tensor> lowbit::fake_quant_int_backward(torch::Tensor dw, torch::Tensor g, torch::Tensor v,
                                                           torch::Tensor s, c10::optional<torch::Tensor> z,
                                                           double qmin, double qmax) {
  const Groups q = groups_of(g, v, s, z, qmin, qmax);
  TORCH_CHECK(dw.sizes() == g.sizes() && dw.scalar_type() == torch::kFloat32 && dw.is_contiguous(),
              "the weight's gradient must be contiguous float32 of the weight's shape");
  auto dv = torch::empty_like(g);
  auto ds = torch::empty_like(s);
  const float* dwp = dw.data_ptr<float>();
  float *dvp = dv.data_ptr<float>(), *dsp = ds.data_ptr<float>();
  at::parallel_for(0, q.M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t at = m * q.K;
      dsp[m] = q.z ? group_backward<true>(dwp + at, q.g + at, q.v + at, q.s[m], q.z[m], q.qmin, q.qmax, q.K, dvp + at)
                   : group_backward<false>(dwp + at, q.g + at, q.v + at, q.s[m], 0.f, q.qmin, q.qmax, q.K, dvp + at);
    }
  });
  return {dv, ds};
}
