"""``parallelize``: this rank's TP x PP part of a model as written, and ``ParallelModel``, its
side of the pipeline contract.

    with record_module_init():
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4))
    model = parallelize(model, plan="gpt2", layout=self.layout)   # in a LightningModule's configure_model

Each rank materialises only the blocks of its stage(s) and the parts around them that it runs
(``pipeline.py``), each tensor drawn whole from the generator of its name and cut to this rank's
TP slice (``record.py``, ``tensor_parallel.py``), so the weights equal those of the whole model
materialised in one process with the same seed (:func:`build_recorded_module`).

``parallelize`` is a short list of steps, each a function taking what the one before returned,
the settings in one value (:class:`ParallelizeSettings`): :func:`resolve_model_plan`,
:func:`add_model_hyper_connections`, :func:`split_pipeline`, :func:`apply_tensor_parallel`,
:func:`load_model_weights`, :func:`attach_model_recompute`.
"""
from __future__ import annotations

import copy

import dataclasses
import fnmatch
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mhc.errors import ConfigError, Label
from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.any_model.pipeline import (
    FirstStageStub,
    ModelParts,
    NotOnThisStage,
    chunk_skeleton,
    cut_per_layer_config,
    find_parts,
    replace_hidden_states,
    set_submodule,
    split_blocks,
    stage_block_list,
)
from lightning_mhc.any_model.context_parallel import SequenceSplit, check_context_parallel_family, split_over_context
from lightning_mhc.any_model.experts import check_experts, shard_experts
from lightning_mhc.any_model.families import (FamilyRecord, check_family_layout, family_of, finish_family_chunks,
                                             native_stream_count, plan_family, resolve_plan)
from lightning_mhc.any_model.router_loss import RouterLoss, router_loss_for
from lightning_mhc.any_model.plan import Column, TPPlan, base_of, check_plan, linear_dims
from lightning_mhc.any_model.adapters import (fill_adapters, lora_layers, place_injected_adapters, place_lora,
                                             unwrap_peft_model)
from lightning_mhc.distributed.grads import mark_replicated
from lightning_mhc.any_model.hyper_connections import (
    HyperConnectionPlan,
    HyperConnectionSettings,
    add_hyper_connections,
)
from lightning_mhc.any_model.record import InitFn, Materializer, is_meta
from lightning_mhc.any_model.weights import check_weights, load_weights
from lightning_mhc.layers.loss import token_mean_loss
from lightning_mhc.layers.sequence_parallel import mark_sequence_parallel_parameters
from lightning_mhc.any_model.tensor_parallel import (
    apply_style,
    divide_attributes,
    gather_replicated_sequence,
    gather_sequence_into,
    random_region,
    scatter_sequence,
)
from lightning_mhc.recompute.groups import attach_block_recompute
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.recompute.without_output import checkpoint
from lightning_mhc.recompute.rng import rng_fork

log = logging.getLogger("lightning_mhc.any_model")
IGNORE_INDEX = -100


