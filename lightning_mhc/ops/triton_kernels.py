"""Triton kernels of the fused hyper-connection, for the GPU (and Triton's CPU interpreter).

``TritonKernels`` is the kernel set ``HyperConnectionPre`` runs with ``mhc_implementation=triton``
(and ``auto`` on CUDA when Triton imports); ``EagerKernels`` in ``hyper_connection.py`` is the same
interface in eager ops. Layout: the stream ``x [T, n*C]`` (stream ``i`` of token ``t`` at
``x[t, i*C:(i+1)*C]``), fp32 or bf16 in and out, fp32 accumulation; the mappings are fp32. ``n``
may be any size: register tiles are padded to ``NP``, the next power of two, with masks
(``tl.arange`` needs powers of two); token and channel tails are masked too.

- ``projection``: ``raw = x @ phi`` and ``r = 1/rms(x)`` in one read of ``x`` (the norm is applied
  after the product, so the normalised stream is never formed); the product on the tensor cores
  where the precision allows (``projection_precision``).
- ``mappings``: from ``raw`` and ``r``: ``H_pre = sigmoid``, ``H_post = 2 sigmoid`` and Sinkhorn in
  registers. Its backward re-runs the iterations instead of storing them, walking the steps in
  reverse with each step's matrix recomputed from the start (iterations^2 small normalisations
  per token: arithmetic in registers, where the kernel's cost is reading memory).
  DeepSeek-V4's convention (``V4``, ``lightning_mhc.ops.convention``): ``H_pre = sigmoid + eps`` and
  V4's comb (softmax over rows + eps, then columns, ``t - 1`` rounds of rows and columns over
  ``sum + eps``) on the logits as laid out, stored transposed (``H_res = comb^T``).
- ``aggregate``: ``H_pre x`` ``[T, C]`` in one read of ``x``; its backward gives ``dx`` and ``dH_pre``.
- ``res_post``: the next stream ``H_res x + dropout(H_post^T (out + bias))`` in one pass that reads
  ``x`` and ``out`` and writes ``n C`` per token (the paper's post/res kernel); its backward reads
  ``x``, ``out`` and the gradient once and gives ``dx``, ``dH_res``, ``dH_post`` and ``d out`` (the
  reductions over ``C`` in registers). Dropout draws its mask in the kernel (Philox, from a seed
  taken from torch's generator), so no mask is stored: the backward draws it again from the seed.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported): slow, for checking them without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_mhc.ops import TRITON_NOT_HERE, triton_runs_on


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_device(x: torch.Tensor) -> None:
    """The kernels need a CUDA tensor, or Triton's interpreter for a CPU one."""
    if not triton_runs_on(x.device.type):
        raise RuntimeError(f"mhc_implementation='triton' on a {x.device.type} tensor: {TRITON_NOT_HERE}")



