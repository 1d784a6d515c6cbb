"""``parallelize``: this rank's TP x PP part of a model as written (a :class:`ParallelModel`,
``parallel_model.py``), and ``check_parallelize``, everything it refuses before launch.

    with record_module_init():
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4))
    model = parallelize(model, plan="gpt2", layout=self.layout)   # in a LightningModule's configure_model

Each rank materialises only the blocks of its stage(s) and the parts around them that it runs,
each tensor drawn whole from the generator of its name and cut to this rank's TP slice
(``record.py``, ``tensor_parallel.py``), so the weights equal those of the whole model
materialised in one process with the same seed (:func:`build_recorded_module`).

``parallelize`` conducts passes, one per dimension, each a function in the file of its dimension
that owns its checks; the model's family record (``families.py``) says what the family has (its
TP plan, its pipeline contract, CP, its experts, its router loss), and each pass asks it. First
what is checked before anything is built (:func:`plan_parallelize`, which ``check_parallelize``
runs too): the plan (``families.resolve_plan``), the hyper-connections
(``hyper_connections.apply_hyper_connections``), the recompute policy
(``recompute.check_recompute``), the TP plan (``plan.check_plan``), the experts
(``experts.check_experts``), the stages (``pipeline.plan_stages``) and the record's pipeline
contract (``FamilyRecord.check_parts``), the logits layer (``tensor_parallel.output_plan``), the
router bias's update (``router_bias.check_router_bias``). Then the passes that build: context parallel
(``context_parallel.split_over_context``), the pretrained files checked (``weights.check_weights``),
the stages cut (``pipeline.split_stages``), tensor (+ sequence) parallel with the experts sharded
(``tensor_parallel.apply_tensor_parallel``), the built chunks as one :class:`ParallelModel` with
its side of the pipeline contract (``ParallelModel.connect_stages``), the family's router loss
and the update of its routers' bias,
the weights read (``weights.load_weights``), the recompute
(``recompute.apply_recompute``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.any_model.adapters import fill_adapters, unwrap_peft_model
from lightning_mhc.any_model.context_parallel import check_context_parallel, split_over_context
from lightning_mhc.any_model.experts import check_experts
from lightning_mhc.any_model.families import (FamilyRecord, check_family_layout, check_family_stages, family_of,
                                             finish_family_chunks, native_stream_count, plan_family,
                                             recomputes_own_streams, resolve_plan)
from lightning_mhc.any_model.hyper_connections import (
    HyperConnectionPlan, HyperConnectionSettings, apply_hyper_connections, check_stream_count, hyper_connection_streams)
from lightning_mhc.any_model.parallel_model import MaterializedReport, ParallelModel, stage_forward_kwargs
from lightning_mhc.any_model.pipeline import ModelParts, StagePlan, model_parts, plan_stages, split_stages
from lightning_mhc.any_model.plan import TPPlan, check_plan
from lightning_mhc.any_model.record import InitFn, Materializer, check_recorded, is_meta
from lightning_mhc.any_model.recompute import apply_recompute, check_recompute, check_selective
from lightning_mhc.any_model.router_bias import check_router_bias
from lightning_mhc.any_model.tensor_parallel import apply_tensor_parallel, output_plan
from lightning_mhc.any_model.weights import check_weights, load_weights
from lightning_mhc.errors import ConfigError
from lightning_mhc.recompute.policy import RecomputePolicy

log = logging.getLogger("lightning_mhc.any_model")


@dataclass(frozen=True)
class ParallelizeSettings:
    """What :func:`parallelize` is asked for, in one value the conductor reads: its keyword
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
    router_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        check_stream_count(self.hyper_connections)  # named as the caller wrote it, before anything else
        object.__setattr__(self, "recompute", RecomputePolicy.of(self.recompute))



