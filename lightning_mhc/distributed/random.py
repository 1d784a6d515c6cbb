"""Seeding per parallel dimension (the multi-dimensional parallel randomizer), device-agnostic.

megatron-core's ``model_parallel_cuda_manual_seed`` needs CUDA; this installs
a ``MultiDimParallelRandomizer`` over the ``tensor``, ``data`` and
``pipeline`` dimensions of megatron's groups, on CPU and GPU alike:

- weights: drawn by name (``model.init``), identical across TP and DP,
  different across stages (different layers);
- dropout on TP-replicated activations: ``rng_fork("tensor")``, identical
  across TP, different across DP and PP;
- dropout inside TP-split regions: ``rng_fork()``, different everywhere.
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
    randomizer = MultiDimParallelRandomizer(seed, ranks, sizes)
    set_parallel_randomizer(randomizer)
    return randomizer

