"""One entry for every schedule (megatron-core's ``get_forward_backward_func``), the one place
that chooses: one model chunk per rank runs 1F1B, two or more run the interleaved schedule."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_mhc.distributed.pipeline.common import ForwardStep, LossFunc, ScheduleConfig, ScheduleResult
from lightning_mhc.distributed.pipeline.interleaved import forward_backward_pipelining_with_interleaving
from lightning_mhc.distributed.pipeline.one_f_one_b import forward_backward_1f1b
from lightning_mhc.distributed.pipeline.protocol import ModuleChunk, has_model_chunks


def forward_backward_pipelining(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step: ForwardStep,
    loss_func: LossFunc,
    config: ScheduleConfig,
) -> ScheduleResult:
    """Run forward (and backward, unless ``config.forward_only``) of every microbatch through this
    rank's stage; with two or more model chunks (a list of them, or a pipelined module whose
    ``model_chunks()`` are two or more: a virtual pipeline) the interleaved schedule runs.

    Gradients accumulate into ``.grad`` (each microbatch's loss is scaled by ``1/m``); reduce them
    across DP afterwards (``distributed.grads``).
    """
    if len(microbatches) < 1:
        raise ValueError("the schedule needs at least one microbatch")
    chunks = _chunks(model)
    if len(chunks) == 1:
        return forward_backward_1f1b(chunks[0], microbatches, forward_step, loss_func, config)
    return forward_backward_pipelining_with_interleaving(chunks, microbatches, forward_step, loss_func, config)


def _chunks(model: Any) -> list[Any]:
    """This rank's model chunks as the schedules run them: a list's items; a pipelined module's
    two or more ``model_chunks()``, each a :class:`ModuleChunk` (its calls name the chunk, the
    contract's form under a virtual pipeline); else the model itself."""
    if isinstance(model, (list, tuple)):
        return list(model)
    count = len(model.model_chunks()) if has_model_chunks(model) else 1
    return [ModuleChunk(model, i) for i in range(count)] if count > 1 else [model]
