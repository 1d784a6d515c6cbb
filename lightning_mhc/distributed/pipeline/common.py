"""What the pipeline schedules share: their configuration, the step and loss signatures, the
result, the tensors held between a microbatch's forward and backward, one backward step, and the
loss reduction.

The model contract (megatron's): ``model.set_input_tensor(t)`` before each forward on a
non-first stage; ``forward_step(model, microbatch)`` returns the stage output (the hidden
state, or on the last stage what ``loss_func`` takes); ``loss_func(output, microbatch)``
returns the microbatch's scalar loss.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.schedules import custom_backward
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout

ForwardStep = Callable[[torch.nn.Module, Any], Tensor]
LossFunc = Callable[[Tensor, Any], Tensor]


@dataclass(frozen=True)
class ScheduleConfig:
    """What every schedule reads besides the model, the microbatches and the step functions
    (megatron's ``config.*`` of its ``forward_backward_func``)."""

    layout: ParallelLayout
    """This rank's built layout (its stage, neighbours and groups)."""
    tensor_shape: tuple[int, ...]
    """What crosses stages, the same for every microbatch."""
    dtype: torch.dtype = torch.float32
    """The dtype of what crosses stages."""
    forward_only: bool = False
    deallocate_pipeline_outputs: bool = True
    """Shrink each sent stage output to one element (megatron's ``deallocate_output_tensor``)."""
    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """Deadline of every point-to-point wait."""
    probe: Callable[[list[Tensor]], None] | None = None
    """Called after every forward with the tensors held for pending backwards."""
    on_last_backward: Callable[[int], None] | None = None
    """Called with a chunk's index right before its last backward of the step (megatron's
    grad-sync point: an overlapped DP reduction starts there)."""
    microbatch_group_size: int | None = None
    """The interleaved schedule's microbatches per group and chunk (default: the PP size)."""


@dataclass
class ScheduleResult:
    loss: Tensor
    """Mean loss over the microbatches and the DP replicas; the same scalar on every rank."""
    num_microbatches: int


class InFlight:
    """Input/output tensors kept between a microbatch's forward and its backward."""

    def __init__(self) -> None:
        self.inputs: list[Tensor | None] = []
        self.outputs: list[Tensor] = []

    def push(self, input_tensor: Tensor | None, output: Tensor) -> None:
        self.inputs.append(input_tensor)
        self.outputs.append(output)

    def pop(self) -> tuple[Tensor | None, Tensor]:
        return self.inputs.pop(0), self.outputs.pop(0)

    def tensors(self) -> list[Tensor]:
        return [t for t in self.inputs + self.outputs if t is not None]


def set_input(model: torch.nn.Module, input_tensor: Tensor | None) -> None:
    if hasattr(model, "set_input_tensor"):
        model.set_input_tensor(input_tensor)
    elif input_tensor is not None:
        raise TypeError(
            f"{type(model).__name__} is a pipeline stage after the first but has no "
            "set_input_tensor(tensor): implement it to receive the previous stage's output."
        )


def backward_step(
    input_tensor: Tensor | None, output: Tensor, output_grad: Tensor | None, deallocated: bool
) -> Tensor | None:
    if output_grad is None:  # last stage: output is the scaled loss
        torch.autograd.backward(output)
    elif deallocated:
        custom_backward(output, output_grad)
    else:
        torch.autograd.backward(output, grad_tensors=output_grad)
    return None if input_tensor is None else input_tensor.grad


def reduce_loss(total: Tensor | None, num_microbatches: int, device: torch.device, layout: ParallelLayout) -> Tensor:
    """Mean over microbatches and DP on the last stage, then broadcast along the pipeline. Under
    context parallelism a rank's loss is its part of the sample's loss (its tokens' sum over the
    whole token count), so the sum over DP x CP divided by DP is the DP mean of whole losses."""
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if layout.is_last_stage:
        loss += total.float() / num_microbatches
        if layout.data_parallel_size * layout.context_parallel_size > 1:
            dist.all_reduce(loss, group=layout.dp_cp_group)
            loss /= layout.data_parallel_size
    if layout.pipeline_model_parallel_size > 1:
        dist.broadcast(loss, src=layout.last_stage_rank, group=layout.pp_group)
    return loss
