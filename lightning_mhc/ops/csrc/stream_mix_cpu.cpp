// The stream mixing of one hyper-connection on CPU, fp32: per token one pass over the n streams
// of width C (the token's n*C floats stay in L1), tokens split across threads (at::parallel_for).
// Same math as lightning_mhc/ops/hyper_connection.py:
//   forward   aggregated = sum_j H_pre[j] x_j,  mixed_i = sum_j H_res[i, j] x_j
//   backward  dx_j = sum_i H_res[i, j] g_mixed_i + H_pre[j] g_agg,
//             dH_res[i, j] = <g_mixed_i, x_j>,  dH_pre[j] = <g_agg, x_j>
//   H_post    result_i = mixed_i + H_post[i] out;  dH_post[i] = <g_i, out>, d out = sum_i H_post[i] g_i
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

// Tokens [begin, end): aggregated = sum_j H_pre[j] x_j, mixed_i = sum_j H_res[i, j] x_j; one read of
// each x_j[c] feeds all n + 1 outputs. N > 0: n known at compile time (unrolled); N == 0: runtime n.
template <int N>
__attribute__((always_inline)) inline void forward_range(const float* __restrict X, const float* __restrict HP,
                                                         const float* __restrict HR, float* __restrict A,
                                                         float* __restrict M, int64_t n_, int64_t C, int64_t begin,
                                                         int64_t end) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t t = begin; t < end; ++t) {
    const float* xs = X + t * n * C;
    const float *hp = HP + t * n, *hr = HR + t * n * n;
    float *a = A + t * C, *m = M + t * n * C;
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += hp[j] * xs[j * C + c];
      a[c] = acc;
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0.f;
        for (int64_t j = 0; j < n; ++j) acc += hr[i * n + j] * xs[j * C + c];
        m[i * C + c] = acc;
      }
  }
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

// dx_j = sum_i H_res[i, j] g_mixed_i + H_pre[j] g_agg, dH_res[i, j] = <g_mixed_i, x_j>, dH_pre[j] = <g_agg, x_j>:
// n known at compile time, all in one pass over the token's floats.
template <int N>
__attribute__((always_inline)) inline void backward_range(const float* __restrict X, const float* __restrict HP,
                                                          const float* __restrict HR, const float* __restrict GA,
                                                          const float* __restrict GM, float* __restrict DX,
                                                          float* __restrict DHP, float* __restrict DHR, int64_t C,
                                                          int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * N * C, *gm = GM + t * N * C, *ga = GA + t * C;
    const float *hp = HP + t * N, *hr = HR + t * N * N;
    float* dx = DX + t * N * C;
    LaneSums<N * N> res;
    LaneSums<N> pre;
    int64_t c = 0;
    for (; c + kLanes <= C; c += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t k = c + l;
        for (int j = 0; j < N; ++j) {
          pre.lanes[j][l] += ga[k] * xs[j * C + k];
          float v = hp[j] * ga[k];
          for (int i = 0; i < N; ++i) {
            res.lanes[i * N + j][l] += gm[i * C + k] * xs[j * C + k];
            v += hr[i * N + j] * gm[i * C + k];
          }
          dx[j * C + k] = v;
        }
      }
    float tail_res[N * N] = {}, tail_pre[N] = {};
    for (; c < C; ++c)
      for (int j = 0; j < N; ++j) {
        tail_pre[j] += ga[c] * xs[j * C + c];
        float v = hp[j] * ga[c];
        for (int i = 0; i < N; ++i) {
          tail_res[i * N + j] += gm[i * C + c] * xs[j * C + c];
          v += hr[i * N + j] * gm[i * C + c];
        }
        dx[j * C + c] = v;
      }
    for (int j = 0; j < N; ++j) {
      DHP[t * N + j] = pre.total(j) + tail_pre[j];
      for (int i = 0; i < N; ++i) DHR[(t * N + i) * N + j] = res.total(i * N + j) + tail_res[i * N + j];
    }
  }
}

// the same for any n: a dot product per (i, j), then dx
inline void backward_range_any(const float* X, const float* HP, const float* HR, const float* GA, const float* GM,
                               float* DX, float* DHP, float* DHR, int64_t n, int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *xs = X + t * n * C, *gm = GM + t * n * C, *ga = GA + t * C;
    const float *hp = HP + t * n, *hr = HR + t * n * n;
    float* dx = DX + t * n * C;
    for (int64_t j = 0; j < n; ++j) {
      DHP[t * n + j] = dot(ga, xs + j * C, C);
      for (int64_t i = 0; i < n; ++i) DHR[(t * n + i) * n + j] = dot(gm + i * C, xs + j * C, C);
      for (int64_t c = 0; c < C; ++c) {
        float v = hp[j] * ga[c];
        for (int64_t i = 0; i < n; ++i) v += hr[i * n + j] * gm[i * C + c];
        dx[j * C + c] = v;
      }
    }
  }
}

// dH_post[i] = <g_i, out>, d out = sum_i H_post[i] g_i, in one pass (n known at compile time)
template <int N>
__attribute__((always_inline)) inline void h_post_range(const float* __restrict G, const float* __restrict HP,
                                                        const float* __restrict O, float* __restrict DHP,
                                                        float* __restrict DO, int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *g = G + t * N * C, *hp = HP + t * N, *o = O + t * C;
    float* d = DO + t * C;
    LaneSums<N> post;
    int64_t c = 0;
    for (; c + kLanes <= C; c += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t k = c + l;
        float v = 0.f;
        for (int i = 0; i < N; ++i) {
          post.lanes[i][l] += g[i * C + k] * o[k];
          v += hp[i] * g[i * C + k];
        }
        d[k] = v;
      }
    float tail[N] = {};
    for (; c < C; ++c) {
      float v = 0.f;
      for (int i = 0; i < N; ++i) {
        tail[i] += g[i * C + c] * o[c];
        v += hp[i] * g[i * C + c];
      }
      d[c] = v;
    }
    for (int i = 0; i < N; ++i) DHP[t * N + i] = post.total(i) + tail[i];
  }
}

