"""The hyper-connection around one sub-layer, as functions of tensors (arXiv 2512.24880, eq. 7-9).

With the stream ``x`` of ``n`` streams of width ``C`` stored as ``[..., n*C]``,
``r = 1 / sqrt(mean(x^2) + eps)`` per token and ``phi = [phi_pre | phi_post | phi_res]``::

    proj   = r * (x @ phi)                                     # = RMSNorm(x) @ phi
    H_pre  = sigmoid(a_pre * proj_pre + b_pre)                 # [..., n]
    H_post = 2 * sigmoid(a_post * proj_post + b_post)          # [..., n]
    H_res  = SinkhornKnopp(a_res * mat(proj_res) + b_res)      # [..., n, n]
    aggregated = H_pre @ x        (the sub-layer input, [..., C])
    x_next     = H_res @ x + dropout(H_post^T (F(aggregated) + bias))     ([..., n*C])

Mappings are fp32 whatever the training dtype; the stream mixing runs in the
stream's dtype. Two implementations of the same math:

- ``reference_*``: op by op (RMSNorm, matmul, sigmoids, the reference Sinkhorn,
  broadcast products), differentiated by autograd. Easy to read; saves the
  normalised ``[..., n*C]`` copy of the stream and about 80 Sinkhorn
  intermediates per token.
- fused: two autograd nodes with hand-written backwards. ``HyperConnectionPre``
  (mappings and aggregate) scales the projection after the matmul
  (``r * (x @ phi)``), so the normalised stream is never formed, and saves ``x``
  (the stream the layer holds anyway) plus O(n^2) floats per token.
  ``ResPostBiasDropoutAdd`` writes the next stream in one pass that reads ``x``
  and the sub-layer output (``(n+1) C`` floats read and ``n C`` written per
  token, the paper's post/res fusion: ``H_res @ x`` is never stored on its own).
  Each computes its pieces through a kernel set (``EagerKernels`` here,
  ``triton_kernels.TritonKernels``).

Both compute either convention (``lightning_mhc.ops.convention``): the project's mHC or
DeepSeek-V4's (``pre + eps``, a softmax-first Sinkhorn with eps floors, ``H_res = comb^T``).
``HyperHead`` is V4's final collapse of the streams (``DeepseekV4HyperHead``) on the same kernels,
and with a post gate HY-V4's hyper-connection (gates only; its layer adds ``post ⊗ F + x``).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_mhc.ops.convention import MHC, Convention
from lightning_mhc.ops.cpu_kernels import kernels_for
from lightning_mhc.ops.rms_norm import rms_normalize
from lightning_mhc.ops.sinkhorn import sinkhorn_backward, sinkhorn_forward, sinkhorn_knopp


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


# ------------------------------------------------------------------ reference path
def reference_mappings(
    x: Tensor, phi_pre, phi_post, phi_res, a_pre, a_post, a_res, b_pre, b_post, b_res,
    n: int, eps: float, iterations: int, convention: Convention = MHC,
) -> tuple[Tensor, Tensor, Tensor]:
    """``x [..., n*C]`` -> ``(H_pre [..., n], H_post [..., n], H_res [..., n, n])``, fp32 (fp64 for an
    fp64 ``x``); ``eps`` is the RMS norm's, ``convention`` carries the Sinkhorn's (and V4's floors)."""
    with _no_autocast(x.device.type):
        xn = rms_normalize(x, eps)
        phi = torch.cat([phi_pre, phi_post, phi_res], dim=1).to(xn.dtype)
        proj = xn @ phi
        p_pre, p_post, p_res = proj.split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(a_pre * p_pre + b_pre)
        if convention.deepseek_v4:
            h_pre = h_pre + convention.eps
        h_post = 2.0 * torch.sigmoid(a_post * p_post + b_post)
        h_res = sinkhorn_knopp(a_res * p_res.unflatten(-1, (n, n)) + b_res, iterations, convention.eps,
                               convention.name)
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


def reference_pre(x: Tensor, params: tuple[Tensor, ...], n: int, eps: float, iterations: int,
                  convention: Convention = MHC):
    """Mappings and aggregate op by op: ``(aggregated, H_res, H_post)``."""
    # One autograd consumer of x for all these ops (the view sums their gradients), as the fused
    # node is: x's gradient is then this sum plus the bias-dropout-add's, added in the same
    # grouping whether or not block recompute checkpoints the two apart (bit-exact recompute).
    x = x.view_as(x)
    h_pre, h_post, h_res = reference_mappings(x, *params, n=n, eps=eps, iterations=iterations, convention=convention)
    return reference_aggregate(x, h_pre, n), h_res, h_post


def reference_res_post(x: Tensor, h_res: Tensor, h_post: Tensor, out: Tensor) -> Tensor:
    """``H_res @ x + H_post^T out`` op by op (no dropout)."""
    return reference_apply_h_res(h_res, x, h_post.shape[-1]) + reference_apply_h_post(out, h_post)


@functools.cache
def compiled(function):
    """``function`` (``reference_pre``, ``reference_res_post``) through ``torch.compile``
    (``mhc_implementation='compile'``): inductor fuses the norm, the gates, the unrolled Sinkhorn and
    the stream products, forward and backward (Triton on CUDA, C++ on CPU). Compiled on first call;
    ``n``, ``eps`` and ``iterations`` are constants of the graph, and a new shape recompiles. No
    random draws inside. Under block recompute the forward (no grad) and the recompute (grad) run
    two compiled graphs; they gave the same bits on CPU (tests/test_fused_ops.py), the GPU test set
    checks CUDA. A ``Convention`` argument is a constant of the graph too (guarded by value)."""
    return torch.compile(function, fullgraph=True)


# ---------------------------------------------------------------------- fused path
def _expand_alpha(alpha: Tensor, n: int) -> Tensor:
    """``[a_pre, a_post, a_res]`` -> one scale per projection column, ``[n^2 + 2n]``."""
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])


