"""The hyper-connection around one sub-layer, as functions of tensors (arXiv 2512.24880, eq. 7-9).

With the stream ``x`` of ``n`` streams of width ``C`` stored as ``[..., n*C]``,
``r = 1 / sqrt(mean(x^2) + eps)`` per token and ``phi = [phi_pre | phi_post | phi_res]``::

    proj   = r * (x @ phi)                                     # = RMSNorm(x) @ phi
    H_pre  = sigmoid(a_pre * proj_pre + b_pre)                 # [..., n]
    H_post = 2 * sigmoid(a_post * proj_post + b_post)          # [..., n]
    H_res  = SinkhornKnopp(a_res * mat(proj_res) + b_res)      # [..., n, n]
    aggregated = H_pre @ x        (the sub-layer input, [..., C])
    mixed      = H_res @ x        (stream i = sum_j H_res[i, j] x_j, [..., n*C])

Mappings are fp32 whatever the training dtype; the stream mixing runs in the
stream's dtype. Two implementations of the same math:

- ``reference_*``: op by op (RMSNorm, matmul, sigmoids, the reference Sinkhorn,
  broadcast products), differentiated by autograd. Easy to read; saves the
  normalised ``[..., n*C]`` copy of the stream and about 80 Sinkhorn
  intermediates per token.
- ``fused_pre``: ``HyperConnectionPre``, one autograd node for mappings,
  aggregate and ``H_res @ x``, with a hand-written backward. It scales the
  projection after the matmul (``r * (x @ phi)``), so the normalised stream is
  never formed, and saves ``x`` (the stream the layer holds anyway) plus
  O(n^2) floats per token. Its input has one consumer, so the gradient of ``x``
  is one sum computed in a fixed order, inside or outside a recompute
  checkpoint.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_mhc.ops.cpu_kernels import kernels_for
from lightning_mhc.ops.rms_norm import rms_normalize
from lightning_mhc.ops.sinkhorn import SINKHORN_EPS, sinkhorn_backward, sinkhorn_forward, sinkhorn_knopp


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


# ------------------------------------------------------------------ reference path
def reference_mappings(
    x: Tensor, phi_pre, phi_post, phi_res, a_pre, a_post, a_res, b_pre, b_post, b_res,
    n: int, eps: float, iterations: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``x [..., n*C]`` -> ``(H_pre [..., n], H_post [..., n], H_res [..., n, n])``, fp32."""
    with _no_autocast(x.device.type):
        xn = rms_normalize(x, eps)
        phi = torch.cat([phi_pre, phi_post, phi_res], dim=1).float()
        proj = xn @ phi
        p_pre, p_post, p_res = proj.split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(a_pre * p_pre + b_pre)
        h_post = 2.0 * torch.sigmoid(a_post * p_post + b_post)
        h_res = sinkhorn_knopp(a_res * p_res.unflatten(-1, (n, n)) + b_res, iterations)
    return h_pre, h_post, h_res


