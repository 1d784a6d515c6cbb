// Sinkhorn-Knopp for [T, n, n] fp32 logits on CPU: one pass per token, all iterations in
// registers/L1, tokens split across threads (at::parallel_for). Same math as
// lightning_mhc/ops/sinkhorn.py: P = exp(L - max L); t times: columns, then rows, each sum
// clamped to >= eps; a division by a sum is a multiply by its reciprocal. The backward re-runs
// the iterations per token and walks them in reverse on the gradient w.r.t. log P
// (g_P = g_Q - [s unclamped] * Q * sum(g_Q)), then through the max (which gets the gradient
// autograd gives it: all of it to the arg-max entries).
//
// DeepSeek-V4's convention (deepseek_v4 = true; lightning_mhc/ops/convention.py) works on V4's
// `comb`, laid out as the projection gives it, and stores its transpose (our H_res = comb^T):
// comb = softmax over rows + eps, then columns, then t - 1 rounds of rows and columns, every sum
// with eps added (not clamped). Backward in the same log-P walk: a step Q = P / (sum P + eps) gives
// g_P = g_Q - Q * sum(g_Q) (the added eps keeps the denominator's dependence on P), "+ eps" gives
// g_P = g_Q * P / (P + eps), the row softmax g_L = g_P - P * rowsum(g_P); no max term (softmax is
// shift invariant per row).
//
// For n = 4 the tokens go 8 at a time, one per vector lane (the token's n x n matrix held as
// n*n arrays of 8 lanes): a token's matrix is too small to vectorise on its own, and the scalar
// loop ran at ~1 flop a cycle. Each lane does the scalar loop's operations in its order, so both
// give the same bits (the build allows no fast-math re-association; there is no FMA to contract to
// in the baseline x86-64 target this file is built for).
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
// Dividing by a sum is a multiply by its reciprocal (one division per sum, not per entry).
inline void normalise(float* p, int64_t n, bool columns, float eps, float* raw, float* clamped) {
  float inv[64];
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

// DeepSeek-V4: p <- softmax of each row of the logits (max subtracted per row); + eps after
inline void v4_start(const float* logits, float* p, int64_t n) {
  for (int64_t a = 0; a < n; ++a) {
    const float* l = logits + a * n;
    float m = l[0];
    for (int64_t b = 1; b < n; ++b) m = std::max(m, l[b]);
    float s = 0.f;
    for (int64_t b = 0; b < n; ++b) s += (p[a * n + b] = std::exp(l[b] - m));
    const float inv = 1.f / s;
    for (int64_t b = 0; b < n; ++b) p[a * n + b] *= inv;
  }
}

// DeepSeek-V4: divide by (sum + eps) along columns or rows
inline void v4_normalise(float* p, int64_t n, bool columns, float eps) {
  float inv[64];
  for (int64_t a = 0; a < n; ++a) {
    float s = 0.f;
    for (int64_t b = 0; b < n; ++b) s += columns ? p[b * n + a] : p[a * n + b];
    inv[a] = 1.f / (s + eps);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) p[i * n + j] *= inv[columns ? j : i];
}

// V4's step k of 2t (k >= 1): odd steps normalise columns, even ones rows (step 0 is the softmax)
inline bool v4_columns(int64_t k) { return k % 2 == 1; }

// V4's forward on one token's comb (t >= 1 iterations); writes comb^T to out
void v4_forward_token(const float* l, float* out, int64_t n, int64_t iterations, float eps, float* p) {
  const int64_t nn = n * n;
  v4_start(l, p, n);
  for (int64_t k = 0; k < nn; ++k) p[k] += eps;
  for (int64_t k = 1; k < 2 * iterations; ++k) v4_normalise(p, n, v4_columns(k), eps);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) out[i * n + j] = p[j * n + i];
}

// V4's backward on one token: G is d loss / d H_res (= comb^T), D gets d loss / d logits
void v4_backward_token(const float* l, const float* G, float* D, int64_t n, int64_t iterations, float eps,
                       float* q, float* g) {
  const int64_t nn = n * n, steps = 2 * iterations;
  float* soft = q;  // q[0]: the softmax; q[k]: after step k (q[0] + eps before step 1)
  v4_start(l, soft, n);
  for (int64_t k = 1; k < steps; ++k) {
    float* next = q + k * nn;
    const float* prev = q + (k - 1) * nn;
    for (int64_t e = 0; e < nn; ++e) next[e] = k == 1 ? prev[e] + eps : prev[e];
    v4_normalise(next, n, v4_columns(k), eps);
  }
  const float* last = q + (steps - 1) * nn;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) g[j * n + i] = G[i * n + j] * last[j * n + i];
  for (int64_t k = steps - 1; k >= 1; --k) {
    const bool columns = v4_columns(k);
    const float* qk = q + k * nn;
    for (int64_t a = 0; a < n; ++a) {
      float total = 0.f;
      for (int64_t b = 0; b < n; ++b) total += g[columns ? b * n + a : a * n + b];
      for (int64_t b = 0; b < n; ++b) {
        const int64_t idx = columns ? b * n + a : a * n + b;
        g[idx] -= qk[idx] * total;
      }
    }
  }
  for (int64_t e = 0; e < nn; ++e) g[e] *= soft[e] / (soft[e] + eps);  // through "+ eps"
  for (int64_t a = 0; a < n; ++a) {  // through the row softmax
    float total = 0.f;
    for (int64_t b = 0; b < n; ++b) total += g[a * n + b];
    for (int64_t b = 0; b < n; ++b) D[a * n + b] = g[a * n + b] - soft[a * n + b] * total;
  }
}

}  // namespace

