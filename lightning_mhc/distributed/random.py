"""Seeding per parallel dimension (the multi-dimensional parallel randomizer), device-agnostic.

megatron-core's ``model_parallel_cuda_manual_seed`` needs CUDA; this installs
a ``MultiDimParallelRandomizer`` over the ``tensor``, ``data`` and
``pipeline`` dimensions of megatron's groups (and ``context`` with context
parallelism), on CPU and GPU alike:

- weights: drawn by name (``model.init``), identical across TP and DP,
  different across stages (different layers);
- dropout on TP-replicated activations: ``rng_fork("tensor")``, identical
  across TP, different across DP and PP;
- dropout inside TP-split regions: ``rng_fork()``, different everywhere.

Context parallelism: every fork differs across CP ranks (no fork names ``context``), as megatron
seeds its CP ranks' dropout apart: a CP rank holds other tokens of the same samples, and one
stream on every CP rank would give token ``t`` of one rank the mask of token ``t'`` of another.
So under CP a token's dropout mask is not the one a single process draws for it (that process
draws one mask for the whole sequence at once); it is reproducible for a given CP size (and
recompute replays it bit for bit). The ``context`` dimension exists only when CP > 1, so the
seeds and stream keys of every other layout are unchanged.
"""
from __future__ import annotations

import torch
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.recompute.rng import MultiDimParallelRandomizer, set_parallel_randomizer


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
    if layout.context_parallel_size > 1:
        ranks["context"], sizes["context"] = layout.context_parallel_rank, layout.context_parallel_size
    randomizer = MultiDimParallelRandomizer(seed, ranks, sizes)
    set_parallel_randomizer(randomizer)
    return randomizer