class _StageExit(Exception):
    """Raised after a non-last stage's last block: carries what goes to the next stage."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass(frozen=True)
class MaterializedReport:
    """Parameters this rank holds against the whole model (tied tensors counted once)."""

    rank_parameters: int
    whole_parameters: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int

    @property
    def fraction(self) -> float:
        return self.rank_parameters / self.whole_parameters

    def __str__(self) -> str:
        ideal = 1 / (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)
        return (f"{self.rank_parameters:,} of {self.whole_parameters:,} parameters materialised "
                f"({self.fraction:.3f}; 1/(TP*PP) = {ideal:.3f})")


class ParallelModel(nn.Module):
    """This rank's chunks of a model split by :func:`parallelize` (one chunk, or ``v`` with a
    virtual pipeline), and the pipeline contract over them: ``set_input_tensor``,
    ``forward_step`` (the model's own forward on the stage), ``loss`` (causal-LM cross entropy,
    vocab-parallel when the head is split), ``pipeline_tensor_shape`` and
    ``global_parameter_name`` (the whole model's names: checkpoints reshard).

    With PP = 1, ``model(input_ids=...)`` is the model's forward (logits; split over the
    vocabulary when ``vocab_parallel_logits``). Under context parallelism it takes the whole
    sequence and returns this rank's chunks' logits (``any_model/context_parallel.py``)."""

    def __init__(self, chunks: list[nn.Module], num_virtual_stages: int, hidden_size: int,
                 vocab_parallel_logits: bool, aliases: dict[str, str], report: MaterializedReport,
                 forward_kwargs: dict[str, Any], recompute: RecomputePolicy = RecomputePolicy(),
                 sequence_shards: int = 1, sequence_split: SequenceSplit | None = None) -> None:
        super().__init__()
        self.sequence_split = sequence_split
        """Under context parallelism: the whole sequence given is cut to this rank's chunks (inputs, labels)."""
        self.sequence_shards = sequence_shards
        """TP under sequence parallelism (each rank's blocks hold ``seq / sequence_shards`` tokens), else 1."""
        self.recompute = recompute
        """The recompute policy the blocks were built with (``parallelize(recompute=...)``)."""
        self.chunks = nn.ModuleList(chunks)
        self.num_virtual_stages = num_virtual_stages
        self.hidden_size = hidden_size
        self.vocab_parallel_logits = vocab_parallel_logits
        self.aliases = aliases
        self.report = report
        self.forward_kwargs = forward_kwargs
        self._inputs: list[Tensor | None] = [None] * len(chunks)
        self.router_loss: RouterLoss | None = None
        """A Hugging Face MoE family's own router loss, where its config asks for it
        (``output_router_logits``): added to :meth:`loss` (``router_loss.py``)."""
        self._running: int | None = None
        self._blocks_ran = False

    # ------------------------------------------------------------------ contract
    def set_input_tensor(self, tensor: Tensor | None, chunk: int = 0) -> None:
        self._inputs[chunk] = tensor

    def forward_step(self, inputs: Mapping[str, Any], chunk: int = 0) -> Tensor:
        """The stage's part of the model's forward on ``inputs`` (the model's keyword arguments):
        the activations for the next stage, or the logits on the last."""
        if self.training and torch.is_grad_enabled():  # turned on after parallelize (Fabric, a plain loop)
            refuse_hf_gradient_checkpointing(self.chunks[chunk])
        if self.sequence_split is not None:
            inputs = self.sequence_split.split_inputs(inputs)
        self._running, self._blocks_ran = chunk, False
        router_loss = self.router_loss
        if router_loss is not None:
            router_loss.begin(chunk, inputs.get("attention_mask"), self.sequence_split)
        final = chunk == len(self.chunks) - 1
        try:
            with rng_fork("tensor"):  # replicated across TP, distinct per DP and PP rank
                try:
                    output = self.chunks[chunk](**inputs, **self.forward_kwargs)
                except _StageExit as stop:
                    output, final = stop.hidden, False
        finally:
            self._running = None
        if not final:
            return output if router_loss is None else router_loss.end(chunk, output, False)
        logits = _logits(output)
        return logits if router_loss is None else router_loss.end(chunk, logits, True)

    def forward(self, **inputs: Any) -> Tensor:
        if len(self.chunks) != 1 or self.num_virtual_stages != 1:
            raise RuntimeError("a pipelined model runs through the strategy's schedule (forward_backward), not "
                               "model(...): call it directly only with pipeline_model_parallel_size=1")
        return self.forward_step(inputs)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross entropy over the labels that are not ``-100`` (``labels[b, s]``
        is the target of position ``s``); fp32; over the vocabulary slices when split. Under context
        parallelism ``labels`` are the whole sequence's, the logits this rank's chunks', and the
        result is this rank's part of the mean (``SequenceSplit.loss``)."""
        if self.sequence_split is not None:
            labels = self.sequence_split.split_labels(labels)
        keep = labels != IGNORE_INDEX
        if self.vocab_parallel_logits:
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            per_token = vocab_parallel_cross_entropy(logits.float(), labels.masked_fill(~keep, 0)) * keep
        else:
            per_token = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="none").view_as(labels)
        if self.sequence_split is not None:
            loss = self.sequence_split.loss(per_token, keep)
        else:
            loss = token_mean_loss(per_token, keep)  # 0, not NaN, when every label is ignored
        term = self.router_loss.loss_term(logits) if self.router_loss is not None else None
        return loss if term is None else loss + term  # as the model's own loss: CE + coef x its router loss

    def pipeline_tensor_shape(self, inputs: Mapping[str, Any]) -> tuple[int, ...]:
        """What crosses stages: the hidden states ``[batch, seq, hidden]`` (``seq / TP`` under
        sequence parallelism, ``/ CP`` under context parallelism; ``hidden``: ``n * C`` with ``n``
        hyper-connection streams)."""
        first = next(v for v in inputs.values() if isinstance(v, Tensor))
        cp = self.sequence_split.size if self.sequence_split is not None else 1
        return (first.shape[0], first.shape[1] // (self.sequence_shards * cp), self.hidden_size)

    def global_parameter_name(self, name: str) -> str:
        """A state-dict name of this module as the whole model names it: no chunk prefix, and a
        tied tensor under its owner's name (one entry in checkpoints)."""
        if name.startswith("chunks."):
            name = name.split(".", 2)[2]
        return self.aliases.get(name, name)

    def place_injected_adapters(self, layout: ParallelLayout) -> list[str]:
        """PEFT's adapters injected into this split model (``get_peft_model(parallelize(...))``),
        drawn from the model's seed by their whole-model names and placed like the layers they
        adapt (``adapters.place_injected_adapters``); the strategy calls it at fit start."""
        return place_injected_adapters(self, layout, getattr(self, "seed", 0), self.global_parameter_name)

    # ------------------------------------------------------------------ hooks
    def _take_input(self, chunk: int, module: nn.Module, args: tuple, kwargs: dict):
        if self._running != chunk:
            return None
        self._blocks_ran = True
        received = self._inputs[chunk]
        if received is None:
            raise RuntimeError("no input tensor was set for a stage after the first (set_input_tensor)")
        return replace_hidden_states(module, args, kwargs, lambda _: received,
                                     "the pipeline cannot hand it the previous stage's activations")

    def _stub_called(self, stub: FirstStageStub, args: tuple) -> None:
        if self._blocks_ran:
            raise ConfigError(
                f"{stub.part_name} is registered before the block list, so it was placed on the first pipeline stage, "
                "but the model's forward runs it after its blocks: name it in the plan's after_blocks "
                f"(TPPlan(after_blocks=('{stub.part_name}',))).")

    def _stop(self, chunk: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._running == chunk:
            hidden = output if isinstance(output, Tensor) else output[0]
            # the schedule frees a sent output's storage once sent; a view (OPT's blocks end with
            # .view()) shares its base's, which the graph still needs
            raise _StageExit(hidden.clone() if hidden._base is not None else hidden)


def _logits(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, Tensor) else output[0]


def _output_layer(model: nn.Module, plan: TPPlan, name: str | None) -> str | None:
    """The layer that produces the logits: ``name``, or the last layer inside it the plan styles
    (a head that is a container, e.g. ``Sequential(norm, Linear)``)."""
    if name is None:
        return None
    styled = [n for n, _ in model.get_submodule(name).named_modules(prefix=name) if plan.style_of(n) is not None]
    return styled[-1] if styled else name


def _hidden_size(model: nn.Module, parts: ModelParts, given: int | None) -> int:
    if given is not None:
        return given
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    for name in parts.first:
        module = model.get_submodule(name)
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
    raise ConfigError(f"cannot tell the hidden size of {type(model).__name__} (what crosses pipeline stages): pass "
                      "hidden_size= to parallelize().")


def _unique_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _checkpointed(module: nn.Module) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    module.forward = run


@dataclass(frozen=True)
class ParallelizeSettings:
    """What :func:`parallelize` is asked for, in one value that every step reads: its keyword
    arguments, with the recompute policy parsed and the hyper-connection count checked (see
    :func:`parallelize` for each one's meaning). ``layout`` is built when the model is split
    (:func:`check_parallelize` takes one not built yet: it builds nothing)."""

    layout: ParallelLayout
    plan: str | TPPlan | Mapping[str, Any] | None = None
    blocks: str | None = None
    pipeline_split: list[int] | list[str] | None = None
    seed: int = 0
    init_fn: InitFn | None = None
    recompute: RecomputePolicy = RecomputePolicy()
    recompute_modules: tuple[str, ...] | list[str] | None = None
    hidden_size: int | None = None
    loss_parallel: bool = True
    weights: str | Any | None = None
    hyper_connections: int | HyperConnectionSettings | None = None
    hyper_connection_plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto"

    def __post_init__(self) -> None:
        _check_hyper_connections(self.hyper_connections)  # named as the caller wrote it, before anything else
        object.__setattr__(self, "recompute", RecomputePolicy.of(self.recompute))


@dataclass
class PlannedModel:
    """The recorded model and its TP plan (resolved: a family's by name, ``recompute_modules`` in),
    and the family's record where the plan is a family's (its pipeline contract)."""

    model: nn.Module
    plan: TPPlan
    family: FamilyRecord | None = None


@dataclass
class SplitModel:
    """A planned model cut into this rank's (virtual) pipeline stages (on the meta device until
    :func:`apply_tensor_parallel` builds them), as the later steps hand it on: what the whole
    model was before the cut (its size, its tied tensors, the pretrained files
    checked against it, the materializer that knows each tensor's owner), and each of this rank's
    chunks with the modules it must build."""

    planned: PlannedModel
    parts: ModelParts | None
    """The block list and the parts around it (None: no block list, the whole model is one stage)."""
    ranges: list[tuple[int, int]]
    """Each (virtual) stage's ``[start, end)`` blocks (``[(0, 0)]`` without a block list)."""
    whole_parameters: int
    hidden_size: int
    """What crosses the stages: the model's hidden size times its residual streams."""
    vocab_parallel_logits: bool
    tied_across_stages: list[int]
    weights: Any
    """The pretrained files checked against the whole model (None: drawn from the seed)."""
    materializer: Materializer
    aliases: dict[str, str]
    chunks: list[StageChunk]
    sequence_split: SequenceSplit | None
    """How this rank cuts the sequence under context parallelism (None without it)."""
    parallel_model: ParallelModel | None = None
    """The built chunks as one module, once :func:`load_model_weights` has made it."""


@dataclass
class StageChunk:
    """One of this rank's chunks: its module (on the meta device until built), its (virtual) stage,
    the modules it builds (whole-model name, module, whether it is a block) and its blocks by index."""

    module: nn.Module
    stage: int
    builds: list[tuple[str, nn.Module, bool]]
    blocks: dict[int, nn.Module]


def parallelize(
    model: nn.Module,
    plan: str | TPPlan | Mapping[str, Any] | None = None,
    *,
    layout: ParallelLayout | None = None,
    blocks: str | None = None,
    pipeline_split: list[int] | list[str] | None = None,
    seed: int = 0,
    init_fn: InitFn | None = None,
    recompute: str | RecomputePolicy = "none",
    recompute_modules: tuple[str, ...] | list[str] | None = None,
    hidden_size: int | None = None,
    loss_parallel: bool = True,
    weights: str | Any | None = None,
    hyper_connections: int | HyperConnectionSettings | None = None,
    hyper_connection_plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto",
) -> ParallelModel:
    """This rank's part of ``model`` (built under :func:`record_module_init`) on ``layout``: the
    run's (a LightningModule's ``self.layout``, a strategy's ``layout``); a layout not built yet,
    ``ParallelLayout(tensor_model_parallel_size=2, ...)``, is built here, over the initialised
    default process group; None: the one-process layout (``single_process_layout()``).

    A short list of steps, each taking what the one before returned, the settings in one value
    (:class:`ParallelizeSettings`): resolve the plan, add hyper-connections, split the pipeline,
    apply TP (each tensor materialised whole, then cut), load the weights, attach the recompute.

    Args:
        plan: the TP plan: ``"gpt2"``, ``"llama"``, a ``{module-name pattern: style}`` dict or a
            :class:`TPPlan` (``plan.py``); None splits nothing (PP and DP only).
        blocks: the name of the repeated block list (found when not given).
        pipeline_split: blocks per (virtual) stage, or the names of the blocks that begin stages
            1, 2, ... (default: balanced).
        seed: the initialisation seed (every layout draws the same weights from it).
        init_fn: the model's init, applied per module (default: the model's ``_init_weights``,
            as Hugging Face models have; else the constructors' own init).
        recompute: ``"none"``, ``"full"`` (every block checkpointed) or ``"selective"`` (the
            modules ``recompute_modules`` names, default the plan's ``selective`` list), or a
            :class:`~lightning_mhc.recompute.RecomputePolicy` of one of them.
        loss_parallel: keep the logits split over the vocabulary when the plan splits the head
            (the loss is then megatron's vocab-parallel cross entropy); False gathers them.
        weights: pretrained weights instead of ``seed``'s: a Hugging Face directory of
            safetensors (indexed or not) or a list of files. Each rank reads only its stage's
            tensors and its TP slices (``weights.py``); names, shapes and dtypes are checked
            against the model first (hyper-connection parameters the files lack are drawn from
            ``seed``).
        hyper_connections: ``n`` residual streams with a hyper-connection around every branch
            (``hyper_connections.py``: exact at step 0 with the default settings), or their
            :class:`HyperConnectionSettings`; None: as the model is (or as
            ``add_hyper_connections`` left it). ``recompute="mhc_block"`` needs them.
        hyper_connection_plan: where they go: ``"auto"`` (by ``model_type``), or a
            :class:`HyperConnectionPlan`.
    """
    settings = ParallelizeSettings(
        layout if layout is not None else ParallelLayout(), plan, blocks, pipeline_split, seed, init_fn, recompute,
        recompute_modules, hidden_size, loss_parallel, weights, hyper_connections, hyper_connection_plan)
    if not settings.layout.is_built:  # the settings checked first, then the groups made
        built = settings.layout.build() if layout is not None else single_process_layout()
        settings = dataclasses.replace(settings, layout=built)
    planned = resolve_model_plan(model, settings)
    planned = add_model_hyper_connections(planned, settings)
    split = split_pipeline(planned, settings)
    split = apply_tensor_parallel(split, settings)
    split = load_model_weights(split, settings)
    return attach_model_recompute(split, settings)


def resolve_model_plan(model: nn.Module, settings: ParallelizeSettings) -> PlannedModel:
    """Step 1: the recorded model (refused if not on the meta device) and its TP plan."""
    model = unwrap_peft_model(model)  # PEFT's LoRA injected into the recorded model: split with it
    _check_recorded(model)
    plan = resolve_plan(settings.plan, model)
    if settings.recompute_modules is not None:
        plan = dataclasses.replace(plan, selective=tuple(settings.recompute_modules))
    return PlannedModel(model, plan, plan_family(settings.plan, model))


def add_model_hyper_connections(planned: PlannedModel, settings: ParallelizeSettings) -> PlannedModel:
    """Step 2: the hyper-connections added to the recorded model before it is split (a model
    ``add_hyper_connections`` rewired already keeps its own), and the recompute policy checked
    against the model they make."""
    if settings.hyper_connections is not None:
        add_hyper_connections(planned.model, HyperConnectionSettings.of(settings.hyper_connections, settings.seed),
                              settings.hyper_connection_plan)
    check_recompute(settings.recompute, hyper_connections=_hyper_connection_streams(planned.model) > 1)
    return planned


def split_pipeline(planned: PlannedModel, settings: ParallelizeSettings) -> SplitModel:
    """Step 3: the plan checked against the model, the block list cut into the (virtual) stages,
    and this rank's chunks made of its stages' blocks and parts (on the meta device: the next steps
    build them). What needs the whole model is read first: the cut changes it (the first chunk is
    the recorded model itself, holding only its blocks)."""
    model, layout = planned.model, settings.layout
    parts, ranges = _stage_ranges(planned, settings)
    sequence_split = split_over_context(model, layout)  # the attention through CP, by transformers' registry
    weights = check_weights(model, settings.weights) if settings.weights is not None else None
    hidden = _hidden_size(model, parts, settings.hidden_size) if parts else settings.hidden_size or 0
    hidden *= _hyper_connection_streams(model) * native_stream_count(model)  # the n streams cross the stages
    materializer = Materializer(model, settings.seed, settings.init_fn,
                                loaded=weights.tensor_ids if weights is not None else None)
    last_stage = layout.num_virtual_stages - 1
    across = _tied_across_stages(_tied_tensors(model), parts, ranges, last_stage) if parts else []
    plan, vocab_parallel = _output_plan(model, planned.plan, parts, layout.tensor_model_parallel_size,
                                        settings.loss_parallel)
    return SplitModel(PlannedModel(model, plan, planned.family), parts, ranges, _unique_numel(model), hidden, vocab_parallel, across,
                      weights, materializer, _tied_aliases(model, materializer),
                      _stage_chunks(model, parts, ranges, layout), sequence_split)


def apply_tensor_parallel(split: SplitModel, settings: ParallelizeSettings) -> SplitModel:
    """Step 4: every module of this rank's chunks materialised and cut by the plan (TP styles,
    divided attributes, random regions; under sequence parallelism the blocks' sequence split):
    each tensor is drawn whole from the generator of its name, then cut to this rank's slice."""
    build = _module_builder(split.materializer, split.planned.plan, settings.layout, split.planned.model)
    for chunk in split.chunks:
        for name, module, block in chunk.builds:
            build(name, module, block)
    finish_family_chunks(split.planned.model, [chunk.module for chunk in split.chunks],
                         split.parts.block_path if split.parts else None, settings.layout)
    return split


def load_model_weights(split: SplitModel, settings: ParallelizeSettings) -> SplitModel:
    """Step 5: the built chunks as one :class:`ParallelModel` (``split.parallel_model``), wired for
    the pipeline (the stages' hooks, the tied embedding's gradient between the first and last
    stage), with the pretrained weights read into this rank's slices where given."""
    layout, tp = settings.layout, settings.layout.tensor_model_parallel_size
    modules = [chunk.module for chunk in split.chunks]
    report = MaterializedReport(_unique_numel(nn.ModuleList(modules)), split.whole_parameters, tp,
                                layout.pipeline_model_parallel_size)
    model_parallel = ParallelModel(modules, layout.num_virtual_stages, split.hidden_size, split.vocab_parallel_logits,
                                   split.aliases, report, _forward_kwargs(split.planned.model), settings.recompute,
                                   tp if layout.sequence_parallel else 1, split.sequence_split)
    model_parallel.seed = settings.seed  # what adapters injected later are drawn from (place_adapters)
    stage_ends = [(chunk.stage, chunk.blocks[min(chunk.blocks)], chunk.blocks[max(chunk.blocks)])
                  for chunk in split.chunks if chunk.blocks]
    _connect_stages(model_parallel, stage_ends, layout.num_virtual_stages - 1, layout.sequence_parallel and tp > 1)
    _attach_router_loss(model_parallel, split.planned.model, layout)
    _mark_shared_embeddings(model_parallel, split.materializer, split.tied_across_stages)
    if split.weights is not None:
        load_weights(model_parallel, split.weights, layout)
    log.info("rank %d (tp %d, pp %d): %s", _global_rank(), layout.tensor_model_parallel_rank,
             layout.pipeline_model_parallel_rank, model_parallel.report)
    return dataclasses.replace(split, parallel_model=model_parallel)


def attach_model_recompute(split: SplitModel, settings: ParallelizeSettings) -> ParallelModel:
    """Step 6: the recompute policy on the built chunks: ``selective``, the modules the plan's
    ``selective`` patterns name; ``full``, every block; the mHC block recompute, groups of blocks
    within each stage."""
    policy, plan = settings.recompute, split.planned.plan
    seen: set[int] = set()  # a part every stage runs is in each chunk's builds: checkpointed once
    for chunk in split.chunks:
        for name, module, _ in chunk.builds if policy.selective else ():
            for sub_name, sub in module.named_modules(prefix=name):
                if id(sub) not in seen and any(_matches(sub_name, p) for p in plan.selective):
                    seen.add(id(sub))
                    _checkpointed(sub)
        local = list(chunk.blocks.values())
        if policy.full:
            for block in local:
                _checkpointed(block)
        if policy.block and local:
            attach_block_recompute(local, policy.block_ranges(local[0].hyper_connection_wiring.n, len(local)),
                                   _recompute_group_name)
    return split.parallel_model


def check_parallelize(model: nn.Module, plan: str | TPPlan | Mapping[str, Any] | None = None, *,
                      layout: ParallelLayout, blocks: str | None = None,
                      pipeline_split: list[int] | list[str] | None = None, seed: int = 0,
                      recompute: str | RecomputePolicy = "none",
                      recompute_modules: tuple[str, ...] | list[str] | None = None,
                      hyper_connections: int | HyperConnectionSettings | None = None,
                      hyper_connection_plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto",
                      ) -> tuple[TPPlan, ModelParts | None, list[tuple[int, int]]]:
    """Everything :func:`parallelize` refuses, before anything is built (the CLI runs it before
    launch, on a layout not built yet): its first steps up to the stage split, on a copy of the
    recorded model when hyper-connections are added (a check changes nothing). Returns the checked
    plan, the model's parts and each (virtual) stage's block range (of the copy, if one was made)."""
    settings = ParallelizeSettings(layout, plan, blocks, pipeline_split, seed, recompute=recompute,
                                   recompute_modules=recompute_modules, hyper_connections=hyper_connections,
                                   hyper_connection_plan=hyper_connection_plan)
    planned = resolve_model_plan(model, settings)
    if HyperConnectionSettings.of(settings.hyper_connections).enabled and _hyper_connection_streams(model) == 1:
        planned = PlannedModel(copy.deepcopy(model), planned.plan, planned.family)  # meta: nothing is allocated
    planned = add_model_hyper_connections(planned, settings)
    if settings.layout.context_parallel_size > 1:
        check_context_parallel_family(planned.model)
    return (planned.plan, *_stage_ranges(planned, settings))


def _check_recorded(model: nn.Module) -> None:
    """A model ``parallelize`` can take: recorded on the meta device, without Hugging Face's own
    gradient checkpointing."""
    if not is_meta(model):
        raise ConfigError(f"parallelize() takes a model built on the meta device with its constructor arguments "
                          f"recorded: construct {type(model).__name__} inside `with record_module_init():`.")
    refuse_hf_gradient_checkpointing(model)


def refuse_hf_gradient_checkpointing(model: nn.Module) -> None:
    """Hugging Face's gradient checkpointing (``gradient_checkpointing_enable()``) refused on a model
    split by ``parallelize``: its re-run of a block restores torch's generator but not the
    randomizer's per-region streams (``recompute/rng.py``), which the forward's dropout drew from
    and which moved on since, so the recomputed masks differ from the forward's and the gradients
    are silently wrong (measured on one process, tiny Llama with 4 streams and dropout 0.1: the
    first step's gradients off by up to 0.075; the second step's loss off by 1.2e-3, its masks
    moved too). Without dropout it was exact (the same Llama on TP 2 x PP 2: losses within 1e-6 of
    one process; transformers checkpoints the block's ``forward``, so the pipeline's module hooks
    stay outside), but a model's dropout can sit anywhere, so it is refused whole.
    ``recompute="full"`` saves the same memory and restores every stream. Checked when the model
    is split and again before training (it may be turned on after)."""
    on = next((m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True), None)
    if on is not None:
        raise ConfigError(
            f"{type(on).__name__} has Hugging Face gradient checkpointing on (gradient_checkpointing_enable() or "
            "activation_checkpointing_enable()), which "
            "re-runs its blocks without the strategy's dropout streams, so a split model's gradients would differ "
            "from the forward's; call gradient_checkpointing_disable() and use recompute=\"full\" "
            "(MHCRecomputeCallback(\"full\") or parallelize(recompute=\"full\")) for the same memory saving, exactly.")


PARALLELIZE_LABELS = {
    "policy": Label("recompute"),
    "hyper_connections": Label("hyper_connections", lambda _: (
        "a model with hyper-connections (parallelize(..., hyper_connections=n), add_hyper_connections(model), or "
        "MHCGPTModule)")),
}
"""How ``parallelize`` names a recompute policy's fields in its errors: by its arguments (a model it
splits has hyper-connections or not, whichever way they were added)."""


def check_recompute(policy: RecomputePolicy, hyper_connections: bool | None = None) -> None:
    """What ``parallelize`` runs of a recompute policy: no named ``modules`` (it checkpoints the
    modules its plan or ``recompute_modules`` name by pattern), and the block recompute only for a
    model with hyper-connections (``hyper_connections``; None: not known yet, checked when the
    model is split). Its errors name ``parallelize``'s arguments (``PARALLELIZE_LABELS``)."""
    try:
        if policy.modules is not None and not (policy.block and policy.modules == ("layernorm",)):
            raise ConfigError("{policy} with {recompute_modules}: a model split by parallelize() names the "
                              "selectively recomputed modules by pattern,",
                              "parallelize(recompute_modules=[patterns]) (default: the plan's selective list).",
                              values=dict(policy=policy.name, recompute_modules=list(policy.modules)))
        if hyper_connections is not None:
            policy.check_model(hyper_connections, model_field="hyper_connections")
    except ConfigError as error:
        raise error.relabel(PARALLELIZE_LABELS) from None


def _check_hyper_connections(hyper_connections: int | HyperConnectionSettings | None) -> None:
    """``parallelize(hyper_connections=...)`` named as the caller wrote it (checked before anything
    else, a layout included)."""
    n = hyper_connections
    if n is None or isinstance(n, HyperConnectionSettings):
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"parallelize(hyper_connections={n!r}): the number of residual streams, n >= 1 (1 or None: "
                          "no hyper-connections); use a positive integer such as 4.")


def _hyper_connection_streams(model: nn.Module) -> int:
    settings = getattr(model, "hyper_connection_settings", None)
    return settings.num_residual_streams if settings is not None else 1


def _stage_ranges(planned: PlannedModel, settings: ParallelizeSettings,
                  ) -> tuple[ModelParts | None, list[tuple[int, int]]]:
    """The plan checked against the model at the layout's TP size; the model's parts (None: no
    block list) and each (virtual) stage's ``(start, end)`` block range (``[(0, 0)]`` without one)."""
    model, plan, layout, recompute = planned.model, planned.plan, settings.layout, settings.recompute
    stages = layout.num_virtual_stages
    check_family_layout(model, layout)  # what the family's own module does not run on yet
    check_plan(model, plan, layout.tensor_model_parallel_size)
    check_experts(model, layout)
    family = planned.family
    blocks = settings.blocks if settings.blocks is not None or family is None else family.pipeline.blocks
    parts = _model_parts(model, blocks, pipelined=stages > 1 or recompute.full or layout.sequence_parallel,
                         after_blocks=plan.after_blocks)
    if parts is not None and family is not None and settings.blocks is None:
        family.check_parts(parts, type(model).__name__)
    ranges = split_blocks(len(parts.blocks), stages, settings.pipeline_split, parts.block_path) if parts else [(0, 0)]
    if recompute.selective and not plan.selective:
        raise ConfigError("recompute='selective' needs the modules to checkpoint: pass recompute_modules=[patterns] "
                          "(e.g. ['*.mlp']) or use a plan with a selective list.")
    return parts, ranges


def _tied_aliases(model: nn.Module, materializer: Materializer) -> dict[str, str]:
    """State-dict name -> its tensor's owner's name, for the names of tensors owned under another
    name (tied): ``ParallelModel.global_parameter_name``."""
    return {name: materializer.owner_name(t)
            for name, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))
            if materializer.owner_name(t) != name}


