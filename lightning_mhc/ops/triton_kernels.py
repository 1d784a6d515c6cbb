"""Triton kernels of the fused hyper-connection, for the GPU (and Triton's CPU interpreter).

``TritonKernels`` is the kernel set ``HyperConnectionPre`` runs with ``mhc_implementation=triton``
(and ``auto`` on CUDA when Triton imports); ``EagerKernels`` in ``hyper_connection.py`` is the same
interface in eager ops. Layout: the stream ``x [T, n*C]`` (stream ``i`` of token ``t`` at
``x[t, i*C:(i+1)*C]``), fp32 or bf16 in and out, fp32 accumulation; the mappings are fp32. ``n``
may be any size: register tiles are padded to ``NP``, the next power of two, with masks
(``tl.arange`` needs powers of two); token and channel tails are masked too.

- ``projection``: ``raw = x @ phi`` and ``r = 1/rms(x)`` in one read of ``x`` (the norm is applied
  after the product, so the normalised stream is never formed).
- ``mappings``: from ``raw`` and ``r``: ``H_pre = sigmoid``, ``H_post = 2 sigmoid`` and Sinkhorn in
  registers. Its backward re-runs the iterations instead of storing them, walking the steps in
  reverse with each step's matrix recomputed from the start (iterations^2 small normalisations
  per token: arithmetic in registers, where the kernel's cost is reading memory).
- ``stream_mix``: ``aggregated = H_pre x`` ``[T, C]`` and ``mixed = H_res x`` ``[T, n*C]`` in one
  read of ``x``; its backward reads ``x``, ``g_agg`` and ``g_mixed`` once and gives ``dx``,
  ``dH_pre`` and ``dH_res`` (the two reductions over ``C`` in registers).
- ``h_post_bda``: the sub-layer's bias-dropout-add onto the streams,
  ``mixed + dropout(H_post^T (out + bias))``, in one pass that reads ``mixed`` and ``out`` and writes
  the new stream. Dropout draws its mask in the kernel (Philox, from a seed taken from torch's
  generator), so no mask is stored: the backward draws it again from the same seed.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported): slow, for checking them without a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_device(x: torch.Tensor) -> None:
    """The kernels need a CUDA tensor, or Triton's interpreter for a CPU one."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"mhc_implementation='triton' on a {x.device.type} tensor: Triton compiles for CUDA GPUs. On CPU, "
            "set TRITON_INTERPRET=1 before starting Python to run the kernels in Triton's interpreter (slow), "
            "or use mhc_implementation='fused' (the C++ CPU kernels).")



