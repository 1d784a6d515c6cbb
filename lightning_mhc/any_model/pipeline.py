"""Splitting a model as written into pipeline stages.

The model's repeated block list (a ``ModuleList`` / ``Sequential`` of modules of one class; the
one with the most parameters, or the one named) is cut into consecutive runs of blocks, one per
(virtual) pipeline stage. Everything else hangs off the *containers* on the path from the root to
the block list; each of their other children is a *part* of the model:

- parts registered before the block list (embeddings) live on the first stage; later stages get a
  stub that returns zeros of the right shape (the model's forward still runs there: it builds the
  masks and position encodings the blocks need, and the stage's first block takes the received
  activations instead of what the stub produced);
- parts registered after it (final norm, head) live on the last stage; earlier stages stop after
  their last block, so they never run them;
- the order is the registration order (``__init__``), as in most Hugging Face models; a part
  registered before the block list that runs after it (OPT's ``final_layer_norm``) is named in
  the plan's ``after_blocks``; a part that runs on the other side of the blocks than it is placed
  is refused when it runs (a stub called after the blocks, a last-stage part called before them),
  naming it;
- parts without parameters (dropout, rotary tables) live on every stage.

A stage is the model's own root object (or a shallow copy of the containers, for the extra chunks
of a virtual pipeline) whose block list holds this stage's blocks under their global indices, so
state-dict names stay those of the whole model.
"""
from __future__ import annotations

import copy
import fnmatch
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.errors import ConfigError


@dataclass
class ModelParts:
    """The layout of a model around its block list (see the module docstring)."""

    block_path: str
    """Name of the block list, e.g. ``transformer.h``."""
    containers: list[str]
    """The root (``""``) and every module between it and the block list, outermost first."""
    blocks: list[nn.Module]
    first: list[str]
    """Parts with parameters before the block list (first stage only)."""
    last: list[str]
    """Parts with parameters after the block list (last stage only)."""
    everywhere: list[str]
    """Parts without parameters (every stage)."""

    def block_name(self, index: int) -> str:
        return f"{self.block_path}.{index}"


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
            and len({type(c) for c in children}) == 1)


