"""Applying a plan's styles to materialised modules, in place.

Each split module keeps its class, its parameter names and its weight's orientation (a
``Conv1D`` weight stays ``[in, out]``); only its tensors become this rank's slices, its size
attributes shrink, and its forward gains megatron-core's tensor-parallel mappings
(``copy_to`` / ``reduce_from_tensor_model_parallel_region``; an all-gather of our own for a
gathered output) over the layout's TP group. The slices are placed as split (``ParameterPlacement``, kept in megatron's own
attributes), which gradient reduction, the global gradient norm and the reshardable checkpoints
read, as they do for the mHC GPT's megatron layers.

Why megatron's mappings and attributes rather than DTensor: the rest of the runtime (the 1F1B
schedule, DP reduction, clipping, checkpoints) speaks them, they run on gloo and NCCL alike, and
the model's own modules keep running their own code on plain tensors.

The tensor-parallel pass (:func:`apply_tensor_parallel`) builds this rank's chunks: each module
materialised (its tensors drawn whole from the generator of its name), then cut by the plan.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import types
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.errors import ConfigError
from lightning_mhc.layers.sequence_parallel import (
    all_gather_sequence,
    mark_sequence_parallel_parameters,
    reduce_scatter_sequence,
    sequence_mapping,
    split_sequence,
)
from lightning_mhc.any_model.adapters import fill_adapters, lora_layers, place_lora
from lightning_mhc.any_model.pipeline import ModelParts, replace_hidden_states
from lightning_mhc.any_model.placement import Placement, shard
from lightning_mhc.any_model.plan import (
    Column, Replicate, ReplicateOnSplit, Row, Style, TPPlan, VocabEmbedding, base_of, linear_dims)
from lightning_mhc.recompute.rng import rng_fork
from lightning_mhc.distributed.placement import mark_replicated, place, placement_of
from lightning_mhc.any_model.experts import shard_experts
from lightning_mhc.roles import assign_roles
from lightning_mhc.wrapping import wrap
from lightning_mhc.any_model.hyper_connections import wire_sequence_parallel

if TYPE_CHECKING:
    from lightning_mhc.any_model.pipeline import StageChunk
    from lightning_mhc.any_model.record import Materializer






def _sharded_parameter(param: torch.Tensor, dim: int, stride: int, layout: ParallelLayout) -> nn.Parameter:
    tp, rank = layout.tensor_model_parallel_size, layout.tensor_model_parallel_rank
    local = nn.Parameter(shard(param.detach(), dim, stride, tp, rank), requires_grad=param.requires_grad)
    place(local, placed=True, split_dim=dim, stride=stride)
    return local


def apply_style(module: nn.Module, style: Style, layout: ParallelLayout,
                replace: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sequence_parallel: bool = False,
                gathered: bool = False) -> None:
    """Split ``module`` (materialised, whole) by ``style``. ``replace(old, new)`` records that the
    tensor ``old`` became ``new`` (tied holders get the slice) and returns the tensor to use: the
    slice already made for a tied tensor, if one was. ``sequence_parallel``: the module runs in a
    block on this rank's part of the sequence: a row layer reduce-scatters its output, and a column
    layer gathers its input, unless it is ``gathered`` already (by the module around it:
    :func:`gather_sequence_into`)."""
    if isinstance(style, Replicate):
        return
    if isinstance(style, ReplicateOnSplit):  # its gradients are summed over TP (``grads.is_partial_over_tp``)
        for param in module.parameters():
            place(param, partial_over_tp=True)
        return
    if isinstance(style, VocabEmbedding):
        _split(module, "weight", 0, 1, layout, replace)
        vocab = module.num_embeddings
        module.num_embeddings = vocab // layout.tensor_model_parallel_size
        module.vocab_start_index = layout.tensor_model_parallel_rank * module.num_embeddings
        padding = module.padding_idx  # the row the gradient skips, if this rank holds it
        start = module.vocab_start_index
        module.padding_idx = padding - start if padding is not None and 0 <= padding - start < module.num_embeddings \
            else None
        if layout.tensor_model_parallel_size > 1:
            _vocab_parallel(module, layout.tp_group)
        return
    out_dim, in_dim, out_attr, in_attr = linear_dims(module)
    tp = layout.tensor_model_parallel_size
    group = layout.tp_group if tp > 1 else None
    if isinstance(style, Column):
        _split(module, "weight", out_dim, style.stride, layout, replace)
        if getattr(module, "bias", None) is not None:
            _split(module, "bias", 0, style.stride, layout, replace)
        setattr(module, out_attr, getattr(module, out_attr) // tp)
        input_map = output_map = None
        if tp > 1 and sequence_parallel and not gathered:  # the sequence is gathered before the split features
            input_map = gather_sequence
        elif tp > 1 and not sequence_parallel:
            input_map = functools.partial(_copy_to_tp, group=group)
        if tp > 1 and style.gather_output:
            output_map = lambda out: _GatherLastDim.apply(out, group)  # noqa: E731 (apply takes no keywords)
        if input_map is not None:
            wrap(module, "column_input", lambda _m, args: (input_map(args[0]), *args[1:]))
        if output_map is not None:
            wrap(module, "column_output", lambda _m, _a, out: output_map(out))
        assign_roles(module, tensor_parallel_placement=Placement(style, sequence_parallel, input_map=input_map,
                                                                 output_map=output_map))
    elif isinstance(style, Row):
        _split(module, "weight", in_dim, 1, layout, replace)
        setattr(module, in_attr, getattr(module, in_attr) // tp)
        reduce = functools.partial(_sum_partial, group=group, sequence_parallel=sequence_parallel) if tp > 1 else None
        if tp > 1:  # the bias is added once, after the partial products are summed
            row_forward = functools.partial(_row_forward, reduce=reduce, transposed=in_dim == 0)
            wrap(module, "row_parallel_forward", lambda mod, _inner: types.MethodType(row_forward, mod))
        assign_roles(module, tensor_parallel_placement=Placement(style, sequence_parallel, reduce=reduce))




class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension over the TP group, on the input's device (megatron's
    ``gather_from_tensor_model_parallel_region`` allocates on CUDA); backward keeps this rank's
    slice of the gradient."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, input_.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = grad.shape[-1] // dist.get_world_size(ctx.group)
        return grad.narrow(-1, dist.get_rank(ctx.group) * size, size).contiguous(), None


def split_parameter(module: nn.Module, attr: str, dim: int, layout: ParallelLayout) -> None:
    """``module``'s parameter ``attr`` (materialised, whole, not tied) cut to this rank's slice
    along ``dim``, marked as megatron's split parameters are (what a style cannot express: a
    family's own per-head tensors, ``deepseek_v4.py``)."""
    _split(module, attr, dim, 1, layout, lambda _old, new: new)


