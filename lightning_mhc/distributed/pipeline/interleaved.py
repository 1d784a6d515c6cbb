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

from typing import Any, Sequence

import torch
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
from torch import Tensor

from lightning_mhc.distributed.pipeline.p2p import PipelineP2P
from lightning_mhc.distributed.pipeline.common import (
    ForwardStep,
    LossFunc,
    ScheduleConfig,
    ScheduleResult,
    backward_step,
    reduce_loss,
    set_input,
)


def schedule_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """Forward order of ``(microbatch, chunk)``: each group of microbatches through chunk 0, then
    chunk 1, ... (megatron's ``get_schedule_table``)."""
    table = []
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(start, end))
    return table


def step_chunk(table: list[tuple[int, int]], k: int, forward: bool, num_chunks: int) -> int:
    """The local chunk step ``k`` of the schedule runs (``table``: :func:`schedule_table`'s order,
    wrapping; backward runs the chunks reversed)."""
    chunk = table[k % len(table)][1]
    return chunk if forward else num_chunks - chunk - 1


def receives_after(table: list[tuple[int, int]], k: int, forward: bool, leading: bool, pp: int,
                   num_chunks: int) -> tuple[bool, int]:
    """Whether the exchange after step ``k`` receives (from the previous stage forward, the next
    one backward), and into which chunk (megatron's ``recv_from_previous_stage``); ``leading``: this
    rank is the first stage (forward) or the last (backward). The planner replays it
    (``planning.activations.in_flight_peak``: the input received ahead of its forward)."""
    if not leading:
        return True, step_chunk(table, k + 1, forward, num_chunks)
    recv = k >= pp - 1
    next_chunk = step_chunk(table, k - (pp - 1) if recv else k + 1, forward, num_chunks)
    if next_chunk == (num_chunks - 1 if forward else 0):
        recv = False
    return recv, next_chunk + (1 if forward else -1)


def forward_backward_pipelining_with_interleaving(chunks: Sequence[torch.nn.Module], microbatches: Sequence[Any],
                                                 forward_step: ForwardStep, loss_func: LossFunc,
                                                 config: ScheduleConfig) -> ScheduleResult:
    """Run every microbatch through this rank's ``chunks`` (``forward_step(chunk, microbatch)``).

    Same contract as :func:`lightning_mhc.distributed.pipeline.forward_backward_pipelining`:
    gradients accumulate (each loss scaled by ``1/m``), the returned loss is the mean over
    microbatches and DP on every rank.
    """
    layout = config.layout
    v, m, pp = len(chunks), len(microbatches), layout.pipeline_model_parallel_size
    if v < 2 or pp < 2:
        raise ValueError(f"the interleaved schedule needs >= 2 model chunks and >= 2 stages (got {v} and {pp})")
    group = layout.check_microbatches(m, config.microbatch_group_size)
    device = next(chunks[0].parameters()).device
    p2p = PipelineP2P(config.tensor_shape, config.dtype, device, layout, config.timeout)
    run = _Interleaved(chunks, microbatches, forward_step, loss_func, config, p2p, schedule_table(m, v, group), group)
    with torch.no_grad() if config.forward_only else torch.enable_grad():
        run.warm_up()
        run.steady()
        if not config.forward_only:
            run.cool_down()
    return ScheduleResult(reduce_loss(run.total_loss, m, device, layout), m)