@dataclass(frozen=True)
class PlannedModel:
    """What the checks before building found (:func:`plan_parallelize`): the recorded model (with
    its hyper-connections), its TP plan (resolved: a family's by name, ``recompute_modules`` in,
    the logits layer gathering where ``loss_parallel`` is off), the family's record where the plan
    is a family's, its residual streams, where its stages fall, and whether the logits stay split
    over the vocabulary."""

    model: nn.Module
    plan: TPPlan
    family: FamilyRecord | None
    streams: int
    stages: StagePlan
    vocab_parallel_logits: bool


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
    router_bias_update_rate: float = 0.0,
) -> ParallelModel:
    """This rank's part of ``model`` (built under :func:`record_module_init`) on ``layout``: the
    run's (a LightningModule's ``self.layout``, a strategy's ``layout``); a layout not built yet,
    ``ParallelLayout(tensor_model_parallel_size=2, ...)``, is built here, over the initialised
    default process group; None: the one-process layout (``single_process_layout()``).

    A conductor of passes, one per dimension, each in the file of its dimension and owning its
    checks (see the module docstring); the settings in one value (:class:`ParallelizeSettings`).

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
        router_bias_update_rate: auxiliary-free balancing of a family whose routers carry a
            score-correction bias (DeepSeek-V4's): each step the bias moves by this towards the
            mean load (megatron's ``moe_router_bias_update_rate``, e.g. 1e-3); 0, the default, as
            transformers trains: the bias stays as loaded (``router_bias.py``).
    """
    settings = ParallelizeSettings(
        layout if layout is not None else ParallelLayout(), plan, blocks, pipeline_split, seed, init_fn, recompute,
        recompute_modules, hidden_size, loss_parallel, weights, hyper_connections, hyper_connection_plan,
        router_bias_update_rate)
    if not settings.layout.is_built:  # the settings checked first, then the groups made
        built = settings.layout.build() if layout is not None else single_process_layout()
        settings = dataclasses.replace(settings, layout=built)
    planned = plan_parallelize(model, settings)
    model, layout, tp = planned.model, settings.layout, settings.layout.tensor_model_parallel_size
    sequence_split = split_over_context(model, layout)  # the attention through CP, by transformers' registry
    weights = check_weights(model, settings.weights) if settings.weights is not None else None
    materializer = Materializer(model, settings.seed, settings.init_fn,
                                loaded=weights.tensor_ids if weights is not None else None)
    aliases, whole_parameters = materializer.aliases(model), _unique_numel(model)  # read before the cut
    streams = planned.streams * native_stream_count(model)  # added or the family's own: they cross the stages
    split = split_stages(model, planned.stages, layout, settings.hidden_size, streams)
    apply_tensor_parallel(split.chunks, materializer, planned.plan, layout, model)
    modules = [chunk.module for chunk in split.chunks]
    parts = planned.stages.parts
    finish_family_chunks(model, modules, parts.block_path if parts else None, layout,  # the family's own pass
                         block_recompute=settings.recompute.block)
    report = MaterializedReport(_unique_numel(nn.ModuleList(modules)), whole_parameters, tp,
                                layout.pipeline_model_parallel_size)
    model_parallel = ParallelModel(modules, layout.num_virtual_stages, split.hidden_size,
                                   planned.vocab_parallel_logits, aliases, report, stage_forward_kwargs(model),
                                   settings.recompute, tp if layout.sequence_parallel else 1, sequence_split)
    model_parallel.seed = settings.seed  # what adapters injected later are drawn from (place_adapters)
    model_parallel.connect_stages(split, materializer, layout)
    model_parallel.attach_router_loss(model, layout)
    model_parallel.attach_router_bias(model, settings.router_bias_update_rate, layout)
    if weights is not None:
        load_weights(model_parallel, weights, layout)
    log.info("rank %d (tp %d, pp %d): %s", _global_rank(), layout.tensor_model_parallel_rank,
             layout.pipeline_model_parallel_rank, model_parallel.report)
    apply_recompute(split.chunks, settings.recompute, planned.plan, streams, parts.block_path if parts else None)
    return model_parallel