def find_parts(root: nn.Module, blocks: str | None = None, after_blocks: tuple[str, ...] = ()) -> ModelParts:
    """The block list (``blocks``, or found) and the parts around it (``after_blocks``: patterns of
    parts that run after the blocks wherever they are registered)."""
    modules = dict(root.named_modules())
    if blocks is None:
        candidates = [name for name, m in modules.items() if _is_block_list(m)]
        if not candidates:
            raise ConfigError(
                f"{type(root).__name__} has no list of repeated blocks (a ModuleList or Sequential of at least two "
                "modules of one class) to split into pipeline stages: name it with blocks='<module name>'.")
        blocks = max(candidates, key=lambda n: sum(p.numel() for p in modules[n].parameters()))
    elif blocks not in modules or not isinstance(modules[blocks], (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"blocks={blocks!r} is not a ModuleList or Sequential of {type(root).__name__}; "
                          "name the list of repeated transformer blocks (print(model) shows it).")
    path = blocks.split(".")
    containers = [".".join(path[:i]) for i in range(len(path))]
    first, last, everywhere = [], [], []
    for container in containers:
        module = modules[container]
        direct = [n for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]
        if direct:
            raise ConfigError(
                f"{container or 'the root'} ({type(module).__name__}) holds tensors itself ({', '.join(direct)}) and "
                f"contains the block list {blocks}, so no pipeline stage can own them: move them into a submodule "
                "(e.g. an nn.Embedding or a small module with the parameter).")
        on_path = path[len(container.split(".")) if container else 0]
        seen_path = False
        for child_name, child in module.named_children():
            full = f"{container}.{child_name}" if container else child_name
            if child_name == on_path:
                seen_path = True
                continue
            if not any(True for _ in child.parameters()):
                everywhere.append(full)
            else:
                runs_after = seen_path or any(fnmatch.fnmatchcase(full, p) for p in after_blocks)
                (last if runs_after else first).append(full)
    return ModelParts(blocks, containers, list(modules[blocks].children()), first, last, everywhere)


def split_blocks(num_blocks: int, num_stages: int, pipeline_split: list[int] | list[str] | None,
                 block_path: str) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges per (virtual) stage: balanced (earlier stages take the extra
    blocks), or ``pipeline_split`` as blocks per stage or as the names of the blocks that begin
    stages 1, 2, ..."""
    if isinstance(pipeline_split, (str, int)):
        raise ConfigError(f"pipeline_split={pipeline_split!r}: give a list, of blocks per stage or of the names of the "
                          f"blocks that begin stages 1, 2, ... (e.g. ['{block_path}.2']).")
    if pipeline_split is None:
        if num_blocks < num_stages:
            raise ConfigError(f"{num_blocks} blocks cannot fill {num_stages} pipeline stages (PP x virtual "
                              "pipeline): use fewer stages.")
        q, r = divmod(num_blocks, num_stages)
        sizes = [q + (1 if i < r else 0) for i in range(num_stages)]
    elif all(isinstance(s, int) for s in pipeline_split):
        sizes = list(pipeline_split)
        if len(sizes) != num_stages or sum(sizes) != num_blocks or min(sizes) < 1:
            raise ConfigError(f"pipeline_split={pipeline_split}: give {num_stages} positive block counts summing to "
                              f"{num_blocks} (one per pipeline stage).")
    else:
        starts = []
        for name in pipeline_split:
            prefix = block_path + "."
            index = name[len(prefix):] if isinstance(name, str) and name.startswith(prefix) else None
            if index is None or not index.isdigit() or not 0 < int(index) < num_blocks:
                raise ConfigError(f"pipeline_split entry {name!r} is not a block after the first ({prefix}1 .. "
                                  f"{prefix}{num_blocks - 1}): name the blocks that begin stages 1, 2, ...")
            starts.append(int(index))
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)):
            raise ConfigError(f"pipeline_split={pipeline_split}: name {num_stages - 1} distinct blocks in order, the "
                              "first block of each stage after the first.")
        bounds = [0, *starts, num_blocks]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


class StageBlocks(nn.ModuleList):
    """A stage's blocks under their indices in the whole model (``h.4``, ``h.5``): indexing,
    slicing and iterating go by position, as the model's own loop expects."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, index):
        values = list(self._modules.values())
        return nn.ModuleList(values[index]) if isinstance(index, slice) else values[index]


def stage_block_list(original: nn.Module, blocks: dict[int, nn.Module]) -> nn.Module:
    if isinstance(original, nn.Sequential):  # Sequential indexes and slices by position already
        return type(original)(OrderedDict((str(i), b) for i, b in blocks.items()))
    return StageBlocks(blocks)


class FirstStageStub(nn.Module):
    """Stands in for a first-stage part on later stages: zeros of the part's output shape (their
    values are never used: the stage's first block takes the received activations)."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.part_name = name
        self.replaces_linear = isinstance(module, nn.Linear)
        if isinstance(module, nn.Embedding):
            self.width = module.embedding_dim
        elif self.replaces_linear:
            self.width = module.out_features
        else:
            raise ConfigError(
                f"{name} ({type(module).__name__}) is registered before the block list, so it is placed on the first "
                "stage and later stages need a stand-in for it; only nn.Embedding and nn.Linear have one. If it runs "
                f"after the blocks, name it in the plan's after_blocks (TPPlan(after_blocks=('{name}',))); else run "
                "with pipeline_model_parallel_size=1, or move it into the first block.")
        dtype = next(module.parameters()).dtype
        self.register_buffer("dtype_probe", torch.zeros(0, dtype=dtype), persistent=False)

    def forward(self, input_: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # an embedding's input is indices of any dtype (OPT's positions take the attention mask)
        shape = input_.shape[:-1] if self.replaces_linear else input_.shape
        return torch.zeros(*shape, self.width, dtype=self.dtype_probe.dtype, device=input_.device)


class NotOnThisStage(nn.Module):
    """Stands in for a last-stage part on earlier stages (they stop after their last block)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.part_name = name

    def forward(self, *args, **kwargs):
        # a stage before the last stops after its last block: a call here comes before the blocks
        raise ConfigError(
            f"{self.part_name} is registered after the block list, so it was placed on the last pipeline stage, but "
            "the model's forward runs it before its blocks: register it before the block list in the model's "
            "__init__ (parts are placed by registration order).")


def replace_hidden_states(module: nn.Module, args: tuple, kwargs: dict, fn, purpose: str) -> tuple[tuple, dict]:
    """A forward pre-hook's ``(args, kwargs)`` with the module's activations (its first positional
    argument, or ``hidden_states``, as Hugging Face blocks and attentions take them) replaced by
    ``fn(activations)``; ``purpose``: what needed them, for the error when there are none."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise RuntimeError(f"{type(module).__name__} was called without a positional or 'hidden_states' input: {purpose}")


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    root.get_submodule(parent_name)._modules[child] = module


def chunk_skeleton(root: nn.Module, parts: ModelParts) -> nn.Module:
    """A shallow copy of ``root`` with fresh copies of the containers on the block path (so one
    chunk's parts and blocks can differ from another's); the parts themselves are shared."""
    skeleton = copy.copy(root)
    _detach_dicts(skeleton)
    parent = skeleton
    for container in parts.containers[1:]:
        child_name = container.rsplit(".", 1)[-1]
        child = copy.copy(parent._modules[child_name])
        _detach_dicts(child)
        parent._modules[child_name] = child
        parent = child
    return skeleton


def cut_per_layer_config(skeleton: nn.Module, parts: ModelParts, start: int, end: int) -> None:
    """The containers' config as this stage sees it: a model whose loop picks each block's mask by
    its position (Hugging Face's ``config.layer_types[i]`` over ``enumerate(self.layers)``) must
    find the stage's blocks' entries at the stage's positions. Each container holding a ``config``
    gets its own copy in which every per-layer list (a list or tuple with one entry per block) is
    cut to ``[start, end)``; the blocks keep the whole config."""
    total = len(parts.blocks)
    if (start, end) == (0, total):
        return
    cut: dict[int, Any] = {}
    for name in parts.containers:
        container = skeleton.get_submodule(name)
        config = container.__dict__.get("config")
        if config is None or not hasattr(config, "__dict__"):
            continue
        if id(config) not in cut:
            own = copy.copy(config)
            for attr, value in vars(config).items():
                if isinstance(value, (list, tuple)) and len(value) == total:
                    setattr(own, attr, type(value)(value[start:end]))
            cut[id(config)] = own
        container.__dict__["config"] = cut[id(config)]


def _detach_dicts(module: nn.Module) -> None:
    for attr in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        if attr in module.__dict__:
            module.__dict__[attr] = copy.copy(module.__dict__[attr])


# ------------------------------------------------------------------ the pipeline pass
@dataclass(frozen=True)
class StagePlan:
    """Where the stages fall, known before anything is built (``check_parallelize`` stops here):
    the model's parts (None: no block list, the whole model is one stage) and each (virtual)
    stage's ``[start, end)`` blocks (``[(0, 0)]`` without a block list)."""

    parts: ModelParts | None
    ranges: list[tuple[int, int]]


@dataclass
class StageSplit:
    """The model cut into this rank's (virtual) stages: what crosses them, the tied tensors kept in
    sync between the first and the last, and this rank's chunks (on the meta device until built)."""

    plan: StagePlan
    hidden_size: int
    """What crosses the stages: the model's hidden size times its residual streams."""
    tied_across_stages: list[int]
    chunks: list[StageChunk]


@dataclass
class StageChunk:
    """One of this rank's chunks: its module (on the meta device until built), its (virtual) stage,
    the modules it builds (whole-model name, module, whether it is a block) and its blocks by index."""

    module: nn.Module
    stage: int
    builds: list[tuple[str, nn.Module, bool]]
    blocks: dict[int, nn.Module]



def plan_stages(model: nn.Module, layout: ParallelLayout, blocks: str | None,
                pipeline_split: list[int] | list[str] | None, after_blocks: tuple[str, ...], recompute_full: bool,
                ) -> StagePlan:
    """The pipeline pass's checks: the block list (``blocks``, or found) and the parts around it,
    and each (virtual) stage's blocks. A block list is looked for even without a pipeline (full
    recompute and sequence parallelism run on it), and a model without one is a single stage."""
    stages = layout.num_virtual_stages
    parts = model_parts(model, blocks, pipelined=stages > 1 or recompute_full or layout.sequence_parallel,
                        after_blocks=after_blocks)
    ranges = split_blocks(len(parts.blocks), stages, pipeline_split, parts.block_path) if parts else [(0, 0)]
    return StagePlan(parts, ranges)


def split_stages(model: nn.Module, plan: StagePlan, layout: ParallelLayout, hidden_size: int | None,
                 streams: int) -> StageSplit:
    """The pipeline pass: the block list cut into the (virtual) stages of ``plan``, and this rank's
    chunks made of its stages' blocks and parts (on the meta device: the tensor-parallel pass
    builds them). What needs the whole model is read first: the cut changes it (the first chunk
    is the recorded model itself, holding only its blocks)."""
    parts, ranges = plan.parts, plan.ranges
    hidden = _hidden_size(model, parts, hidden_size) if parts else hidden_size or 0
    last_stage = layout.num_virtual_stages - 1
    across = _tied_across_stages(_tied_tensors(model), parts, ranges, last_stage) if parts else []
    return StageSplit(plan, hidden * streams, across, _stage_chunks(model, parts, ranges, layout))  # n streams cross


def model_parts(model: nn.Module, blocks: str | None, pipelined: bool, after_blocks: tuple[str, ...] = ()
                 ) -> ModelParts | None:
    """The block list and the parts around it; None when nothing needs them (no pipeline, no full
    recompute, no ``blocks=`` given) and the model has no block list a pipeline could split."""
    if pipelined or blocks is not None:
        return find_parts(model, blocks, after_blocks)
    try:
        return find_parts(model, None, after_blocks)
    except ConfigError:
        return None


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

