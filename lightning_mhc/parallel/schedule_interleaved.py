"""The interleaved 1F1B schedule (virtual pipeline), device-agnostic.

Follows megatron-core's ``forward_backward_pipelining_with_interleaving`` (its
non-overlapped communication path): each rank holds ``v`` model chunks; chunk
``c`` of stage ``r`` is virtual stage ``c * p + r``, so an activation crosses
every rank once per chunk and the last stage sends chunk ``c``'s output to the
first stage's chunk ``c + 1``. Microbatches run in groups of
``microbatch_group_size`` (default ``p``) per chunk: the schedule table lists
``(microbatch, chunk)`` pairs, forward in table order and backward with the
chunks reversed. Warm-up is ``2 (p - r - 1) + (v - 1) * group`` forwards, then
steady 1F1B, then cool-down backwards. Stage outputs are deallocated after they
are sent and their backward goes through ``custom_backward`` (pipeline output deallocation).

The microbatch count follows megatron's rule: ``p <= group <= m``, and the last
group (``m mod group``) is empty or at least ``p`` long; with the default group
that means ``m`` is a multiple of ``p``.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
from torch import Tensor

from lightning_mhc.errors import ConfigError
from lightning_mhc.parallel.p2p import PipelineP2P
from lightning_mhc.parallel.schedule import (
    ForwardStep,
    LossFunc,
    ScheduleResult,
    backward_step,
    reduce_loss,
    set_input,
)
from lightning_mhc.parallel.state import ParallelLayout


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int, group: int | None = None) -> int:
    """Megatron's rule for the interleaved schedule; returns the group size."""
    m, p = num_microbatches, pipeline_size
    group = group or p
    if not p <= group <= m:
        raise ConfigError(
            f"the interleaved pipeline schedule runs microbatches in groups of {group} per model chunk, which "
            f"must lie in [pipeline_model_parallel_size={p}, num_microbatches={m}]: use at least {max(p, group)} "
            f"microbatches (a multiple of {p}), or no virtual pipeline."
        )
    if 0 < m % group < p:
        raise ConfigError(
            f"num_microbatches={m} leaves a last group of {m % group} microbatches for the interleaved schedule "
            f"(groups of {group}); it must be 0 or at least pipeline_model_parallel_size={p} (megatron's rule, "
            f"else the pipeline stalls): use a multiple of {group} microbatches."
        )
    return group


def schedule_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """Forward order of ``(microbatch, chunk)``: each group of microbatches through chunk 0, then
    chunk 1, ... (megatron's ``get_schedule_table``)."""
    table = []
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(start, end))
    return table


