"""Per-rank element counts of a Hugging Face model under a layout, from its config alone.

The model is the one ``parallelize`` takes: recorded on the meta device (no weights read, nothing
allocated). Its parts are placed by ``parallelize``'s own passes, run on meta copies of each
the model's modules: its checks (``plan_parallelize``: the family's TP plan, the hyper-connections
added, where the stages fall), the tensor-parallel pass's builder (``module_builder``: each plan
style cutting its module, the experts cut to an EP rank's) and the family's own TP step
(``FamilyRecord.tensor_parallel``: DeepSeek-V4's per-head sinks and grouped output projection).
What each rank then holds is counted, so the placement rules are written once, where the runtime
applies them; the counts become bytes by the rules the mHC GPT's do (``memory.rank_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import placement_of
from lightning_mhc.planning.memory import FP32, HeldTensor, RankBytes, StageCount, rank_bytes


@dataclass(frozen=True)
class _RankPlace:
    """What the builders read of a layout to cut one rank's tensors: its sizes and a rank of each
    (every TP and EP rank holds slices of one size). No process group: the hooks the builders
    register name one and never run here."""

    tensor_model_parallel_size: int
    expert_model_parallel_size: int
    tensor_model_parallel_rank: int = 0
    expert_model_parallel_rank: int = 0
    context_parallel_size: int = 1
    sequence_parallel: bool = False  # (the sequence's split changes no tensor's shape)
    tp_group: Any = None
    ep_group: Any = None


class _MetaMaterializer:
    """The builder's materializer, on the meta device: nothing is drawn; a tensor cut already keeps
    its slice in every module that holds it (a tied embedding and head on one stage are one tensor,
    as ``record.Materializer`` hands each holder the tensor made for the first)."""

    seed = 0

    def __init__(self) -> None:
        self.real: dict[int, nn.Parameter] = {}
        self._meta_of: dict[int, int] = {}

    def materialize(self, name: str, module: nn.Module) -> None:
        for sub in module.modules():
            for attr, tensor in list(sub._parameters.items()):
                if tensor is not None and id(tensor) in self.real:
                    sub._parameters[attr] = self.real[id(tensor)]
                elif tensor is not None:
                    self._meta_of.setdefault(id(tensor), id(tensor))

    def meta_id(self, tensor) -> int | None:
        return self._meta_of.get(id(tensor))

    def replace(self, meta_id: int, new) -> None:
        self.real[meta_id] = new
        self._meta_of[id(new)] = meta_id


def hf_stage_counts(model: nn.Module, layout: ParallelLayout, *, plan: Any = "auto", hyper_connections: Any = None,
                    pipeline_split: list[int] | list[str] | None = None, recompute: Any = "none") -> list[StageCount]:
    """One :class:`StageCount` per physical pipeline stage of ``layout`` for ``model`` (recorded on
    the meta device, e.g. ``any_model.record.recorded_hf_model``; hyper-connections are added
    to it, as ``parallelize`` does). The model is cut in place, as ``parallelize`` cuts it: record
    one per call. Refused as ``parallelize`` refuses (ConfigError)."""
    from lightning_mhc.any_model.model import ParallelizeSettings, plan_parallelize
    from lightning_mhc.any_model.tensor_parallel import module_builder

    settings = ParallelizeSettings(layout, plan, pipeline_split=pipeline_split, recompute=recompute,
                                   hyper_connections=hyper_connections)
    planned = plan_parallelize(model, settings)
    model, parts, ranges = planned.model, planned.stages.parts, planned.stages.ranges
    family_split = planned.family.tensor_parallel if planned.family is not None else None
    tp, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    place = _RankPlace(tp, ep)
    p, v = layout.pipeline_model_parallel_size, layout.num_virtual_stages // layout.pipeline_model_parallel_size
    build = module_builder(_MetaMaterializer(), planned.plan, place, model)
    stages = []
    for stage in range(p):
        chunks = [c * p + stage for c in range(v)]  # megatron's interleaved assignment, as the runtime's
        held = []
        for virtual in chunks:
            named = _stage_modules(model, parts, ranges, [virtual], layout.num_virtual_stages - 1)
            for name, module in named:  # each module is on one stage only: cut in place
                build(name, module)
                if family_split is not None and tp > 1:
                    family_split(module, place)
            # each tensor once (a tie on one chunk), in the chunk's parameter order
            held.append(list(nn.ModuleList([module for _, module in named]).parameters()))
        stages.append((stage, chunks, held))
    # a tensor on two stages (a tie across them): the runtime gives each copy a bucket of its own
    stages_of: dict[int, set[int]] = {}
    for stage, _, held in stages:
        for param in (p for chunk in held for p in chunk):
            stages_of.setdefault(id(param), set()).add(stage)
    counts = []
    for stage, chunks, held in stages:
        listed = tuple(tuple(HeldTensor(param.numel(), placement_of(param).expert,
                                        len(stages_of[id(param)]) > 1) for param in chunk) for chunk in held)
        flat = [t for chunk in listed for t in chunk]
        # an EP rank's experts (megatron's allreduce=False) are reduced over the expert-data ranks
        counts.append(StageCount(stage, tuple(ranges[c] for c in chunks), sum(t.numel for t in flat if not t.expert),
                                 sum(t.numel for t in flat if t.expert), len(flat), listed))
    return counts


def _stage_modules(model: nn.Module, parts, ranges: list[tuple[int, int]], chunks: list[int],
                   last: int) -> list[tuple[str, nn.Module]]:
    """The modules one physical stage builds, by whole-model name (``pipeline._stage_chunks``'
    ``builds``): the parts before the blocks on the first stage, those after on the last, the
    stage's blocks; the whole model when it has no block list."""
    if parts is None:
        return [("", model)]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    named = []
    for virtual in chunks:
        chunk = [(name, model.get_submodule(name)) for name in parts.first] if virtual == 0 else []
        start, end = ranges[virtual]
        chunk += [(parts.block_name(i), parts.blocks[i]) for i in range(start, end)]
        if virtual == last:
            chunk += [(name, model.get_submodule(name)) for name in parts.last]
        # in the model's order, as the runtime's chunk (the model holding its share) lists them:
        # ZeRO-1's buckets follow it
        named += sorted(chunk, key=lambda item: order[item[0]])
    return named


def plan_hf(model: nn.Module, layout: ParallelLayout, *, param_bytes: int = FP32, distributed_optimizer: bool = False,
            bucket_bytes: int | None = None, **parallelize_args: Any) -> list[RankBytes]:
    """Each stage's per-rank bytes of ``model`` (recorded on the meta device; cut in place):
    :func:`hf_stage_counts` (``parallelize_args``: its ``plan``, ``hyper_connections``,
    ``pipeline_split``, ``recompute``) in bytes by ``memory.rank_bytes``."""
    sizes = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return rank_bytes(hf_stage_counts(model, layout, **parallelize_args), layout, param_bytes=param_bytes,
                      distributed_optimizer=distributed_optimizer, **sizes)