def _output_plan(model: nn.Module, plan: TPPlan, parts: ModelParts | None, tp: int,
                 loss_parallel: bool) -> tuple[TPPlan, bool]:
    """The plan, with the output layer gathering its logits where the plan splits them over the
    vocabulary but ``loss_parallel`` is off; and whether the logits stay split (vocab-parallel loss)."""
    last_parts = parts.last if parts else [n for n, c in model.named_children() if any(True for _ in c.parameters())]
    output_name = _output_layer(model, plan, plan.output or _default_output(model, plan, parts, last_parts))
    output_style = plan.style_of(output_name) if output_name else None
    split_logits = tp > 1 and isinstance(output_style, Column) and not output_style.gather_output
    vocab_parallel = loss_parallel and split_logits
    if split_logits and not loss_parallel:  # gather the logits: the output layer's style first (first match wins)
        if output_style.stride > 1:
            raise ConfigError(f"loss_parallel=False gathers {output_name}'s output, which is split with stride "
                              f"{output_style.stride} (its parts would come out of order): keep loss_parallel=True.")
        layers = {output_name: Column(1, True), **{k: v for k, v in plan.layers.items() if k != output_name}}
        plan = dataclasses.replace(plan, layers=layers)
    return plan, vocab_parallel


def _default_output(model: nn.Module, plan: TPPlan, parts: ModelParts | None, last_parts: list[str]) -> str | None:
    """The logits layer of a plan that names none (``TPPlan.output``): among the linear layers
    after the block list, the one whose weight is tied to a tensor before it (a tied head: the
    parts after the blocks are listed outermost container first, so the last of them is often
    the final norm); else the one the plan splits as a column; else the only one; else the last
    part after the blocks."""
    if parts is None:
        return last_parts[-1] if last_parts else None
    linears = [name for part in last_parts for name, module in model.get_submodule(part).named_modules(prefix=part)
               if linear_dims(module) is not None]
    before = {id(p) for part in parts.first for p in model.get_submodule(part).parameters()}
    tied = [n for n in linears if id(getattr(model.get_submodule(n), "weight", None)) in before]
    columns = [n for n in linears if isinstance(plan.style_of(n), Column)]
    for found in (tied, columns, linears):
        if len(found) == 1:
            return found[0]
    return last_parts[-1] if last_parts else None


