"""Helpers for tensor-parallel shards made by megatron-core layers."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from lightning_mhc.distributed.placement import placement_of


def gather_tensor_parallel(tensor: Tensor, param: torch.nn.Parameter) -> Tensor:
    """The full tensor of a TP-sharded ``param`` (or of its gradient) on every TP rank.

    Follows its placement (``distributed/placement.py``: the master weight is
    split into ``stride * tp`` chunks; rank ``r`` holds chunks ``r, r + tp, ...``). Replicated parameters
    are returned as they are.
    """
    placement = placement_of(param)
    if not placement.split:
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    dim, stride = placement.split_dim, placement.stride
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    chunks = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(world)], dim=dim)