def _aggregate(x: Tensor, h_pre: Tensor, n: int) -> Tensor:
    """``H_pre @ x`` ``[T, C]`` for ``x [T, n*C]``: the CPU kernel for fp32, else a batched product."""
    kernel = kernels_for(x)
    if kernel is not None:
        return kernel.aggregate_forward(x.contiguous(), h_pre.contiguous())
    tokens, width = x.shape
    return torch.bmm(h_pre.to(x.dtype).unsqueeze(1), x.view(tokens, n, width // n)).view(tokens, width // n)


def _aggregate_backward(x: Tensor, h_pre: Tensor, g_agg: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Gradients of ``_aggregate``: ``(dx, dH_pre (fp32))``."""
    kernel = kernels_for(x, g_agg)
    if kernel is not None:
        return tuple(kernel.aggregate_backward(x.contiguous(), h_pre.contiguous(), g_agg.contiguous()))
    tokens, width = x.shape
    g_h_pre = torch.bmm(x.view(tokens, n, width // n), g_agg.unsqueeze(-1)).squeeze(-1).float()
    return (h_pre.to(x.dtype).unsqueeze(-1) * g_agg.unsqueeze(1)).view(tokens, width), g_h_pre


def _with_bias(out: Tensor, bias: Tensor | None) -> Tensor:
    return out if bias is None else out + bias


def _res_post(x: Tensor, h_res: Tensor, h_post: Tensor, out: Tensor, bias: Tensor | None, prob: float,
              seed: Tensor | None) -> Tensor:
    """``H_res @ x + H_post^T (out + bias)`` ``[T, n*C]`` in the stream's dtype: the CPU kernel for fp32,
    else a batched product and an ``addcmul`` in place. No dropout (``prob`` must be 0)."""
    if prob:
        raise ValueError("the eager kernel set has no dropout (EagerKernels.DROPOUT is False): with dropout "
                         "active, run the reference's ops, as h_res_h_post_bias_dropout_add does")
    out = _with_bias(out, bias)
    kernel = kernels_for(x, out)
    if kernel is not None:
        return kernel.res_post_forward(x.contiguous(), h_res.contiguous(), h_post.contiguous(), out.contiguous())
    tokens, width = x.shape
    n = h_post.shape[1]
    y = torch.bmm(h_res.to(x.dtype), x.view(tokens, n, width // n))
    y.addcmul_(h_post.to(x.dtype).unsqueeze(-1), out.to(x.dtype).unsqueeze(1))
    return y.view(tokens, width)


def _res_post_backward(x, h_res, h_post, out, bias, prob: float, seed, grad) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``_res_post``: ``(dx, dH_res (fp32), dH_post (fp32), d out)``; the products with
    ``out`` in its dtype (a bf16 sub-layer output on an fp32 stream, as autograd would)."""
    out = _with_bias(out, bias)
    kernel = kernels_for(x, out, grad)
    if kernel is not None:
        return tuple(kernel.res_post_backward(x.contiguous(), h_res.contiguous(), h_post.contiguous(),
                                              out.contiguous(), grad.contiguous()))
    tokens, width = x.shape
    n = h_post.shape[1]
    g = grad.reshape(tokens, n, width // n)
    dx = torch.bmm(h_res.to(g.dtype).transpose(1, 2), g).view(tokens, width)
    g_h_res = torch.bmm(g, x.view(tokens, n, width // n).transpose(1, 2)).float()
    g = g.to(out.dtype)
    g_h_post = torch.bmm(g, out.unsqueeze(-1)).squeeze(-1).float()
    d_out = torch.bmm(h_post.to(out.dtype).unsqueeze(1), g).view(tokens, width // n)
    return dx, g_h_res, g_h_post, d_out


class EagerKernels:
    """The pieces of the fused hyper-connection in eager ops (the C++ kernels for fp32 CPU tensors).

    A kernel set has these static methods, all on ``[T, ...]`` tensors, mappings in fp32:
    ``project(x, phi, eps) -> (raw = x @ phi, r = 1/rms(x) [T])``;
    ``mappings(raw, r, alpha, bias, n, iterations, eps, convention) -> (H_pre, H_post, H_res)``;
    ``mappings_dz(raw, r, alpha, bias, H_pre, H_post, dH_pre, dH_post, dH_res, n, iterations, eps,
    convention) -> dz`` (the gradient of the logits ``z = alpha * r * raw + bias``); ``eps`` and
    ``convention`` (a name) as ``lightning_mhc.ops.convention.Convention``'s;
    ``aggregate(x, H_pre, n) -> H_pre x`` and ``aggregate_backward(x, H_pre, g, n) -> (dx, dH_pre)``;
    ``res_post(x, H_res, H_post, out, bias, prob, seed) -> H_res x + dropout(H_post^T (out + bias))``
    and ``res_post_backward(..., grad) -> (dx, dH_res, dH_post, d out)``. ``DROPOUT``: whether
    ``res_post`` draws dropout itself (from ``seed``); the eager set does not, so the layer runs the
    reference's ops when dropout is active (the same mask as the reference).
    ``lightning_mhc.ops.triton_kernels.TritonKernels`` is the other set.
    """

    name = "eager"
    DROPOUT = False

    @staticmethod
    def project(x: Tensor, phi: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        xf = x.float()
        # 1/rms from the norm: no [T, n*C] temporary
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).pow_(2).div_(x.shape[1]).add_(eps).rsqrt_()
        return xf @ phi, r.view(-1)

    @staticmethod
    def mappings(raw, r, alpha, bias, n: int, iterations: int, eps: float, convention: str = "mhc",
                 ) -> tuple[Tensor, Tensor, Tensor]:
        z = torch.addcmul(bias, raw * r[:, None], _expand_alpha(alpha, n))
        h_pre = torch.sigmoid(z[:, :n])
        if convention == "deepseek_v4":
            h_pre.add_(eps)
        h_post = torch.sigmoid(z[:, n:2 * n]).mul_(2.0)
        h_res = sinkhorn_forward(z[:, 2 * n:].reshape(raw.shape[0], n, n), iterations, eps, convention)
        return h_pre, h_post, h_res

    @staticmethod
    def mappings_dz(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_h_post, g_h_res, n: int, iterations: int,
                    eps: float, convention: str = "mhc") -> Tensor:
        a = _expand_alpha(alpha, n)
        logits = torch.addcmul(bias[2 * n:], (raw * r[:, None])[:, 2 * n:], a[2 * n:]).view(raw.shape[0], n, n)
        if convention == "deepseek_v4":  # H_pre = sigmoid + eps: the sigmoid again, not H_pre - eps (rounded)
            h_pre = torch.sigmoid(torch.addcmul(bias[:n], (raw * r[:, None])[:, :n], a[:n]))
        return torch.cat([
            g_h_pre * h_pre * (1.0 - h_pre),
            g_h_post * h_post * (1.0 - 0.5 * h_post),
            sinkhorn_backward(logits, g_h_res, iterations, eps, convention).view(raw.shape[0], n * n),
        ], dim=1)

    aggregate = staticmethod(_aggregate)
    aggregate_backward = staticmethod(_aggregate_backward)
    res_post = staticmethod(_res_post)
    res_post_backward = staticmethod(_res_post_backward)


class HyperConnectionPre(torch.autograd.Function):
    """The stream ``x [..., n*C]`` (``T`` tokens) -> ``(aggregated [T, C], H_res [T, n, n],
    H_post [T, n])`` in one node. ``x``'s gradient comes back in its shape, not as a view (see
    ``_not_a_view``).

    Takes the packed parameters: ``phi = [phi_pre | phi_post | phi_res]`` ``[n*C, n^2+2n]`` (any
    strides: DeepSeek-V4's ``fn.t()`` is read in place), ``alpha = [a_pre, a_post, a_res]`` and
    ``bias = [b_pre | b_post | b_res]`` ``[n^2+2n]``, the kernel set that computes the pieces
    (``EagerKernels`` or Triton's) and the ``Convention``. Saves ``x``, the
    parameters, the raw projection ``x @ phi`` and ``r`` (``n^2+2n+1`` floats per token),
    ``H_pre`` and ``H_post``. The Sinkhorn backward re-runs its iterations from the logits,
    which are recomputed from the projection.
    """

    @staticmethod
    def forward(ctx, stream, phi, alpha, bias, n, eps, iterations, kernels=EagerKernels, convention=MHC):
        x = stream.reshape(-1, stream.shape[-1])
        raw, r = kernels.project(x, phi, eps)
        h_pre, h_post, h_res = kernels.mappings(raw, r, alpha, bias, n, iterations, convention.eps,
                                                convention=convention.name)
        aggregated = kernels.aggregate(x, h_pre, n)
        ctx.save_for_backward(stream, phi, alpha, bias, raw, r, h_pre, h_post)
        ctx.n, ctx.iterations, ctx.kernels, ctx.convention = n, iterations, kernels, convention
        return aggregated, h_res, h_post

    @staticmethod
    def backward(ctx, g_agg, g_res, g_post):
        # backward may run inside the caller's autocast region (e.g. a pipeline schedule under
        # bf16-mixed); the forward ran without it, and so does this. An output without a gradient
        # arrives as zeros (autograd materialises them: ctx.set_materialize_grads defaults to True).
        with _no_autocast(g_agg.device.type):
            return HyperConnectionPre._backward(ctx, g_agg, g_res.float(), g_post.float())

    @staticmethod
    def _backward(ctx, g_agg, g_res, g_post):
        stream, phi, alpha, bias, raw, r, h_pre, h_post = ctx.saved_tensors
        n, iterations, kernels = ctx.n, ctx.iterations, ctx.kernels
        x = stream.reshape(-1, stream.shape[-1])
        dx, g_h_pre = kernels.aggregate_backward(x, h_pre, g_agg, n)
        # mappings: z = alpha * (r * raw) + bias, then sigmoid / 2 sigmoid / Sinkhorn
        dz = kernels.mappings_dz(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_post, g_res, n, iterations,
                                 ctx.convention.eps, convention=ctx.convention.name)
        d_bias = dz.sum(0)
        per_column = (dz * (raw * r[:, None])).sum(0)
        d_alpha = torch.stack([per_column[:n].sum(), per_column[n:2 * n].sum(), per_column[2 * n:].sum()])
        dx, d_phi = _projection_backward(x, phi, raw, r, dz.mul_(_expand_alpha(alpha, n)), dx)
        return _not_a_view(dx, stream.shape), d_phi, d_alpha, d_bias, None, None, None, None, None


def _projection_backward(x: Tensor, phi: Tensor, raw: Tensor, r: Tensor, d_scaled: Tensor, dx: Tensor):
    """Through ``proj = r * (x @ phi)`` with ``r = 1/rms(x)``, from ``d_scaled = d proj`` (taken
    over, scaled in place): ``(dx + what the projection adds, d_phi)``."""
    width = x.shape[1]
    r = r[:, None]
    d_raw = d_scaled.mul_(r)
    d_r = (d_raw * raw).sum(dim=-1, keepdim=True).div_(r)  # = sum(d_proj * raw)
    xf = x.float()
    d_phi = torch.mm(d_raw.t(), xf).t()  # [m, T] @ [T, n*C]: MKL runs it ~1.5x faster than x^T @ d_raw
    # r = (mean(x^2) + eps)^(-1/2):  dr/dx = -r^3 x / width
    coef = d_r * r.pow(3) * (-1.0 / width)
    if x.dtype == torch.float32:
        dx.addmm_(d_raw, phi.t()).addcmul_(coef, xf)
    else:
        dx = (dx.float().addmm_(d_raw, phi.t()).addcmul_(coef, xf)).to(x.dtype)
    return dx, d_phi


def fused_pre_packed(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, n: int, eps: float, iterations: int,
                     kernels=EagerKernels, convention: Convention = MHC):
    """``HyperConnectionPre`` on a ``[..., n*C]`` stream: ``(aggregated, H_res, H_post)``."""
    lead = x.shape[:-1]
    with _no_autocast(x.device.type):
        aggregated, h_res, h_post = HyperConnectionPre.apply(
            x, phi.float(), alpha.float(), bias.float(), n, eps, iterations, kernels, convention
        )
    return aggregated.view(*lead, -1), h_res.view(*lead, n, n), h_post.view(*lead, n)


def fused_pre(x: Tensor, params: tuple[Tensor, ...], n: int, eps: float, iterations: int, kernels=EagerKernels,
              convention: Convention = MHC):
    """``fused_pre_packed`` from the nine separate parameters (``reference_pre``'s signature)."""
    phi_pre, phi_post, phi_res, a_pre, a_post, a_res, b_pre, b_post, b_res = params
    return fused_pre_packed(
        x, torch.cat([phi_pre, phi_post, phi_res], dim=1), torch.stack([a_pre, a_post, a_res]),
        torch.cat([b_pre, b_post, b_res.flatten()]), n, eps, iterations, kernels, convention,
    )


class HyperHead(torch.autograd.Function):
    """The streams collapsed by sigmoid gates alone (no stream mixing) on the kernel set.

    DeepSeek-V4's final collapse (``DeepseekV4HyperHead``, HY-V4's ``HYV4HyperHead``):
    ``pre = sigmoid(scale * (x @ phi) / rms(x) + base) + eps`` ``[T, n]``, out ``= pre x`` ``[T, C]``
    (``phi [n*C, n]``: the head's ``hc_fn.t()``, read in place, ``scale [1]``, ``base [n]``).

    With ``post_magnitude`` set, HY-V4's hyper-connection (``HYV4HyperConnection``, the layer adding
    ``post ⊗ F + x``: ``H_res`` the identity, so no Sinkhorn): ``phi [n*C, 2n]`` (``fn.t()``),
    ``scale [2]`` (one per block of ``n`` columns), ``base [2n]``, and a second output
    ``post = post_magnitude * sigmoid(z_post) + eps`` ``[T, n]``.

    Saves ``x``, the raw projection and ``r`` (``n + 1`` floats per token, ``2n + 1`` with post);
    the sigmoids are recomputed in backward."""

    @staticmethod
    def forward(ctx, stream, phi, scale, base, n, norm_eps, eps, kernels=EagerKernels, post_magnitude=None):
        x = stream.reshape(-1, stream.shape[-1])
        raw, r = kernels.project(x, phi, norm_eps)
        gates = torch.sigmoid(torch.addcmul(base, raw * r[:, None], scale.repeat_interleave(n)))
        ctx.save_for_backward(stream, phi, scale, base, raw, r)
        ctx.n, ctx.kernels, ctx.eps, ctx.post_magnitude = n, kernels, eps, post_magnitude
        out = kernels.aggregate(x, gates[:, :n] + eps, n)
        if post_magnitude is None:
            return out
        return out, gates[:, n:] * post_magnitude + eps

    @staticmethod
    def backward(ctx, g_out, *g_post):
        stream, phi, scale, base, raw, r, = ctx.saved_tensors
        n, kernels, magnitude = ctx.n, ctx.kernels, ctx.post_magnitude
        x = stream.reshape(-1, stream.shape[-1])
        with _no_autocast(g_out.device.type):
            proj = raw * r[:, None]
            scales = scale.repeat_interleave(n)
            s = torch.sigmoid(torch.addcmul(base, proj, scales))
            dx, g_gates = kernels.aggregate_backward(x, s[:, :n] + ctx.eps, g_out.contiguous(), n)
            if magnitude is not None:
                g_gates = torch.cat([g_gates, g_post[0].float() * magnitude], dim=1)
            dz = g_gates * s * (1.0 - s)
            d_base, d_scale = dz.sum(0), (dz * proj).unflatten(1, (-1, n)).sum((0, 2))
            dx, d_phi = _projection_backward(x, phi, raw, r, dz * scales, dx)
        return _not_a_view(dx, stream.shape), d_phi, d_scale, d_base, None, None, None, None, None


def fused_hyper_head(x: Tensor, phi: Tensor, scale: Tensor, base: Tensor, n: int, norm_eps: float, eps: float,
                     kernels=EagerKernels, post_magnitude: float | None = None):
    """``HyperHead`` on a ``[..., n*C]`` stream: ``[..., C]``, and ``post [..., n]`` with
    ``post_magnitude`` (HY-V4's hyper-connection)."""
    with _no_autocast(x.device.type):
        outs = HyperHead.apply(x, phi.float(), scale.float(), base.float(), n, norm_eps, eps, kernels,
                               post_magnitude)
    if post_magnitude is None:
        return outs.view(*x.shape[:-1], -1)
    out, post = outs
    return out.view(*x.shape[:-1], -1), post.view(*x.shape[:-1], n)


class ResPostBiasDropoutAdd(torch.autograd.Function):
    """``H_res @ x + dropout(H_post^T (out + bias))``: the stream ``x [..., n*C]`` (``T`` tokens),
    ``H_res [T, n, n]``, ``H_post [T, n]``, ``out [T, C]``, ``bias [C]`` or None -> a new stream of
    ``x``'s shape (not a view, so a pipeline stage may free it as its output; ``x``'s gradient is
    no view either), in one pass of the kernel set each way.

    Saves ``x`` (held by the layer anyway), ``H_res``, ``H_post``, ``out``, the bias and, with
    dropout, the seed its kernel draws the mask from (not the mask). ``H_res @ x`` is never
    stored on its own.
    """

    @staticmethod
    def forward(ctx, stream, h_res, h_post, out, bias, prob: float, kernels=EagerKernels):
        x = stream.reshape(-1, stream.shape[-1])
        seed = dropout_seed(x.device) if prob > 0 else None
        y = kernels.res_post(x, h_res, h_post, out, bias, prob, seed)
        ctx.save_for_backward(stream, h_res, h_post, out, bias, seed)
        ctx.prob, ctx.kernels = prob, kernels
        return _not_a_view(y, stream.shape)

    @staticmethod
    def backward(ctx, grad):
        stream, h_res, h_post, out, bias, seed = ctx.saved_tensors
        x = stream.reshape(-1, stream.shape[-1])
        with _no_autocast(grad.device.type):  # as the forward (see HyperConnectionPre.backward)
            dx, d_h_res, d_h_post, d_out = ctx.kernels.res_post_backward(
                x, h_res, h_post, out, bias, ctx.prob, seed, grad.reshape(x.shape).contiguous())
        d_bias = d_out.float().sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[4] else None
        return (_not_a_view(dx, stream.shape), d_h_res.to(h_res.dtype), d_h_post.to(h_post.dtype),
                d_out.to(out.dtype), d_bias, None, None)


def dropout_seed(device: torch.device) -> Tensor:
    """A seed for a kernel's dropout, drawn from the device's generator (inside the caller's RNG
    fork, so a recompute that restores the generator states draws it again) and kept on the
    device: no host sync."""
    return torch.randint(0, 2 ** 31 - 1, (1,), device=device, dtype=torch.int32)


def fused_res_post(x: Tensor, h_res: Tensor, h_post: Tensor, out: Tensor, bias: Tensor | None, prob: float,
                   kernels=EagerKernels) -> Tensor:
    """``ResPostBiasDropoutAdd`` on ``[..., n*C]`` streams (leading dimensions flattened)."""
    n = h_post.shape[-1]
    with _no_autocast(x.device.type):
        return ResPostBiasDropoutAdd.apply(x, h_res.reshape(-1, n, n), h_post.reshape(-1, n),
                                           out.reshape(-1, out.shape[-1]), bias, prob, kernels)


def _not_a_view(t: Tensor, shape) -> Tensor:
    """``t`` (used by nobody else) as ``shape``, on its storage but not a view of it: a pipeline
    stage frees its output's storage, which megatron's ``deallocate_output_tensor`` refuses for a
    view (``_base`` set); and autograd adds a second gradient of the stream in place into one that
    holds its storage alone, where for a view's it allocates a new ``[..., n*C]`` sum. Detached,
    not ``set_`` on ``untyped_storage()``: the Python storage object that makes keeps a second
    reference to the storage, which stops the in-place add."""
    return t.contiguous().view(tuple(shape)).detach()
