"""The roles one room gives a module for another room to read, as one typed record
(:class:`ModuleRoles`) and the one place that reads and writes it (:func:`roles_of`,
:func:`assign_roles`).

The record is kept whole in the module's own ``__dict__`` (one entry), so ``copy.deepcopy`` and
pickling of the module carry it as they carry the module's other state, and a module nobody gave a
role reads the defaults. The rooms that write a role and those that read it stand on different
floors (recompute groups are made by ``recompute`` and read by both model wings' blocks; the TP
pass places a linear and LoRA's adapters read it), so the record lives on the lowest floor and
types its values loosely (``object``) where their classes live above it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

_ENTRY = "module_roles"
"""The one entry of a module's ``__dict__`` the record is kept in."""


@dataclasses.dataclass(frozen=True)
class ModuleRoles:
    """What other rooms were told about a module.

    ``recompute_group``: the block-recompute group (``recompute.groups.RecomputeGroup``) the layer
    checkpoints into; ``last_in_recompute_group``: it ends the group (megatron's
    ``is_last_layer_in_block``) and hands the group its output. ``hyper_connection_observer``:
    called with a hyper-connected block's mixing matrices each forward (a stream monitor).
    ``tensor_parallel_placement``: how the TP pass split a linear (``any_model.placement.Placement``),
    for what runs beside it on the same input (LoRA's adapters); ``adapters_placed``: its LoRA
    adapters were cut as it was. ``initialises_itself``: its parameters were drawn already (by
    name), so a model's own init function must not redraw them."""

    recompute_group: object | None = None
    last_in_recompute_group: bool = False
    hyper_connection_observer: Callable | None = None
    tensor_parallel_placement: object | None = None
    adapters_placed: bool = False
    initialises_itself: bool = False


NO_ROLES = ModuleRoles()


def roles_of(module: nn.Module) -> ModuleRoles:
    """``module``'s roles (:data:`NO_ROLES` where none was given)."""
    return module.__dict__.get(_ENTRY, NO_ROLES)


def assign_roles(module: nn.Module, **changes) -> ModuleRoles:
    """Give ``module`` the roles ``changes`` names (the others kept); returns its roles now."""
    roles = dataclasses.replace(roles_of(module), **changes)
    module.__dict__[_ENTRY] = roles  # not setattr: nn.Module's would look for parameters and submodules first
    return roles
