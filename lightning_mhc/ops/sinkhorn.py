"""Sinkhorn-Knopp projection of ``[..., n, n]`` logits onto the doubly stochastic matrices.

Both versions compute, in fp32::

    P = exp(L - max(L))
    repeat t_max times:  P = P / colsum(P);  P = P / rowsum(P)

Columns first, then rows: the paper's ``T_r(T_c(.))`` (arXiv 2512.24880, eq. 9).
DeepSeek-V4 (and Megatron-LM main, which follows it) normalise rows first, but of ``comb``, whose
transpose is the residual mixing (the layer computes ``comb^T x``): rows of ``comb`` are columns of
``H_res``, so with the transpose the two orders are the same computation (identical bits on our
development machine; CI's CPU sums four numbers in another order and put fp32 4e-5 apart at N(0, 1),
so the benchmark compares them in fp64). Without the transpose they differ by 1.4e-4 (logits ~ N(0, 1)), 9.2e-2
(N(0, 5^2)) and 0.82 (N(0, 25^2)) after 20 iterations. What does change ``H_res`` is V4's eps
floors (``+ eps`` after the softmax, ``sum + eps`` denominators; ``convention="deepseek_v4"``): at
most 3e-6 at N(0, 1) logits, but up to 0.47 at N(0, 5^2) and 1.0 at N(0, 25^2) (median 0.46 per
token there), where 20 iterations have not converged and the floors decide which small entries
survive (4096 tokens, n = 4, fp32; ``python benchmarks/v4_hyper_connection.py`` prints them).
Every sum is clamped to at least
``SINKHORN_EPS`` (1e-6, as Megatron-LM does), so finite logits never give NaN
or inf: a column whose entries all underflow stays 0 instead of becoming 0/0.

``sinkhorn_knopp`` is the readable reference (autograd through every op: about
80 nodes and 40 saved ``[n, n]`` matrices per call). ``SinkhornKnopp`` is one
autograd node that saves only its input (``n*n`` floats per token) and, in
backward, re-runs the iterations and differentiates them by hand, step by step
in reverse. ``max(L)`` gets its gradient only when a sum was clamped: otherwise
P does not change when L shifts by a constant, and that gradient is zero. On
CPU both directions run as one C++ pass per token when the kernel builds
(``lightning_mhc.ops.cpu_kernels``); elsewhere as eager ops in place.
"""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mhc.ops.cpu_kernels import kernels_for
from lightning_mhc.ops.rms_norm import at_least_fp32

SINKHORN_EPS = 1e-6


def _start(logits: Tensor) -> Tensor:
    return torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))


def sinkhorn_knopp(logits: Tensor, iterations: int, eps: float = SINKHORN_EPS, convention: str = "mhc") -> Tensor:
    """The reference: ``iterations`` column-then-row normalisations of ``exp(logits)``, fp32 (or fp64).

    ``convention="deepseek_v4"``: DeepSeek-V4's ``comb`` from the same logits, op for op as
    transformers' ``DeepseekV4HyperConnection`` computes it, returned transposed (``H_res = comb^T``,
    see ``lightning_mhc.ops.convention``)."""
    if convention == "deepseek_v4":
        return _deepseek_v4_comb(at_least_fp32(logits), iterations, eps).mT
    p = _start(at_least_fp32(logits))  # exp(L - max L)
    for _ in range(iterations):
        p = p / p.sum(dim=-2, keepdim=True).clamp_min(eps)  # columns sum to 1
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(eps)  # rows sum to 1
    return p


def _deepseek_v4_comb(logits: Tensor, iterations: int, eps: float) -> Tensor:
    """V4's comb: softmax over rows + eps, columns, then ``iterations - 1`` rounds of rows and
    columns, every sum with ``eps`` added."""
    _at_least_one(iterations)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _at_least_one(iterations: int) -> None:
    """V4's Sinkhorn always runs its first round (softmax and columns); ``hc_sinkhorn_iters = 0``
    would run it as 1 does, so it is refused rather than read silently as 1."""
    if iterations < 1:
        raise ValueError(f"DeepSeek-V4's Sinkhorn: iterations={iterations}, need at least 1 (hc_sinkhorn_iters)")


def _deepseek_v4_backward(logits: Tensor, grad: Tensor, iterations: int, eps: float) -> Tensor:
    """d loss / d logits from d loss / d H_res (= comb^T) in V4's convention, eager: the C++
    kernel's walk (csrc/sinkhorn_cpu.cpp) on the gradient with respect to ``log P``. A step
    ``Q = P / (sum P + eps)`` gives ``g_P = g_Q - Q sum(g_Q)``; ``Q = P + eps`` gives
    ``g_P = g_Q P / Q``; the row softmax ``g_L = g_P - P rowsum(g_P)``."""
    soft = torch.softmax(logits, dim=-1)
    q = soft + eps
    steps = []  # (dim, Q after the step)
    for k in range(1, 2 * iterations):
        dim = -2 if k % 2 == 1 else -1
        q = q / (q.sum(dim=dim, keepdim=True) + eps)
        steps.append((dim, q))
    g = grad.float().mT * q
    for dim, qk in reversed(steps):
        g = g - qk * g.sum(dim=dim, keepdim=True)
    g = g * (soft / (soft + eps))
    return g - soft * g.sum(dim=-1, keepdim=True)