def forward_backward_pipelining_with_interleaving(
    chunks: Sequence[torch.nn.Module],
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
    microbatch_group_size: int | None = None,
    on_last_backward: Callable[[int], None] | None = None,
) -> ScheduleResult:
    """Run every microbatch through this rank's ``chunks`` (``forward_step(chunk, microbatch)``).

    Same contract as :func:`lightning_mhc.parallel.schedule.forward_backward_pipelining`:
    gradients accumulate (each loss scaled by ``1/m``), the returned loss is the mean over
    microbatches and DP on every rank.
    """
    v, m = len(chunks), len(microbatches)
    pp, rank = layout.pipeline_model_parallel_size, layout.pipeline_model_parallel_rank
    if v < 2 or pp < 2:
        raise ValueError(f"the interleaved schedule needs >= 2 model chunks and >= 2 stages (got {v} and {pp})")
    group = check_interleaved_microbatches(m, pp, microbatch_group_size)
    table = schedule_table(m, v, group)
    total = m * v
    warmup = total if forward_only else min(2 * (pp - rank - 1) + (v - 1) * group, total)
    all_warmup = warmup == total
    remaining = total - warmup
    device = next(chunks[0].parameters()).device
    p2p = PipelineP2P(tensor_shape, dtype, device, layout, timeout)
    total_loss: Tensor | None = None
    inputs: list[list[Tensor | None]] = [[] for _ in range(v)]
    outputs: list[list[Tensor]] = [[] for _ in range(v)]
    output_grads: list[list[Tensor | None]] = [[] for _ in range(v)]

    def is_first(chunk: int) -> bool:  # embeds tokens
        return chunk == 0 and layout.is_first_stage

    def is_last(chunk: int) -> bool:  # computes the loss
        return chunk == v - 1 and layout.is_last_stage

    def chunk_id(k: int, forward: bool) -> int:
        chunk = table[k % total][1]
        return chunk if forward else v - chunk - 1

    def recv_from_previous_stage(k: int, forward: bool) -> tuple[bool, int]:
        """Whether the exchange after step ``k`` receives (from the previous stage forward,
        the next one backward), and into which chunk (megatron's helper of the same name)."""
        leading = layout.is_first_stage if forward else layout.is_last_stage
        if not leading:
            return True, chunk_id(k + 1, forward)
        recv = k >= pp - 1
        next_chunk = chunk_id(k - (pp - 1) if recv else k + 1, forward)
        if next_chunk == (v - 1 if forward else 0):
            recv = False
        return recv, next_chunk + (1 if forward else -1)

    def held() -> list[Tensor]:
        return [t for lists in (inputs, outputs) for ts in lists for t in ts if t is not None]

    def forward(k: int) -> Tensor | None:
        nonlocal total_loss
        chunk = chunk_id(k, True)
        if is_first(chunk) and len(inputs[chunk]) == len(outputs[chunk]):
            inputs[chunk].append(None)
        input_tensor = inputs[chunk][len(outputs[chunk])]
        model, microbatch = chunks[chunk], microbatches[table[k][0]]
        set_input(model, input_tensor)
        output = forward_step(model, microbatch)
        if is_last(chunk):
            loss = loss_func(output, microbatch)
            total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
            output = loss / m
        outputs[chunk].append(output)
        if forward_only:
            inputs[chunk].pop(0)
            outputs[chunk].pop()
        return None if is_last(chunk) else output  # the loss is not sent

    def backward(k: int) -> Tensor | None:
        chunk = chunk_id(k, False)
        if is_last(chunk) and not output_grads[chunk]:
            output_grads[chunk].append(None)
        if on_last_backward is not None and table[k][0] == m - 1:  # the chunk's last microbatch
            on_last_backward(chunk)
        input_grad = backward_step(inputs[chunk].pop(0), outputs[chunk].pop(0), output_grads[chunk].pop(0),
                                   deallocate_pipeline_outputs)
        return None if is_first(chunk) else input_grad

    def after_forward(output: Tensor | None) -> None:
        deallocate_output_tensor(output, deallocate_pipeline_outputs)
        if probe is not None:
            probe(held())

    grad_context = torch.no_grad() if forward_only else torch.enable_grad()
    with grad_context:
        inputs[0].append(None if is_first(0) else p2p.exchange(recv_prev=True)[0])
        for k in range(warmup):
            output = forward(k)
            recv_prev, next_chunk = recv_from_previous_stage(k, True)
            if k == total - 1:
                recv_prev = False
            if k == warmup - 1 and not forward_only and not all_warmup:
                recv_next = not layout.is_last_stage
                input_tensor, output_grad = p2p.exchange(send_next=output, recv_prev=recv_prev, recv_next=recv_next)
                output_grads[v - 1].append(output_grad)
            else:
                input_tensor = p2p.exchange(send_next=output, recv_prev=recv_prev)[0]
            if recv_prev:
                inputs[next_chunk].append(input_tensor)
            after_forward(output)

        for k in range(remaining):
            forward_k = k + warmup
            output = forward(forward_k)
            input_grad = backward(k)
            recv_prev, next_forward_chunk = recv_from_previous_stage(forward_k, True)
            recv_next, next_backward_chunk = recv_from_previous_stage(k, False)
            if k == remaining - 1:
                recv_prev = False
            input_tensor, output_grad = p2p.exchange(send_next=output, send_prev=input_grad,
                                                     recv_prev=recv_prev, recv_next=recv_next)
            after_forward(output)
            if recv_prev:
                inputs[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_grads[next_backward_chunk].append(output_grad)

        if not forward_only:
            if all_warmup:
                output_grads[v - 1].append(None if is_last(v - 1) else p2p.exchange(recv_next=True)[1])
            for k in range(remaining, total):
                input_grad = backward(k)
                recv_next, next_chunk = recv_from_previous_stage(k, False)
                if k == total - 1:
                    recv_next = False
                output_grad = p2p.exchange(send_prev=input_grad, recv_next=recv_next)[1]
                if recv_next:
                    output_grads[next_chunk].append(output_grad)

    return ScheduleResult(reduce_loss(total_loss, m, device, layout), m)
