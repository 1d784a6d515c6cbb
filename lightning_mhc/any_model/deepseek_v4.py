"""DeepSeek-V4 (``model_type`` ``deepseek_v4``, transformers' ``DeepseekV4ForCausalLM``) in
``parallelize``: what its family record (``families.py``) calls beyond the generic steps.

V4 carries hyper-connections of its own (``hc_mult`` streams, ``[B, S, n, D]`` between its decoder
layers, collapsed by ``model.hc_head`` before the final norm): ``parallelize`` adds none
(``FamilyRecord.native_streams``) and runs its own as they are.

- :func:`carry_streams_flat`: every decoder layer takes and returns its streams flat,
  ``[B, S, n*D]``, as every other family's blocks carry their hidden states, so the pipeline sends
  and receives them like any activation (``ParallelModel.pipeline_tensor_shape`` is
  ``n * hidden``), and ``hc_head`` (on the last stage, after the blocks) takes them flat too. The
  views change no value: one process is bit-exact with the model as written.
- :func:`check_layout`: the layouts not built for V4 yet, refused in one line before anything is
  built.
"""
from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn

from lightning_mhc.any_model.plan import TPPlan
from lightning_mhc.errors import ConfigError

DEEPSEEK_V4 = TPPlan(layers={"model.embed_tokens": "vocab", "lm_head": "column"}, output="lm_head")
"""Hugging Face ``DeepseekV4ForCausalLM``: its vocabulary and head; the rest is not split over TP
yet (:func:`check_layout` refuses TP > 1)."""

NOT_YET = {
    "tensor_model_parallel_size": "tensor parallelism (its low-rank query, per-head sinks and grouped output "
                                  "projection are not split yet)",
    "expert_model_parallel_size": "expert parallelism (its hash router's tid2eid and score-correction bias are "
                                  "not placed yet)",
}
"""The layout sizes above 1 that V4 does not run on yet, and why (context parallelism: the
record's ``context_parallel_refusal``, :data:`NOT_UNDER_CP`)."""
NOT_UNDER_CP = "its sliding-window and compressed attention are not split over the sequence yet"


def check_layout(model: nn.Module, layout: Any) -> None:
    """Refuse, before anything is built, a layout dimension V4 does not run on yet (:data:`NOT_YET`)."""
    for size, what in NOT_YET.items():
        value = getattr(layout, size, 1)
        if value > 1:
            raise ConfigError(f"{type(model).__name__} (model_type 'deepseek_v4'): {size}={value} needs {what}; "
                              "run it with pipeline and data parallelism only.")


def carry_streams_flat(chunk: nn.Module, block_path: str | None, streams: int) -> None:
    """Each decoder layer of ``chunk`` (the modules of ``block_path``) and its ``hc_head`` (where
    this chunk holds it) take their streams flat or not, and the layers return them flat: the
    forwards are wrapped, so the pipeline's hooks around them (a stage's first layer taking the
    received activations, its last one ending the stage) see ``[B, S, n*D]``."""
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
        return output.flatten(-2) if flatten_output else output

    return run