// ---- n known at compile time, 8 tokens per block, one per lane -------------------------------
constexpr int kLanes = 8;

// p[k][l] <- logits of token begin + l (lanes past `count` get zeros); returns nothing, writes max m[l]
template <int N>
inline void load_block(const float* L, int64_t begin, int64_t count, float (*p)[kLanes], float* m) {
  constexpr int NN = N * N;
  for (int k = 0; k < NN; ++k)
    for (int l = 0; l < kLanes; ++l) p[k][l] = l < count ? L[(begin + l) * NN + k] : 0.f;
  for (int l = 0; l < kLanes; ++l) m[l] = p[0][l];
  for (int k = 1; k < NN; ++k)
    for (int l = 0; l < kLanes; ++l) m[l] = std::max(m[l], p[k][l]);
  for (int k = 0; k < NN; ++k)
    for (int l = 0; l < kLanes; ++l) p[k][l] = std::exp(p[k][l] - m[l]);
}

// normalise each lane's matrix along columns or rows, writing the raw sums (as normalise)
template <int N, bool Columns>
inline void normalise_block(float (*p)[kLanes], float (*raw)[kLanes], float eps) {
  float inv[N][kLanes];
  for (int a = 0; a < N; ++a) {
    float s[kLanes] = {};
    for (int b = 0; b < N; ++b)
      for (int l = 0; l < kLanes; ++l) s[l] += p[Columns ? b * N + a : a * N + b][l];
    for (int l = 0; l < kLanes; ++l) {
      raw[a][l] = s[l];
      inv[a][l] = 1.f / std::max(s[l], eps);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      for (int l = 0; l < kLanes; ++l) p[i * N + j][l] *= inv[Columns ? j : i][l];
}

template <int N>
void forward_blocks(const float* L, float* P, int64_t T, int64_t iterations, float e) {
  constexpr int NN = N * N;
  const int64_t blocks = (T + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
    float p[NN][kLanes], raw[N][kLanes], m[kLanes];
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kLanes, count = std::min<int64_t>(kLanes, T - begin);
      load_block<N>(L, begin, count, p, m);
      for (int64_t it = 0; it < iterations; ++it) {
        normalise_block<N, true>(p, raw, e);
        normalise_block<N, false>(p, raw, e);
      }
      for (int64_t l = 0; l < count; ++l)
        for (int k = 0; k < NN; ++k) P[(begin + l) * NN + k] = p[k][l];
    }
  });
}

// one reverse step on g (the gradient w.r.t. log P) through a normalisation along columns or rows
template <int N, bool Columns>
inline void reverse_block(float (*g)[kLanes], const float (*q)[kLanes], const float (*raw)[kLanes], float eps) {
  for (int a = 0; a < N; ++a) {
    float total[kLanes] = {};
    for (int b = 0; b < N; ++b)
      for (int l = 0; l < kLanes; ++l) total[l] += g[Columns ? b * N + a : a * N + b][l];
    for (int b = 0; b < N; ++b) {
      const int idx = Columns ? b * N + a : a * N + b;
      for (int l = 0; l < kLanes; ++l)  // a clamped sum is a constant: no gradient through it
        g[idx][l] = raw[a][l] >= eps ? g[idx][l] - q[idx][l] * total[l] : g[idx][l];
    }
  }
}

