"""Global keys and shards: where this rank's tensors sit in the whole model's.

A checkpoint names every tensor as the one-process model would (``GPTModel.global_parameter_name``:
layer indices shifted by the stage's first layer, chunks of a virtual pipeline merged, the tied
output layer of a last stage stored as the embedding it copies) and stores this rank's piece
of the global tensor, so that ``torch.distributed.checkpoint`` can read any other layout's
pieces back (resharding):

- a tensor split across TP (megatron's ``tensor_model_parallel`` / ``partition_dim`` /
  ``partition_stride`` attributes) becomes a ``DTensor`` sharded over the TP group; with
  ``partition_stride = s > 1`` (SwiGLU's ``[gate; up]``: each rank holds matching slices of
  both halves) the split dimension is viewed as ``[s, size / s]`` and sharded on the second,
  so the global tensor is the same under every TP size;
- an MoE expert tensor (stacked ``[experts, in, out]``, megatron's ``allreduce = False``) holds
  its EP rank's block of experts: a ``DTensor`` sharded along dim 0 over the EP group, so the
  global tensor holds every expert and reads back onto any EP size (one process included);
- any other tensor is stored whole; copies held by several ranks (DP replicas, TP peers, the
  tied embedding on the first and last stage) are written once (DCP deduplicates them);
- optimizer states shaped like their parameter (AdamW's moments) are sharded like it; the
  others (AdamW's ``step``) are stored whole;
- the distributed optimizer's states cover a flat range of a parameter (a *piece*,
  ``lightning_mhc.distributed.optimizer``): the range is stored as the rectangles of the global
  tensor it covers (a ``ShardedTensor`` with one shard per rectangle), so the state is written
  without a gather and reads back onto any layout, with or without the distributed optimizer.

Every tensor handed to DCP is a view of this rank's storage: a save copies nothing, a load
writes into the given buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from lightning_mhc.distributed.placement import placement_of
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.optimizer import MAIN_PARAM

@dataclass(frozen=True)
class Placement:
    """How a tensor is split: ``dim`` of its own shape (None: whole on every rank), with
    megatron's ``partition_stride``, over the ranks of ``over`` ('tp' or 'ep')."""

    dim: int | None = None
    stride: int = 1
    over: str = "tp"


REPLICATED = Placement()


@dataclass(frozen=True)
class StateKey:
    """Where a tensor an optimizer steps sits in the whole model: the parameter's global name
    and TP placement; for a piece of it, the local parameter's shape and the piece's flat range."""

    name: str
    placement: Placement
    shape: tuple[int, ...] | None = None
    flat_range: slice | None = None
    main_weights: bool = False
    """The tensor stepped is an fp32 copy of bf16 weights: its saved main weights are read back."""


EXPERTS = Placement(0, 1, "ep")
"""An expert tensor: this EP rank's block of experts along dim 0."""


def tp_placement(tensor: Tensor) -> Placement:
    """A parameter's TP split (its ``ParameterPlacement``), as a :class:`Placement`; an expert
    tensor's split over EP."""
    placement = placement_of(tensor)
    if placement.expert:
        return EXPERTS
    if placement.split:
        return Placement(placement.split_dim, placement.stride)
    return REPLICATED


