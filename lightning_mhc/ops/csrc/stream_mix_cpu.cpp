// The stream mixing of one hyper-connection on CPU, fp32: per token one pass over the n streams
// of width C (the token's n*C floats stay in L1), tokens split across threads (at::parallel_for).
// Same math as lightning_mhc/ops/hyper_connection.py:
//   aggregate  a = sum_j H_pre[j] x_j;              da: dx_j = H_pre[j] g_a, dH_pre[j] = <g_a, x_j>
//   res_post   y_i = sum_j H_res[i, j] x_j + H_post[i] out
//              dx_j = sum_i H_res[i, j] g_i, dH_res[i, j] = <g_i, x_j>, dH_post[i] = <g_i, out>,
//              d out = sum_i H_post[i] g_i
// Eager PyTorch runs these as batched matrix products of [n, n] x [n, C] per token, whose
// per-batch overhead dominates at these shapes. Dot products keep 8 partial sums (vectorised)
// added in a fixed order, so a result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

// x86-64 builds default to SSE2; these clones add an AVX2+FMA version chosen at load time
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMHC_VECTOR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define LMHC_VECTOR_CLONES
#endif

constexpr int64_t kLanes = 8;

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim, name,
              " must be a contiguous fp32 CPU tensor with ", dim, " dimensions");
}

__attribute__((always_inline)) inline float dot(const float* __restrict a, const float* __restrict b, int64_t C) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[c + l] * b[c + l];
  float total = 0.f;
  for (; c < C; ++c) total += a[c] * b[c];
  for (int64_t l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// Sums over c of a[c] * b[c] for K pairs, kept as 8 lanes (vectorised) and added in a fixed order.
template <int K>
struct LaneSums {
  float lanes[K][kLanes] = {};
  __attribute__((always_inline)) inline float total(int k) const {
    float s = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) s += lanes[k][l];
    return s;
  }
};

// Tokens [begin, end): a = sum_j H_pre[j] x_j. N > 0: n known at compile time (unrolled); N == 0: runtime n.
template <int N>
__attribute__((always_inline)) inline void aggregate_range(const float* __restrict X, const float* __restrict HP,
                                                           float* __restrict A, int64_t n_, int64_t C, int64_t begin,
                                                           int64_t end) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * n * C, *hp = HP + t * n;
    float* a = A + t * C;
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += hp[j] * xs[j * C + c];
      a[c] = acc;
    }
  }
}

// dx_j = H_pre[j] g_a, dH_pre[j] = <g_a, x_j>, any n
inline void aggregate_backward_range(const float* X, const float* HP, const float* GA, float* DX, float* DHP,
                                     int64_t n, int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * n * C, *ga = GA + t * C, *hp = HP + t * n;
    float* dx = DX + t * n * C;
    for (int64_t j = 0; j < n; ++j) {
      DHP[t * n + j] = dot(ga, xs + j * C, C);
      for (int64_t c = 0; c < C; ++c) dx[j * C + c] = hp[j] * ga[c];
    }
  }
}

// y_i = sum_j H_res[i, j] x_j + H_post[i] out
template <int N>
__attribute__((always_inline)) inline void res_post_range(const float* __restrict X, const float* __restrict HR,
                                                          const float* __restrict HQ, const float* __restrict O,
                                                          float* __restrict Y, int64_t n_, int64_t C, int64_t begin,
                                                          int64_t end) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * n * C, *hr = HR + t * n * n, *hq = HQ + t * n, *o = O + t * C;
    float* y = Y + t * n * C;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        float acc = hq[i] * o[c];
        for (int64_t j = 0; j < n; ++j) acc += hr[i * n + j] * xs[j * C + c];
        y[i * C + c] = acc;
      }
  }
}

