// The CPU kernels of lightning_mhc.ops as one extension module (built by ops/cpu_kernels.py).
#include <torch/extension.h>

#include <vector>

at::Tensor sinkhorn_forward(at::Tensor logits, int64_t iterations, double eps, bool deepseek_v4);
at::Tensor sinkhorn_backward(at::Tensor logits, at::Tensor grad, int64_t iterations, double eps, bool deepseek_v4);
at::Tensor aggregate_forward(at::Tensor x, at::Tensor h_pre);
std::vector<at::Tensor> aggregate_backward(at::Tensor x, at::Tensor h_pre, at::Tensor g_agg);
at::Tensor res_post_forward(at::Tensor x, at::Tensor h_res, at::Tensor h_post, at::Tensor out);
std::vector<at::Tensor> res_post_backward(at::Tensor x, at::Tensor h_res, at::Tensor h_post, at::Tensor out,
                                          at::Tensor grad);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sinkhorn_forward", &sinkhorn_forward, "Sinkhorn-Knopp forward, [T, n, n] fp32 CPU (deepseek_v4: V4's convention, comb^T out)",
        py::arg("logits"), py::arg("iterations"), py::arg("eps"), py::arg("deepseek_v4") = false);
  m.def("sinkhorn_backward", &sinkhorn_backward, "Sinkhorn-Knopp backward (re-runs the iterations)",
        py::arg("logits"), py::arg("grad"), py::arg("iterations"), py::arg("eps"), py::arg("deepseek_v4") = false);
  m.def("aggregate_forward", &aggregate_forward, "H_pre @ x per token, fp32 CPU");
  m.def("aggregate_backward", &aggregate_backward, "gradients of aggregate_forward: (dx, dH_pre)");
  m.def("res_post_forward", &res_post_forward, "H_res @ x + H_post^T out per token, fp32 CPU");
  m.def("res_post_backward", &res_post_backward, "gradients of res_post_forward: (dx, dH_res, dH_post, d out)");
}