class Sharder:
    """Turns local tensors into pieces of global ones for this rank's TP group (and EP group for
    the experts)."""

    def __init__(self, layout: ParallelLayout | None) -> None:
        self.tp = layout.tensor_model_parallel_size if layout is not None else 1
        self.tp_rank = layout.tensor_model_parallel_rank if layout is not None else 0
        ep = layout.expert_model_parallel_size if layout is not None else 1
        self._split = {"tp": (self.tp, self.tp_rank, layout.tp_group if self.tp > 1 else None),
                       "ep": (ep, layout.expert_model_parallel_rank if ep > 1 else 0,
                              layout.ep_group if ep > 1 else None)}
        """'tp' / 'ep' -> (size, this rank's place, group)."""
        self._meshes: dict[tuple[str, str], Any] = {}

    def _view(self, local: Tensor, placement: Placement) -> tuple[Tensor, int | None]:
        """The stored view of ``local`` and its TP-split dimension."""
        d, s = placement.dim, placement.stride
        if d is None:
            return local, None
        if s > 1:
            shape = local.shape
            if shape[d] % s:
                raise ValueError(f"a tensor of shape {tuple(shape)} cannot hold stride {s} along dim {d}")
            return local.view(*shape[:d], s, shape[d] // s, *shape[d + 1:]), d + 1
        return local, d

    def global_shape(self, local_shape: Iterable[int], placement: Placement) -> torch.Size:
        """The stored (global) shape of a tensor of ``local_shape`` on this layout."""
        view, dim = self._view(torch.empty(tuple(local_shape), device="meta"), placement)
        shape = list(view.shape)
        if dim is not None:
            shape[dim] *= self._split[placement.over][0]
        return torch.Size(shape)

    def shard(self, local: Tensor, placement: Placement) -> Tensor:
        """``local`` as this rank's piece of the global tensor (a view: no copy)."""
        view, dim = self._view(local.detach(), placement)
        if dim is None or self._split[placement.over][0] == 1:
            return view
        from torch.distributed.tensor import DTensor, Shard

        shape = self.global_shape(local.shape, placement)
        return DTensor.from_local(view, self._mesh(local.device, placement.over), [Shard(dim)], run_check=False,
                                  shape=shape, stride=_contiguous_strides(shape))

    def shard_piece(self, flat: Tensor, key: StateKey) -> Any:
        """``flat`` (the values of ``key.flat_range`` of a local parameter) as the rectangles of the
        global tensor it covers (views of ``flat``: no copy)."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        view, dim = self._view(torch.empty(key.shape, device="meta"), key.placement)
        local_shape, numel = tuple(view.shape), view.numel()
        parts, part, _ = self._split[key.placement.over]
        lo, hi = key.flat_range.start, key.flat_range.stop
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        mine, elsewhere = f"rank:{rank}/{flat.device}", f"rank:{(rank + 1) % world}/{flat.device}"

        def placed(offsets: list[int], tp_rank: int) -> list[int]:
            if dim is not None:
                offsets[dim] += tp_rank * local_shape[dim]
            return offsets

        shards = [Shard(flat.detach()[start - lo:start - lo + math.prod(sizes)].view(sizes),
                        ShardMetadata(placed(offsets, part), sizes, mine))
                  for offsets, sizes, start in _rectangles(lo, hi, local_shape)]
        # ShardedTensor wants metadata that covers the whole tensor; DCP reads only the local
        # shards, so the rest (the other ranks' ranges, the other TP blocks) is named as elsewhere
        rest = [ShardMetadata(placed(offsets, part), sizes, elsewhere)
                for a, b in ((0, lo), (hi, numel)) if a < b for offsets, sizes, _ in _rectangles(a, b, local_shape)]
        if dim is not None:
            rest += [ShardMetadata(placed([0] * len(local_shape), t), list(local_shape), elsewhere)
                     for t in range(parts) if t != part]
        meta = ShardedTensorMetadata([s.metadata for s in shards] + rest,
                                     self.global_shape(key.shape, key.placement), TensorProperties(dtype=flat.dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)

    def _mesh(self, device: torch.device, over: str = "tp"):
        if (device.type, over) not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            _, rank, group = self._split[over]
            mesh = DeviceMesh.from_group(group, device_type=device.type)
            if mesh.get_local_rank() != rank:
                raise RuntimeError(f"the {over.upper()} mesh puts this rank at {mesh.get_local_rank()}, megatron at {rank}")
            self._meshes[device.type, over] = mesh
        return self._meshes[device.type, over]


def _rectangles(lo: int, hi: int, shape: tuple[int, ...]) -> Iterable[tuple[list[int], list[int], int]]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangles
    ``(offsets, sizes, flat start)``, each a contiguous run: a partial first row, whole rows, a
    partial last row (recursively)."""
    if not shape:
        yield [], [], lo
        return
    if len(shape) == 1:
        yield [lo], [hi - lo], lo
        return
    inner = math.prod(shape[1:])
    row, last = lo // inner, hi // inner
    if lo % inner:
        stop = min(hi, (row + 1) * inner)
        for offsets, sizes, start in _rectangles(lo - row * inner, stop - row * inner, shape[1:]):
            yield [row, *offsets], [1, *sizes], start + row * inner
        if stop == hi:
            return
        row += 1
    if last > row:
        yield [row] + [0] * (len(shape) - 1), [last - row, *shape[1:]], row * inner
    if hi % inner:
        for offsets, sizes, start in _rectangles(0, hi - last * inner, shape[1:]):
            yield [last, *offsets], [1, *sizes], start + last * inner


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# ----------------------------------------------------------------------------- naming
def global_namer(module: torch.nn.Module, layout: ParallelLayout | None) -> tuple[Callable[[str], str], bool]:
    """``(local state-dict name -> global name, whether the names are global)``.

    A module names its tensors globally with ``global_parameter_name`` (``MHCGPTModule``
    does). Without it, a data-parallel module's names are global already; a pipeline stage's
    are prefixed with the stage (such a checkpoint reshards TP and DP, not PP)."""
    name = getattr(module, "global_parameter_name", None)
    if callable(name):
        return name, True
    pp = layout.pipeline_model_parallel_size if layout is not None else 1
    if pp == 1:
        return (lambda n: n), True
    stage = layout.pipeline_model_parallel_rank
    return (lambda n: f"pipeline_stage{stage}.{n}"), False


def model_entries(module: torch.nn.Module, layout: ParallelLayout | None) -> dict[str, tuple[str, Tensor]]:
    """``{global name: (local name, tensor)}`` for every tensor of ``module.state_dict()``."""
    namer, _ = global_namer(module, layout)
    entries: dict[str, tuple[str, Tensor]] = {}
    for local, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, Tensor):
            continue  # megatron's "_extra_state" placeholders
        key = namer(local)
        if key in entries and entries[key][1] is tensor:
            continue  # one tensor held twice (a tied embedding and head on one stage): stored once
        if key in entries:
            raise ValueError(f"{local} and {entries[key][0]} have the same global name {key}")
        entries[key] = (local, tensor)
    return entries