def _split(module: nn.Module, attr: str, dim: int, stride: int, layout: ParallelLayout, replace) -> None:
    whole = module._parameters[attr]
    placed = placement_of(whole)
    if placed.split:  # a tied tensor another holder split already
        if (placed.split_dim, placed.stride) != (dim, stride):
            raise ValueError(f"{type(module).__name__}.{attr} is tied to a tensor split along dim "
                             f"{placed.split_dim}, not {dim}: give both holders matching styles")
        return
    module._parameters[attr] = replace(whole, _sharded_parameter(whole, dim, stride, layout))


def _row_forward(module: nn.Module, input_: torch.Tensor, reduce, transposed: bool) -> torch.Tensor:
    """``nn.Linear`` / ``Conv1D`` on the rank's input features: the partial products summed over
    TP (``reduce``: :func:`_sum_partial`), then the (whole) bias."""
    if transposed:  # Conv1D: weight [in, out]
        partial = torch.matmul(input_, module.weight)
    else:
        partial = F.linear(input_, module.weight)
    output = reduce(partial)
    return output if module.bias is None else output + module.bias


def _copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """megatron's copy to the TP region (identity forward, summed gradient), imported when a
    forward runs: planning a layout on the meta device imports no megatron-core."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group=group)


def _reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """megatron's sum over the TP region (identity backward), imported as ``_copy_to_tp``."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group)