def _module_builder(materializer: Materializer, plan: TPPlan, layout: ParallelLayout,
                    root: nn.Module | None = None) -> Callable[..., nn.Module]:
    """``build(name, module, block=False)``: materialise ``module`` under its whole-model ``name``
    and apply the plan to it and its submodules (TP styles, divided attributes, random regions);
    a module met again (shared by several parts) is returned as it is. Under
    sequence parallelism a block runs on this rank's part of the sequence: its linears gather and
    reduce-scatter it, every dropout in it draws this rank's own mask, and its TP-replicated
    parameters (norms, biases after a row layer, hyper-connections) get partial gradients, summed
    over TP by the runtime (megatron's ``sequence_parallel`` mark). PEFT's LoRA layers (injected
    into the recorded model) get their adapters drawn by name, their base split by the plan and
    their adapters placed with it (``adapters.py``); every parameter built here is marked as
    placed (``mark_replicated``)."""
    tp = layout.tensor_model_parallel_size

    def replace(old: Tensor, new: Tensor) -> Tensor:
        key = materializer.meta_id(old)
        if key is not None:
            materializer.replace(key, new)
        return new

    built: set[int] = set()

    def build(name: str, module: nn.Module, block: bool = False) -> nn.Module:
        if id(module) in built:
            return module
        built.add(id(module))
        fill_adapters(module, name, materializer.seed, root if root is not None else module)
        materializer.materialize(name, module)
        split_sequence = block and layout.sequence_parallel and tp > 1
        regions = _gathering_regions(module, name, plan) if split_sequence else {}
        for sub_name, sub in module.named_modules(prefix=name):
            style = plan.style_of(sub_name)
            if style is not None:  # (a LoRA layer's base: its adapters are placed below)
                apply_style(base_of(sub), style, layout, replace, sequence_parallel=split_sequence,
                            gathered=sub_name.rpartition(".")[0] in regions)
            for pattern, attrs in plan.divide.items():
                if _matches(sub_name, pattern):
                    divide_attributes(sub, attrs, tp)
            for pattern, region in plan.random.items():
                if _matches(sub_name, pattern) and not split_sequence:  # (all of the block is, below)
                    random_region(sub, region)
        for layer_name, layer in lora_layers(module, name):
            place_lora(layer_name, layer, layout, root if root is not None else module)
        shard_experts(module, layout)  # this EP rank's experts (nothing without EP)
        if split_sequence:
            for region in regions.values():
                gather_sequence_into(region)
            mark_sequence_parallel_parameters(module)
            random_region(module, "parallel")
            wiring = getattr(module, "hyper_connection_wiring", None)
            if wiring is not None:
                module.hyper_connection_wiring = dataclasses.replace(wiring, sequence_parallel=True)
        mark_replicated(module)  # the rest is whole on every TP rank
        return module

    return build


