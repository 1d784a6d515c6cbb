"""Small model configurations and independent reference math for the tests."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from lightning_mhc.model import MHCTransformerConfig


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """``max|a - b|`` over ``scale`` (default ``max|b|``), in fp32."""
    a, b = a.float(), b.float()
    denom = b.abs().max().item() if scale is None else scale
    return (a - b).abs().max().item() / denom


def tiny_config(**overrides) -> MHCTransformerConfig:
    kwargs = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        vocab_size=256,
        max_sequence_length=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return MHCTransformerConfig(**kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def plain_attention(layer, h: torch.Tensor, freqs) -> torch.Tensor:
    """Causal MHA written from the weights (no grouped-query layout: heads == groups)."""
    attn = layer.self_attention
    s, b, _ = h.shape
    d, heads = attn.head_dim, attn.heads_per_rank
    qkv = F.linear(h, attn.linear_qkv.weight, attn.linear_qkv.bias).view(s, b, heads, 3 * d)
    q, k, v = qkv.split(d, dim=-1)
    if freqs is not None:
        def rot(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * freqs.cos() + torch.cat([-t2, t1], dim=-1) * freqs.sin()
        q, k = rot(q), rot(k)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ctx = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, heads * d)
    return F.linear(ctx, attn.linear_proj.weight, attn.linear_proj.bias)


def plain_mlp(layer, h: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp
    inter = F.gelu(F.linear(h, mlp.linear_fc1.weight, mlp.linear_fc1.bias))
    return F.linear(inter, mlp.linear_fc2.weight, mlp.linear_fc2.bias)


def plain_prenorm_layer(layer, x: torch.Tensor, freqs=None) -> torch.Tensor:
    """x + attn(norm(x)), then + mlp(norm(.)), from the layer's weights."""
    eps = layer.config.layernorm_epsilon
    x = x + plain_attention(layer, rms_norm(x, layer.input_layernorm.weight, eps), freqs)
    return x + plain_mlp(layer, rms_norm(x, layer.pre_mlp_layernorm.weight, eps))


def sinkhorn_reference(logits: torch.Tensor, iterations: int, eps: float = 1e-6) -> torch.Tensor:
    """Columns, then rows; every sum clamped to >= eps (the library's rule, written again)."""
    p = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        p = p / p.sum(-2, keepdim=True).clamp_min(eps)
        p = p / p.sum(-1, keepdim=True).clamp_min(eps)
    return p


def mhc_sublayer_reference(hc, x: torch.Tensor, branch) -> torch.Tensor:
    """eq. 7-9 stream by stream: x_i' = sum_j H_res[i,j] x_j + H_post[i] * F(sum_k H_pre[k] x_k)."""
    n, C = hc.n, hc.hidden_size
    xn = rms_norm(x, None, hc.eps)
    pre = torch.sigmoid(hc.a_pre * (xn @ hc.phi_pre) + hc.b_pre)
    post = 2 * torch.sigmoid(hc.a_post * (xn @ hc.phi_post) + hc.b_post)
    res = sinkhorn_reference(
        hc.a_res * (xn @ hc.phi_res).view(*x.shape[:-1], n, n) + hc.b_res, hc.sinkhorn_iterations
    )
    streams = [x[..., i * C:(i + 1) * C] for i in range(n)]
    f = branch(sum(pre[..., k:k + 1] * streams[k] for k in range(n)))
    out = []
    for i in range(n):
        mixed = sum(res[..., i, j:j + 1] * streams[j] for j in range(n))
        out.append(mixed + post[..., i:i + 1] * f)
    return torch.cat(out, dim=-1)