// dx_j = sum_i H_res[i, j] g_i, dH_res[i, j] = <g_i, x_j>, dH_post[i] = <g_i, out>, d out = sum_i H_post[i] g_i,
// n known at compile time. Per token, first the reductions one stream gradient g_i at a time (n + 1 lane
// accumulators: all n^2 + n at once spill out of the vector registers, measured 3x slower), then dx and
// d out in one pass; the token's floats stay in L1 between the passes. Each reduction keeps 8 lanes in
// the order of c, then adds the tail: the same sums whatever the thread count.
template <int N>
__attribute__((always_inline)) inline void res_post_backward_range(
    const float* __restrict X, const float* __restrict HR, const float* __restrict HQ, const float* __restrict O,
    const float* __restrict G, float* __restrict DX, float* __restrict DHR, float* __restrict DHQ,
    float* __restrict DO, int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * N * C, *g = G + t * N * C, *o = O + t * C;
    const float *hr = HR + t * N * N, *hq = HQ + t * N;
    float *dx = DX + t * N * C, *d_out = DO + t * C;
    for (int i = 0; i < N; ++i) {
      const float* gi = g + i * C;
      LaneSums<N + 1> sums;  // <g_i, x_j> for each j, then <g_i, out>
      int64_t c = 0;
      for (; c + kLanes <= C; c += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t k = c + l;
          for (int j = 0; j < N; ++j) sums.lanes[j][l] += gi[k] * xs[j * C + k];
          sums.lanes[N][l] += gi[k] * o[k];
        }
      float tail[N + 1] = {};
      for (; c < C; ++c) {
        for (int j = 0; j < N; ++j) tail[j] += gi[c] * xs[j * C + c];
        tail[N] += gi[c] * o[c];
      }
      for (int j = 0; j < N; ++j) DHR[(t * N + i) * N + j] = sums.total(j) + tail[j];
      DHQ[t * N + i] = sums.total(N) + tail[N];
    }
    for (int64_t c = 0; c < C; ++c) {
      float v_out = 0.f;
      for (int i = 0; i < N; ++i) v_out += hq[i] * g[i * C + c];
      d_out[c] = v_out;
      for (int j = 0; j < N; ++j) {
        float v = 0.f;
        for (int i = 0; i < N; ++i) v += hr[i * N + j] * g[i * C + c];
        dx[j * C + c] = v;
      }
    }
  }
}

// the same for any n: a dot product per pair, then dx and d out
inline void res_post_backward_range_any(const float* X, const float* HR, const float* HQ, const float* O,
                                        const float* G, float* DX, float* DHR, float* DHQ, float* DO, int64_t n,
                                        int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * n * C, *g = G + t * n * C, *o = O + t * C;
    const float *hr = HR + t * n * n, *hq = HQ + t * n;
    float *dx = DX + t * n * C, *d_out = DO + t * C;
    for (int64_t i = 0; i < n; ++i) {
      DHQ[t * n + i] = dot(g + i * C, o, C);
      for (int64_t j = 0; j < n; ++j) DHR[(t * n + i) * n + j] = dot(g + i * C, xs + j * C, C);
    }
    for (int64_t c = 0; c < C; ++c) {
      float v_out = 0.f;
      for (int64_t i = 0; i < n; ++i) v_out += hq[i] * g[i * C + c];
      d_out[c] = v_out;
      for (int64_t j = 0; j < n; ++j) {
        float v = 0.f;
        for (int64_t i = 0; i < n; ++i) v += hr[i * n + j] * g[i * C + c];
        dx[j * C + c] = v;
      }
    }
  }
}

LMHC_VECTOR_CLONES void aggregate_chunk(const float* X, const float* HP, float* A, int64_t n, int64_t C,
                                        int64_t begin, int64_t end) {
  if (n == 4)
    aggregate_range<4>(X, HP, A, n, C, begin, end);
  else
    aggregate_range<0>(X, HP, A, n, C, begin, end);
}

LMHC_VECTOR_CLONES void aggregate_backward_chunk(const float* X, const float* HP, const float* GA, float* DX,
                                                 float* DHP, int64_t n, int64_t C, int64_t begin, int64_t end) {
  aggregate_backward_range(X, HP, GA, DX, DHP, n, C, begin, end);
}

LMHC_VECTOR_CLONES void res_post_chunk(const float* X, const float* HR, const float* HQ, const float* O, float* Y,
                                       int64_t n, int64_t C, int64_t begin, int64_t end) {
  if (n == 4)
    res_post_range<4>(X, HR, HQ, O, Y, n, C, begin, end);
  else
    res_post_range<0>(X, HR, HQ, O, Y, n, C, begin, end);
}

LMHC_VECTOR_CLONES void res_post_backward_chunk(const float* X, const float* HR, const float* HQ, const float* O,
                                                const float* G, float* DX, float* DHR, float* DHQ, float* DO,
                                                int64_t n, int64_t C, int64_t begin, int64_t end) {
  if (n == 4)
    res_post_backward_range<4>(X, HR, HQ, O, G, DX, DHR, DHQ, DO, C, begin, end);
  else
    res_post_backward_range_any(X, HR, HQ, O, G, DX, DHR, DHQ, DO, n, C, begin, end);
}

}  // namespace

