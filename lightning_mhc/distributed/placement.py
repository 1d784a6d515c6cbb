"""Where a parameter lives over the parallel ranks, as one typed record (:class:`ParameterPlacement`)
and the one place that reads and writes it (:func:`placement_of`, :func:`place`).

The record is kept on the parameter as the attributes megatron-core's own layers write and its
code reads (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``allreduce``,
``sequence_parallel``, ``shared_embedding``) beside the one it does not know (``partial_over_tp``):
a parameter a megatron layer built and one our passes built then say the same thing the same way,
and megatron reads ours. Every other file of the package asks this module; none names the
attributes (``tests/test_contracts.py`` holds them to it).

``copy.deepcopy`` of a ``torch.nn.Parameter`` keeps none of its attributes (torch builds a new
parameter from the data): what copies a placed parameter gives the copy its placement again
(:func:`place` with the original's record), as PEFT's ``modules_to_save`` copies get theirs.
"""
from __future__ import annotations

import dataclasses

import torch

# megatron's names (its layers write them, its code reads them), and ours
_SPLIT, _DIM, _STRIDE = "tensor_model_parallel", "partition_dim", "partition_stride"
_ALLREDUCE, _SEQUENCE_PARALLEL, _SHARED_EMBEDDING = "allreduce", "sequence_parallel", "shared_embedding"
_PARTIAL_OVER_TP = "partial_over_tp"


@dataclasses.dataclass(frozen=True)
class ParameterPlacement:
    """How the ranks hold one parameter, and so how its gradient is reduced and how a checkpoint
    stores it.

    ``placed``: a builder said how TP holds it (split or replicated): a trainable parameter added to
    a split model afterwards is not, and TP refuses it. ``split_dim``/``stride``: megatron's
    strided split over TP (the dimension is ``stride`` equal parts, each cut over the TP ranks);
    None: whole on every TP rank. ``partial_over_tp``: replicated, but applied to this rank's heads,
    so its gradient is a partial sum over TP. ``sequence_parallel``: replicated and applied to this
    rank's part of the sequence: its gradient is a partial sum over TP when SP is on. ``expert``:
    an MoE expert's (megatron's ``allreduce = False``): reduced over the expert-data-parallel ranks
    only, stored as this EP rank's block of dim 0. ``shared_embedding``: a tied embedding's copy
    whose gradient is summed between the first and the last pipeline stage."""

    placed: bool = False
    split_dim: int | None = None
    stride: int = 1
    partial_over_tp: bool = False
    sequence_parallel: bool = False
    expert: bool = False
    shared_embedding: bool = False

    @property
    def split(self) -> bool:
        """Cut over the TP ranks (each holds a slice)."""
        return self.split_dim is not None


REPLICATED = ParameterPlacement(placed=True)
"""Whole on every TP rank, its gradient whole."""


def placement_of(param: torch.Tensor) -> ParameterPlacement:
    """``param``'s placement, as the builders (ours and megatron's layers) left it."""
    attrs = param.__dict__
    split = bool(attrs.get(_SPLIT, False))
    return ParameterPlacement(
        placed=_SPLIT in attrs,
        split_dim=int(attrs[_DIM]) if split else None,
        stride=int(attrs.get(_STRIDE, 1)) if split else 1,
        partial_over_tp=bool(attrs.get(_PARTIAL_OVER_TP, False)),
        sequence_parallel=bool(attrs.get(_SEQUENCE_PARALLEL, False)),
        expert=attrs.get(_ALLREDUCE, True) is False,
        shared_embedding=bool(attrs.get(_SHARED_EMBEDDING, False)),
    )


def place(param: torch.Tensor, placement: ParameterPlacement | None = None, **changes) -> ParameterPlacement:
    """Give ``param`` ``placement`` (default: its own), with ``changes`` to its fields; returns the
    placement written. A flag is written where it is set or was set before (so an unset one leaves
    the parameter as megatron's layers leave theirs), the split only where there is one."""
    new = dataclasses.replace(placement if placement is not None else placement_of(param), **changes)
    attrs = param.__dict__
    if new.placed:
        setattr(param, _SPLIT, new.split)
        if new.split:
            setattr(param, _DIM, new.split_dim)
            setattr(param, _STRIDE, new.stride)
    elif _SPLIT in attrs:
        delattr(param, _SPLIT)
    for name, value in ((_PARTIAL_OVER_TP, new.partial_over_tp), (_SEQUENCE_PARALLEL, new.sequence_parallel),
                        (_SHARED_EMBEDDING, new.shared_embedding)):
        if value or name in attrs:
            setattr(param, name, value)
    if new.expert or _ALLREDUCE in attrs:
        setattr(param, _ALLREDUCE, not new.expert)
    return new


def mark_replicated(module: torch.nn.Module) -> None:
    """Mark the parameters a model builder made whole on every TP rank (those it did not place)
    replicated, as megatron's layers mark theirs: the strategy then knows every parameter's
    placement. Run by the builders (the GPT, ``parallelize``) on what they built, never on what
    was added afterwards."""
    for param in module.parameters():
        if not placement_of(param).placed:
            place(param, placed=True, split_dim=None)
