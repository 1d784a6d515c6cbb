"""Retained activation bytes and traffic per step of a Hugging Face model per pipeline stage,
counted by TRACING one micro-batch on the meta device rather than by a formula per family.

Each stage's chunks are built as ``parallelize`` builds them (its checks, ``plan_parallelize``; the
context-parallel pass, ``split_over_context``; the pipeline pass, ``split_stages``; the
tensor-parallel pass with the experts cut to an EP rank's, ``apply_tensor_parallel``; the family's
own pass; the pipeline contract, ``ParallelModel.connect_stages``; the recompute pass,
``apply_recompute``), but left on the meta device: nothing is drawn or allocated. Under TP, CP or
EP the stage is built and run as one of its ranks over a fake process group (``fake_group``: the
layout's groups, collectives that return at once), so their collectives run; without them, on a
view of the layout naming the stage, no group made at all. One micro-batch of meta tensors of the
run's shape then goes through each chunk's ``forward_step`` (and the loss on the last), under the
runtime's own meter (``recompute.memory.ActivationMemoryMeter``: what autograd saves, as unique
live non-empty storages, parameters excluded; a storage freed by recompute has size 0), together
with what the schedule holds for the micro-batch (its received input, its sent output shrunk to one
element, the last stage's loss). The micro-batches in flight come from the schedule's order
(``activations.in_flight_peak``, as the GPT's count); the step's token ids and labels (one storage
each, of which micro-batches are views) are counted once per stage.

The traffic (``traffic``'s convention: each rank's payload per dimension and collective): the
backward runs after the forward, and what the forward and backward hand to torch.distributed (TP's
all-reduces, gathers and scatters, the vocabulary-parallel loss's, CP's K/V gathers, EP's
all-to-alls, recompute's replays) is read by the collective counter (``distributed.collectives``), once
per micro-batch and chunk; beside it, from the stage's traced tensors: the sends between stages
(each chunk's output and its input's gradient, per micro-batch) and the step's end, as the GPT's
(``traffic.finish_stage``: the gradients' DP x CP and expert-DP all-reduce, the TP sum of the
sequence-parallel ones, the tied embedding's between stages, the loss; under ZeRO-1 or bf16 weights
the distributed optimizer's buckets of the traced stage's parameters). An EP rank's experts on meta
tensors hold no routing: they spread the pairs evenly over the experts (the GPT's count assumes a
balanced router too), through the same exchange (``ExpertParallelExperts``).

Counted so: PP (1F1B and interleaved), DP, TP with and without SP, CP (the families CP takes), EP,
every recompute policy the family takes, added hyper-connections and a family's own streams
(DeepSeek-V4's runtime keeps about 4 % more than one micro-batch's trace sees once a second one has
run: docs/planning.md), fp32 or bf16 weights, with or without ZeRO-1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.planning.activations import in_flight_peak
from lightning_mhc.planning.memory import FP32, HeldTensor, StageCount
from lightning_mhc.planning.traffic import StageTraffic, finish_stage
from lightning_mhc.recompute.memory import ActivationMemoryMeter, storage_key


def trace_dtype(param_bytes: int) -> torch.dtype | None:
    """The dtype a stage is traced in for a run whose weights take ``param_bytes`` each: the recorded
    model's fp32 (None) or, for 2, ``bf16-true``'s bf16 (:func:`trace_hf_stages`)."""
    return None if param_bytes == FP32 else torch.bfloat16


def needs_groups(layout: Any) -> bool:
    """Whether a stage's forward runs collectives (TP, CP, EP): then it is traced over a fake group."""
    return max(layout.tensor_model_parallel_size, layout.context_parallel_size,
               layout.expert_model_parallel_size) > 1


