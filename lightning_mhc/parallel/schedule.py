"""The non-interleaved 1F1B pipeline schedule and a forward-only schedule, device-agnostic.

Follows megatron-core's ``forward_backward_pipelining_without_interleaving``:
warm-up (``p - rank - 1`` forwards, at most ``m``), steady 1F1B, cool-down.
After a non-last stage sends a microbatch's output, megatron's
``deallocate_output_tensor`` shrinks it to one element and its backward
runs through ``custom_backward`` (pipeline output deallocation). The loss is computed on the last
stage; the mean over microbatches, averaged over DP, is returned on every rank.

The model contract (megatron's): ``model.set_input_tensor(t)`` before each
forward on a non-first stage; ``forward_step(model, microbatch)`` returns the
stage output (the hidden state, or on the last stage what ``loss_func``
takes); ``loss_func(output, microbatch)`` returns the microbatch's scalar loss.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
from torch import Tensor

from lightning_mhc.parallel.p2p import PipelineP2P
from lightning_mhc.parallel.state import ParallelLayout

ForwardStep = Callable[[torch.nn.Module, Any], Tensor]
LossFunc = Callable[[Tensor, Any], Tensor]


@dataclass
class ScheduleResult:
    loss: Tensor
    """Mean loss over the microbatches and the DP replicas; the same scalar on every rank."""
    num_microbatches: int


class _InFlight:
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
    """Mean over microbatches and DP on the last stage, then broadcast along the pipeline."""
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if layout.is_last_stage:
        loss += total.float() / num_microbatches
        if layout.data_parallel_size > 1:
            dist.all_reduce(loss, group=layout.dp_group)
            loss /= layout.data_parallel_size
    if layout.pipeline_model_parallel_size > 1:
        dist.broadcast(loss, src=layout.last_stage_rank, group=layout.pp_group)
    return loss


def forward_backward_pipelining(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step: ForwardStep,
    loss_func: LossFunc,
    *,
    layout: ParallelLayout,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    deallocate_pipeline_outputs: bool = True,
    forward_only: bool = False,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    probe: Callable[[list[Tensor]], None] | None = None,
    on_last_backward: Callable[[int], None] | None = None,
) -> ScheduleResult:
    """Run forward (and backward) of every microbatch through this rank's stage; given a list
    of two or more model chunks, the interleaved schedule (``schedule_interleaved``) runs.

    Gradients accumulate into ``.grad`` (each microbatch's loss is scaled by
    ``1/m``); reduce them across DP afterwards (``parallel.grads``).
    ``probe(tensors)``, when given, is called after every forward with the
    tensors the schedule holds for pending backwards. ``on_last_backward(chunk)`` is
    called right before each model chunk's last backward of the step (megatron's
    grad-sync point: an overlapped DP reduction starts there).
    """
    m = len(microbatches)
    if m < 1:
        raise ValueError("the schedule needs at least one microbatch")
    if not isinstance(model, torch.nn.Module):  # a rank's model chunks
        if len(model) > 1:
            from lightning_mhc.parallel.schedule_interleaved import forward_backward_pipelining_with_interleaving

            return forward_backward_pipelining_with_interleaving(
                model, microbatches, forward_step, loss_func, layout=layout, tensor_shape=tensor_shape,
                dtype=dtype, deallocate_pipeline_outputs=deallocate_pipeline_outputs, forward_only=forward_only,
                timeout=timeout, probe=probe, on_last_backward=on_last_backward,
            )
        model = model[0]
    device = next(model.parameters()).device
    p2p = PipelineP2P(tensor_shape, dtype, device, layout, timeout)
    pp, rank = layout.pipeline_model_parallel_size, layout.pipeline_model_parallel_rank
    deallocate = deallocate_pipeline_outputs and not p2p.is_last
    total_loss: Tensor | None = None
    in_flight = _InFlight()
    backwards = 0

    def backward(input_tensor: Tensor | None, output: Tensor, output_grad: Tensor | None) -> Tensor | None:
        nonlocal backwards
        backwards += 1
        if backwards == m and on_last_backward is not None:
            on_last_backward(0)
        return backward_step(input_tensor, output, output_grad, deallocate)

    def forward(index: int, input_tensor: Tensor | None) -> Tensor:
        nonlocal total_loss
        set_input(model, input_tensor)
        output = forward_step(model, microbatches[index])
        if p2p.is_last:
            loss = loss_func(output, microbatches[index])
            total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
            output = loss / m
        return output

    if forward_only:
        with torch.no_grad():
            for i in range(m):
                p2p.send_forward(forward(i, p2p.recv_forward()))
        return ScheduleResult(reduce_loss(total_loss, m, device, layout), m)

    num_warmup = min(pp - rank - 1, m)
    num_steady = m - num_warmup

    for i in range(num_warmup):
        input_tensor = p2p.recv_forward()
        output = forward(i, input_tensor)
        p2p.send_forward(output)
        in_flight.push(input_tensor, output)
        deallocate_output_tensor(output, deallocate)
        if probe is not None:
            probe(in_flight.tensors())

    input_tensor = p2p.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last_iteration = i == num_steady - 1
        output = forward(num_warmup + i, input_tensor)
        output_grad = p2p.send_forward_recv_backward(output)
        in_flight.push(input_tensor, output)
        deallocate_output_tensor(output, deallocate)
        if probe is not None:
            probe(in_flight.tensors())
        oldest_input, oldest_output = in_flight.pop()
        input_grad = backward(oldest_input, oldest_output, output_grad)
        if last_iteration:
            input_tensor = None
            p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad)

    for _ in range(num_warmup):
        oldest_input, oldest_output = in_flight.pop()
        output_grad = p2p.recv_backward()
        p2p.send_backward(backward(oldest_input, oldest_output, output_grad))

    return ScheduleResult(reduce_loss(total_loss, m, device, layout), m)
