"""One entry for every schedule (megatron-core's ``get_forward_backward_func``): one model chunk
per rank runs 1F1B, two or more run the interleaved schedule."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_mhc.distributed.pipeline.common import ForwardStep, LossFunc, ScheduleConfig, ScheduleResult
from lightning_mhc.distributed.pipeline.interleaved import forward_backward_pipelining_with_interleaving
from lightning_mhc.distributed.pipeline.one_f_one_b import forward_backward_1f1b


def forward_backward_pipelining(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step: ForwardStep,
    loss_func: LossFunc,
    config: ScheduleConfig,
) -> ScheduleResult:
    """Run forward (and backward, unless ``config.forward_only``) of every microbatch through this
    rank's stage; given a list of two or more model chunks, the interleaved schedule runs.

    Gradients accumulate into ``.grad`` (each microbatch's loss is scaled by ``1/m``); reduce them
    across DP afterwards (``distributed.grads``).
    """
    if len(microbatches) < 1:
        raise ValueError("the schedule needs at least one microbatch")
    if isinstance(model, torch.nn.Module):
        return forward_backward_1f1b(model, microbatches, forward_step, loss_func, config)
    if len(model) == 1:
        return forward_backward_1f1b(model[0], microbatches, forward_step, loss_func, config)
    return forward_backward_pipelining_with_interleaving(model, microbatches, forward_step, loss_func, config)
