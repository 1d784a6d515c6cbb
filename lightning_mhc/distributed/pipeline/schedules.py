"""One entry for every schedule (megatron-core's ``get_forward_backward_func``): one model chunk
per rank runs 1F1B, two or more run the interleaved schedule."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.pipeline.common import ForwardStep, LossFunc, ScheduleResult
from lightning_mhc.distributed.pipeline.interleaved import forward_backward_pipelining_with_interleaving
from lightning_mhc.distributed.pipeline.one_f_one_b import forward_backward_1f1b


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
    of two or more model chunks, the interleaved schedule runs.

    Gradients accumulate into ``.grad`` (each microbatch's loss is scaled by
    ``1/m``); reduce them across DP afterwards (``distributed.grads``).
    ``probe(tensors)``, when given, is called after every forward with the
    tensors the schedule holds for pending backwards. ``on_last_backward(chunk)`` is
    called right before each model chunk's last backward of the step (megatron's
    grad-sync point: an overlapped DP reduction starts there).
    """
    if len(microbatches) < 1:
        raise ValueError("the schedule needs at least one microbatch")
    schedule = forward_backward_1f1b
    if not isinstance(model, torch.nn.Module):  # a rank's model chunks
        if len(model) > 1:
            schedule = forward_backward_pipelining_with_interleaving
        else:
            model = model[0]
    return schedule(model, microbatches, forward_step, loss_func, layout=layout, tensor_shape=tensor_shape,
                    dtype=dtype, deallocate_pipeline_outputs=deallocate_pipeline_outputs,
                    forward_only=forward_only, timeout=timeout, probe=probe, on_last_backward=on_last_backward)