def _gathering_regions(block: nn.Module, name: str, plan: TPPlan) -> dict[str, nn.Module]:
    """Under sequence parallelism, the modules of ``block`` that gather the sequence for their
    column layers: the parent of each column layer (its attention, its MLP), unless that parent
    is the block itself (OPT's ``fc1``, which then gathers its own input)."""
    regions = {}
    for sub_name, sub in block.named_modules(prefix=name):
        parent = sub_name.rpartition(".")[0]
        if isinstance(plan.style_of(sub_name), Column) and parent != name:
            regions[parent] = block.get_submodule(parent[len(name) + 1:])
    return regions


def _connect_stages(model_parallel: ParallelModel, stage_ends: list[tuple[int, nn.Module, nn.Module]],
                    last_stage: int, sequence_parallel: bool = False) -> None:
    """The hooks of the pipeline contract: a stage's first block takes the previous stage's
    activations, its last block ends the forward before the last stage, and a first-stage part
    run after the blocks is refused (``FirstStageStub``). Under sequence parallelism the blocks
    run on this rank's part of the sequence: it is scattered before the first block and gathered
    after the last (the embeddings, masks and positions before, and the final norm and head after,
    see the whole sequence)."""
    for chunk, (stage, first_block, last_block) in enumerate(stage_ends):
        if sequence_parallel and stage == 0:
            first_block.register_forward_pre_hook(_scatter_hidden, with_kwargs=True)
        if sequence_parallel and stage == last_stage:
            last_block.register_forward_hook(_gather_hidden)
        if stage > 0:  # takes the previous stage's activations
            first_block.register_forward_pre_hook(functools.partial(model_parallel._take_input, chunk),
                                                  with_kwargs=True)
        if stage < last_stage:  # the stage ends here
            last_block.register_forward_hook(functools.partial(model_parallel._stop, chunk))
    for chunk in model_parallel.chunks:
        for stub in chunk.modules():
            if isinstance(stub, FirstStageStub):
                stub.register_forward_pre_hook(model_parallel._stub_called)


