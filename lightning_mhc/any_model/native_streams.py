"""The families that carry hyper-connections of their own (``FamilyRecord.native_streams``:
DeepSeek-V4, HY-V4): how their decoder layers' streams cross pipeline stages, and how their
layers run under the block recompute.

Their layers take and return ``[B, S, n, D]`` (``n`` = the config's ``hc_mult``), and a learned
``model.hc_head`` collapses the streams before the final norm. :func:`carry_streams_flat` makes
every layer take and return them flat, ``[B, S, n*D]``, as every other family's blocks carry their
hidden states, so the pipeline sends and receives them like any activation
(``ParallelModel.pipeline_tensor_shape`` is ``n * hidden``), and ``hc_head`` (on the last stage,
after the blocks) takes them flat too. The views change no value: one process is bit-exact with the
model as written.

Under ``recompute="mhc_block"`` :func:`recompute_hyper_connections` gives each layer the family's
forward with its own hyper-connections checkpointed into the layer's recompute group
(:class:`HyperConnectionCheckpoints`; the forwards are ``FamilyRecord.block_recompute``).
"""
from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn

from lightning_mhc.roles import roles_of
from lightning_mhc.wrapping import wrap


def carry_streams_flat(chunk: nn.Module, block_path: str | None, streams: int) -> None:
    """Each decoder layer of ``chunk`` (the modules of ``block_path``) and its ``hc_head`` (where
    this chunk holds it) take their streams flat or not, and the layers return them flat: the
    forwards are wrapped, so the pipeline's hooks around them (a stage's first layer taking the
    received activations, its last one ending the stage) see ``[B, S, n*D]``. A layer that returns
    more than its streams (HY-V4's returns ``(streams, top-k indices)``) returns the rest as it is."""
    if block_path is None:
        return
    for layer in chunk.get_submodule(block_path).children():
        wrap(layer, "native_flat_streams", lambda _m, inner: _flat_streams(inner, streams, flatten_output=True))
    head = getattr(getattr(chunk, "model", None), "hc_head", None)
    if isinstance(head, nn.Module) and hasattr(head, "hc_fn"):  # NotOnThisStage before the last stage
        wrap(head, "native_flat_streams", lambda _m, inner: _flat_streams(inner, streams, flatten_output=False))


def _flat_streams(forward, streams: int, flatten_output: bool):
    @functools.wraps(forward)
    def run(hidden_states: Tensor, *args: Any, **kwargs: Any):
        if hidden_states.dim() == 3:  # flat [B, S, n*D] (the layer before, or a previous stage's)
            hidden_states = hidden_states.unflatten(-1, (streams, -1))
        output = forward(hidden_states, *args, **kwargs)
        if not flatten_output:
            return output
        if isinstance(output, tuple):
            return (output[0].flatten(-2), *output[1:])
        return output.flatten(-2)

    return run


# ------------------------------------------------------------------ block recompute of their own connections
def recompute_hyper_connections(chunk: nn.Module, block_path: str | None, layer_forward) -> None:
    """``mhc_block`` on the family's own hyper-connections: each decoder layer of ``chunk`` runs
    ``layer_forward(layer, checkpoints, *args, **kwargs)`` (the family's forward of a layer, its
    hyper-connections through :class:`HyperConnectionCheckpoints`) whenever its recompute group
    (``lightning_mhc.recompute.groups``, attached by the recompute pass) has a manager, i.e. in a
    training forward with grad; otherwise the layer's own forward, as written. Runs before
    :func:`carry_streams_flat`, which then wraps this forward (the streams arrive ``[B, S, n, D]``)."""
    if block_path is None:
        return
    for name, layer in chunk.get_submodule(block_path).named_children():
        wrap(layer, "native_block_recompute", functools.partial(_under_block_recompute, layer_forward=layer_forward,
                                                                 name=f"{block_path}.{name}"))


def _under_block_recompute(layer: nn.Module, forward, layer_forward, name: str):
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any):
        roles = roles_of(layer)  # given by the recompute pass (``recompute.groups``)
        group = roles.recompute_group
        manager = group.manager if group is not None else None
        if manager is None:  # evaluation, no grad, or no group: the layer as written
            return forward(*args, **kwargs)
        last = roles.last_in_recompute_group
        output = layer_forward(layer, HyperConnectionCheckpoints(manager, name, last),
                               *args, **kwargs)
        if last:  # the group's last output, kept: every checkpoint of the group recomputed from its hook
            group.finish(output[0] if isinstance(output, tuple) else output)
        return output

    return run


class HyperConnectionCheckpoints:
    """One layer's checkpoints in its recompute group's ``MHCBlockRecomputeManager``, as the block
    recompute makes them for the hyper-connections we add (``hyper_connections.py``): per
    sub-layer the hyper-connection with the branch's norm one checkpoint (:meth:`entry`) and the
    mix of the streams with the branch's output another (:meth:`mix`), except the group's last
    mix, the manager's hook tensor. Their outputs are freed after the group's forward and
    recomputed, in forward order, from one hook when the group's output gradient arrives; the
    attention and the MLP keep their own activations (they saved the freed tensors, refilled in
    place before their backward)."""

    def __init__(self, manager, name: str, last_in_group: bool) -> None:
        self.manager, self.name, self.last_in_group = manager, name, last_in_group

    def entry(self, branch: str, hyper_connection: nn.Module, norm: nn.Module, streams: Tensor) -> tuple:
        """``(*maps, norm(collapsed))`` of ``hyper_connection(streams) = (*maps, collapsed)``."""
        def run(s: Tensor) -> tuple:
            *maps, collapsed = hyper_connection(s)
            return (*maps, norm(collapsed))

        return self.manager.checkpoint(run, streams, name=f"{self.name}.{branch}+norm")

    def mix(self, branch: str, function, *args: Any, last_of_layer: bool = False) -> Tensor:
        """``function(*args)``, the streams after the branch: checkpointed unless it is the group's
        last output."""
        if last_of_layer and self.last_in_group:
            return function(*args)
        return self.manager.checkpoint(function, *args, name=f"{self.name}.{branch} mix")
