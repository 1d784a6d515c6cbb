"""How a tensor or a layer is placed over TP ranks, the words the tensor-parallel pass
(``tensor_parallel.py``), LoRA's adapters (``adapters.py``) and the pretrained weights
(``weights.py``) share: megatron's strided split of a dimension, this rank's slice of a tensor, and
how a linear layer was split (:class:`Placement`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from lightning_mhc.any_model.plan import Style


def strided_runs(size: int, stride: int, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """Megatron's strided split of a dimension of ``size``: it is ``stride`` equal parts, and
    this rank's slice is its piece of each part, concatenated. Per part, ``(start in the slice,
    start in the whole, length)``."""
    part = size // stride
    share = part // tp
    return [(j * share, j * part + rank * share, share) for j in range(stride)]


def shard(tensor: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``dim`` (:func:`strided_runs`)."""
    runs = strided_runs(tensor.shape[dim], stride, tp, rank)
    return torch.cat([tensor.narrow(dim, start, length) for _, start, length in runs], dim).contiguous()


@dataclasses.dataclass(frozen=True)
class Placement:
    """How :func:`apply_style` split a linear layer, kept as its role ``tensor_parallel_placement``
    (``lightning_mhc.roles``) for what runs beside it on the same input, as a LoRA adapter does (``adapters.py``):
    ``input_map``, what a column layer does to its input first (the copy into the TP region, or
    the sequence's all-gather; None: nothing); ``output_map``, to its output (the all-gather of a
    gathered output); ``reduce``, how a row layer sums its partial products over TP (all-reduce,
    or reduce-scatter of the sequence)."""

    style: Style
    sequence_parallel: bool
    input_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    output_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