def _sum_partial(partial: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Partial products of TP-split input features summed over TP (under sequence parallelism:
    reduce-scattered, this rank keeping its part of the sequence)."""
    if sequence_parallel:
        return sequence_mapping(partial, reduce_scatter_sequence, all_gather_sequence, _sequence_dim(partial))
    return _reduce_from_tp(partial, group)


# ------------------------------------------------------------------ sequence parallelism
# A model as written keeps its activations batch first: ``[b, s, C]`` (the sequence is dim 1), or
# ``[tokens, C]`` where a block flattens them (OPT's MLP; then the tokens are dim 0, and a gather
# followed by the reduce-scatter of the next row-parallel layer returns each rank its own tokens,
# which is all a per-token MLP needs). The sequence mappings are the project's GPT's
# (``layers/sequence_parallel.py``), on this dimension.
def _sequence_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else 0


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """``[b, s/TP, C]`` -> ``[b, s, C]`` before a column-parallel layer (backward: reduce-scatter,
    the layer's TP-split consumers each giving a partial gradient)."""
    return sequence_mapping(x, all_gather_sequence, reduce_scatter_sequence, _sequence_dim(x))


def gather_sequence_into(module: nn.Module) -> None:
    """Under sequence parallelism, ``module`` (an attention or an MLP holding column layers) gets
    the whole sequence: its input (the first positional argument, or ``hidden_states``) is gathered
    once before its forward, which may size its reshapes by it (Hugging Face's attention takes its
    ``input_shape`` from its input); its column layers then take it as it is."""

    def gather_input(mod: nn.Module, args: tuple, kwargs: dict):
        return replace_hidden_states(mod, args, kwargs, gather_sequence, "sequence parallelism cannot gather its sequence")

    wrap(module, "sequence_gathered", gather_input, with_kwargs=True)


def gather_replicated_sequence(x: torch.Tensor) -> torch.Tensor:
    """``[b, s/TP, C]`` -> ``[b, s, C]`` after the blocks, for the parts every TP rank runs whole
    (backward: this rank's part of the gradient)."""
    return sequence_mapping(x, all_gather_sequence, split_sequence, _sequence_dim(x))


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, C]`` (TP-replicated, before the blocks) -> this rank's ``[b, s/TP, C]`` (backward: all-gather)."""
    return sequence_mapping(x, split_sequence, all_gather_sequence, _sequence_dim(x))


def _vocab_parallel(module: nn.Embedding, group) -> None:
    """megatron's ``VocabParallelEmbedding`` around the module's own forward (a subclass that
    scales its rows, as Gemma's, keeps doing so): ids outside this rank's rows look up row 0 and
    give zeros; the rows are summed over TP."""

    def local_ids(mod: nn.Embedding, args: tuple, kwargs: dict):
        ids = args[0] if args else kwargs.pop("input")
        start = mod.vocab_start_index
        outside = (ids < start) | (ids >= start + mod.num_embeddings)
        mod._outside_rows = outside
        return ((ids - start).masked_fill(outside, 0), *args[1:]), kwargs

    def summed(mod: nn.Embedding, _args: tuple, _kwargs: dict, rows: torch.Tensor) -> torch.Tensor:
        outside = mod.__dict__.pop("_outside_rows")
        return _reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)

    wrap(module, "vocab_local_ids", local_ids, with_kwargs=True)
    wrap(module, "vocab_rows_summed", summed, with_kwargs=True)


