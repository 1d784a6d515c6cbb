"""Bias-dropout-add: ``residual + dropout(out + bias)``, and its hyper-connection form
``H_res @ x + dropout(H_post^T * (out + bias))`` (``H_res`` mixes the ``n`` streams of ``x``,
``H_post`` spreads the sub-layer output over them)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mhc.distributed.random import whole_sequence_dropout
from lightning_mhc.ops import fused_kernels, is_fused
from lightning_mhc.ops.hyper_connection import (
    compiled,
    fused_res_post,
    reference_apply_h_post,
    reference_apply_h_res,
    reference_res_post,
)
from lightning_mhc.recompute.rng import rng_fork


def _dropout_fork(sequence_parallel: bool):
    """The random stream of a dropout on the residual stream: the same on every TP rank (the
    stream is replicated across TP), or each rank's own under sequence parallelism (split)."""
    return rng_fork(*(() if sequence_parallel else ("tensor",)))


def residual_dropout(x: Tensor, prob: float, training: bool, sequence_parallel: bool = False,
                     exact: bool = False) -> Tensor:
    """Dropout on the residual stream ``[s, b, C]`` (the embedding's and the bias-dropout-adds').
    ``exact`` (``exact_hidden_dropout``): the mask a layout without TP and CP draws, this rank's
    rows of it (``whole_sequence_dropout``); otherwise this rank's stream's (``_dropout_fork``)."""
    if exact:
        return whole_sequence_dropout(x, prob, training, sequence_parallel)
    with _dropout_fork(sequence_parallel):
        return F.dropout(x, p=prob, training=training)


def bias_dropout_add(
    x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float, training: bool,
    sequence_parallel: bool = False, exact_dropout: bool = False,
) -> Tensor:
    """``residual + dropout(out + bias)``. The residual stream is replicated across TP (same mask
    on every TP rank) or, under ``sequence_parallel``, split along the sequence (a mask per rank);
    ``exact_dropout``: see :func:`residual_dropout`."""
    out, bias = x_with_bias
    if bias is not None:
        out = out + bias
    return residual + residual_dropout(out, prob, training, sequence_parallel, exact_dropout)


def h_res_h_post_bias_dropout_add(
    x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, h_res: Tensor, h_post: Tensor, prob: float,
    training: bool, implementation: str = "fused", sequence_parallel: bool = False, exact_dropout: bool = False,
) -> Tensor:
    """``H_res @ residual + dropout(H_post^T (out + bias))``: ``[s,b,C]`` (+ ``[C]``), ``[s,b,n*C]``,
    ``[s,b,n,n]``, ``[s,b,n]`` -> ``[s,b,n*C]``.

    By ``implementation`` (``mhc_implementation``): the fused ops run
    ``ResPostBiasDropoutAdd``, one pass each way that reads the stream and the sub-layer output and
    writes the next stream. Triton's kernels draw the dropout mask inside (from a seed, so it
    differs from the reference's, and is not stored); the eager kernels have no dropout, so with
    active dropout they take the reference's ops, which draw the reference's mask. 'compile' runs
    the reference's ops compiled when no dropout is active. ``exact_dropout`` (see
    :func:`residual_dropout`) with active dropout takes the reference's ops on every implementation:
    a kernel that draws inside cannot draw the whole sequence's mask and keep this rank's rows.
    """
    out, bias = x_with_bias
    prob = prob if training else 0.0
    with torch.autocast(device_type=out.device.type, enabled=False):
        if is_fused(implementation):
            kernels = fused_kernels(implementation, out.device.type)
            # the kernels draw their seed where bias_dropout_add draws its mask
            if prob == 0 or (kernels.DROPOUT and not exact_dropout):
                with _dropout_fork(sequence_parallel) if prob else contextlib.nullcontext():
                    return fused_res_post(residual, h_res, h_post, out, bias, prob, kernels)
        if bias is not None:
            out = out + bias
        if prob == 0:
            res_post = compiled(reference_res_post) if implementation == "compile" else reference_res_post
            return res_post(residual, h_res, h_post, out)
        mixed = reference_apply_h_res(h_res, residual, h_post.shape[-1])
        return bias_dropout_add((reference_apply_h_post(out, h_post), None), mixed, prob, training,
                                sequence_parallel, exact_dropout)
