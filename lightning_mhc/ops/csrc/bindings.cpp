// The CPU kernels of lightning_mhc.ops as one extension module (built by ops/cpu_kernels.py).
#include <torch/extension.h>

#include <vector>

at::Tensor sinkhorn_forward(at::Tensor logits, int64_t iterations, double eps);
at::Tensor sinkhorn_backward(at::Tensor logits, at::Tensor grad, int64_t iterations, double eps);
std::vector<at::Tensor> stream_mix_forward(at::Tensor x, at::Tensor h_pre, at::Tensor h_res);
std::vector<at::Tensor> stream_mix_backward(at::Tensor x, at::Tensor h_pre, at::Tensor h_res, at::Tensor g_agg,
                                            at::Tensor g_mixed);
std::vector<at::Tensor> h_post_backward(at::Tensor grad, at::Tensor h_post, at::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sinkhorn_forward", &sinkhorn_forward, "Sinkhorn-Knopp forward, [T, n, n] fp32 CPU");
  m.def("sinkhorn_backward", &sinkhorn_backward, "Sinkhorn-Knopp backward (re-runs the iterations)");
  m.def("stream_mix_forward", &stream_mix_forward, "(H_pre @ x, H_res @ x) per token, fp32 CPU");
  m.def("stream_mix_backward", &stream_mix_backward, "gradients of stream_mix_forward: (dx, dH_pre, dH_res)");
  m.def("h_post_backward", &h_post_backward, "gradients of mixed + H_post^T out: (dH_post, d out)");
}