inline void h_post_range_any(const float* G, const float* HP, const float* O, float* DHP, float* DO, int64_t n,
                             int64_t C, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float *g = G + t * n * C, *hp = HP + t * n;
    for (int64_t i = 0; i < n; ++i) DHP[t * n + i] = dot(g + i * C, O + t * C, C);
    float* d = DO + t * C;
    for (int64_t c = 0; c < C; ++c) {
      float v = 0.f;
      for (int64_t i = 0; i < n; ++i) v += hp[i] * g[i * C + c];
      d[c] = v;
    }
  }
}

LMHC_VECTOR_CLONES void forward_chunk(const float* X, const float* HP, const float* HR, float* A, float* M,
                                      int64_t n, int64_t C, int64_t begin, int64_t end) {
  if (n == 4)
    forward_range<4>(X, HP, HR, A, M, n, C, begin, end);
  else
    forward_range<0>(X, HP, HR, A, M, n, C, begin, end);
}

LMHC_VECTOR_CLONES void backward_chunk(const float* X, const float* HP, const float* HR, const float* GA,
                                       const float* GM, float* DX, float* DHP, float* DHR, int64_t n, int64_t C,
                                       int64_t begin, int64_t end) {
  if (n == 4)
    backward_range<4>(X, HP, HR, GA, GM, DX, DHP, DHR, C, begin, end);
  else
    backward_range_any(X, HP, HR, GA, GM, DX, DHP, DHR, n, C, begin, end);
}

LMHC_VECTOR_CLONES void h_post_chunk(const float* G, const float* HP, const float* O, float* DHP, float* DO,
                                     int64_t n, int64_t C, int64_t begin, int64_t end) {
  if (n == 4)
    h_post_range<4>(G, HP, O, DHP, DO, C, begin, end);
  else
    h_post_range_any(G, HP, O, DHP, DO, n, C, begin, end);
}

}  // namespace

std::vector<at::Tensor> stream_mix_forward(at::Tensor x, at::Tensor h_pre, at::Tensor h_res) {
  check(x, "x", 2);
  check(h_pre, "h_pre", 2);
  check(h_res, "h_res", 3);
  const int64_t T = x.size(0), n = h_pre.size(1), C = x.size(1) / n;
  TORCH_CHECK(x.size(1) == n * C && h_res.size(1) == n && h_res.size(2) == n, "shapes of x, h_pre, h_res differ");
  auto aggregated = at::empty({T, C}, x.options());
  auto mixed = at::empty_like(x);
  const float *X = x.data_ptr<float>(), *HP = h_pre.data_ptr<float>(), *HR = h_res.data_ptr<float>();
  float *A = aggregated.data_ptr<float>(), *M = mixed.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) { forward_chunk(X, HP, HR, A, M, n, C, begin, end); });
  return {aggregated, mixed};
}

std::vector<at::Tensor> stream_mix_backward(at::Tensor x, at::Tensor h_pre, at::Tensor h_res, at::Tensor g_agg,
                                            at::Tensor g_mixed) {
  check(x, "x", 2);
  check(h_pre, "h_pre", 2);
  check(h_res, "h_res", 3);
  check(g_agg, "g_agg", 2);
  check(g_mixed, "g_mixed", 2);
  const int64_t T = x.size(0), n = h_pre.size(1), C = x.size(1) / n;
  TORCH_CHECK(g_mixed.sizes() == x.sizes() && g_agg.size(0) == T && g_agg.size(1) == C, "gradient shapes differ");
  auto dx = at::empty_like(x);
  auto d_h_pre = at::empty({T, n}, x.options());
  auto d_h_res = at::empty({T, n, n}, x.options());
  const float *X = x.data_ptr<float>(), *HP = h_pre.data_ptr<float>(), *HR = h_res.data_ptr<float>();
  const float *GA = g_agg.data_ptr<float>(), *GM = g_mixed.data_ptr<float>();
  float *DX = dx.data_ptr<float>(), *DHP = d_h_pre.data_ptr<float>(), *DHR = d_h_res.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    backward_chunk(X, HP, HR, GA, GM, DX, DHP, DHR, n, C, begin, end);
  });
  return {dx, d_h_pre, d_h_res};
}

std::vector<at::Tensor> h_post_backward(at::Tensor grad, at::Tensor h_post, at::Tensor out) {
  check(grad, "grad", 2);
  check(h_post, "h_post", 2);
  check(out, "out", 2);
  const int64_t T = grad.size(0), n = h_post.size(1), C = out.size(1);
  TORCH_CHECK(grad.size(1) == n * C && out.size(0) == T && h_post.size(0) == T, "shapes of grad, h_post, out differ");
  auto d_h_post = at::empty({T, n}, grad.options());
  auto d_out = at::empty({T, C}, grad.options());
  const float *G = grad.data_ptr<float>(), *HP = h_post.data_ptr<float>(), *O = out.data_ptr<float>();
  float *DHP = d_h_post.data_ptr<float>(), *DO = d_out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) { h_post_chunk(G, HP, O, DHP, DO, n, C, begin, end); });
  return {d_h_post, d_out};
}