def model_shards(module: torch.nn.Module, layout: ParallelLayout | None, sharder: Sharder) -> dict[str, Tensor]:
    """What DCP saves of ``module`` on this rank: its tensors under global names (views)."""
    return {key: sharder.shard(t, tp_placement(t)) for key, (_, t) in model_entries(module, layout).items()}


def model_targets(module: torch.nn.Module, layout: ParallelLayout | None,
                  sharder: Sharder) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Fresh buffers for a load: ``(targets by global name, {local name: the buffer behind it})``."""
    targets, local = {}, {}
    for key, (name, tensor) in model_entries(module, layout).items():
        buffer = torch.empty_like(tensor, requires_grad=False)
        local[name] = buffer
        targets[key] = sharder.shard(buffer, tp_placement(tensor))
    return targets, local


def parameter_keys(module: torch.nn.Module, layout: ParallelLayout | None,
                   pieces: Iterable[tuple[Tensor, Tensor, slice]] = ()) -> dict[int, StateKey]:
    """``{id(tensor an optimizer steps): its StateKey}`` for the optimizer states: the parameters,
    and the distributed optimizer's ``pieces`` (``(piece, its parameter, its flat range)``)."""
    namer, _ = global_namer(module, layout)
    keys = {id(p): StateKey(namer(name), tp_placement(p)) for name, p in module.named_parameters()}
    for piece, param, flat_range in pieces:
        whole = keys[id(param)]
        keys[id(piece)] = StateKey(whole.name, whole.placement, tuple(param.shape), flat_range,
                                   main_weights=param.dtype != torch.float32)
    return keys


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _stored(value: Tensor, key: StateKey, sharder: Sharder) -> Any:
    """An optimizer state shaped like what it belongs to, as the piece of the global one."""
    return sharder.shard(value, key.placement) if key.flat_range is None else sharder.shard_piece(value, key)


def optimizer_shards(optimizer: torch.optim.Optimizer, keys: dict[int, StateKey],
                     sharder: Sharder) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(its per-parameter states as ``{"<global parameter name>.<state name>": piece}``, its param
    groups without "params")``."""
    params = _ordered_params(optimizer)
    state = optimizer.state_dict()
    shards: dict[str, Any] = {}
    for position, values in state["state"].items():
        param = params[position]
        key = keys[id(param)]
        for state_name, value in values.items():
            sharded = isinstance(value, Tensor) and value.shape == param.shape
            shards[f"{key.name}.{state_name}"] = _stored(value, key, sharder) if sharded else value
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return shards, groups


def optimizer_targets(optimizer: torch.optim.Optimizer, prefix: str, keys: dict[int, StateKey],
                      sharder: Sharder, saved: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], dict]]:
    """Fresh buffers for the saved states of the optimizer's parameters: ``(DCP targets, a
    function that, after the load, returns the torch ``state`` for ``optimizer.load_state_dict``)``.
    ``saved`` is the checkpoint's DCP metadata (``state_dict_metadata``), ``prefix`` this
    optimizer's in it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    by_param: dict[str, list[tuple[str, str]]] = {}
    for key in saved:
        if key.startswith(prefix):
            name, state_name = key[len(prefix):].rsplit(".", 1)
            by_param.setdefault(name, []).append((key, state_name))
    targets: dict[str, Any] = {}
    slots: list[tuple[int, str, str, Tensor | None]] = []
    for position, param in enumerate(_ordered_params(optimizer)):
        param_key = keys[id(param)]
        for key, state_name in by_param.get(param_key.name, ()):
            if state_name == MAIN_PARAM and not param_key.main_weights:
                continue  # fp32 weights are the model's own
            meta = saved[key]
            buffer = None
            if not isinstance(meta, TensorStorageMetadata):
                targets[key] = None  # a non-tensor state: DCP puts the saved object in its place
            elif meta.size == sharder.global_shape(param_key.shape or param.shape, param_key.placement):
                buffer = torch.empty(param.shape, dtype=meta.properties.dtype, device=param.device)
                targets[key] = _stored(buffer, param_key, sharder)
            else:
                buffer = torch.empty(meta.size, dtype=meta.properties.dtype, device=_state_device(state_name, param))
                targets[key] = buffer
            slots.append((position, state_name, key, buffer))

    def loaded_state() -> dict[int, dict[str, Any]]:
        state: dict[int, dict[str, Any]] = {}
        for position, state_name, key, buffer in slots:
            state.setdefault(position, {})[state_name] = buffer if buffer is not None else targets[key]
        return state

    return targets, loaded_state


def _state_device(state_name: str, param: Tensor) -> torch.device:
    # torch keeps Adam's scalar "step" on the CPU unless capturable/fused
    return torch.device("cpu") if state_name == "step" else param.device
