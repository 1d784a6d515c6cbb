"""The non-interleaved 1F1B pipeline schedule and a forward-only schedule, device-agnostic.

Follows megatron-core's ``forward_backward_pipelining_without_interleaving``:
warm-up (``p - rank - 1`` forwards, at most ``m``), steady 1F1B, cool-down.
After a non-last stage sends a microbatch's output, megatron's
``deallocate_output_tensor`` shrinks it to one element and its backward
runs through ``custom_backward`` (pipeline output deallocation). The loss is computed on the last
stage; the mean over microbatches, averaged over DP, is returned on every rank.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
from torch import Tensor

from lightning_mhc.distributed.pipeline.common import (
    ForwardStep,
    InFlight,
    LossFunc,
    ScheduleConfig,
    ScheduleResult,
    backward_step,
    reduce_loss,
    set_input,
)
from lightning_mhc.distributed.pipeline.p2p import PipelineP2P


def forward_backward_1f1b(model: torch.nn.Module, microbatches: Sequence[Any], forward_step: ForwardStep,
                         loss_func: LossFunc, config: ScheduleConfig) -> ScheduleResult:
    """Forward (and backward) of every microbatch through this rank's one model chunk (see
    ``schedules.forward_backward_pipelining``)."""
    layout = config.layout
    p2p = PipelineP2P(config.tensor_shape, config.dtype, next(model.parameters()).device, layout, config.timeout)
    run = _OneFOneB(model, microbatches, forward_step, loss_func, config, p2p)
    if config.forward_only:
        run.forward_only()
    else:
        run.warm_up_steady_cool_down()
    return ScheduleResult(reduce_loss(run.total_loss, run.m, run.device, layout), run.m)


class _OneFOneB:
    """One step of the schedule on one rank: the microbatches' forwards and backwards in 1F1B
    order, the tensors held between them, and the summed loss of the last stage."""

    def __init__(self, model, microbatches, forward_step, loss_func, config: ScheduleConfig, p2p: PipelineP2P) -> None:
        self.model, self.microbatches, self.m = model, microbatches, len(microbatches)
        self.forward_step, self.loss_func = forward_step, loss_func
        self.layout, self.p2p, self.device = config.layout, p2p, p2p.device
        self.deallocate = config.deallocate_pipeline_outputs and not p2p.is_last
        self.probe, self.on_last_backward = config.probe, config.on_last_backward
        self.total_loss: Tensor | None = None
        self.in_flight = InFlight()
        self.backwards = 0

    def forward(self, index: int, input_tensor: Tensor | None) -> Tensor:
        set_input(self.model, input_tensor)
        output = self.forward_step(self.model, self.microbatches[index])
        if self.p2p.is_last:
            loss = self.loss_func(output, self.microbatches[index])
            self.total_loss = loss.detach() if self.total_loss is None else self.total_loss + loss.detach()
            output = loss / self.m
        return output

    def backward(self, output_grad: Tensor | None) -> Tensor | None:
        """The backward of the oldest microbatch in flight; the last one of the step first calls
        ``on_last_backward`` (where an overlapped DP reduction starts)."""
        self.backwards += 1
        if self.backwards == self.m and self.on_last_backward is not None:
            self.on_last_backward(0)
        input_tensor, output = self.in_flight.pop()
        return backward_step(input_tensor, output, output_grad, self.deallocate)

    def hold(self, input_tensor: Tensor | None, output: Tensor) -> None:
        """Keep a sent output for its backward (shrunk to one element when deallocating)."""
        self.in_flight.push(input_tensor, output)
        deallocate_output_tensor(output, self.deallocate)
        if self.probe is not None:
            self.probe(self.in_flight.tensors())

    def forward_only(self) -> None:
        with torch.no_grad():
            for i in range(self.m):
                self.p2p.send_forward(self.forward(i, self.p2p.recv_forward()))

    def warm_up_steady_cool_down(self) -> None:
        p2p, pp, rank = self.p2p, self.layout.pipeline_model_parallel_size, self.layout.pipeline_model_parallel_rank
        num_warmup = min(pp - rank - 1, self.m)
        num_steady = self.m - num_warmup
        for i in range(num_warmup):
            input_tensor = p2p.recv_forward()
            output = self.forward(i, input_tensor)
            p2p.send_forward(output)
            self.hold(input_tensor, output)

        input_tensor = p2p.recv_forward() if num_steady > 0 else None
        for i in range(num_steady):
            output = self.forward(num_warmup + i, input_tensor)
            output_grad = p2p.send_forward_recv_backward(output)
            self.hold(input_tensor, output)
            input_grad = self.backward(output_grad)
            if i == num_steady - 1:
                input_tensor = None
                p2p.send_backward(input_grad)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_grad)

        for _ in range(num_warmup):
            p2p.send_backward(self.backward(p2p.recv_backward()))
