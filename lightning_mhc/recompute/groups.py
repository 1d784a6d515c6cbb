"""Block recompute's groups, for every model the package recomputes block by block: our GPT's
decoder layers (``policy.attach_recompute``) and the hyper-connected blocks of a model split by
``parallelize`` (``parallelize/model.py``).

A group is ``L_r`` consecutive layers of one pipeline stage (:func:`block_ranges`, the paper's
eq. 20) under one ``MHCBlockRecomputeManager`` per training forward. Each layer of a group holds
it as its role ``recompute_group`` and knows whether it ends it (``last_in_recompute_group``,
megatron's ``is_last_layer_in_block``; ``lightning_mhc.roles``); a forward pre-hook on the
group's first layer (its ``block_recompute`` wrapper, ``lightning_mhc.wrapping``) makes the manager (only in training forwards with grad enabled, so
evaluation is untouched), the layers checkpoint into ``group.manager``, and the last one hands its
output, which it keeps out of the manager, to :meth:`RecomputeGroup.finish`: every checkpoint's
output is freed and recomputed from one hook.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_mhc.recompute.manager import MHCBlockRecomputeManager
from lightning_mhc.roles import assign_roles
from lightning_mhc.wrapping import unwrap, wrap


def block_ranges(layers: int, n: int, layer_num: int | None = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` layer ranges of the recompute groups of a stage of ``layers`` layers
    with ``n`` residual streams: ``layer_num`` layers each (None: the paper's eq. 20,
    ``L_r = max(1, int(sqrt(n L / (n + 2))))``), the last one shorter; none crosses the stage."""
    size = layer_num if layer_num is not None else max(1, int(math.sqrt(n * layers / (n + 2))))
    return [(start, min(start + size, layers)) for start in range(0, layers, size)]


class RecomputeGroup:
    """The layers of one recompute group share it: :meth:`start` (a forward pre-hook on the first
    layer) makes the manager of this training forward, :meth:`finish` (called by the last layer
    with its output) hands it over. ``created``: a list that collects every manager made (for
    inspection and tests, not for long runs)."""

    def __init__(self, name: str, created: list[MHCBlockRecomputeManager] | None = None) -> None:
        self.name = name
        self.manager: MHCBlockRecomputeManager | None = None
        self.created = created

    def start(self, module: nn.Module, args: tuple) -> None:
        training = module.training and torch.is_grad_enabled()
        self.manager = MHCBlockRecomputeManager(name=self.name) if training else None
        if self.manager is not None and self.created is not None:
            self.created.append(self.manager)

    def finish(self, output: Tensor) -> None:
        """The group's last output: its manager frees every checkpoint's output and recomputes
        them all from one hook on ``output``; the layers keep nothing of this forward."""
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.discard_all_outputs_and_register_unified_recompute(output)


def attach_block_recompute(layers: Sequence[nn.Module], ranges: Sequence[tuple[int, int]],
                           name: Callable[[nn.Module, nn.Module], str],
                           created: list[MHCBlockRecomputeManager] | None = None) -> None:
    """One :class:`RecomputeGroup` per ``[start, end)`` range of the consecutive ``layers``, named
    ``name(first layer, last layer)``; its start is the first layer's ``block_recompute`` wrapper
    (:func:`detach_block_recompute` takes them off)."""
    for start, end in ranges:
        members = layers[start:end]
        group = RecomputeGroup(name(members[0], members[-1]), created)
        for layer in members:
            assign_roles(layer, recompute_group=group, last_in_recompute_group=layer is members[-1])
        wrap(members[0], "block_recompute", group.start)


def detach_block_recompute(layers: Sequence[nn.Module]) -> None:
    """Undo :func:`attach_block_recompute`: the groups' starts unwrapped, the layers in no group."""
    for layer in layers:
        unwrap(layer, owner="block_recompute")
        assign_roles(layer, recompute_group=None, last_in_recompute_group=False)