class _StageView:
    """The layout as the pipeline pass reads it for one stage, without groups (no TP, CP or EP):
    its chunks are that stage's."""

    def __init__(self, layout: Any, stage: int) -> None:
        self._layout, self._stage = layout, stage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layout, name)

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self._stage

    @property
    def is_first_stage(self) -> bool:
        return self._stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self._stage == self._layout.pipeline_model_parallel_size - 1

    def local_virtual_stages(self) -> list[int]:
        p = self._layout.pipeline_model_parallel_size
        return [c * p + self._stage for c in range(self._layout.num_virtual_stages // p)]


@contextlib.contextmanager
def _meta_trace():
    """What the forward on meta tensors needs of its libraries: transformers looks for packed
    sequences in the positions it makes (``arange``: never packed) by reading their values, which
    meta tensors have none of (told there are none); ``torch.autocast`` knows no meta device (the
    modules turning it off for their fp32 math are given the CPU's, where it is off too); the
    experts' grouped product has a meta kernel for bf16 only (transformers' own fallback, which
    keeps the same inputs for the backward, is traced instead); the fused attention on meta tensors
    would take the unfused math (keeping the score matrix): it is given the fused kernel the runtime
    runs, which keeps its inputs, output and log-sum-exp (the CPU's; the GPU's flash kernel keeps the
    same)."""
    from transformers import masking_utils
    from transformers.integrations import moe

    found, autocast, grouped = masking_utils.find_packed_sequence_indices, torch.autocast, moe._can_use_grouped_mm

    class _Autocast(autocast):
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or dropout_p:
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        bias = sys.modules.get("torch.nn.attention.bias")  # imported by whoever made one (seconds: not here)
        if bias is not None and isinstance(attn_mask, bias.CausalBias):
            # CP's chunk against its causal prefix: off the CPU a lower-right bias the fused kernels
            # apply without a mask tensor (on the CPU a one-row strided mask of a few hundred bytes);
            # handed to this kernel it would be materialised, a mask per chunk kept the run has not
            attn_mask = None
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    torch.autocast = _Autocast
    moe._can_use_grouped_mm = lambda input, weight, offs: False
    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices, torch.autocast, moe._can_use_grouped_mm = found, autocast, grouped
        torch.nn.functional.scaled_dot_product_attention = sdpa


def _stage_model(recorded: Callable[[], nn.Module], layout: Any, settings: Any):
    """Stage ``layout.pipeline_model_parallel_rank``'s ``ParallelModel``, built on the meta device by
    ``parallelize``'s passes (a fresh recorded model: the passes cut it in place). ``layout``: built
    over a fake group (TP, CP, EP) or a :class:`_StageView` (no group: nothing to cut)."""
    from lightning_mhc.any_model.context_parallel import split_over_context
    from lightning_mhc.any_model.families import finish_family_chunks, native_stream_count
    from lightning_mhc.any_model.model import plan_parallelize
    from lightning_mhc.any_model.parallel_model import ParallelModel, stage_forward_kwargs
    from lightning_mhc.any_model.pipeline import split_stages
    from lightning_mhc.any_model.recompute import apply_recompute
    from lightning_mhc.any_model.tensor_parallel import apply_tensor_parallel
    from lightning_mhc.planning.hf import _MetaMaterializer

    planned = plan_parallelize(recorded(), dataclasses.replace(settings, layout=layout))
    model, parts = planned.model, planned.stages.parts
    sequence_split = split_over_context(model, layout) if layout.context_parallel_size > 1 else None
    streams = planned.streams * native_stream_count(model)
    split = split_stages(model, planned.stages, layout, settings.hidden_size, streams)
    materializer = _MetaMaterializer()
    modules = [chunk.module for chunk in split.chunks]
    if needs_groups(layout):  # each module cut to this rank's (TP's styles, EP's experts), left on meta
        apply_tensor_parallel(split.chunks, materializer, planned.plan, layout, model)
    for param in nn.ModuleList(modules).parameters():  # a tensor not cut stands for itself (a tie is marked on it)
        if materializer.meta_id(param) in (None, id(param)):
            materializer.replace(id(param), param)
    block_path = parts.block_path if parts else None
    finish_family_chunks(model, modules, block_path, layout, block_recompute=settings.recompute.block)
    tp = layout.tensor_model_parallel_size
    parallel = ParallelModel(modules, layout.num_virtual_stages, split.hidden_size, planned.vocab_parallel_logits, {},
                             None, stage_forward_kwargs(model), settings.recompute,
                             tp if layout.sequence_parallel else 1, sequence_split)
    parallel.connect_stages(split, materializer, layout)
    parallel.attach_router_loss(model, layout)
    apply_recompute(split.chunks, settings.recompute, planned.plan, streams, block_path)
    return parallel.train()


@dataclasses.dataclass(frozen=True)
class StageTrace:
    """One pipeline stage's traced figures, per rank of it."""

    activation_bytes: int
    """Retained at the schedule's peak, in the recorded model's dtype."""
    chunks_held: int
    """Micro-batch chunks in flight at that peak."""
    traffic: StageTraffic | None
    """The payload bytes a rank sends per step (None: the backward was not traced)."""


def trace_hf_stages(recorded: Callable[[], nn.Module], layout: Any, *, seq_length: int, micro_batch_size: int,
                    num_microbatches: int, plan: Any = "auto", hyper_connections: Any = None,
                    recompute: Any = "none", pipeline_split: list[int] | list[str] | None = None,
                    backward: bool = True, dtype: torch.dtype | None = None,
                    distributed_optimizer: bool = False) -> list[StageTrace]:
    """Each pipeline stage's :class:`StageTrace` (``backward=False``: the activations alone, no
    traffic). ``recorded``: makes the model on the meta device (e.g. ``lambda:
    recorded_hf_model(directory)``), called once per stage. ``dtype``: the run's weights'
    (``torch.bfloat16`` under ``bf16-true``): each stage is cast whole to it, as Lightning's
    precision plugin casts the model (``module.to(dtype)``), and traced with it as torch's default
    dtype, as the plugin runs a training step (what the model computes in fp32 regardless, its
    norms' statistics, the loss, stays fp32 in the trace too); None: the recorded model's (fp32).
    ``distributed_optimizer``: ZeRO-1's buckets in the traffic (``traffic.finish_stage``; bf16
    weights bring the distributed optimizer too, unsharded)."""
    from lightning_mhc.any_model.model import ParallelizeSettings
    from lightning_mhc.planning.fake_group import pretend_rank, stage_rank

    settings = ParallelizeSettings(layout, plan, pipeline_split=pipeline_split, recompute=recompute,
                                   hyper_connections=hyper_connections)
    sizes = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                 backward=backward, dtype=dtype, distributed_optimizer=distributed_optimizer)
    out = []
    for stage in range(layout.pipeline_model_parallel_size):
        if needs_groups(layout):
            with pretend_rank(layout, stage_rank(layout, stage)) as built:
                out.append(_trace_stage(recorded, built, settings, **sizes))
        else:
            out.append(_trace_stage(recorded, _StageView(layout, stage), settings, **sizes))
    return out


def _trace_stage(recorded: Callable[[], nn.Module], layout: Any, settings: Any, *, seq_length: int,
                 micro_batch_size: int, num_microbatches: int, backward: bool, dtype: torch.dtype | None,
                 distributed_optimizer: bool) -> StageTrace:
    """One stage's trace (``layout`` names it: see :func:`_stage_model`)."""
    from lightning_mhc.distributed.grads import is_partial_over_tp
    from lightning_mhc.distributed.placement import placement_of
    from lightning_mhc.distributed.collectives import CollectiveCounter, dimension_of

    p, m, stage = layout.pipeline_model_parallel_size, num_microbatches, layout.pipeline_model_parallel_rank
    v = layout.num_virtual_stages // p
    model = _stage_model(recorded, layout, settings)
    if dtype is not None:
        model.to(dtype)
    weights = next(model.parameters()).dtype
    # the step's batch, of which each micro-batch is a view (the runtime's split_microbatches)
    input_ids = torch.zeros(m * micro_batch_size, seq_length, dtype=torch.long, device="meta")
    labels = torch.zeros(m * micro_batch_size, seq_length, dtype=torch.long, device="meta")
    inputs = {"input_ids": input_ids[:micro_batch_size]}
    batch = {storage_key(input_ids), storage_key(labels)}
    counted = CollectiveCounter(dimension_of(layout)) if backward and needs_groups(layout) else None
    units, batch_bytes, received, input_saved, sent = [], 0, 0, False, Counter()
    for chunk in range(v):
        virtual = chunk * p + stage
        first, last = virtual == 0, virtual == layout.num_virtual_stages - 1
        input_tensor = None
        if not first:
            input_tensor = torch.empty(model.pipeline_tensor_shape(inputs), dtype=weights, device="meta",
                                       requires_grad=True)
            received = input_tensor.untyped_storage().nbytes()
        try:
            with counted if counted is not None else contextlib.nullcontext(), _meta_trace(), _default_dtype(dtype):
                with ActivationMemoryMeter(model) as meter:
                    model.set_input_tensor(input_tensor, chunk)
                    output = model.forward_step(inputs, chunk)
                    if last:  # the schedule keeps the loss over the micro-batches
                        output = model.loss(output, labels[:micro_batch_size]) / m
                input_saved = input_saved or (input_tensor is not None and meter.saved_itself(input_tensor))
                held = ([output] if last else []) + ([input_tensor] if input_tensor is not None else [])
                sent_output = 0 if last else output.element_size()  # the sent output, shrunk to one element
                units.append(sent_output + meter.live_bytes(held, where=lambda t: storage_key(t) not in batch))
                batch_bytes = max(batch_bytes, meter.live_bytes(where=lambda t: storage_key(t) in batch))
                if backward:  # as the schedule's: the loss's, or the gradient the next stage sends back
                    torch.autograd.backward(output, None if last else torch.empty_like(output))
        except Exception as error:  # an op the meta device cannot run (or a family's code that reads values):
            # one line, which the pre-launch check prints beside the model states, not a failed launch
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"the planner's activation count could not trace {type(model.chunks[0]).__name__} "
                              f"on the meta device ({first_line}); its model states are exact.") from error
        if not last:  # every micro-batch sends its output forward and (below) its input's gradient back
            sent["pipeline", "send"] += m * output.numel() * output.element_size()
        if input_tensor is not None:
            sent["pipeline", "send"] += m * received
    # interleaved: the chunks' inputs received before their forward, and each chunk's last one (its
    # model references it) where the forward saved that tensor itself
    peak, chunks_held = in_flight_peak(units, p, stage, m, received=received, kept=received if input_saved else 0)
    activation_bytes = peak + batch_bytes  # the step's ids and labels once
    if not backward:
        return StageTrace(activation_bytes, chunks_held, None)
    if counted is not None:  # each micro-batch passes each chunk once each way
        sent.update({key: m * payload for key, payload in counted.bytes.items() if payload})
    # the stage's trainable tensors as the runtime buckets them: each chunk's, in its parameter order
    tp = layout.tensor_model_parallel_size
    chunks = tuple(tuple(HeldTensor(param.numel(), placement_of(param).expert, placement_of(param).shared_embedding,
                                    tp > 1 and is_partial_over_tp(param, layout))
                         for param in chunk.parameters() if param.requires_grad) for chunk in model.chunks)
    held = [t for chunk in chunks for t in chunk]
    count = StageCount(stage, (), sum(t.numel for t in held if not t.expert), sum(t.numel for t in held if t.expert),
                       len(held), chunks)
    traffic = finish_stage(sent, count, layout, stage, param_bytes=weights.itemsize,
                           distributed_optimizer=distributed_optimizer)
    return StageTrace(activation_bytes, chunks_held, traffic)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """torch's default dtype ``dtype`` in the block (None: left as it is): what Lightning's
    ``bf16-true`` plugin sets around each training step (``HalfPrecision.forward_context``), for the
    tensors a forward makes without naming a dtype."""
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def plan_hf_activations(recorded: Callable[[], nn.Module], layout: Any, *, seq_length: int, micro_batch_size: int,
                        num_microbatches: int, plan: Any = "auto", hyper_connections: Any = None,
                        recompute: Any = "none", pipeline_split: list[int] | list[str] | None = None,
                        dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's ``(retained activation bytes, micro-batch chunks in flight)`` at the
    schedule's peak, per rank of that stage (as ``activations.plan_activations`` for the GPT), in
    ``dtype`` (:func:`trace_hf_stages`, forward only)."""
    return [(t.activation_bytes, t.chunks_held) for t in trace_hf_stages(
        recorded, layout, seq_length=seq_length, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
        plan=plan, hyper_connections=hyper_connections, recompute=recompute, pipeline_split=pipeline_split,
        backward=False, dtype=dtype)]


def plan_hf_traffic(recorded: Callable[[], nn.Module], layout: Any, *, seq_length: int, micro_batch_size: int,
                    num_microbatches: int, param_bytes: int = FP32, distributed_optimizer: bool = False,
                    **parallelize_args: Any) -> list[StageTraffic]:
    """Each pipeline stage's :class:`StageTraffic` for one rank of it (:func:`trace_hf_stages`, in
    bf16 for ``param_bytes`` 2, the ``bf16-true`` run's; ``parallelize_args``: its ``plan``,
    ``hyper_connections``, ``recompute``, ``pipeline_split``)."""
    return [t.traffic for t in trace_hf_stages(recorded, layout, seq_length=seq_length,
                                               micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                                               dtype=trace_dtype(param_bytes),
                                               distributed_optimizer=distributed_optimizer, **parallelize_args)]