# ------------------------------------------------------------------ stream mixing
@triton.jit
def _stream_mix_fwd(x_ptr, hpre_ptr, hres_ptr, agg_ptr, mixed_ptr, C, N: tl.constexpr, NP: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ns = tl.arange(0, NP)
    cmask = offs < C
    nmask = ns < N
    xmask = nmask[:, None] & cmask[None, :]
    base = t * N * C
    x = tl.load(x_ptr + base + ns[:, None] * C + offs[None, :], mask=xmask, other=0.0).to(tl.float32)
    hpre = tl.load(hpre_ptr + t * N + ns, mask=nmask, other=0.0)
    agg = tl.sum(hpre[:, None] * x, axis=0)
    tl.store(agg_ptr + t * C + offs, agg.to(agg_ptr.dtype.element_ty), mask=cmask)
    hres = tl.load(hres_ptr + t * N * N + ns[:, None] * N + ns[None, :], mask=nmask[:, None] & nmask[None, :],
                   other=0.0)
    mixed = tl.sum(hres[:, :, None] * x[None, :, :], axis=1)
    tl.store(mixed_ptr + base + ns[:, None] * C + offs[None, :], mixed.to(mixed_ptr.dtype.element_ty), mask=xmask)


@triton.jit
def _stream_mix_bwd(x_ptr, hpre_ptr, hres_ptr, gagg_ptr, gmixed_ptr, dx_ptr, dhpre_ptr, dhres_ptr, C,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, NP)
    nmask = ns < N
    nnmask = nmask[:, None] & nmask[None, :]
    base = t * N * C
    hpre = tl.load(hpre_ptr + t * N + ns, mask=nmask, other=0.0)
    hres = tl.load(hres_ptr + t * N * N + ns[:, None] * N + ns[None, :], mask=nnmask, other=0.0)
    dhpre = tl.zeros([NP], dtype=tl.float32)
    dhres = tl.zeros([NP, NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        cmask = offs < C
        xmask = nmask[:, None] & cmask[None, :]
        ptrs = base + ns[:, None] * C + offs[None, :]
        x = tl.load(x_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
        gm = tl.load(gmixed_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
        ga = tl.load(gagg_ptr + t * C + offs, mask=cmask, other=0.0).to(tl.float32)
        dhpre += tl.sum(x * ga[None, :], axis=1)
        dhres += tl.sum(gm[:, None, :] * x[None, :, :], axis=2)  # [i, j] = <g_i, x_j>
        dx = tl.sum(hres[:, :, None] * gm[:, None, :], axis=0) + hpre[:, None] * ga[None, :]  # H_res^T g
        tl.store(dx_ptr + ptrs, dx.to(dx_ptr.dtype.element_ty), mask=xmask)
    tl.store(dhpre_ptr + t * N + ns, dhpre, mask=nmask)
    tl.store(dhres_ptr + t * N * N + ns[:, None] * N + ns[None, :], dhres, mask=nnmask)


def stream_mix(x: torch.Tensor, h_pre: torch.Tensor, h_res: torch.Tensor, n: int, block_c: int = 64):
    x = x.contiguous()
    tokens, width = x.shape
    c = width // n
    agg, mixed = x.new_empty(tokens, c), torch.empty_like(x)
    grid = (tokens, triton.cdiv(c, block_c))
    _stream_mix_fwd[grid](x, h_pre.float().contiguous(), h_res.float().contiguous(), agg, mixed, c, N=n, NP=_pow2(n),
                          BLOCK_C=block_c)
    return agg, mixed


def stream_mix_backward(x, h_pre, h_res, g_agg, g_mixed, n: int, block_c: int = 64):
    x = x.contiguous()
    tokens, width = x.shape
    dx = torch.empty_like(x)
    dh_pre = torch.empty(tokens, n, device=x.device, dtype=torch.float32)
    dh_res = torch.empty(tokens, n, n, device=x.device, dtype=torch.float32)
    _stream_mix_bwd[(tokens,)](x, h_pre.float().contiguous(), h_res.float().contiguous(), g_agg.contiguous(),
                               g_mixed.contiguous(), dx, dh_pre, dh_res, width // n, N=n, NP=_pow2(n),
                               BLOCK_C=block_c)
    return dx, dh_pre, dh_res


# ------------------------------------------------------------------ H_post bias-dropout-add
@triton.jit
def _keep(seed_ptr, offsets, p):
    """The dropout mask, from the seed and each element's position in the ``[T, n*C]`` stream."""
    return tl.rand(tl.load(seed_ptr), offsets) >= p


@triton.jit
def _h_post_bda_fwd(mixed_ptr, hpost_ptr, out_ptr, bias_ptr, seed_ptr, y_ptr, C, p, scale, N: tl.constexpr,
                    NP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ns = tl.arange(0, NP)
    cmask = offs < C
    nmask = ns < N
    xmask = nmask[:, None] & cmask[None, :]
    out = tl.load(out_ptr + t * C + offs, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
    hpost = tl.load(hpost_ptr + t * N + ns, mask=nmask, other=0.0)
    spread = hpost[:, None] * out[None, :]
    ptrs = t * N * C + ns[:, None] * C + offs[None, :]
    if DROPOUT:
        spread = tl.where(_keep(seed_ptr, ptrs.to(tl.uint32), p), spread * scale, 0.0)
    y = tl.load(mixed_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32) + spread
    tl.store(y_ptr + ptrs, y.to(y_ptr.dtype.element_ty), mask=xmask)


@triton.jit
def _h_post_bda_bwd(g_ptr, hpost_ptr, out_ptr, bias_ptr, seed_ptr, dhpost_ptr, dout_ptr, C, p, scale,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, NP)
    nmask = ns < N
    hpost = tl.load(hpost_ptr + t * N + ns, mask=nmask, other=0.0)
    dhpost = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        cmask = offs < C
        ptrs = t * N * C + ns[:, None] * C + offs[None, :]
        g = tl.load(g_ptr + ptrs, mask=nmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if DROPOUT:
            g = tl.where(_keep(seed_ptr, ptrs.to(tl.uint32), p), g * scale, 0.0)
        out = tl.load(out_ptr + t * C + offs, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
        dhpost += tl.sum(g * out[None, :], axis=1)
        dout = tl.sum(hpost[:, None] * g, axis=0)
        tl.store(dout_ptr + t * C + offs, dout.to(dout_ptr.dtype.element_ty), mask=cmask)
    tl.store(dhpost_ptr + t * N + ns, dhpost, mask=nmask)


def _dropout_seed(device: torch.device) -> torch.Tensor:
    """A seed drawn from the device's generator (inside the caller's RNG fork, so a recompute that
    restores the generator states draws it again), kept on the device: no host sync."""
    return torch.randint(0, 2 ** 31 - 1, (1,), device=device, dtype=torch.int32)


class HPostBiasDropoutAdd(torch.autograd.Function):
    """``mixed + dropout(H_post^T (out + bias))``, ``[T, n*C]``, ``[T, n]``, ``[T, C]``, ``[C]`` ->
    ``[T, n*C]``: one Triton pass each way. Saves ``H_post``, ``out``, the bias and the dropout
    seed (not the mask); the gradient of ``mixed`` is the incoming one."""

    @staticmethod
    def forward(ctx, mixed, h_post, out, bias, prob: float, block_c: int = 64):
        check_device(mixed)
        mixed, out = mixed.contiguous(), out.contiguous()
        tokens, width = mixed.shape
        n = h_post.shape[1]
        c = width // n
        h_post = h_post.float().contiguous()
        seed = _dropout_seed(mixed.device) if prob > 0 else h_post.new_zeros(1, dtype=torch.int32)
        y = torch.empty_like(mixed)
        _h_post_bda_fwd[(tokens, triton.cdiv(c, block_c))](
            mixed, h_post, out, bias if bias is not None else out, seed, y, c, prob, 1.0 / (1.0 - prob) if prob < 1
            else 0.0, N=n, NP=_pow2(n), BLOCK_C=block_c, HAS_BIAS=bias is not None, DROPOUT=prob > 0)
        ctx.save_for_backward(h_post, out, bias, seed)
        ctx.prob, ctx.block_c = prob, block_c
        return y

    @staticmethod
    def backward(ctx, grad):
        h_post, out, bias, seed = ctx.saved_tensors
        grad = grad.contiguous()
        tokens, width = grad.shape
        n = h_post.shape[1]
        c = width // n
        d_h_post = torch.empty_like(h_post)
        d_out = torch.empty_like(out)
        prob = ctx.prob
        _h_post_bda_bwd[(tokens,)](grad, h_post, out, bias if bias is not None else out, seed, d_h_post, d_out, c,
                                   prob, 1.0 / (1.0 - prob) if prob < 1 else 0.0, N=n, NP=_pow2(n),
                                   BLOCK_C=ctx.block_c, HAS_BIAS=bias is not None, DROPOUT=prob > 0)
        d_bias = d_out.float().sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return grad, d_h_post, d_out, d_bias, None, None


def h_post_bda(mixed, h_post, out, bias, prob: float):
    """``HPostBiasDropoutAdd`` on ``[..., n*C]`` streams (leading dimensions flattened)."""
    lead = mixed.shape[:-1]
    y = HPostBiasDropoutAdd.apply(mixed.reshape(-1, mixed.shape[-1]), h_post.reshape(-1, h_post.shape[-1]),
                                  out.reshape(-1, out.shape[-1]), bias, prob)
    return y.view(*lead, -1)


# ------------------------------------------------------------------ projection: x @ phi and 1/rms(x)
@triton.jit
def _projection_fwd(x_ptr, phi_ptr, raw_ptr, r_ptr, T, K, M, eps, MP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, MP)
    tmask = rows < T
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        phi = tl.load(phi_ptr + ks[:, None] * MP + cols[None, :], mask=kmask[:, None], other=0.0)
        acc = tl.dot(x, phi, acc, input_precision="ieee")
        sumsq += tl.sum(x * x, axis=1)
    r = 1.0 / tl.sqrt(sumsq / K + eps)
    tl.store(r_ptr + rows, r, mask=tmask)
    tl.store(raw_ptr + rows[:, None].to(tl.int64) * M + cols[None, :], acc, mask=tmask[:, None] & (cols[None, :] < M))


def projection(x: torch.Tensor, phi: torch.Tensor, eps: float, block_t: int = 16, block_k: int = 32):
    """``(raw = x @ phi [T, M] fp32, r = 1/rms(x) [T] fp32)`` reading ``x`` once."""
    check_device(x)
    x = x.contiguous()
    tokens, width = x.shape
    m = phi.shape[1]
    mp = _pow2(max(m, 16))
    phi_padded = torch.zeros(width, mp, device=x.device, dtype=torch.float32)
    phi_padded[:, :m] = phi
    raw = torch.empty(tokens, m, device=x.device, dtype=torch.float32)
    r = torch.empty(tokens, device=x.device, dtype=torch.float32)
    _projection_fwd[(triton.cdiv(tokens, block_t),)](x, phi_padded, raw, r, tokens, width, m, eps, MP=mp,
                                                     BLOCK_T=block_t, BLOCK_K=block_k)
    return raw, r


# ------------------------------------------------------------------ mappings: sigmoids and Sinkhorn
@triton.jit
def _load_z(raw_ptr, r_ptr, alpha_ptr, bias_ptr, rows, tmask, M, N: tl.constexpr, NP: tl.constexpr):
    """The logits ``z = alpha * r * raw + bias`` of pre, post ``[BT, NP]`` and res ``[BT, NP, NP]``."""
    ns = tl.arange(0, NP)
    nmask = ns < N
    r = tl.load(r_ptr + rows, mask=tmask, other=0.0)
    base = rows.to(tl.int64) * M
    m2 = tmask[:, None] & nmask[None, :]
    a_pre, a_post, a_res = tl.load(alpha_ptr), tl.load(alpha_ptr + 1), tl.load(alpha_ptr + 2)
    z_pre = a_pre * r[:, None] * tl.load(raw_ptr + base[:, None] + ns[None, :], mask=m2, other=0.0) \
        + tl.load(bias_ptr + ns, mask=nmask, other=0.0)[None, :]
    z_post = a_post * r[:, None] * tl.load(raw_ptr + base[:, None] + N + ns[None, :], mask=m2, other=0.0) \
        + tl.load(bias_ptr + N + ns, mask=nmask, other=0.0)[None, :]
    ij = ns[:, None] * N + ns[None, :]
    m3 = tmask[:, None, None] & (nmask[:, None] & nmask[None, :])[None, :, :]
    z_res = a_res * r[:, None, None] * tl.load(raw_ptr + base[:, None, None] + 2 * N + ij[None, :, :], mask=m3,
                                                other=0.0) \
        + tl.load(bias_ptr + 2 * N + ij, mask=nmask[:, None] & nmask[None, :], other=0.0)[None, :, :]
    return z_pre, z_post, z_res, m2, m3


@triton.jit
def _sinkhorn_start(z_res, m3):
    logits = tl.where(m3, z_res, float("-inf"))
    top = tl.max(tl.max(logits, axis=2), axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)  # a masked-out (tail) token
    return tl.where(m3, tl.exp(logits - top[:, None, None]), 0.0)


@triton.jit
def _sinkhorn_step(p, step, eps):
    """Step ``step``: even normalises columns (sums over rows, axis 1), odd rows (axis 2)."""
    if step % 2 == 0:
        raw = tl.sum(p, axis=1)[:, None, :]
    else:
        raw = tl.sum(p, axis=2)[:, :, None]
    return p / tl.maximum(raw, eps), raw


@triton.jit
def _mappings_fwd(raw_ptr, r_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, hres_ptr, T, M, iterations, eps,
                  N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rows < T
    z_pre, z_post, z_res, m2, m3 = _load_z(raw_ptr, r_ptr, alpha_ptr, bias_ptr, rows, tmask, M, N, NP)
    ns = tl.arange(0, NP)
    out2 = rows[:, None].to(tl.int64) * N + ns[None, :]
    tl.store(hpre_ptr + out2, tl.sigmoid(z_pre), mask=m2)
    tl.store(hpost_ptr + out2, 2.0 * tl.sigmoid(z_post), mask=m2)
    p = _sinkhorn_start(z_res, m3)
    for step in range(0, 2 * iterations):
        p, _ = _sinkhorn_step(p, step, eps)
    ij = ns[:, None] * N + ns[None, :]
    tl.store(hres_ptr + rows[:, None, None].to(tl.int64) * N * N + ij[None, :, :], p, mask=m3)


@triton.jit
def _mappings_bwd(raw_ptr, r_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, ghpre_ptr, ghpost_ptr, ghres_ptr,
                  dz_ptr, T, M, iterations, eps, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``dz [T, M]``: the gradient of the logits ``z`` (sigmoids, and Sinkhorn walked in reverse
    with each step's matrix recomputed from the start)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rows < T
    z_pre, z_post, z_res, m2, m3 = _load_z(raw_ptr, r_ptr, alpha_ptr, bias_ptr, rows, tmask, M, N, NP)
    ns = tl.arange(0, NP)
    in2 = rows[:, None].to(tl.int64) * N + ns[None, :]
    hpre = tl.load(hpre_ptr + in2, mask=m2, other=0.0)
    hpost = tl.load(hpost_ptr + in2, mask=m2, other=0.0)
    dz_pre = tl.load(ghpre_ptr + in2, mask=m2, other=0.0) * hpre * (1.0 - hpre)
    dz_post = tl.load(ghpost_ptr + in2, mask=m2, other=0.0) * hpost * (1.0 - 0.5 * hpost)
    base = rows.to(tl.int64) * M
    tl.store(dz_ptr + base[:, None] + ns[None, :], dz_pre, mask=m2)
    tl.store(dz_ptr + base[:, None] + N + ns[None, :], dz_post, mask=m2)
    ij = ns[:, None] * N + ns[None, :]
    start = _sinkhorn_start(z_res, m3)
    p = start
    clamped = tl.zeros([BLOCK_T], dtype=tl.int32)
    for step in range(0, 2 * iterations):
        p, raw = _sinkhorn_step(p, step, eps)
        low = tl.where(raw < eps, 1, 0)
        clamped = tl.maximum(clamped, tl.max(tl.max(low, axis=2), axis=1))
    g = tl.load(ghres_ptr + rows[:, None, None].to(tl.int64) * N * N + ij[None, :, :], mask=m3, other=0.0) * p
    for back in range(0, 2 * iterations):
        step = 2 * iterations - 1 - back
        q = start
        for s in range(0, step):
            q, _ = _sinkhorn_step(q, s, eps)
        q, raw = _sinkhorn_step(q, step, eps)
        keep = tl.where(raw >= eps, 1.0, 0.0)
        if step % 2 == 0:
            total = tl.sum(g, axis=1)[:, None, :] * keep
        else:
            total = tl.sum(g, axis=2)[:, :, None] * keep
        g = g - q * total
    # where a sum was clamped, the maximum logit gets a gradient too (shift invariance is broken)
    logits = tl.where(m3, z_res, float("-inf"))
    top = tl.max(tl.max(logits, axis=2), axis=1)
    at_max = tl.where(m3 & (logits == top[:, None, None]), 1.0, 0.0)
    shift = tl.sum(tl.sum(g, axis=2), axis=1) / tl.maximum(tl.sum(tl.sum(at_max, axis=2), axis=1), 1.0)
    g = g - at_max * (shift * (clamped > 0).to(tl.float32))[:, None, None]
    tl.store(dz_ptr + base[:, None, None] + 2 * N + ij[None, :, :], g, mask=m3)


def mappings(raw, r, alpha, bias, n: int, iterations: int, eps: float, block_t: int = 16):
    tokens, m = raw.shape
    h_pre = torch.empty(tokens, n, device=raw.device, dtype=torch.float32)
    h_post, h_res = torch.empty_like(h_pre), torch.empty(tokens, n, n, device=raw.device, dtype=torch.float32)
    _mappings_fwd[(triton.cdiv(tokens, block_t),)](raw, r, alpha.float().contiguous(), bias.float().contiguous(),
                                                   h_pre, h_post, h_res, tokens, m, iterations, eps, N=n,
                                                   NP=_pow2(n), BLOCK_T=block_t)
    return h_pre, h_post, h_res


def mappings_backward(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_h_post, g_h_res, n: int, iterations: int,
                      eps: float, block_t: int = 16):
    tokens, m = raw.shape
    dz = torch.empty(tokens, m, device=raw.device, dtype=torch.float32)
    _mappings_bwd[(triton.cdiv(tokens, block_t),)](raw, r, alpha.float().contiguous(), bias.float().contiguous(),
                                                   h_pre, h_post, g_h_pre.float().contiguous(),
                                                   g_h_post.float().contiguous(), g_h_res.float().contiguous(),
                                                   dz, tokens, m, iterations, eps, N=n, NP=_pow2(n),
                                                   BLOCK_T=block_t)
    return dz


class TritonKernels:
    """The kernel set of ``HyperConnectionPre`` in Triton (see ``EagerKernels`` for the contract)."""

    name = "triton"
    project = staticmethod(projection)
    mappings = staticmethod(mappings)
    mappings_dz = staticmethod(mappings_backward)
    stream_mix = staticmethod(stream_mix)
    stream_mix_backward = staticmethod(stream_mix_backward)
