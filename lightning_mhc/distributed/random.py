"""Seeding per parallel dimension (the multi-dimensional parallel randomizer), device-agnostic.

megatron-core's ``model_parallel_cuda_manual_seed`` needs CUDA; this installs
a ``MultiDimParallelRandomizer`` over the ``tensor``, ``data`` and
``pipeline`` dimensions of megatron's groups (and ``context`` with context
parallelism), on CPU and GPU alike:

- weights: drawn by name (``layers.init``), identical across TP and DP,
  different across stages (different layers);
- dropout on TP-replicated activations: ``rng_fork("tensor")``, identical
  across TP, different across DP and PP;
- dropout inside TP-split regions: ``rng_fork()``, different everywhere.

Context parallelism, by default: every fork differs across CP ranks (no fork names ``context``),
as megatron seeds its CP ranks' dropout apart: a CP rank holds other tokens of the same samples,
and one stream on every CP rank would give token ``t`` of one rank the mask of token ``t'`` of
another. So under CP a token's dropout mask is not the one a single process draws for it (that
process draws one mask for the whole sequence at once); it is reproducible for a given CP size
(and recompute replays it bit for bit). The ``context`` dimension exists only when CP > 1, so the
seeds and stream keys of every other layout are unchanged.

Exact hidden dropout (the model config's ``exact_hidden_dropout``): the residual-stream dropouts
(the embedding's and the bias-dropout-adds') call :func:`whole_sequence_dropout`, which draws the
mask of the WHOLE sequence from the ``WHOLE_SEQUENCE_STREAM`` stream and keeps this rank's rows
(its two CP chunks in ``shard_sequence``'s order, then, under sequence parallelism, its TP slice
of them). That stream's seed is the one ``rng_fork("tensor")`` has in the layout with the same DP
and PP but TP and CP at 1, the same on every TP and CP rank; so every TP x CP layout draws the
masks that layout draws, bit for bit: one process's, when DP and PP are 1. Cost: each rank draws
``cp`` (x ``tp`` with sequence parallelism) times the random numbers and holds a transient mask
of the whole sequence per dropout. Not exact: attention-probability dropout (refused with the
option under TP or CP), DP (each DP rank draws its own samples' masks from its own stream, as
without the option) and PP (each stage its own stream).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mhc.distributed.context_parallel import shard_sequence
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.recompute.rng import MultiDimParallelRandomizer, get_parallel_randomizer, set_parallel_randomizer

WHOLE_SEQUENCE_STREAM = "whole_sequence"
"""The named stream of :func:`whole_sequence_dropout`."""


def model_parallel_manual_seed(seed: int, layout: ParallelLayout) -> MultiDimParallelRandomizer:
    """Seed torch's default generators with ``seed`` and install the parallel randomizer."""
    torch.manual_seed(seed)
    ranks = {
        "tensor": layout.tensor_model_parallel_rank,
        "data": layout.data_parallel_rank,
        "pipeline": layout.pipeline_model_parallel_rank,
    }
    sizes = {
        "tensor": layout.tensor_model_parallel_size,
        "data": layout.data_parallel_size,
        "pipeline": layout.pipeline_model_parallel_size,
    }
    # the seed rng_fork("tensor") has with TP and CP at 1 (same DP and PP): one process's with DP = PP = 1
    without_tp_cp = MultiDimParallelRandomizer(seed, dict(ranks, tensor=0), dict(sizes, tensor=1))
    named_seeds = {WHOLE_SEQUENCE_STREAM: without_tp_cp.seed_of("tensor")}
    if layout.context_parallel_size > 1:
        ranks["context"], sizes["context"] = layout.context_parallel_rank, layout.context_parallel_size
    randomizer = MultiDimParallelRandomizer(seed, ranks, sizes, named_seeds)
    set_parallel_randomizer(randomizer)
    return randomizer


def whole_sequence_dropout(x: Tensor, prob: float, training: bool, sequence_parallel: bool) -> Tensor:
    """``F.dropout(x)`` on the residual stream with the mask one process draws for the whole
    sequence: drawn whole (``x``'s shape with the sequence, dim 0, ``cp`` (x ``tp`` under
    ``sequence_parallel``) times longer) from ``WHOLE_SEQUENCE_STREAM``, then this rank's rows kept.
    Without an installed randomizer (one process) it is ``F.dropout``. The mask is drawn as
    ``F.dropout`` of ones (the same kernel and draws as one process's ``F.dropout`` of the whole
    tensor; it holds 0 or ``1 / (1 - prob)``), so ``x * mask`` is one process's result bit for bit."""
    randomizer = get_parallel_randomizer()
    if not training or prob == 0 or randomizer is None:
        return F.dropout(x, p=prob, training=training)
    cp = randomizer.sizes.get("context", 1)
    tp = randomizer.sizes["tensor"] if sequence_parallel else 1
    with randomizer.get_named_randomizer(WHOLE_SEQUENCE_STREAM).fork():
        mask = F.dropout(torch.ones((x.shape[0] * cp * tp, *x.shape[1:]), dtype=x.dtype, device=x.device), p=prob)
    if cp > 1:  # this rank's two chunks (the CP split comes first: the TP ranks split the CP rank's part)
        mask = shard_sequence(mask, randomizer.ranks["context"], cp, dim=0)
    if tp > 1:
        mask = mask.chunk(tp, dim=0)[randomizer.ranks["tensor"]]
    return x * mask