def reference_aggregate(x: Tensor, h_pre: Tensor, n: int) -> Tensor:
    """``H_pre @ x``: ``[..., n*C]`` -> ``[..., C]``."""
    with _no_autocast(x.device.type):
        streams = x.unflatten(-1, (n, x.shape[-1] // n))
        return (h_pre.to(x.dtype).unsqueeze(-1) * streams).sum(dim=-2)


def reference_apply_h_res(h_res: Tensor, x: Tensor, n: int) -> Tensor:
    """``H_res @ x``: stream ``i`` becomes ``sum_j H_res[i, j] * x_j``."""
    with _no_autocast(x.device.type):
        streams = x.unflatten(-1, (n, x.shape[-1] // n))
        return torch.matmul(h_res.to(x.dtype), streams).flatten(-2)


def reference_apply_h_post(out: Tensor, h_post: Tensor) -> Tensor:
    """``H_post^T out``: stream ``i`` receives ``H_post[i] * out`` (``[..., C]`` -> ``[..., n*C]``)."""
    return (h_post.to(out.dtype).unsqueeze(-1) * out.unsqueeze(-2)).flatten(-2)


def reference_pre(x: Tensor, params: tuple[Tensor, ...], n: int, eps: float, iterations: int):
    """Mappings, aggregate and ``H_res @ x`` op by op: ``(aggregated, mixed, H_post)``."""
    h_pre, h_post, h_res = reference_mappings(x, *params, n=n, eps=eps, iterations=iterations)
    return reference_aggregate(x, h_pre, n), reference_apply_h_res(h_res, x, n), h_post


@functools.cache
def compiled_pre():
    """``reference_pre`` through ``torch.compile`` (``mhc_implementation='compile'``): inductor fuses
    the norm, the gates, the unrolled Sinkhorn and the stream products, forward and backward
    (Triton on CUDA, C++ on CPU). Compiled on first call; ``n``, ``eps`` and ``iterations`` are
    constants of the graph, and a new shape recompiles. No random draws inside, so recompute
    replays it exactly."""
    return torch.compile(reference_pre, fullgraph=True)


# ---------------------------------------------------------------------- fused path
def _expand_alpha(alpha: Tensor, n: int) -> Tensor:
    """``[a_pre, a_post, a_res]`` -> one scale per projection column, ``[n^2 + 2n]``."""
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])


def _grad_or_zeros(grad: Tensor | None, shape, like: Tensor) -> Tensor:
    return grad if grad is not None else like.new_zeros(shape)


def _stream_mix(x: Tensor, h_pre: Tensor, h_res: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``(H_pre @ x [T, C], H_res @ x [T, n*C])`` for ``x [T, n*C]``: the CPU kernel for fp32,
    else batched products."""
    kernel = kernels_for(x)
    if kernel is not None:
        return tuple(kernel.stream_mix_forward(x.contiguous(), h_pre.contiguous(), h_res.contiguous()))
    tokens, width = x.shape
    streams = x.view(tokens, n, width // n)
    aggregated = torch.bmm(h_pre.to(x.dtype).unsqueeze(1), streams).view(tokens, width // n)
    return aggregated, torch.bmm(h_res.to(x.dtype), streams).view(tokens, width)


def _stream_mix_backward(x, h_pre, h_res, g_agg, g_mixed, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``_stream_mix``: ``(dx, dH_pre (fp32), dH_res (fp32))``."""
    kernel = kernels_for(x, g_agg, g_mixed)
    if kernel is not None:
        return tuple(kernel.stream_mix_backward(x.contiguous(), h_pre.contiguous(), h_res.contiguous(),
                                                g_agg.contiguous(), g_mixed.contiguous()))
    tokens, width = x.shape
    streams = x.view(tokens, n, width // n)
    g_streams = g_mixed.reshape(tokens, n, width // n)
    g_h_res = torch.bmm(g_streams, streams.transpose(1, 2)).float()
    g_h_pre = torch.bmm(streams, g_agg.unsqueeze(-1)).squeeze(-1).float()
    dx = torch.bmm(h_res.to(x.dtype).transpose(1, 2), g_streams)
    dx.addcmul_(h_pre.to(x.dtype).unsqueeze(-1), g_agg.unsqueeze(1))
    return dx.view(tokens, width), g_h_pre, g_h_res


class EagerKernels:
    """The pieces of ``HyperConnectionPre`` in eager ops (the C++ kernels for fp32 CPU tensors).

    A kernel set has five static methods, all on ``[T, ...]`` tensors, mappings in fp32:
    ``project(x, phi, eps) -> (raw = x @ phi, r = 1/rms(x) [T])``;
    ``mappings(raw, r, alpha, bias, n, iterations, eps) -> (H_pre, H_post, H_res)``;
    ``mappings_dz(raw, r, alpha, bias, H_pre, H_post, dH_pre, dH_post, dH_res, n, iterations, eps)
    -> dz`` (the gradient of the logits ``z = alpha * r * raw + bias``);
    ``stream_mix(x, H_pre, H_res, n) -> (H_pre x, H_res x)`` and its ``stream_mix_backward``.
    ``lightning_mhc.ops.triton_kernels.TritonKernels`` is the other set.
    """

    name = "eager"

    @staticmethod
    def project(x: Tensor, phi: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        xf = x.float()
        # 1/rms from the norm: no [T, n*C] temporary
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).pow_(2).div_(x.shape[1]).add_(eps).rsqrt_()
        return xf @ phi, r.view(-1)

    @staticmethod
    def mappings(raw, r, alpha, bias, n: int, iterations: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        z = torch.addcmul(bias, raw * r[:, None], _expand_alpha(alpha, n))
        h_pre = torch.sigmoid(z[:, :n])
        h_post = torch.sigmoid(z[:, n:2 * n]).mul_(2.0)
        h_res = sinkhorn_forward(z[:, 2 * n:].reshape(raw.shape[0], n, n), iterations, eps)
        return h_pre, h_post, h_res

    @staticmethod
    def mappings_dz(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_h_post, g_h_res, n: int, iterations: int,
                    eps: float) -> Tensor:
        a = _expand_alpha(alpha, n)
        logits = torch.addcmul(bias[2 * n:], (raw * r[:, None])[:, 2 * n:], a[2 * n:]).view(raw.shape[0], n, n)
        return torch.cat([
            g_h_pre * h_pre * (1.0 - h_pre),
            g_h_post * h_post * (1.0 - 0.5 * h_post),
            sinkhorn_backward(logits, g_h_res, iterations, eps).view(raw.shape[0], n * n),
        ], dim=1)

    stream_mix = staticmethod(_stream_mix)
    stream_mix_backward = staticmethod(_stream_mix_backward)


class HyperConnectionPre(torch.autograd.Function):
    """``x [T, n*C]`` -> ``(aggregated [T, C], mixed [T, n*C], H_post [T, n])`` in one node.

    Takes the packed parameters: ``phi = [phi_pre | phi_post | phi_res]`` ``[n*C, n^2+2n]``,
    ``alpha = [a_pre, a_post, a_res]`` and ``bias = [b_pre | b_post | b_res]`` ``[n^2+2n]``, and
    the kernel set that computes the pieces (``EagerKernels`` or Triton's). Saves ``x``, the
    parameters, the raw projection ``x @ phi`` and ``r`` (``n^2+2n+1`` floats per token),
    ``H_pre``, ``H_post`` and ``H_res``. The Sinkhorn backward re-runs its iterations from the
    logits, which are recomputed from the projection.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, n, eps, iterations, kernels=EagerKernels):
        raw, r = kernels.project(x, phi, eps)
        h_pre, h_post, h_res = kernels.mappings(raw, r, alpha, bias, n, iterations, SINKHORN_EPS)
        aggregated, mixed = kernels.stream_mix(x, h_pre, h_res, n)
        ctx.save_for_backward(x, phi, alpha, bias, raw, r, h_pre, h_post, h_res)
        ctx.n, ctx.iterations, ctx.kernels = n, iterations, kernels
        return aggregated, mixed, h_post

    @staticmethod
    def backward(ctx, g_agg, g_mixed, g_post):
        # backward may run inside the caller's autocast region (e.g. a pipeline schedule under
        # bf16-mixed); the forward ran without it, and so does this
        with _no_autocast(g_post.device.type if g_post is not None else ctx.saved_tensors[0].device.type):
            return HyperConnectionPre._backward(ctx, g_agg, g_mixed, g_post)

    @staticmethod
    def _backward(ctx, g_agg, g_mixed, g_post):
        x, phi, alpha, bias, raw, r, h_pre, h_post, h_res = ctx.saved_tensors
        n, iterations, kernels = ctx.n, ctx.iterations, ctx.kernels
        tokens, width = x.shape
        g_mixed = _grad_or_zeros(g_mixed, (tokens, width), x)
        g_agg = _grad_or_zeros(g_agg, (tokens, width // n), x)
        dx, g_h_pre, g_h_res = kernels.stream_mix_backward(x, h_pre, h_res, g_agg, g_mixed, n)
        g_post = g_post.float() if g_post is not None else torch.zeros_like(h_post)
        # mappings: z = alpha * (r * raw) + bias, then sigmoid / 2 sigmoid / Sinkhorn
        dz = kernels.mappings_dz(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_post, g_h_res, n, iterations,
                                 SINKHORN_EPS)
        r = r[:, None]
        proj = raw * r
        d_bias = dz.sum(0)
        per_column = (dz * proj).sum(0)
        d_alpha = torch.stack([per_column[:n].sum(), per_column[n:2 * n].sum(), per_column[2 * n:].sum()])
        d_raw = dz.mul_(_expand_alpha(alpha, n)).mul_(r)
        d_r = (d_raw * raw).sum(dim=-1, keepdim=True).div_(r)  # = sum(d_proj * raw)
        xf = x.float()
        d_phi = xf.t() @ d_raw
        # r = (mean(x^2) + eps)^(-1/2):  dr/dx = -r^3 x / width
        coef = d_r * r.pow(3) * (-1.0 / width)
        if x.dtype == torch.float32:
            dx.addmm_(d_raw, phi.t()).addcmul_(coef, xf)
        else:
            dx = (dx.float().addmm_(d_raw, phi.t()).addcmul_(coef, xf)).to(x.dtype)
        return dx, d_phi, d_alpha, d_bias, None, None, None, None


def fused_pre_packed(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, n: int, eps: float, iterations: int,
                     kernels=EagerKernels):
    """``HyperConnectionPre`` on a ``[..., n*C]`` stream: ``(aggregated, mixed, H_post)``."""
    lead = x.shape[:-1]
    with _no_autocast(x.device.type):
        aggregated, mixed, h_post = HyperConnectionPre.apply(
            x.reshape(-1, x.shape[-1]), phi.float(), alpha.float(), bias.float(), n, eps, iterations, kernels
        )
    return aggregated.view(*lead, -1), mixed.view(*lead, -1), h_post.view(*lead, n)


def fused_pre(x: Tensor, params: tuple[Tensor, ...], n: int, eps: float, iterations: int, kernels=EagerKernels):
    """``fused_pre_packed`` from the nine separate parameters (``reference_pre``'s signature)."""
    phi_pre, phi_post, phi_res, a_pre, a_post, a_res, b_pre, b_post, b_res = params
    return fused_pre_packed(
        x, torch.cat([phi_pre, phi_post, phi_res], dim=1), torch.stack([a_pre, a_post, a_res]),
        torch.cat([b_pre, b_post, b_res.flatten()]), n, eps, iterations, kernels,
    )


class HPostResidual(torch.autograd.Function):
    """``mixed + H_post^T out``: ``[..., n*C]``, ``[..., n]``, ``[..., C]`` -> a new ``[..., n*C]``.

    One ``addcmul`` written into a fresh tensor of the stream's shape (not a view, so a
    pipeline stage may free it as its output); saves ``H_post`` and ``out``. Backward:
    ``d mixed = g``, ``d H_post[i] = <g_i, out>``, ``d out = sum_i H_post[i] g_i``.
    """

    @staticmethod
    def forward(ctx, mixed, h_post, out):
        n, width = h_post.shape[-1], out.shape[-1]
        result = torch.empty_like(mixed, memory_format=torch.contiguous_format)
        torch.addcmul(mixed.unflatten(-1, (n, width)), h_post.unsqueeze(-1), out.unsqueeze(-2),
                      out=result.view(*mixed.shape[:-1], n, width))
        ctx.save_for_backward(h_post, out)
        return result

    @staticmethod
    def backward(ctx, grad):
        h_post, out = ctx.saved_tensors
        n, width = h_post.shape[-1], out.shape[-1]
        with _no_autocast(grad.device.type):  # as the forward (see HyperConnectionPre.backward)
            # the stream may be fp32 with a bf16 sub-layer output (mixed precision): the product's
            # gradients are taken in the output's dtype, as autograd does for the reference's spread
            g = grad.reshape(-1, n * width).to(out.dtype)
            kernel = kernels_for(g, h_post, out)
            if kernel is not None:
                d_h_post, d_out = kernel.h_post_backward(g.contiguous(), h_post.reshape(-1, n).contiguous(),
                                                         out.reshape(-1, width).contiguous())
            else:
                g = g.view(-1, n, width)
                d_h_post = torch.bmm(g, out.reshape(-1, width, 1))
                d_out = torch.bmm(h_post.reshape(-1, 1, n).to(out.dtype), g)
            d_h_post, d_out = d_h_post.view(h_post.shape).to(h_post.dtype), d_out.view(out.shape)
        return grad, d_h_post, d_out