template <int N>
void backward_blocks(const float* L, const float* G, float* D, int64_t T, int64_t iterations, float e) {
  constexpr int NN = N * N;
  const int64_t steps = 2 * iterations, blocks = (T + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
    // per step: the matrices after it and its raw sums
    std::vector<float> q_buf((steps + 1) * NN * kLanes), raw_buf(steps * N * kLanes);
    auto q = reinterpret_cast<float (*)[NN][kLanes]>(q_buf.data());
    auto raw = reinterpret_cast<float (*)[N][kLanes]>(raw_buf.data());
    float g[NN][kLanes], m[kLanes];
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kLanes, count = std::min<int64_t>(kLanes, T - begin);
      load_block<N>(L, begin, count, q[0], m);
      for (int64_t k = 0; k < steps; ++k) {
        std::copy(&q[k][0][0], &q[k][0][0] + NN * kLanes, &q[k + 1][0][0]);
        if (k % 2 == 0)
          normalise_block<N, true>(q[k + 1], raw[k], e);
        else
          normalise_block<N, false>(q[k + 1], raw[k], e);
      }
      for (int k = 0; k < NN; ++k)
        for (int l = 0; l < kLanes; ++l) g[k][l] = (l < count ? G[(begin + l) * NN + k] : 0.f) * q[steps][k][l];
      for (int64_t k = steps - 1; k >= 0; --k) {
        if (k % 2 == 0)
          reverse_block<N, true>(g, q[k + 1], raw[k], e);
        else
          reverse_block<N, false>(g, q[k + 1], raw[k], e);
      }
      // through the max: the arg-max entries share minus the total (as the scalar loop)
      for (int64_t l = 0; l < count; ++l) {
        const float* lg = L + (begin + l) * NN;
        float* d = D + (begin + l) * NN;
        float total = 0.f;
        int64_t at_max = 0;
        for (int k = 0; k < NN; ++k) {
          d[k] = g[k][l];
          total += d[k];
          at_max += lg[k] == m[l];
        }
        const float shift = total / static_cast<float>(at_max);
        for (int k = 0; k < NN; ++k)
          if (lg[k] == m[l]) d[k] -= shift;
      }
    }
  });
}

// any n: one token at a time
void forward_tokens(const float* L, float* P, int64_t T, int64_t n, int64_t iterations, float e) {
  const int64_t nn = n * n;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> raw(n), clamped(n);
    for (int64_t t = begin; t < end; ++t) {
      float* p = P + t * nn;
      start(L + t * nn, p, nn);
      for (int64_t it = 0; it < iterations; ++it) {
        normalise(p, n, true, e, raw.data(), clamped.data());
        normalise(p, n, false, e, raw.data(), clamped.data());
      }
    }
  });
}

// DeepSeek-V4's convention, any n: one token at a time
void v4_forward_tokens(const float* L, float* P, int64_t T, int64_t n, int64_t iterations, float e) {
  const int64_t nn = n * n;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> p(nn);
    for (int64_t t = begin; t < end; ++t) v4_forward_token(L + t * nn, P + t * nn, n, iterations, e, p.data());
  });
}

void v4_backward_tokens(const float* L, const float* G, float* D, int64_t T, int64_t n, int64_t iterations, float e) {
  const int64_t nn = n * n;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> q(2 * iterations * nn), g(nn);
    for (int64_t t = begin; t < end; ++t)
      v4_backward_token(L + t * nn, G + t * nn, D + t * nn, n, iterations, e, q.data(), g.data());
  });
}

at::Tensor sinkhorn_forward(at::Tensor logits, int64_t iterations, double eps, bool deepseek_v4) {
  check(logits, "logits");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= 64, "at most 64 residual streams");
  auto out = at::empty_like(logits);
  const float e = static_cast<float>(eps);
  if (deepseek_v4) {
    TORCH_CHECK(iterations >= 1, "DeepSeek-V4's Sinkhorn runs at least one iteration");
    v4_forward_tokens(logits.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  } else if (n == 4)
    forward_blocks<4>(logits.data_ptr<float>(), out.data_ptr<float>(), T, iterations, e);
  else
    forward_tokens(logits.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  return out;
}

// any n: one token at a time
void backward_tokens(const float* L, const float* G, float* D, int64_t T, int64_t n, int64_t iterations, float e) {
  const int64_t nn = n * n, steps = 2 * iterations;
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
        normalise(next, n, k % 2 == 0, e, raw.data() + k * n, clamped.data() + k * n);
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

at::Tensor sinkhorn_backward(at::Tensor logits, at::Tensor grad, int64_t iterations, double eps, bool deepseek_v4) {
  check(logits, "logits");
  check(grad, "grad");
  TORCH_CHECK(grad.sizes() == logits.sizes(), "grad and logits differ in shape");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= 64, "at most 64 residual streams");
  auto out = at::empty_like(logits);
  const float e = static_cast<float>(eps);
  if (deepseek_v4) {
    TORCH_CHECK(iterations >= 1, "DeepSeek-V4's Sinkhorn runs at least one iteration");
    v4_backward_tokens(logits.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  } else if (n == 4)
    backward_blocks<4>(logits.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), T, iterations, e);
  else
    backward_tokens(logits.data_ptr<float>(), grad.data_ptr<float>(), out.data_ptr<float>(), T, n, iterations, e);
  return out;
}
