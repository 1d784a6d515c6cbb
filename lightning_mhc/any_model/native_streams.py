"""The families that carry hyper-connections of their own (``FamilyRecord.native_streams``:
DeepSeek-V4, HY-V4): how their decoder layers' streams cross pipeline stages.

Their layers take and return ``[B, S, n, D]`` (``n`` = the config's ``hc_mult``), and a learned
``model.hc_head`` collapses the streams before the final norm. :func:`carry_streams_flat` makes
every layer take and return them flat, ``[B, S, n*D]``, as every other family's blocks carry their
hidden states, so the pipeline sends and receives them like any activation
(``ParallelModel.pipeline_tensor_shape`` is ``n * hidden``), and ``hc_head`` (on the last stage,
after the blocks) takes them flat too. The views change no value: one process is bit-exact with the
model as written.
"""
from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn


def carry_streams_flat(chunk: nn.Module, block_path: str | None, streams: int) -> None:
    """Each decoder layer of ``chunk`` (the modules of ``block_path``) and its ``hc_head`` (where
    this chunk holds it) take their streams flat or not, and the layers return them flat: the
    forwards are wrapped, so the pipeline's hooks around them (a stage's first layer taking the
    received activations, its last one ending the stage) see ``[B, S, n*D]``. A layer that returns
    more than its streams (HY-V4's returns ``(streams, top-k indices)``) returns the rest as it is."""
    if block_path is None:
        return
    for layer in chunk.get_submodule(block_path).children():
        layer.forward = _flat_streams(layer.forward, streams, flatten_output=True)
    head = getattr(getattr(chunk, "model", None), "hc_head", None)
    if isinstance(head, nn.Module) and hasattr(head, "hc_fn"):  # NotOnThisStage before the last stage
        head.forward = _flat_streams(head.forward, streams, flatten_output=False)


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