at::Tensor aggregate_forward(at::Tensor x, at::Tensor h_pre) {
  check(x, "x", 2);
  check(h_pre, "h_pre", 2);
  const int64_t T = x.size(0), n = h_pre.size(1);
  TORCH_CHECK(n > 0 && x.size(1) % n == 0 && h_pre.size(0) == T, "shapes of x and h_pre differ");
  const int64_t C = x.size(1) / n;
  auto aggregated = at::empty({T, C}, x.options());
  const float *X = x.data_ptr<float>(), *HP = h_pre.data_ptr<float>();
  float* A = aggregated.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) { aggregate_chunk(X, HP, A, n, C, begin, end); });
  return aggregated;
}

std::vector<at::Tensor> aggregate_backward(at::Tensor x, at::Tensor h_pre, at::Tensor g_agg) {
  check(x, "x", 2);
  check(h_pre, "h_pre", 2);
  check(g_agg, "g_agg", 2);
  const int64_t T = x.size(0), n = h_pre.size(1);
  TORCH_CHECK(n > 0 && x.size(1) % n == 0 && h_pre.size(0) == T, "shapes of x and h_pre differ");
  const int64_t C = x.size(1) / n;
  TORCH_CHECK(g_agg.size(0) == T && g_agg.size(1) == C, "gradient shape differs");
  auto dx = at::empty_like(x);
  auto d_h_pre = at::empty({T, n}, x.options());
  const float *X = x.data_ptr<float>(), *HP = h_pre.data_ptr<float>(), *GA = g_agg.data_ptr<float>();
  float *DX = dx.data_ptr<float>(), *DHP = d_h_pre.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    aggregate_backward_chunk(X, HP, GA, DX, DHP, n, C, begin, end);
  });
  return {dx, d_h_pre};
}

at::Tensor res_post_forward(at::Tensor x, at::Tensor h_res, at::Tensor h_post, at::Tensor out) {
  check(x, "x", 2);
  check(h_res, "h_res", 3);
  check(h_post, "h_post", 2);
  check(out, "out", 2);
  const int64_t T = x.size(0), n = h_post.size(1), C = out.size(1);
  TORCH_CHECK(n > 0 && x.size(1) == n * C && h_post.size(0) == T && h_res.size(0) == T && h_res.size(1) == n &&
                  h_res.size(2) == n && out.size(0) == T,
              "shapes of x, h_res, h_post, out differ");
  auto y = at::empty_like(x);
  const float *X = x.data_ptr<float>(), *HR = h_res.data_ptr<float>(), *HQ = h_post.data_ptr<float>();
  const float* O = out.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) { res_post_chunk(X, HR, HQ, O, Y, n, C, begin, end); });
  return y;
}

std::vector<at::Tensor> res_post_backward(at::Tensor x, at::Tensor h_res, at::Tensor h_post, at::Tensor out,
                                          at::Tensor grad) {
  check(x, "x", 2);
  check(h_res, "h_res", 3);
  check(h_post, "h_post", 2);
  check(out, "out", 2);
  check(grad, "grad", 2);
  const int64_t T = x.size(0), n = h_post.size(1), C = out.size(1);
  TORCH_CHECK(n > 0 && grad.sizes() == x.sizes() && x.size(1) == n * C && h_post.size(0) == T && h_res.size(0) == T &&
                  h_res.size(1) == n && h_res.size(2) == n && out.size(0) == T,
              "shapes of x, grad, h_res, h_post, out differ");
  auto dx = at::empty_like(x);
  auto d_h_res = at::empty({T, n, n}, x.options());
  auto d_h_post = at::empty({T, n}, x.options());
  auto d_out = at::empty({T, C}, x.options());
  const float *X = x.data_ptr<float>(), *HR = h_res.data_ptr<float>(), *HQ = h_post.data_ptr<float>();
  const float *O = out.data_ptr<float>(), *G = grad.data_ptr<float>();
  float *DX = dx.data_ptr<float>(), *DHR = d_h_res.data_ptr<float>(), *DHQ = d_h_post.data_ptr<float>();
  float* DO = d_out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    res_post_backward_chunk(X, HR, HQ, O, G, DX, DHR, DHQ, DO, n, C, begin, end);
  });
  return {dx, d_h_res, d_h_post, d_out};
}
