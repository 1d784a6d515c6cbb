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
- any other tensor is stored whole; copies held by several ranks (DP replicas, TP peers, the
  tied embedding on the first and last stage) are written once (DCP deduplicates them);
- optimizer states shaped like their parameter (AdamW's moments) are sharded like it; the
  others (AdamW's ``step``) are stored whole.

Every tensor handed to DCP is a view of this rank's storage: a save copies nothing, a load
writes into the given buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout

@dataclass(frozen=True)
class Placement:
    """How a tensor is split across TP: ``dim`` of its own shape (None: whole on every rank),
    with megatron's ``partition_stride``."""

    dim: int | None = None
    stride: int = 1


REPLICATED = Placement()


def tp_placement(tensor: Tensor) -> Placement:
    """Megatron's tensor-parallel attributes of a parameter, as a :class:`Placement`."""
    if getattr(tensor, "tensor_model_parallel", False):
        return Placement(int(tensor.partition_dim), int(getattr(tensor, "partition_stride", 1)))
    return REPLICATED


class Sharder:
    """Turns local tensors into pieces of global ones for this rank's TP group."""

    def __init__(self, layout: ParallelLayout | None) -> None:
        self.tp = layout.tensor_model_parallel_size if layout is not None else 1
        self.tp_rank = layout.tensor_model_parallel_rank if layout is not None else 0
        self._group = layout.tp_group if self.tp > 1 else None
        self._meshes: dict[str, Any] = {}

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
            shape[dim] *= self.tp
        return torch.Size(shape)

    def shard(self, local: Tensor, placement: Placement) -> Tensor:
        """``local`` as this rank's piece of the global tensor (a view: no copy)."""
        view, dim = self._view(local.detach(), placement)
        if dim is None or self.tp == 1:
            return view
        from torch.distributed.tensor import DTensor, Shard

        shape = self.global_shape(local.shape, placement)
        return DTensor.from_local(view, self._mesh(local.device), [Shard(dim)], run_check=False,
                                  shape=shape, stride=_contiguous_strides(shape))

    def _mesh(self, device: torch.device):
        if device.type not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self._group, device_type=device.type)
            if mesh.get_local_rank() != self.tp_rank:
                raise RuntimeError(f"the TP mesh puts this rank at {mesh.get_local_rank()}, megatron at {self.tp_rank}")
            self._meshes[device.type] = mesh
        return self._meshes[device.type]


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


def parameter_keys(module: torch.nn.Module, layout: ParallelLayout | None) -> dict[int, tuple[str, Placement]]:
    """``{id(parameter): (global name, placement)}`` for the optimizer states."""
    namer, _ = global_namer(module, layout)
    return {id(p): (namer(name), tp_placement(p)) for name, p in module.named_parameters()}


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_shards(optimizer: torch.optim.Optimizer, keys: dict[int, tuple[str, Placement]],
                     sharder: Sharder) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(its per-parameter states as ``{"<global parameter name>.<state name>": piece}``, its param
    groups without "params")``."""
    params = _ordered_params(optimizer)
    state = optimizer.state_dict()
    shards: dict[str, Any] = {}
    for position, values in state["state"].items():
        param = params[position]
        name, placement = keys[id(param)]
        for state_name, value in values.items():
            sharded = isinstance(value, Tensor) and value.shape == param.shape
            shards[f"{name}.{state_name}"] = (
                sharder.shard(value, placement) if sharded else value)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return shards, groups


def optimizer_targets(optimizer: torch.optim.Optimizer, prefix: str, keys: dict[int, tuple[str, Placement]],
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
        name, placement = keys[id(param)]
        for key, state_name in by_param.get(name, ()):
            meta = saved[key]
            buffer = None
            if not isinstance(meta, TensorStorageMetadata):
                targets[key] = None  # a non-tensor state: DCP puts the saved object in its place
            elif meta.size == sharder.global_shape(param.shape, placement):
                buffer = torch.empty(param.shape, dtype=meta.properties.dtype, device=param.device)
                targets[key] = sharder.shard(buffer, placement)
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