def _scatter_hidden(module: nn.Module, args: tuple, kwargs: dict):
    return replace_hidden_states(module, args, kwargs, scatter_sequence,
                                 "sequence parallelism cannot split its sequence")


def _gather_hidden(module: nn.Module, args: tuple, output: Any):
    if isinstance(output, Tensor):
        return gather_replicated_sequence(output)
    return (gather_replicated_sequence(output[0]), *output[1:])


def _mark_shared_embeddings(model_parallel: ParallelModel, materializer: Materializer,
                            tied_across: Iterable[int]) -> None:
    """Mark the tensors of ``tied_across`` (meta ids) that this rank holds: their gradient is summed
    between the first and the last stage."""
    for meta_id in tied_across:
        held = materializer.real.get(meta_id)
        if held is not None and any(p is held for p in model_parallel.parameters()):
            held.shared_embedding = True


def _model_parts(model: nn.Module, blocks: str | None, pipelined: bool, after_blocks: tuple[str, ...] = ()
                 ) -> ModelParts | None:
    """The block list and the parts around it; None when nothing needs them (no pipeline, no full
    recompute, no ``blocks=`` given) and the model has no block list a pipeline could split."""
    if pipelined or blocks is not None:
        return find_parts(model, blocks, after_blocks)
    try:
        return find_parts(model, None, after_blocks)
    except ConfigError:
        return None