def train_steps(model, steps: int = 3, batch: int = 2, seq: int = 16, lr: float = 1e-2, seed: int = 0):
    """AdamW steps on fixed random tokens; returns per-step (loss, {name: grad}) and the model."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return history


def hc_sublayer(x, phi, alpha, bias, weight, out_bias, n: int, implementation: str, iterations: int = 20):
    """One hyper-connected sub-layer with a linear branch, as a layer runs it: ``(next stream,
    H_post)`` by the fused ops with Triton's kernels (``triton``), the eager/C++ ones (``fused``) or
    a kernel set given as ``implementation`` (its ``H_res``/``H_post`` step by the eager ones), or by
    the op-by-op reference (``reference``; in fp64 for an fp64 ``x``)."""
    from lightning_mhc.layers.bda import h_res_h_post_bias_dropout_add
    from lightning_mhc.ops.hyper_connection import EagerKernels, fused_pre_packed, reference_pre

    kernels = None
    if not isinstance(implementation, str):  # a kernel set (tensor_core_projection): the fused ops with it
        kernels, implementation = implementation, "fused"
    if implementation in ("triton", "fused"):
        if implementation == "triton":
            from lightning_mhc.ops.triton_kernels import TritonKernels as kernels
        else:
            kernels = kernels or EagerKernels
        aggregated, h_res, h_post = fused_pre_packed(x, phi, alpha, bias, n=n, eps=1e-6, iterations=iterations,
                                                     kernels=kernels)
    else:
        params = (*phi.split([n, n, n * n], dim=1), *alpha.unbind(), bias[:n], bias[n:2 * n], bias[2 * n:].view(n, n))
        aggregated, h_res, h_post = reference_pre(x, params, n, 1e-6, iterations)
    branch = (aggregated @ weight.to(aggregated.dtype), out_bias.to(aggregated.dtype))
    return h_res_h_post_bias_dropout_add(branch, x, h_res, h_post, 0.0, True, implementation), h_post


# Against an fp64 evaluation of the reference (errors_against_fp64): a fused implementation may be
# at most ERROR_FACTOR times as far from it as the op-by-op reference at the stream's own precision
# (fp32 mappings; bf16 products for a bf16 stream), plus a floor for results the reference gets
# almost exactly (another summation order alone costs a few units in the last place).
ERROR_FACTOR = 4.0
ERROR_FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-3}

HC_SUBLAYER_RESULTS = ("next stream", "H_post", "dx", "dphi", "dalpha", "dbias", "dweight", "d out bias")


def hc_sublayer_inputs(tokens: int, n: int, c: int, dtype: torch.dtype = torch.float32, device="cpu",
                       seed: int = 0) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """``((x, phi, alpha, bias, weight, out_bias), upstream)`` for ``hc_sublayer_and_grads``: a
    stream of ``tokens`` in ``dtype``, ``phi`` scaled to unit projections, gates 0.8 / 0.6 / 1.5,
    a ``[c, c]`` branch with a bias, and the outputs' upstream gradients, drawn from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = n * n + 2 * n
    phi = torch.randn(n * c, m, generator=g, device=device) / (n * c) ** 0.5
    bias = torch.randn(m, generator=g, device=device)
    x = torch.randn(tokens, n * c, generator=g, device=device).to(dtype)
    weight = torch.randn(c, c, generator=g, device=device) / c ** 0.5
    out_bias = torch.randn(c, generator=g, device=device)
    upstream = [torch.randn(tokens, n * c, generator=g, device=device),
                torch.randn(tokens, n, generator=g, device=device)]
    alpha = torch.tensor([0.8, 0.6, 1.5], device=device)
    return (x, phi, alpha, bias, weight, out_bias), upstream


def hc_sublayer_and_grads(implementation: str, inputs, upstream, n: int, iterations: int = 20) -> list[torch.Tensor]:
    """``hc_sublayer``'s two outputs and the gradients of its six inputs (``x, phi, alpha, bias,
    weight, out_bias``) for the ``upstream`` gradients of the outputs: ``HC_SUBLAYER_RESULTS``.
    The loss is summed in fp64 for an fp64 ``x``, else in fp32."""
    wide = torch.float64 if inputs[0].dtype == torch.float64 else torch.float32
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    outs = hc_sublayer(*leaves, n, implementation, iterations)
    loss = sum((o.to(wide) * u.to(wide)).sum() for o, u in zip(outs, upstream))
    return [*(o.detach() for o in outs), *torch.autograd.grad(loss, leaves)]


def fp64_evaluation(inputs, upstream, n: int, iterations: int = 20) -> list[torch.Tensor]:
    """The reference's outputs and gradients evaluated in fp64 on ``inputs``' values."""
    return hc_sublayer_and_grads("reference", [t.double() for t in inputs], upstream, n, iterations)


def errors_against_fp64(implementation: str, inputs, upstream, n: int, iterations: int = 20,
                        matmul_precision: str | None = None, exact: list[torch.Tensor] | None = None) -> dict:
    """``{result: (error of implementation, error of the reference)}``: each run at the inputs'
    precision (the reference op by op, in the stream's dtype) against the reference evaluated in
    fp64 on the same values (``exact``: that evaluation, when the caller has it already); an
    error is ``max|a - exact| / max|exact|``, in fp64. With ``matmul_precision``, the
    implementation alone runs under that ``torch.set_float32_matmul_precision`` (the reference
    and the fp64 evaluation under the caller's)."""
    from lightning_mhc.testing.precision import float32_matmul_precision

    exact = exact if exact is not None else fp64_evaluation(inputs, upstream, n, iterations)
    with float32_matmul_precision(matmul_precision) if matmul_precision else contextlib.nullcontext():
        ours = hc_sublayer_and_grads(implementation, inputs, upstream, n, iterations)
    reference = hc_sublayer_and_grads("reference", inputs, upstream, n, iterations)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    return {name: (error(o, e), error(r, e)) for name, o, r, e in zip(HC_SUBLAYER_RESULTS, ours, reference, exact)}