def divide_attributes(module: nn.Module, attrs: tuple[str, ...], tp: int) -> None:
    """Attributes the forward reads as whole-model sizes (heads, split sizes) become per-rank.
    A dotted name reaches into an object the module shares with others (the model's config):
    the module gets its own shallow copy of each object on the way, so that the model's config
    (which ``export_pretrained`` writes) and the other modules keep the whole-model value."""
    for attr in attrs:
        *path, last = attr.split(".")
        owner = module
        for part in path:
            own = copy.copy(getattr(owner, part))
            setattr(owner, part, own)
            owner = own
        setattr(owner, last, getattr(owner, last) // tp)


def random_region(module: nn.Module, region: str) -> None:
    """Run ``module``'s forward on the randomizer's stream for ``region``: ``"parallel"`` differs
    across TP ranks (dropout on TP-split activations), ``"replicated"`` is shared by them."""
    groups = () if region == "parallel" else ("tensor",)

    def in_region(_module: nn.Module, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def forward_in_region(*args, **kwargs):
            with rng_fork(*groups):
                return forward(*args, **kwargs)

        return forward_in_region

    wrap(module, "random_region", in_region)


# ------------------------------------------------------------------ the logits layer
def output_plan(model: nn.Module, plan: TPPlan, parts: ModelParts | None, tp: int,
                 loss_parallel: bool) -> tuple[TPPlan, bool]:
    """The plan, with the output layer gathering its logits where the plan splits them over the
    vocabulary but ``loss_parallel`` is off; and whether the logits stay split (vocab-parallel loss)."""
    last_parts = parts.last if parts else [n for n, c in model.named_children() if any(True for _ in c.parameters())]
    output_name = _output_layer(model, plan, plan.output or default_output(model, plan, parts, last_parts))
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


def _output_layer(model: nn.Module, plan: TPPlan, name: str | None) -> str | None:
    """The layer that produces the logits: ``name``, or the last layer inside it the plan styles
    (a head that is a container, e.g. ``Sequential(norm, Linear)``)."""
    if name is None:
        return None
    styled = [n for n, _ in model.get_submodule(name).named_modules(prefix=name) if plan.style_of(n) is not None]
    return styled[-1] if styled else name


def default_output(model: nn.Module, plan: TPPlan, parts: ModelParts | None, last_parts: list[str]) -> str | None:
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


# ------------------------------------------------------------------ the tensor-parallel pass
def apply_tensor_parallel(chunks: list[StageChunk], materializer: Materializer, plan: TPPlan,
                          layout: ParallelLayout, root: nn.Module) -> None:
    """The tensor-parallel pass: every module of this rank's chunks materialised and cut by the
    plan (TP styles, divided attributes, random regions; each tensor drawn whole from the
    generator of its name, then cut to this rank's slice). Under sequence parallelism the blocks
    run on this rank's part of the sequence: it is scattered before the first stage's first block
    and gathered after the last stage's last (the embeddings, masks and positions before, and the
    final norm and head after, see the whole sequence)."""
    build = module_builder(materializer, plan, layout, root)
    for chunk in chunks:
        for name, module, block in chunk.builds:
            build(name, module, block)
    if not (layout.sequence_parallel and layout.tensor_model_parallel_size > 1):
        return
    last_stage = layout.num_virtual_stages - 1
    for chunk in chunks:
        if chunk.blocks and chunk.stage == 0:
            wrap(chunk.blocks[min(chunk.blocks)], "sequence_scattered_before_blocks", _scatter_hidden, with_kwargs=True)
        if chunk.blocks and chunk.stage == last_stage:
            wrap(chunk.blocks[max(chunk.blocks)], "sequence_gathered_after_blocks", _gather_hidden)


def module_builder(materializer: Materializer, plan: TPPlan, layout: ParallelLayout,
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
    def replace(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
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
                if fnmatch.fnmatchcase(sub_name, pattern):
                    divide_attributes(sub, attrs, tp)
            for pattern, region in plan.random.items():
                if fnmatch.fnmatchcase(sub_name, pattern) and not split_sequence:  # (all of the block is, below)
                    random_region(sub, region)
        for layer_name, layer in lora_layers(module, name):
            place_lora(layer_name, layer, layout, root if root is not None else module)
        shard_experts(module, layout)  # this EP rank's experts (nothing without EP)
        if split_sequence:
            for region in regions.values():
                gather_sequence_into(region)
            mark_sequence_parallel_parameters(module)
            random_region(module, "parallel")
            wire_sequence_parallel(module)  # its hyper-connections on this rank's part of the sequence
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


def _scatter_hidden(module: nn.Module, args: tuple, kwargs: dict):
    return replace_hidden_states(module, args, kwargs, scatter_sequence,
                                 "sequence parallelism cannot split its sequence")


def _gather_hidden(module: nn.Module, args: tuple, output: Any):
    if isinstance(output, torch.Tensor):
        return gather_replicated_sequence(output)
    return (gather_replicated_sequence(output[0]), *output[1:])

