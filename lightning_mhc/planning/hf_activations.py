"""Retained activation bytes of a Hugging Face model per pipeline stage, counted by TRACING on the
meta device rather than by a formula per family.

Each stage's chunks are built as ``parallelize`` builds them (its checks, ``plan_parallelize``; the
pipeline pass, ``split_stages``, for a view of the layout that names the stage; the family's own
pass; the pipeline contract, ``ParallelModel.connect_stages``; the recompute pass,
``apply_recompute``), but left on the meta device: nothing is drawn or allocated. One micro-batch
of meta tensors of the run's shape then goes through each chunk's ``forward_step`` (and the loss on
the last), under the runtime's own meter (``recompute.memory.ActivationMemoryMeter``: what
autograd saves, as unique live non-empty storages, parameters excluded; a storage freed by
recompute has size 0), together with what the schedule holds for the
micro-batch (its received input, its sent output shrunk to one element, the last stage's loss).
The micro-batches in flight come from the schedule's order (``activations.in_flight_peak``, as the
GPT's count); the step's token ids and labels (one storage each, of which micro-batches are views)
are counted once per stage.

Counted so: PP (1F1B and interleaved), DP (nothing divides the activations), every recompute policy
the family takes, added hyper-connections and a family's own streams (DeepSeek-V4's runtime keeps
about 4 % more than one micro-batch's trace sees once a second one has run: docs/planning.md). Not
yet: TP, CP, EP, whose forwards run collectives a
trace without process groups cannot (refused in one line by :func:`check_hf_activation_plan`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from lightning_mhc.errors import ConfigError
from lightning_mhc.planning.activations import in_flight_peak
from lightning_mhc.recompute.memory import ActivationMemoryMeter, storage_key


def check_hf_activation_plan(layout: Any) -> None:
    """What the traced count does not cover yet, refused in one line."""
    missing = [what for what, size in (("tensor parallelism", layout.tensor_model_parallel_size),
                                       ("context parallelism", layout.context_parallel_size),
                                       ("expert parallelism", layout.expert_model_parallel_size)) if size > 1]
    if missing:
        raise ConfigError(f"the planner's activation count of a Hugging Face model does not cover {', '.join(missing)} "
                          "yet (its forward runs collectives the meta-device trace has no group for); its model "
                          "states are exact.")


class _StageView:
    """The layout as the pipeline pass reads it for one stage: its chunks are that stage's."""

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
    runs, which keeps its inputs, output and log-sum-exp (the CPU's; the GPU's flash kernel keeps the same)."""
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


def _stage_model(recorded: Callable[[], nn.Module], layout: Any, stage: int, settings: Any):
    """``(ParallelModel, streams x hidden)`` of stage ``stage``, built on the meta device by
    ``parallelize``'s passes (a fresh recorded model: the passes cut it in place)."""
    from lightning_mhc.any_model.families import finish_family_chunks, native_stream_count
    from lightning_mhc.any_model.model import plan_parallelize
    from lightning_mhc.any_model.parallel_model import ParallelModel, stage_forward_kwargs
    from lightning_mhc.any_model.pipeline import split_stages
    from lightning_mhc.any_model.recompute import apply_recompute
    from lightning_mhc.planning.hf import _MetaMaterializer

    view = _StageView(layout, stage)
    planned = plan_parallelize(recorded(), dataclasses.replace(settings, layout=view))
    model, parts = planned.model, planned.stages.parts
    streams = planned.streams * native_stream_count(model)
    split = split_stages(model, planned.stages, view, settings.hidden_size, streams)
    modules = [chunk.module for chunk in split.chunks]
    block_path = parts.block_path if parts else None
    finish_family_chunks(model, modules, block_path, view, block_recompute=settings.recompute.block)
    parallel = ParallelModel(modules, layout.num_virtual_stages, split.hidden_size, planned.vocab_parallel_logits, {},
                             None, stage_forward_kwargs(model), settings.recompute)
    parallel.connect_stages(split, _MetaMaterializer(), view)
    parallel.attach_router_loss(model, view)
    apply_recompute(split.chunks, settings.recompute, planned.plan, streams, block_path)
    return parallel.train(), split.hidden_size


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
    schedule's peak, per rank of that stage (as ``activations.plan_activations`` for the GPT).
    ``recorded``: makes the model on the meta device (e.g. ``lambda: recorded_hf_model(directory)``),
    called once per stage. ``dtype``: the run's weights' (``torch.bfloat16`` under ``bf16-true``):
    each stage is cast whole to it, as Lightning's precision plugin casts the model
    (``module.to(dtype)``), and traced with it as torch's default dtype, as the plugin runs a
    training step (what the model computes in fp32 regardless, its norms' statistics, the loss,
    stays fp32 in the trace too); None: the recorded model's (fp32)."""
    from lightning_mhc.any_model.model import ParallelizeSettings

    check_hf_activation_plan(layout)
    settings = ParallelizeSettings(layout, plan, pipeline_split=pipeline_split, recompute=recompute,
                                   hyper_connections=hyper_connections)
    p, m = layout.pipeline_model_parallel_size, num_microbatches
    v = layout.num_virtual_stages // p
    out = []
    for stage in range(p):
        model, width = _stage_model(recorded, layout, stage, settings)
        if dtype is not None:
            model.to(dtype)
        weights = next(model.parameters()).dtype
        # the step's batch, of which each micro-batch is a view (the runtime's split_microbatches)
        input_ids = torch.zeros(m * micro_batch_size, seq_length, dtype=torch.long, device="meta")
        labels = torch.zeros(m * micro_batch_size, seq_length, dtype=torch.long, device="meta")
        batch = {storage_key(input_ids), storage_key(labels)}
        units, batch_bytes, received = [], 0, 0
        for chunk in range(v):
            virtual = chunk * p + stage
            first, last = virtual == 0, virtual == layout.num_virtual_stages - 1
            input_tensor = None
            if not first:
                input_tensor = torch.empty(micro_batch_size, seq_length, width, dtype=weights, device="meta",
                                           requires_grad=True)
                received = input_tensor.untyped_storage().nbytes()
            try:
                with ActivationMemoryMeter(model) as meter, _meta_trace(), _default_dtype(dtype):
                    model.set_input_tensor(input_tensor, chunk)
                    output = model.forward_step({"input_ids": input_ids[:micro_batch_size]}, chunk)
                    if last:  # the schedule keeps the loss over the micro-batches
                        output = model.loss(output, labels[:micro_batch_size]) / m
            except (RuntimeError, NotImplementedError) as error:  # an op the meta device cannot run
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ConfigError(f"the planner's activation count could not trace {type(model.chunks[0]).__name__} "
                                  f"on the meta device ({first_line}); its model states are exact.") from error
            held = ([output] if last else []) + ([input_tensor] if input_tensor is not None else [])
            sent = 0 if last else output.element_size()  # the sent output, shrunk to one element
            units.append(sent + meter.live_bytes(held, where=lambda t: storage_key(t) not in batch))
            batch_bytes = max(batch_bytes, meter.live_bytes(where=lambda t: storage_key(t) in batch))
        peak, chunks_held = in_flight_peak(units, p, stage, m)
        # the step's ids and labels once; interleaved: the next chunk's input, received before its forward
        out.append((peak + batch_bytes + (received if v > 1 else 0), chunks_held))
    return out
