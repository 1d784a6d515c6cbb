"""Bias-dropout-add: ``residual + dropout(out + bias)``, and its hyper-connection form
``mixed + dropout(H_post^T * (out + bias))`` (``H_post`` spreads the sub-layer output over
the ``n`` streams; ``mixed = H_res @ x``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mhc.ops import is_fused, uses_triton
from lightning_mhc.ops.hyper_connection import HPostResidual, reference_apply_h_post
from lightning_mhc.recompute.rng import rng_fork


def bias_dropout_add(
    x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float, training: bool,
    sequence_parallel: bool = False,
) -> Tensor:
    """``residual + dropout(out + bias)``. The residual stream is replicated across TP (same mask
    on every TP rank) or, under ``sequence_parallel``, split along the sequence (a mask per rank)."""
    out, bias = x_with_bias
    if bias is not None:
        out = out + bias
    with rng_fork(*(() if sequence_parallel else ("tensor",))):
        dropped = F.dropout(out, p=prob, training=training)
    return residual + dropped


def h_post_bias_dropout_add(
    x_with_bias: tuple[Tensor, Tensor | None], h_post: Tensor, mixed: Tensor, prob: float, training: bool,
    implementation: str = "fused", sequence_parallel: bool = False,
) -> Tensor:
    """``mixed + dropout(H_post^T * (out + bias))``: ``[s,b,C]``, ``[s,b,n]``, ``[s,b,n*C]`` -> ``[s,b,n*C]``.

    By ``implementation`` (``mhc_implementation``): with Triton's kernels, one pass each way,
    dropout included (``triton_kernels.HPostBiasDropoutAdd``: its mask is drawn in the kernel from a
    seed, so it differs from the reference's, and is not stored). Otherwise, the fused ops without
    active dropout are ``HPostResidual``: one ``addcmul`` into a fresh tensor (no ``[s,b,n*C]``
    temporaries, saves ``H_post`` and ``out + bias`` for backward); with dropout, or for the
    reference, the spread output is formed and goes through :func:`bias_dropout_add`.
    """
    out, bias = x_with_bias
    with torch.autocast(device_type=out.device.type, enabled=False):
        if uses_triton(implementation, out.device.type):
            from lightning_mhc.ops.triton_kernels import h_post_bda

            with rng_fork(*(() if sequence_parallel else ("tensor",))):  # as bias_dropout_add
                return h_post_bda(mixed, h_post, out, bias, prob if training else 0.0)
        if bias is not None:
            out = out + bias
        if is_fused(implementation) and (prob == 0 or not training):
            return HPostResidual.apply(mixed, h_post.to(out.dtype), out)
        return bias_dropout_add((reference_apply_h_post(out, h_post), None), mixed, prob, training,
                                sequence_parallel)