def plan_parallelize(model: nn.Module, settings: ParallelizeSettings) -> PlannedModel:
    """The passes' checks, run before anything is built (``check_parallelize`` runs them on a
    layout not built yet): the recorded model (refused if not on the meta device) and its TP plan,
    the hyper-connections added to it (they change what is split), the recompute policy against
    them, the TP plan and the experts against the model, where the stages fall, and the logits
    layer."""
    model = unwrap_peft_model(model)  # PEFT's LoRA injected into the recorded model: split with it
    check_recorded(model)
    plan = resolve_plan(settings.plan, model)
    if settings.recompute_modules is not None:
        plan = dataclasses.replace(plan, selective=tuple(settings.recompute_modules))
    family = plan_family(settings.plan, model)
    streams = apply_hyper_connections(model, settings.hyper_connections, settings.hyper_connection_plan, settings.seed)
    check_recompute(settings.recompute, hyper_connections=streams > 1, native_streams=native_stream_count(model),
                    native_block_recompute=recomputes_own_streams(model))
    layout = settings.layout
    check_family_layout(model, layout)  # what the family's own modules do not run on yet
    check_plan(model, plan, layout.tensor_model_parallel_size)
    check_experts(model, layout)
    by_record = family is not None and settings.blocks is None  # the record's pipeline contract names the blocks
    stages = plan_stages(model, layout, family.pipeline.blocks if by_record else settings.blocks,
                         settings.pipeline_split, plan.after_blocks, settings.recompute.full)
    if by_record:
        family.check_parts(stages.parts, type(model).__name__)  # the contract against the split found
    check_family_stages(model, stages.ranges)  # what the family's own blocks cannot begin a stage with
    check_selective(settings.recompute, plan)
    check_router_bias(settings.router_bias_update_rate, family_of(model), model)
    plan, vocab_parallel = output_plan(model, plan, stages.parts, layout.tensor_model_parallel_size,
                                       settings.loss_parallel)
    return PlannedModel(model, plan, family, streams, stages, vocab_parallel)


def check_parallelize(model: nn.Module, plan: str | TPPlan | Mapping[str, Any] | None = None, *,
                      layout: ParallelLayout, blocks: str | None = None,
                      pipeline_split: list[int] | list[str] | None = None, seed: int = 0,
                      recompute: str | RecomputePolicy = "none",
                      recompute_modules: tuple[str, ...] | list[str] | None = None,
                      hyper_connections: int | HyperConnectionSettings | None = None,
                      hyper_connection_plan: str | HyperConnectionPlan | Mapping[str, Any] = "auto",
                      router_bias_update_rate: float = 0.0,
                      ) -> tuple[TPPlan, ModelParts | None, list[tuple[int, int]]]:
    """Everything :func:`parallelize` refuses, before anything is built (the CLI runs it before
    launch, on a layout not built yet): the passes' checks (:func:`plan_parallelize`) and the
    context-parallel pass's, on a copy of the recorded model when hyper-connections are added (a
    check changes nothing). Returns the checked plan, the model's parts and each (virtual) stage's
    block range (of the copy, if one was made)."""
    settings = ParallelizeSettings(layout, plan, blocks, pipeline_split, seed, recompute=recompute,
                                   recompute_modules=recompute_modules, hyper_connections=hyper_connections,
                                   hyper_connection_plan=hyper_connection_plan,
                                   router_bias_update_rate=router_bias_update_rate)
    recorded = unwrap_peft_model(model)
    if HyperConnectionSettings.of(hyper_connections).enabled and hyper_connection_streams(recorded) == 1 \
            and is_meta(recorded):
        model = copy.deepcopy(recorded)  # meta: nothing is allocated
    planned = plan_parallelize(model, settings)
    check_context_parallel(planned.model, settings.layout)
    return planned.plan, planned.stages.parts, planned.stages.ranges


def build_recorded_module(model: nn.Module, seed: int = 0, init_fn: InitFn | None = None,
                          blocks: str | None = None) -> nn.Module:
    """The whole recorded ``model`` materialised in this process, in place, with the weights every
    layout of :func:`parallelize` (same ``seed`` and ``init_fn``) draws: the unmodified model for
    one-process reference runs, evaluation and export."""
    model = unwrap_peft_model(model)
    if not is_meta(model):
        raise ConfigError(f"build_recorded_module() takes a model built inside `with record_module_init():`; "
                          f"this {type(model).__name__} is materialised already.")
    parts = model_parts(model, blocks, pipelined=False)
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



def _unique_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