# ------------------------------------------------------------------ the tiles the stream kernels share
@triton.jit
def _stream_tile(t, c0, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channels ``c0 .. c0 + BLOCK_C`` of token ``t``'s ``n`` streams in ``[T, n*C]``: the channel
    offsets and their mask, and the ``[NP, BLOCK_C]`` element offsets and mask (padded streams and
    the channel tail masked)."""
    ns = tl.arange(0, NP)
    offs = c0 + tl.arange(0, BLOCK_C)
    cmask = offs < C
    return offs, cmask, t * N * C + ns[:, None] * C + offs[None, :], (ns < N)[:, None] & cmask[None, :]


@triton.jit
def _load_per_token(ptr, t, N: tl.constexpr, NP: tl.constexpr):
    """Token ``t``'s ``[n]`` coefficients (H_pre or H_post), padded to ``NP`` with zeros."""
    ns = tl.arange(0, NP)
    return tl.load(ptr + t * N + ns, mask=ns < N, other=0.0)


@triton.jit
def _load_h_res(hres_ptr, t, N: tl.constexpr, NP: tl.constexpr):
    """Token ``t``'s ``[n, n]`` H_res, padded to ``[NP, NP]`` with zeros."""
    ns = tl.arange(0, NP)
    nmask = ns < N
    return tl.load(hres_ptr + t * N * N + ns[:, None] * N + ns[None, :], mask=nmask[:, None] & nmask[None, :],
                   other=0.0)


# ------------------------------------------------------------------ aggregate: H_pre x
@triton.jit
def _aggregate_fwd(x_ptr, hpre_ptr, agg_ptr, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs, cmask, ptrs, xmask = _stream_tile(t, tl.program_id(1) * BLOCK_C, C, N, NP, BLOCK_C)
    x = tl.load(x_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
    hpre = _load_per_token(hpre_ptr, t, N, NP)
    tl.store(agg_ptr + t * C + offs, tl.sum(hpre[:, None] * x, axis=0).to(agg_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _aggregate_bwd(x_ptr, hpre_ptr, gagg_ptr, dx_ptr, dhpre_ptr, C, N: tl.constexpr, NP: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, NP)
    hpre = _load_per_token(hpre_ptr, t, N, NP)
    dhpre = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs, cmask, ptrs, xmask = _stream_tile(t, c0, C, N, NP, BLOCK_C)
        x = tl.load(x_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
        ga = tl.load(gagg_ptr + t * C + offs, mask=cmask, other=0.0).to(tl.float32)
        dhpre += tl.sum(x * ga[None, :], axis=1)
        tl.store(dx_ptr + ptrs, (hpre[:, None] * ga[None, :]).to(dx_ptr.dtype.element_ty), mask=xmask)
    tl.store(dhpre_ptr + t * N + ns, dhpre, mask=ns < N)


def aggregate(x: torch.Tensor, h_pre: torch.Tensor, n: int, block_c: int = 64) -> torch.Tensor:
    check_device(x)
    x = x.contiguous()
    tokens, width = x.shape
    c = width // n
    agg = x.new_empty(tokens, c)
    _aggregate_fwd[(tokens, triton.cdiv(c, block_c))](x, h_pre.float().contiguous(), agg, c, N=n, NP=_pow2(n),
                                                      BLOCK_C=block_c)
    return agg


def aggregate_backward(x, h_pre, g_agg, n: int, block_c: int = 64):
    x = x.contiguous()
    tokens, width = x.shape
    dx = torch.empty_like(x)
    dh_pre = torch.empty(tokens, n, device=x.device, dtype=torch.float32)
    _aggregate_bwd[(tokens,)](x, h_pre.float().contiguous(), g_agg.contiguous(), dx, dh_pre, width // n, N=n,
                              NP=_pow2(n), BLOCK_C=block_c)
    return dx, dh_pre


# ------------------------------------------------------------------ res_post: H_res x + dropout(H_post^T (out + b))
@triton.jit
def _keep(seed_ptr, offsets, p):
    """The dropout mask, from the seed and each element's position in the ``[T, n*C]`` stream."""
    return tl.rand(tl.load(seed_ptr), offsets) >= p


@triton.jit
def _load_out(out_ptr, bias_ptr, t, C, offs, cmask, HAS_BIAS: tl.constexpr):
    out = tl.load(out_ptr + t * C + offs, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
    return out


@triton.jit
def _res_post_fwd(x_ptr, hres_ptr, hpost_ptr, out_ptr, bias_ptr, seed_ptr, y_ptr, C, p, scale, N: tl.constexpr,
                  NP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs, cmask, ptrs, xmask = _stream_tile(t, tl.program_id(1) * BLOCK_C, C, N, NP, BLOCK_C)
    x = tl.load(x_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
    mixed = tl.sum(_load_h_res(hres_ptr, t, N, NP)[:, :, None] * x[None, :, :], axis=1)
    hpost = _load_per_token(hpost_ptr, t, N, NP)
    spread = hpost[:, None] * _load_out(out_ptr, bias_ptr, t, C, offs, cmask, HAS_BIAS)[None, :]
    if DROPOUT:
        spread = tl.where(_keep(seed_ptr, ptrs.to(tl.uint32), p), spread * scale, 0.0)
    tl.store(y_ptr + ptrs, (mixed + spread).to(y_ptr.dtype.element_ty), mask=xmask)


@triton.jit
def _res_post_bwd(x_ptr, hres_ptr, hpost_ptr, out_ptr, bias_ptr, seed_ptr, g_ptr, dx_ptr, dhres_ptr, dhpost_ptr,
                  dout_ptr, C, p, scale, N: tl.constexpr, NP: tl.constexpr, BLOCK_C: tl.constexpr,
                  HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, NP)
    nmask = ns < N
    hres = _load_h_res(hres_ptr, t, N, NP)
    hpost = _load_per_token(hpost_ptr, t, N, NP)
    dhres = tl.zeros([NP, NP], dtype=tl.float32)
    dhpost = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs, cmask, ptrs, xmask = _stream_tile(t, c0, C, N, NP, BLOCK_C)
        x = tl.load(x_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + ptrs, mask=xmask, other=0.0).to(tl.float32)
        dhres += tl.sum(g[:, None, :] * x[None, :, :], axis=2)  # [i, j] = <g_i, x_j>
        tl.store(dx_ptr + ptrs, tl.sum(hres[:, :, None] * g[:, None, :], axis=0).to(dx_ptr.dtype.element_ty),
                 mask=xmask)  # H_res^T g
        if DROPOUT:
            g = tl.where(_keep(seed_ptr, ptrs.to(tl.uint32), p), g * scale, 0.0)
        out = _load_out(out_ptr, bias_ptr, t, C, offs, cmask, HAS_BIAS)
        dhpost += tl.sum(g * out[None, :], axis=1)
        tl.store(dout_ptr + t * C + offs, tl.sum(hpost[:, None] * g, axis=0).to(dout_ptr.dtype.element_ty),
                 mask=cmask)
    tl.store(dhres_ptr + t * N * N + ns[:, None] * N + ns[None, :], dhres, mask=nmask[:, None] & nmask[None, :])
    tl.store(dhpost_ptr + t * N + ns, dhpost, mask=nmask)


def _dropout_args(prob: float, seed, like: torch.Tensor):
    """``(seed, p, 1/(1-p))`` as the kernels take them (a dummy seed without dropout)."""
    seed = seed if seed is not None else like.new_zeros(1, dtype=torch.int32)
    return seed, prob, 1.0 / (1.0 - prob) if prob < 1 else 0.0


def res_post(x, h_res, h_post, out, bias, prob: float, seed, block_c: int = 64) -> torch.Tensor:
    """``H_res x + dropout(H_post^T (out + bias))`` ``[T, n*C]`` in ``x``'s dtype, in one pass."""
    check_device(x)
    x, out = x.contiguous(), out.contiguous()
    tokens, width = x.shape
    n = h_post.shape[1]
    c = width // n
    y = torch.empty_like(x)
    seed, p, scale = _dropout_args(prob, seed, x)
    _res_post_fwd[(tokens, triton.cdiv(c, block_c))](
        x, h_res.float().contiguous(), h_post.float().contiguous(), out, bias if bias is not None else out, seed, y,
        c, p, scale, N=n, NP=_pow2(n), BLOCK_C=block_c, HAS_BIAS=bias is not None, DROPOUT=prob > 0)
    return y


def res_post_backward(x, h_res, h_post, out, bias, prob: float, seed, grad, block_c: int = 64):
    """Gradients of ``res_post``: ``(dx, dH_res (fp32), dH_post (fp32), d out)``, in one pass."""
    x, out = x.contiguous(), out.contiguous()
    tokens, width = x.shape
    n = h_post.shape[1]
    dx = torch.empty_like(x)
    dh_res = torch.empty(tokens, n, n, device=x.device, dtype=torch.float32)
    dh_post = torch.empty(tokens, n, device=x.device, dtype=torch.float32)
    d_out = torch.empty_like(out)
    seed, p, scale = _dropout_args(prob, seed, x)
    _res_post_bwd[(tokens,)](x, h_res.float().contiguous(), h_post.float().contiguous(), out,
                             bias if bias is not None else out, seed, grad.contiguous(), dx, dh_res, dh_post, d_out,
                             width // n, p, scale, N=n, NP=_pow2(n), BLOCK_C=block_c, HAS_BIAS=bias is not None,
                             DROPOUT=prob > 0)
    return dx, dh_res, dh_post, d_out


# ------------------------------------------------------------------ projection: x @ phi and 1/rms(x)
# A program takes a tile of tokens and one split of the stream's width: it reads its slice of phi
# once for the whole tile, so phi's traffic over the stream's is 4 M / (tile * element size): 19 %
# at n = 4 with 128 fp32 or 256 bf16 tokens a tile (a tile of 16, reading phi padded to 32 columns,
# re-read 4 times the bf16 stream's bytes at C = 4096). Splitting the width keeps enough programs
# for every SM when tiles are that large; the partial products and sums of squares are added by
# torch (deterministic: no atomics).
@triton.jit
def _projection_fwd(x_ptr, phi_ptr, part_ptr, sq_ptr, T, K, M, k_per_split, MP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    cols = tl.arange(0, MP)
    tmask, cmask = rows < T, cols < M
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_end
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        phi = tl.load(phi_ptr + ks[:, None] * M + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(x, phi, acc, input_precision=PRECISION)
        sumsq += tl.sum(x * x, axis=1)
    base = split.to(tl.int64) * T + rows.to(tl.int64)
    tl.store(sq_ptr + base, sumsq, mask=tmask)
    tl.store(part_ptr + base[:, None] * M + cols[None, :], acc, mask=tmask[:, None] & cmask[None, :])


PROJECTION_TILE_BYTES = 512
"""Stream bytes per token row of a projection tile: 128 fp32 or 256 bf16 tokens."""
PROJECTION_PROGRAMS = 512
"""Programs the width is split for (a few per SM of an H100's 132)."""


PRECISION_OF_FP32_MATMULS = {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}
"""``torch.get_float32_matmul_precision()`` -> the projection's ``tl.dot`` input precision."""


def projection_precision(dtype: torch.dtype) -> str:
    """How the projection of a ``dtype`` stream multiplies (``tl.dot``'s ``input_precision``;
    accumulation is fp32 in every case):

    - a bf16 or fp16 stream: ``tf32``, on the tensor cores. tf32 holds every bf16 and fp16 value
      exactly, so only ``phi`` is rounded (to 10 mantissa bits); measured against an fp64
      evaluation, the sub-layer's outputs and gradients stay within the bound the bf16 path is
      held to (``benchmarks/fp64_accuracy.py``, docs/fused_hyper_connection.md);
    - an fp32 stream: what ``torch.set_float32_matmul_precision`` asks of every fp32 matmul of the
      model: ``highest`` (torch's default) -> ``ieee`` (fp32 FMAs, no tensor cores), ``high`` ->
      ``tf32x3`` (three tf32 products that carry the low bits: about fp32's accuracy, measured),
      ``medium`` -> ``tf32``."""
    if dtype in (torch.bfloat16, torch.float16):
        return "tf32"
    return PRECISION_OF_FP32_MATMULS[torch.get_float32_matmul_precision()]


def projection_plan(tokens: int, width: int, element_size: int, block_k: int = 32) -> tuple[int, int, int]:
    """``(tokens per tile, width per split, splits)`` of one ``projection`` call: splits enough
    for ``PROJECTION_PROGRAMS`` programs, each split at least 8 steps of ``block_k``."""
    block_t = PROJECTION_TILE_BYTES // element_size
    tiles = triton.cdiv(tokens, block_t)
    splits = max(1, min(triton.cdiv(PROJECTION_PROGRAMS, tiles), width // (8 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(width, splits), block_k) * block_k
    return block_t, k_per_split, triton.cdiv(width, k_per_split)


def projection_bytes(tokens: int, width: int, m: int, element_size: int) -> dict:
    """What one ``projection`` call moves, in bytes: ``minimum`` (the stream, ``phi`` and the
    outputs once each) and ``requested`` (what its loads and stores ask of memory, L2 or DRAM:
    the stream once, ``phi`` once per tile of tokens, the partial products and sums written and
    read back, the outputs); ``phi_share``: ``phi``'s requested bytes over the stream's."""
    block_t, _, splits = projection_plan(tokens, width, element_size)
    stream, outputs = tokens * width * element_size, tokens * (m + 1) * 4
    phi_reads = triton.cdiv(tokens, block_t) * width * m * 4
    partials = 2 * splits * tokens * (m + 1) * 4
    return dict(minimum=stream + width * m * 4 + outputs, requested=stream + phi_reads + partials + outputs,
                phi_share=phi_reads / stream)


def projection(x: torch.Tensor, phi: torch.Tensor, eps: float, block_k: int = 32):
    """``(raw = x @ phi [T, M] fp32, r = 1/rms(x) [T] fp32)`` reading ``x`` once."""
    check_device(x)
    x = x.contiguous()
    tokens, width = x.shape
    m = phi.shape[1]
    block_t, k_per_split, splits = projection_plan(tokens, width, x.element_size(), block_k)
    part = torch.empty(splits, tokens, m, device=x.device, dtype=torch.float32)
    sq = torch.empty(splits, tokens, device=x.device, dtype=torch.float32)
    _projection_fwd[(triton.cdiv(tokens, block_t), splits)](x, phi.float().contiguous(), part, sq, tokens, width, m,
                                                            k_per_split, MP=_pow2(max(m, 16)), BLOCK_T=block_t,
                                                            BLOCK_K=block_k, PRECISION=projection_precision(x.dtype),
                                                            num_warps=8)
    return part.sum(0), 1.0 / torch.sqrt(sq.sum(0) / width + eps)


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


# Column and row steps are separate functions, each with a fixed shape of sums: a step picked by
# a runtime branch would give the two branches results of different shapes, which compiled
# Triton refuses (the interpreter would not notice).
@triton.jit
def _normalise_columns(p, eps):
    """Divide by the column sums (over rows, axis 1); returns (p, the raw sums [BT, 1, NP])."""
    sums = tl.sum(p, axis=1)[:, None, :]
    return p / tl.maximum(sums, eps), sums


@triton.jit
def _normalise_rows(p, eps):
    """Divide by the row sums (over columns, axis 2); returns (p, the raw sums [BT, NP, 1])."""
    sums = tl.sum(p, axis=2)[:, :, None]
    return p / tl.maximum(sums, eps), sums


@triton.jit
def _sinkhorn_iterations(p, count, eps):
    """``count`` iterations of columns, then rows (the paper's order)."""
    for _ in range(0, count):
        p, col_sums = _normalise_columns(p, eps)
        p, row_sums = _normalise_rows(p, eps)
    return p


@triton.jit
def _v4_softmax_rows(z_res, m3):
    """V4's start: the softmax of each row of the logits (padded rows and entries 0)."""
    logits = tl.where(m3, z_res, float("-inf"))
    top = tl.max(logits, axis=2)
    top = tl.where(top == float("-inf"), 0.0, top)
    p = tl.where(m3, tl.exp(logits - top[:, :, None]), 0.0)
    sums = tl.sum(p, axis=2)
    return p / tl.where(sums == 0.0, 1.0, sums)[:, :, None]


@triton.jit
def _v4_columns(p, eps):
    return p / (tl.sum(p, axis=1)[:, None, :] + eps)


@triton.jit
def _v4_rows(p, eps):
    return p / (tl.sum(p, axis=2)[:, :, None] + eps)


@triton.jit
def _v4_rounds(p, count, eps):
    """``count`` rounds of V4's rows, then columns."""
    for _ in range(0, count):
        p = _v4_columns(_v4_rows(p, eps), eps)
    return p


@triton.jit
def _v4_comb(z_res, m3, iterations, eps):
    """V4's comb and its softmax: softmax over rows + eps (real entries only), columns, then
    ``iterations - 1`` rounds."""
    soft = _v4_softmax_rows(z_res, m3)
    return _v4_rounds(_v4_columns(tl.where(m3, soft + eps, 0.0), eps), iterations - 1, eps), soft


@triton.jit
def _v4_comb_backward(g, soft, m3, iterations, eps):
    """d loss / d logits from ``g`` (the gradient w.r.t. log comb), walking V4's steps in reverse
    with each matrix recomputed from the start (as the mHC walk): a step ``Q = P / (sum P + eps)``
    gives ``g - Q sum(g)``, ``+ eps`` multiplies by ``P / (P + eps)``, the row softmax gives
    ``g - P rowsum(g)``."""
    first = _v4_columns(tl.where(m3, soft + eps, 0.0), eps)
    for back in range(0, iterations - 1):
        q_row = _v4_rows(_v4_rounds(first, iterations - 2 - back, eps), eps)
        q_col = _v4_columns(q_row, eps)
        g = g - q_col * tl.sum(g, axis=1)[:, None, :]
        g = g - q_row * tl.sum(g, axis=2)[:, :, None]
    g = g - first * tl.sum(g, axis=1)[:, None, :]
    g = g * (soft / (soft + eps))
    return g - soft * tl.sum(g, axis=2)[:, :, None]


@triton.jit
def _any_clamped(sums, valid, eps):
    """Per token, 1 where a real row or column (``valid``, not padding) had its sum clamped."""
    low = tl.where(valid & (sums < eps), 1, 0)
    return tl.max(tl.max(low, axis=2), axis=1)


@triton.jit
def _mappings_fwd(raw_ptr, r_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, hres_ptr, T, M, iterations, eps,
                  N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, V4: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rows < T
    z_pre, z_post, z_res, m2, m3 = _load_z(raw_ptr, r_ptr, alpha_ptr, bias_ptr, rows, tmask, M, N, NP)
    ns = tl.arange(0, NP)
    out2 = rows[:, None].to(tl.int64) * N + ns[None, :]
    tl.store(hpost_ptr + out2, 2.0 * tl.sigmoid(z_post), mask=m2)
    base = rows[:, None, None].to(tl.int64) * N * N
    if V4:
        tl.store(hpre_ptr + out2, tl.sigmoid(z_pre) + eps, mask=m2)
        comb, soft = _v4_comb(z_res, m3, iterations, eps)
        ji = ns[:, None] + ns[None, :] * N  # comb[i, j] -> H_res[j, i]
        tl.store(hres_ptr + base + ji[None, :, :], comb, mask=m3)
    else:
        tl.store(hpre_ptr + out2, tl.sigmoid(z_pre), mask=m2)
        p = _sinkhorn_iterations(_sinkhorn_start(z_res, m3), iterations, eps)
        ij = ns[:, None] * N + ns[None, :]
        tl.store(hres_ptr + base + ij[None, :, :], p, mask=m3)


@triton.jit
def _mappings_bwd(raw_ptr, r_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, ghpre_ptr, ghpost_ptr, ghres_ptr,
                  dz_ptr, T, M, iterations, eps, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
                  V4: tl.constexpr = False):
    """``dz [T, M]``: the gradient of the logits ``z`` (sigmoids, and Sinkhorn walked in reverse
    with each step's matrix recomputed from the start)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = rows < T
    z_pre, z_post, z_res, m2, m3 = _load_z(raw_ptr, r_ptr, alpha_ptr, bias_ptr, rows, tmask, M, N, NP)
    ns = tl.arange(0, NP)
    nmask = ns < N
    in2 = rows[:, None].to(tl.int64) * N + ns[None, :]
    if V4:  # H_pre = sigmoid + eps: the sigmoid again, not H_pre - eps (rounded)
        hpre = tl.where(m2, tl.sigmoid(z_pre), 0.0)
    else:
        hpre = tl.load(hpre_ptr + in2, mask=m2, other=0.0)
    hpost = tl.load(hpost_ptr + in2, mask=m2, other=0.0)
    dz_pre = tl.load(ghpre_ptr + in2, mask=m2, other=0.0) * hpre * (1.0 - hpre)
    dz_post = tl.load(ghpost_ptr + in2, mask=m2, other=0.0) * hpost * (1.0 - 0.5 * hpost)
    base = rows.to(tl.int64) * M
    tl.store(dz_ptr + base[:, None] + ns[None, :], dz_pre, mask=m2)
    tl.store(dz_ptr + base[:, None] + N + ns[None, :], dz_post, mask=m2)
    ij = ns[:, None] * N + ns[None, :]
    if V4:
        comb, soft = _v4_comb(z_res, m3, iterations, eps)
        ji = ns[:, None] + ns[None, :] * N  # d H_res[j, i] is d comb[i, j]
        g = tl.load(ghres_ptr + rows[:, None, None].to(tl.int64) * N * N + ji[None, :, :], mask=m3, other=0.0)
        g = _v4_comb_backward(g * comb, soft, m3, iterations, eps)
        tl.store(dz_ptr + base[:, None, None] + 2 * N + ij[None, :, :], g, mask=m3)
    else:
        _mhc_sinkhorn_backward(z_res, m3, nmask, ghres_ptr, dz_ptr, rows, base, ij, iterations, eps, N, BLOCK_T)


@triton.jit
def _mhc_sinkhorn_backward(z_res, m3, nmask, ghres_ptr, dz_ptr, rows, base, ij, iterations, eps, N: tl.constexpr,
                           BLOCK_T: tl.constexpr):
    """The mHC Sinkhorn's part of ``_mappings_bwd``."""
    start = _sinkhorn_start(z_res, m3)
    p = start
    clamped = tl.zeros([BLOCK_T], dtype=tl.int32)
    real_columns, real_rows = nmask[None, None, :], nmask[None, :, None]
    for _ in range(0, iterations):
        p, col_sums = _normalise_columns(p, eps)
        clamped = tl.maximum(clamped, _any_clamped(col_sums, real_columns, eps))
        p, row_sums = _normalise_rows(p, eps)
        clamped = tl.maximum(clamped, _any_clamped(row_sums, real_rows, eps))
    g = tl.load(ghres_ptr + rows[:, None, None].to(tl.int64) * N * N + ij[None, :, :], mask=m3, other=0.0) * p
    # iteration k in reverse: its row step, then its column step, each matrix recomputed from the start
    for back in range(0, iterations):
        q = _sinkhorn_iterations(start, iterations - 1 - back, eps)
        q_col, col_sums = _normalise_columns(q, eps)
        q_row, row_sums = _normalise_rows(q_col, eps)
        g = g - q_row * (tl.sum(g, axis=2)[:, :, None] * tl.where(row_sums >= eps, 1.0, 0.0))
        g = g - q_col * (tl.sum(g, axis=1)[:, None, :] * tl.where(col_sums >= eps, 1.0, 0.0))
    # where a sum was clamped, the maximum logit gets a gradient too (shift invariance is broken)
    logits = tl.where(m3, z_res, float("-inf"))
    top = tl.max(tl.max(logits, axis=2), axis=1)
    at_max = tl.where(m3 & (logits == top[:, None, None]), 1.0, 0.0)
    shift = tl.sum(tl.sum(g, axis=2), axis=1) / tl.maximum(tl.sum(tl.sum(at_max, axis=2), axis=1), 1.0)
    g = g - at_max * (shift * (clamped > 0).to(tl.float32))[:, None, None]
    tl.store(dz_ptr + base[:, None, None] + 2 * N + ij[None, :, :], g, mask=m3)


def _v4(convention: str, iterations: int) -> bool:
    """The kernels' ``V4`` switch for a convention (V4's Sinkhorn needs an iteration)."""
    if convention == "deepseek_v4":
        from lightning_mhc.ops.sinkhorn import _at_least_one

        _at_least_one(iterations)
        return True
    return False


def mappings(raw, r, alpha, bias, n: int, iterations: int, eps: float, convention: str = "mhc", block_t: int = 16):
    tokens, m = raw.shape
    h_pre = torch.empty(tokens, n, device=raw.device, dtype=torch.float32)
    h_post, h_res = torch.empty_like(h_pre), torch.empty(tokens, n, n, device=raw.device, dtype=torch.float32)
    _mappings_fwd[(triton.cdiv(tokens, block_t),)](raw, r, alpha.float().contiguous(), bias.float().contiguous(),
                                                   h_pre, h_post, h_res, tokens, m, iterations, eps, N=n,
                                                   NP=_pow2(n), BLOCK_T=block_t, V4=_v4(convention, iterations))
    return h_pre, h_post, h_res


def mappings_backward(raw, r, alpha, bias, h_pre, h_post, g_h_pre, g_h_post, g_h_res, n: int, iterations: int,
                      eps: float, convention: str = "mhc", block_t: int = 16):
    tokens, m = raw.shape
    dz = torch.empty(tokens, m, device=raw.device, dtype=torch.float32)
    _mappings_bwd[(triton.cdiv(tokens, block_t),)](raw, r, alpha.float().contiguous(), bias.float().contiguous(),
                                                   h_pre, h_post, g_h_pre.float().contiguous(),
                                                   g_h_post.float().contiguous(), g_h_res.float().contiguous(),
                                                   dz, tokens, m, iterations, eps, N=n, NP=_pow2(n),
                                                   BLOCK_T=block_t, V4=_v4(convention, iterations))
    return dz


class TritonKernels:
    """The kernel set of the fused hyper-connection in Triton (see ``EagerKernels`` for the contract)."""

    name = "triton"
    DROPOUT = True
    project = staticmethod(projection)
    mappings = staticmethod(mappings)
    mappings_dz = staticmethod(mappings_backward)
    aggregate = staticmethod(aggregate)
    aggregate_backward = staticmethod(aggregate_backward)
    res_post = staticmethod(res_post)
    res_post_backward = staticmethod(res_post_backward)