class _Interleaved:
    """One step of the interleaved schedule on one rank. Step ``k`` is the ``k``-th entry of the
    schedule table (forward order; backward runs the chunks reversed); per chunk, the inputs,
    outputs and output gradients wait in FIFO lists between a microbatch's forward and backward."""

    def __init__(self, chunks, microbatches, forward_step, loss_func, config: ScheduleConfig, p2p: PipelineP2P,
                 table: list[tuple[int, int]], group: int) -> None:
        self.chunks, self.microbatches = chunks, microbatches
        self.forward_step, self.loss_func = forward_step, loss_func
        layout = self.layout = config.layout
        self.p2p, self.table = p2p, table
        self.deallocate, self.forward_only = config.deallocate_pipeline_outputs, config.forward_only
        self.probe, self.on_last_backward = config.probe, config.on_last_backward
        self.v, self.m = len(chunks), len(microbatches)
        self.pp, rank = layout.pipeline_model_parallel_size, layout.pipeline_model_parallel_rank
        self.total = self.m * self.v
        self.warmup = self.total if self.forward_only else min(2 * (self.pp - rank - 1) + (self.v - 1) * group, self.total)
        self.all_warmup = self.warmup == self.total
        self.remaining = self.total - self.warmup
        self.total_loss: Tensor | None = None
        self.inputs: list[list[Tensor | None]] = [[] for _ in range(self.v)]
        self.outputs: list[list[Tensor]] = [[] for _ in range(self.v)]
        self.output_grads: list[list[Tensor | None]] = [[] for _ in range(self.v)]

    # ------------------------------------------------------------ the table
    def is_first(self, chunk: int) -> bool:  # embeds tokens
        return chunk == 0 and self.layout.is_first_stage

    def is_last(self, chunk: int) -> bool:  # computes the loss
        return chunk == self.v - 1 and self.layout.is_last_stage

    def chunk_id(self, k: int, forward: bool) -> int:
        return step_chunk(self.table, k, forward, self.v)

    def recv_from_previous_stage(self, k: int, forward: bool) -> tuple[bool, int]:
        """Whether the exchange after step ``k`` receives, and into which chunk (:func:`receives_after`)."""
        leading = self.layout.is_first_stage if forward else self.layout.is_last_stage
        return receives_after(self.table, k, forward, leading, self.pp, self.v)

    # ------------------------------------------------------- one microbatch
    def forward(self, k: int) -> Tensor | None:
        chunk = self.chunk_id(k, True)
        inputs, outputs = self.inputs[chunk], self.outputs[chunk]
        if self.is_first(chunk) and len(inputs) == len(outputs):
            inputs.append(None)
        model, microbatch = self.chunks[chunk], self.microbatches[self.table[k][0]]
        set_input(model, inputs[len(outputs)])
        output = self.forward_step(model, microbatch)
        if self.is_last(chunk):
            loss = self.loss_func(output, microbatch)
            self.total_loss = loss.detach() if self.total_loss is None else self.total_loss + loss.detach()
            output = loss / self.m
        outputs.append(output)
        if self.forward_only:
            inputs.pop(0)
            outputs.pop()
        return None if self.is_last(chunk) else output  # the loss is not sent

    def backward(self, k: int) -> Tensor | None:
        chunk = self.chunk_id(k, False)
        if self.is_last(chunk) and not self.output_grads[chunk]:
            self.output_grads[chunk].append(None)
        if self.on_last_backward is not None and self.table[k][0] == self.m - 1:  # the chunk's last microbatch
            self.on_last_backward(chunk)
        input_grad = backward_step(self.inputs[chunk].pop(0), self.outputs[chunk].pop(0),
                                   self.output_grads[chunk].pop(0), self.deallocate)
        return None if self.is_first(chunk) else input_grad

    def after_forward(self, output: Tensor | None) -> None:
        deallocate_output_tensor(output, self.deallocate)
        if self.probe is not None:
            self.probe([t for lists in (self.inputs, self.outputs) for ts in lists for t in ts if t is not None])

    # ------------------------------------------------------------ the phases
    def warm_up(self) -> None:
        p2p, v = self.p2p, self.v
        self.inputs[0].append(None if self.is_first(0) else p2p.exchange(recv_prev=True)[0])
        for k in range(self.warmup):
            output = self.forward(k)
            recv_prev, next_chunk = self.recv_from_previous_stage(k, True)
            if k == self.total - 1:
                recv_prev = False
            if k == self.warmup - 1 and not self.forward_only and not self.all_warmup:
                recv_next = not self.layout.is_last_stage
                input_tensor, output_grad = p2p.exchange(send_next=output, recv_prev=recv_prev, recv_next=recv_next)
                self.output_grads[v - 1].append(output_grad)
            else:
                input_tensor = p2p.exchange(send_next=output, recv_prev=recv_prev)[0]
            if recv_prev:
                self.inputs[next_chunk].append(input_tensor)
            self.after_forward(output)

    def steady(self) -> None:
        for k in range(self.remaining):
            forward_k = k + self.warmup
            output = self.forward(forward_k)
            input_grad = self.backward(k)
            recv_prev, next_forward_chunk = self.recv_from_previous_stage(forward_k, True)
            recv_next, next_backward_chunk = self.recv_from_previous_stage(k, False)
            if k == self.remaining - 1:
                recv_prev = False
            input_tensor, output_grad = self.p2p.exchange(send_next=output, send_prev=input_grad,
                                                          recv_prev=recv_prev, recv_next=recv_next)
            self.after_forward(output)
            if recv_prev:
                self.inputs[next_forward_chunk].append(input_tensor)
            if recv_next:
                self.output_grads[next_backward_chunk].append(output_grad)

    def cool_down(self) -> None:
        v = self.v
        if self.all_warmup:
            self.output_grads[v - 1].append(None if self.is_last(v - 1) else self.p2p.exchange(recv_next=True)[1])
        for k in range(self.remaining, self.total):
            input_grad = self.backward(k)
            recv_next, next_chunk = self.recv_from_previous_stage(k, False)
            if k == self.total - 1:
                recv_next = False
            output_grad = self.p2p.exchange(send_prev=input_grad, recv_next=recv_next)[1]
            if recv_next:
                self.output_grads[next_chunk].append(output_grad)