def _normalise_(p: Tensor, dim: int, eps: float) -> tuple[Tensor, Tensor]:
    """Divide ``p`` in place by its clamped sums along ``dim``; returns (raw sums, clamped sums)."""
    raw = p.sum(dim=dim, keepdim=True)
    clamped = raw.clamp_min(eps)
    p.div_(clamped)
    return raw, clamped


def _kernel(*tensors: Tensor):
    """The C++ kernels when every tensor is an fp32 CPU ``[T, n, n]`` and they built (callers pass
    contiguous tensors)."""
    return kernels_for(*tensors) if all(t.dim() == 3 for t in tensors) else None


def sinkhorn_forward(logits: Tensor, iterations: int, eps: float = SINKHORN_EPS, convention: str = "mhc") -> Tensor:
    """The reference's values without a graph (the CPU kernel, or eager ops in place)."""
    logits = logits.float()
    v4 = convention == "deepseek_v4"
    if v4:
        _at_least_one(iterations)
    kernel = _kernel(logits)
    if kernel is not None:
        return kernel.sinkhorn_forward(logits.contiguous(), iterations, eps, v4)
    if v4:
        return _deepseek_v4_comb(logits, iterations, eps).mT.contiguous()
    p = _start(logits)
    for _ in range(iterations):
        _normalise_(p, -2, eps)
        _normalise_(p, -1, eps)
    return p


class SinkhornKnopp(torch.autograd.Function):
    """``sinkhorn_knopp`` as one node that saves only the logits (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits: Tensor, iterations: int, eps: float, convention: str = "mhc") -> Tensor:
        logits = logits.float()
        p = sinkhorn_forward(logits, iterations, eps, convention)
        ctx.save_for_backward(logits)
        ctx.iterations, ctx.eps, ctx.convention = iterations, eps, convention
        return p

    @staticmethod
    def backward(ctx, grad: Tensor):
        (logits,) = ctx.saved_tensors
        with torch.autocast(device_type=logits.device.type, enabled=False):  # fp32, as the forward
            return sinkhorn_backward(logits, grad, ctx.iterations, ctx.eps, ctx.convention), None, None, None


def sinkhorn_backward(logits: Tensor, grad: Tensor, iterations: int, eps: float, convention: str = "mhc") -> Tensor:
    """d loss / d logits from d loss / d P, re-running the iterations.

    Walks the steps in reverse on the gradient with respect to ``log P``
    (``g = dP * P``): a step ``Q = P / s`` with ``s = max(sum_dim P, eps)`` gives
    ``g_P = g_Q - [s unclamped] * Q * sum_dim(g_Q)``, and ``log P0 = L - max L``
    makes the last ``g`` the logits' gradient. There is no division: entries that
    underflow to 0 behind a clamped sum keep a finite (zero) gradient, where the
    reference's autograd multiplies by 1/eps at every step and ends in inf * 0 = NaN.
    ``convention="deepseek_v4"``: see ``_deepseek_v4_backward``.
    """
    v4 = convention == "deepseek_v4"
    kernel = _kernel(logits, grad.float())
    if kernel is not None:
        return kernel.sinkhorn_backward(logits.contiguous(), grad.float().contiguous(), iterations, eps, v4)
    if v4:
        return _deepseek_v4_backward(logits, grad, iterations, eps)
    p = _start(logits)
    steps = []  # (dim, Q after the step, raw sums)
    for _ in range(iterations):
        for dim in (-2, -1):
            raw, _ = _normalise_(p, dim, eps)
            steps.append((dim, p.clone(), raw))
    # (meta tensors, the planner's trace, hold no values: either branch makes the same shapes)
    any_clamped = bool(torch.cat([raw.flatten() for *_, raw in steps]).amin() < eps) \
        if steps and not logits.is_meta else False
    g = grad.float() * p
    for dim, q, raw in reversed(steps):
        total = g.sum(dim=dim, keepdim=True)
        if any_clamped:
            total.mul_(raw >= eps)
        g.sub_(q * total)
    grad_logits = g
    if any_clamped:  # the clamp breaks the shift invariance: max(L) gets a gradient too
        at_max = (logits == logits.amax(dim=(-2, -1), keepdim=True)).float()
        shift = grad_logits.sum(dim=(-2, -1), keepdim=True) / at_max.sum(dim=(-2, -1), keepdim=True)
        grad_logits.sub_(at_max * shift)
    return grad_logits