def tf32(t: torch.Tensor, rounding: str = "truncate") -> torch.Tensor:
    """fp32 ``t`` with 10 mantissa bits, as a tensor core takes it for a tf32 product: ``truncate``
    drops the low 13 bits (an fp32 register handed to the MMA as it is: Triton's ``tf32`` dot, whose
    PTX has no rounding instruction), ``nearest`` rounds half away from zero (``cvt.rna.tf32.f32``,
    which Triton's ``tf32x3`` applies to the high part of each operand)."""
    bits = t.float().contiguous().view(torch.int32)
    if rounding == "nearest":
        bits = bits + 0x1000  # on the magnitude: the sign bit is apart
    return (bits & ~0x1FFF).view(torch.float32).view(t.shape)


def tensor_core_projection(precision: str):
    """The eager kernel set with its projection ``x @ phi`` as Triton's ``tl.dot`` computes it on
    tensor cores at ``input_precision=precision`` (``triton_kernels.projection_precision``): ``tf32``
    (both operands truncated to tf32), ``tf32x3`` (each operand split into ``hi`` (rounded to
    nearest) + ``lo``, the sum of ``hi hi``, ``hi lo``, ``lo hi``) or ``ieee`` (fp32). The products
    of two tf32 values are exact in fp32 and sums are fp32, as in the MMA; only the order differs.
    For measuring on CPU what the GPU's tensor cores cost in accuracy (Triton's interpreter
    ignores the precision)."""
    from lightning_mhc.ops.hyper_connection import EagerKernels

    def product(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        if precision == "tf32":
            return tf32(x) @ tf32(phi)
        if precision == "tf32x3":
            x_hi, phi_hi = tf32(x, "nearest"), tf32(phi, "nearest")
            x_lo, phi_lo = tf32(x - x_hi), tf32(phi - phi_hi)
            return x_lo @ phi_hi + x_hi @ phi_lo + x_hi @ phi_hi
        assert precision == "ieee", precision
        return x @ phi

    class TensorCoreProjection(EagerKernels):
        name = f"eager, projection {precision}"

        @staticmethod
        def project(x: torch.Tensor, phi: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            _, r = EagerKernels.project(x, phi, eps)
            return product(x.float(), phi.float()), r

    return TensorCoreProjection


def expected_projection_precision(dtype: torch.dtype, matmul_precision: str) -> str:
    """The precision Triton's projection must multiply at (docs/fused_hyper_connection.md), written
    here apart from the code under test: tf32 for a bf16/fp16 stream; for an fp32 stream what
    torch's fp32 matmul precision asks (``highest`` fp32, ``high`` tf32x3, ``medium`` tf32)."""
    if dtype != torch.float32:
        return "tf32"
    return {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}[matmul_precision]


def fp64_bound_violations(implementation, inputs, upstream, n: int, matmul_precision: str = "highest",
                          iterations: int = 20) -> dict:
    """``{result: (error, bound)}`` for each output and gradient of ``implementation`` (run under
    torch's ``matmul_precision``) whose error against the fp64 evaluation breaks its bound; empty
    when every one holds. The bound is ERROR_FACTOR times the op-by-op reference's error (its
    products fp32, under the caller's precision: ``highest``) or, where the projection should run
    on tensor cores (``expected_projection_precision``), the error of the fused eager ops with that
    product emulated (``tensor_core_projection``) when larger, plus ERROR_FLOOR. So a projection
    that falls below the precision asked (tf32x3 -> tf32: about 2000x the error) breaks it, where a
    reference run under the same setting would have fallen with it."""
    exact = fp64_evaluation(inputs, upstream, n, iterations)
    errors = errors_against_fp64(implementation, inputs, upstream, n, iterations, matmul_precision, exact)
    precision = expected_projection_precision(inputs[0].dtype, matmul_precision)
    emulated = (errors_against_fp64(tensor_core_projection(precision), inputs, upstream, n, iterations, exact=exact)
                if precision != "ieee" else {})
    violations = {}
    for name, (ours, reference) in errors.items():
        bound = ERROR_FACTOR * max(reference, emulated.get(name, (0.0,))[0]) + ERROR_FLOOR[inputs[0].dtype]
        if not ours <= bound:
            violations[name] = (ours, bound)
    return violations
