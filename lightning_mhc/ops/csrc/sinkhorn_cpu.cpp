// Sinkhorn-Knopp for [T, n, n] fp32 logits on CPU: one pass per token, all iterations in
// registers/L1, tokens split across threads (at::parallel_for). Same math as
// lightning_mhc/ops/sinkhorn.py: P = exp(L - max L); t times: columns, then rows, each sum
// clamped to >= eps; a division by a sum is a multiply by its reciprocal. The backward re-runs
// the iterations per token and walks them in reverse on the gradient w.r.t. log P
// (g_P = g_Q - [s unclamped] * Q * sum(g_Q)), then through the max (which gets the gradient
// autograd gives it: all of it to the arg-max entries).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 &&
                  t.size(1) == t.size(2),
              name, " must be a contiguous fp32 CPU tensor [T, n, n]");
}

// Normalise p (n x n, row-major) along columns (dim 0) or rows (dim 1); write raw and clamped sums.
// N > 0: the size is a compile-time constant (unrolled, vectorised); N == 0: runtime n.
// Dividing by a sum is a multiply by its reciprocal (one division per sum, not per entry).
template <int N>
inline void normalise(float* p, int64_t n_, bool columns, float eps, float* raw, float* clamped) {
  const int64_t n = N > 0 ? N : n_;
  float inv[N > 0 ? N : 64];
  for (int64_t a = 0; a < n; ++a) {
    float s = 0.f;
    for (int64_t b = 0; b < n; ++b) s += columns ? p[b * n + a] : p[a * n + b];
    raw[a] = s;
    clamped[a] = std::max(s, eps);
    inv[a] = 1.f / clamped[a];
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) p[i * n + j] *= inv[columns ? j : i];
}

inline float start(const float* logits, float* p, int64_t nn) {
  float m = logits[0];
  for (int64_t k = 1; k < nn; ++k) m = std::max(m, logits[k]);
  for (int64_t k = 0; k < nn; ++k) p[k] = std::exp(logits[k] - m);
  return m;
}

}  // namespace

template <int N>
void forward_tokens(const float* L, float* P, int64_t T, int64_t n, int64_t iterations, float e) {
  const int64_t nn = n * n;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> raw(n), clamped(n);
    for (int64_t t = begin; t < end; ++t) {
      float* p = P + t * nn;
      start(L + t * nn, p, nn);
      for (int64_t it = 0; it < iterations; ++it) {
        normalise<N>(p, n, true, e, raw.data(), clamped.data());
        normalise<N>(p, n, false, e, raw.data(), clamped.data());
      }
    }
  });
}

at::Tensor sinkhorn_forward(at::Tensor logits, int64_t iterations, double eps) {
  check(logits, "logits");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= 64, "at most 64 residual streams");
  auto out = at::empty_like(logits);
  const float e = static_cast<float>(eps);
  if (n == 4)
    forward_tokens<4>(logits.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  else
    forward_tokens<0>(logits.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  return out;
}

template <int N>
void backward_tokens(const float* L, const float* G, float* D, int64_t T, int64_t n_, int64_t iterations, float e) {
  const int64_t n = N > 0 ? N : n_, nn = n * n, steps = 2 * iterations;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    // per step: Q after the step (nn), raw and clamped sums (n each)
    std::vector<float> q((steps + 1) * nn), raw(steps * n), clamped(steps * n), g(nn);
    for (int64_t t = begin; t < end; ++t) {
      const float* l = L + t * nn;
      float* p0 = q.data();
      const float m = start(l, p0, nn);
      for (int64_t k = 0; k < steps; ++k) {
        float* next = q.data() + (k + 1) * nn;
        std::copy(q.data() + k * nn, q.data() + (k + 1) * nn, next);
        normalise<N>(next, n, k % 2 == 0, e, raw.data() + k * n, clamped.data() + k * n);
      }
      // reverse pass on the gradient w.r.t. log P (no division: stays finite behind clamped sums)
      const float* last = q.data() + steps * nn;
      for (int64_t k = 0; k < nn; ++k) g[k] = G[t * nn + k] * last[k];
      for (int64_t k = steps - 1; k >= 0; --k) {
        const bool columns = k % 2 == 0;
        const float* qk = q.data() + (k + 1) * nn;
        const float* rk = raw.data() + k * n;
        for (int64_t a = 0; a < n; ++a) {
          if (!(rk[a] >= e)) continue;  // a clamped sum is a constant
          float total = 0.f;
          for (int64_t b = 0; b < n; ++b) total += g[columns ? b * n + a : a * n + b];
          for (int64_t b = 0; b < n; ++b) {
            const int64_t idx = columns ? b * n + a : a * n + b;
            g[idx] -= qk[idx] * total;
          }
        }
      }
      float* d = D + t * nn;
      float total = 0.f;
      int64_t at_max = 0;
      for (int64_t k = 0; k < nn; ++k) {
        d[k] = g[k];
        total += d[k];
        at_max += l[k] == m;
      }
      const float shift = total / static_cast<float>(at_max);
      for (int64_t k = 0; k < nn; ++k)
        if (l[k] == m) d[k] -= shift;
    }
  });
}

at::Tensor sinkhorn_backward(at::Tensor logits, at::Tensor grad, int64_t iterations, double eps) {
  check(logits, "logits");
  check(grad, "grad");
  TORCH_CHECK(grad.sizes() == logits.sizes(), "grad and logits differ in shape");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= 64, "at most 64 residual streams");
  auto out = at::empty_like(logits);
  const float e = static_cast<float>(eps);
  if (n == 4)
    backward_tokens<4>(logits.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  else
    backward_tokens<0>(logits.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  return out;
}
