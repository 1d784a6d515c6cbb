"""TP/PP/DP process groups through megatron-core ``parallel_state``.

``initialize_parallel(tp, pp)`` builds the groups over the initialised
default process group (gloo on CPU, NCCL on GPU); DP is inferred as
``world_size / (tp * pp)``. Megatron's rank order: TP fastest, then DP, then PP.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mhc.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the 3D layout."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_rank: int
    pipeline_model_parallel_rank: int
    data_parallel_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == self.pipeline_model_parallel_size - 1


def check_layout(world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> int:
    """Returns the data-parallel size; raises ConfigError naming the numbers and the fix."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError(
            f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}: both must be >= 1."
        )
    if world_size % (tp * pp):
        raise ConfigError(
            f"tensor_model_parallel_size * pipeline_model_parallel_size = {tp} * {pp} = {tp * pp} "
            f"does not divide the world size {world_size}. Use a number of devices that is a "
            f"multiple of {tp * pp}, or change the TP/PP sizes."
        )
    return world_size // (tp * pp)


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    timeout: datetime.timedelta | None = None,
) -> ParallelLayout:
    """Build megatron-core's TP, PP, DP (and embedding) groups; returns this rank's layout."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(or run under MHCParallelStrategy / torchrun) first."
        )
    world = dist.get_world_size()
    check_layout(world, tensor_model_parallel_size, pipeline_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    kwargs = {"distributed_timeout_minutes": max(1, int(timeout.total_seconds() // 60))} if timeout else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **kwargs,
    )
    return current_layout()


def current_layout() -> ParallelLayout:
    return ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        tensor_model_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        pipeline_model_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear the model-parallel groups down (the default group stays)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
