"""Count the bytes each rank hands to torch.distributed's collectives and point-to-point ops, per
process group: in a real run, the measurement the planner's traffic (``planning.traffic``) is checked
against; in the planner's trace of a Hugging Face stage over a fake group, its traffic
(``planning.hf_activations``).

Every collective and p2p function of ``torch.distributed`` is wrapped for the duration of a
:class:`CollectiveCounter` block, under every name a loaded module holds it by (megatron-core keeps
``all_gather_into_tensor`` under its own alias), so a call counts whoever makes it. Each call adds
its *payload* (the planner's convention, ``planning.traffic``): the bytes of the tensor(s) this rank
hands in as its contribution, read off the real tensors of the call: all-reduce its tensor;
all-gather its own shard; reduce-scatter its whole input; all-to-all its whole input (what it keeps
included, so the count does not depend on the routing); send and isend the tensor; broadcast the
tensor on the source rank; receives nothing. A call over a group of one rank sends nothing.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


# name -> (index of the tensor argument handed in, its keyword name) or a payload function
def _payload_rules() -> dict[str, Callable[..., int]]:
    def arg(i: int, key: str) -> Callable[..., int]:
        return lambda args, kwargs: _bytes(kwargs[key] if key in kwargs else args[i])

    def broadcast(args, kwargs) -> int:  # ``src`` is a global rank
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        return _bytes(kwargs.get("tensor", args[0])) if dist.get_rank() == src else 0

    rules = dict(
        all_reduce=arg(0, "tensor"),
        all_gather=arg(1, "tensor"),
        all_gather_into_tensor=arg(1, "input_tensor"),
        all_gather_single=arg(1, "input"),
        _all_gather_base=arg(1, "input_tensor"),
        reduce_scatter=arg(1, "input_list"),
        reduce_scatter_tensor=arg(1, "input"),
        reduce_scatter_single=arg(1, "input"),
        _reduce_scatter_base=arg(1, "input"),
        all_to_all_single=arg(1, "input"),
        all_to_all=arg(1, "input_tensor_list"),
        send=arg(0, "tensor"),
        isend=arg(0, "tensor"),
        recv=lambda args, kwargs: 0,
        irecv=lambda args, kwargs: 0,
        broadcast=broadcast,
    )
    return {name: rule for name, rule in rules.items() if hasattr(c10d, name)}


def _group_of(name: str, args: tuple, kwargs: dict) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    # the positional place of ``group`` in each signature
    place = dict(all_reduce=2, all_gather=2, all_gather_into_tensor=2, all_gather_single=2, _all_gather_base=2,
                 reduce_scatter=3, reduce_scatter_tensor=3, reduce_scatter_single=3, _reduce_scatter_base=3,
                 all_to_all_single=4, all_to_all=2, send=2, isend=2, recv=2, irecv=2, broadcast=2)[name]
    return args[place] if len(args) > place else None


def dimension_of(layout: Any) -> Callable[[Any, str], str | None]:
    """A :class:`CollectiveCounter`'s ``names`` for a built layout: which parallel dimension a call
    is, by its process group (the expert-data ranks' reduction is DP's; the tied embedding's, PP's;
    a send or receive is PP's)."""
    named = {}
    for dimension, group in (("tensor", layout.tp_group), ("context", layout.cp_group), ("expert", layout.ep_group),
                             ("pipeline", layout.pp_group), ("pipeline", layout.embedding_group),
                             ("data", layout.dp_cp_group), ("data", layout.dp_group),
                             ("data", layout.expert_dp_group)):
        if group is not None:
            named.setdefault(id(group), dimension)
    return lambda group, op: "pipeline" if op in ("send", "recv") else named.get(id(group))


OP_NAMES = dict(all_gather_into_tensor="all_gather", all_gather_single="all_gather", _all_gather_base="all_gather",
                reduce_scatter_tensor="reduce_scatter", reduce_scatter_single="reduce_scatter",
                _reduce_scatter_base="reduce_scatter", all_to_all_single="all_to_all", isend="send", irecv="recv")
"""torch's names of one collective under the planner's (``planning.traffic``)."""


class CollectiveCounter:
    """``with CollectiveCounter(names) as counted:`` ... ``counted.bytes``: a Counter of payload bytes
    by ``(dimension, op)`` (``OP_NAMES``), where ``names(group, op)`` says which dimension a call is
    (None: counted under its group's ranks). Only the outermost call counts (torch's older names
    call the newer ones)."""

    def __init__(self, names: Callable[[Any], str | None]) -> None:
        self.names = names
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self.log: list[tuple[str, str, int]] = []
        """Every counted call in order: ``(dimension, op, payload bytes)``."""
        self._undo: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def _wrap(self, name: str, original: Callable, rule: Callable[..., int]) -> Callable:
        op = OP_NAMES.get(name, name)

        def counted(*args, **kwargs):
            group = _group_of(name, args, kwargs)
            if self._depth == 0 and _group_size(group) > 1:
                where = self.names(group, op) or str(tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
                payload = rule(args, kwargs)
                self.bytes[where, op] += payload
                self.calls[where, op] += 1
                self.log.append((where, op, payload))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__wrapped__ = original
        return counted

    def __enter__(self) -> CollectiveCounter:
        wrappers = {}
        for name, rule in _payload_rules().items():
            original = getattr(c10d, name)
            wrappers[id(original)] = (original, self._wrap(name, original, rule))
        for module in list(sys.modules.values()):  # every name a loaded module holds one by
            space = getattr(module, "__dict__", None)
            if not isinstance(space, dict):
                continue
            for key, value in list(space.items()):
                found = wrappers.get(id(value))
                if found is not None and value is found[0]:
                    self._undo.append((module, key, value))
                    setattr(module, key, found[1])
        return self

    def __exit__(self, *exc) -> None:
        for module, key, value in reversed(self._undo):
            setattr(module, key, value)
        self._undo.clear()