def _stage_chunks(model: nn.Module, parts: ModelParts | None, ranges: list[tuple[int, int]],
                  layout: ParallelLayout) -> list[StageChunk]:
    """This rank's (virtual) stages of ``model``, each a chunk holding its blocks, the parts before
    the blocks on the first stage (a ``FirstStageStub`` elsewhere), those after on the last (else
    ``NotOnThisStage``), the parts every stage runs, and the list of what it must build. Without a
    block list the whole model is the one chunk."""
    if parts is None:  # TP and DP only, no block list to split
        return [StageChunk(model, 0, [("", model, False)], {})]
    block_list = model.get_submodule(parts.block_path)
    virtual_stages = layout.local_virtual_stages()
    skeletons = [model] + [chunk_skeleton(model, parts) for _ in virtual_stages[1:]]
    part_modules = {name: model.get_submodule(name) for name in parts.first + parts.last + parts.everywhere}
    last_stage = layout.num_virtual_stages - 1
    chunks = []
    for skeleton, stage in zip(skeletons, virtual_stages):
        start, end = ranges[stage]
        local = {i: parts.blocks[i] for i in range(start, end)}
        set_submodule(skeleton, parts.block_path, stage_block_list(block_list, local))
        cut_per_layer_config(skeleton, parts, start, end)
        builds = []
        for names, here, absent in ((parts.first, stage == 0, FirstStageStub),
                                    (parts.last, stage == last_stage, lambda name, _: NotOnThisStage(name)),
                                    (parts.everywhere, True, None)):
            for name in names:
                set_submodule(skeleton, name, part_modules[name] if here else absent(name, part_modules[name]))
                if here:
                    builds.append((name, part_modules[name], False))
        builds += [(parts.block_name(index), block, True) for index, block in local.items()]
        chunks.append(StageChunk(skeleton, stage, builds, local))
    return chunks


def _recompute_group_name(first: nn.Module, last: nn.Module) -> str:
    return f"{first.hyper_connection_wiring.name}..{last.hyper_connection_wiring.name}"


def _tied_tensors(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> the names of the modules holding it``, for parameters held by several."""
    holders: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name.rpartition(".")[0])
    return {key: names for key, names in holders.items() if len(names) > 1}


def _tied_across_stages(ties: dict[int, list[str]], parts: ModelParts, ranges: list[tuple[int, int]],
                        last_stage: int) -> list[int]:
    """The tied parameters whose holders sit on different (virtual) stages: the first and the last
    (a tied embedding and head), like megatron's embedding group; any other split is refused."""
    def stage_of(module_name: str) -> int:
        prefix = parts.block_path + "."
        if module_name.startswith(prefix):
            index = int(module_name[len(prefix):].split(".")[0])
            return next(stage for stage, (start, end) in enumerate(ranges) if start <= index < end)
        if any(module_name == p or module_name.startswith(p + ".") for p in parts.first):
            return 0
        return last_stage

    across = []
    for key, holders in ties.items():
        stages = {stage_of(name) for name in holders}
        if len(stages) == 1:
            continue
        if stages != {0, last_stage}:
            raise ConfigError(f"{', '.join(holders)} share a parameter across pipeline stages {sorted(stages)}; only a "
                              "tie between the first and the last stage (embedding and head) is kept in sync. Change "
                              "pipeline_split so the holders share a stage.")
        across.append(key)
    return across


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _attach_router_loss(model_parallel: ParallelModel, model: nn.Module, layout: ParallelLayout) -> None:
    """The family's own router loss (``Family.router_loss``) where the model's config asks for it:
    the model's forward then leaves its own out (each stage would take it over its layers only)."""
    family = family_of(model)
    router_loss = router_loss_for(list(model_parallel.chunks), family.router_loss if family else None,
                                  getattr(model, "config", None), layout)
    if router_loss is not None:
        model_parallel.router_loss = router_loss
        if router_loss.active:
            model_parallel.forward_kwargs = {**model_parallel.forward_kwargs, "output_router_logits": False}


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every stage forward gets: no KV cache for a model that would make one."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters else {}


def build_recorded_module(model: nn.Module, seed: int = 0, init_fn: InitFn | None = None,
                          blocks: str | None = None) -> nn.Module:
    """The whole recorded ``model`` materialised in this process, in place, with the weights every
    layout of :func:`parallelize` (same ``seed`` and ``init_fn``) draws: the unmodified model for
    one-process reference runs, evaluation and export."""
    model = unwrap_peft_model(model)
    if not is_meta(model):
        raise ConfigError(f"build_recorded_module() takes a model built inside `with record_module_init():`; "
                          f"this {type(model).__name__} is materialised already.")
    parts = _model_parts(model, blocks, pipelined=False)
    materializer = Materializer(model, seed, init_fn)
    if parts is None:  # as parallelize() at TP = PP = 1
        fill_adapters(model, "", seed, model)
        materializer.materialize("", model)
        return model
    for name in parts.first + parts.last + parts.everywhere:
        fill_adapters(model.get_submodule(name), name, seed, model)
        materializer.materialize(name, model.get_submodule(name))
    for index, block in enumerate(parts.blocks):
        fill_adapters(block, parts.block_name(index), seed, model)
        materializer.materialize(parts.block_name(index), block)
    return model
