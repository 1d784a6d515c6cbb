"""The pipeline contract between ``MHCParallelStrategy`` (Trainer or Fabric) and a module.

A module that implements it is trained with the 1F1B schedule; any other
module trains as plain data parallel (TP = PP = 1). The contract,
megatron-style:

- ``configure_model()``: build this rank's pipeline stage (and only it);
- ``set_input_tensor(tensor)``: receive the previous stage's output;
- ``forward_step(microbatch)``: this stage's forward of one microbatch;
- ``loss_func(output, microbatch)``: the microbatch's scalar loss (last stage);
- ``pipeline_tensor_shape(microbatch)``: the shape of what crosses stages.

Its ``training_step`` / ``validation_step`` call
``self.trainer.strategy.forward_backward(self, batch[, forward_only=True])``
(a Fabric loop calls ``fabric.strategy.forward_backward(model, batch)``),
which splits the batch into microbatches and runs the schedule.

With a virtual pipeline (``virtual_pipeline_model_parallel_size = v``) the module
builds ``v`` chunks and adds ``model_chunks()`` (the chunk modules, in order);
``set_input_tensor`` and ``forward_step`` then take the chunk's index as
``chunk=``. ``MHCGPTModule`` implements both forms.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class PipelineModule(Protocol):
    def set_input_tensor(self, tensor: torch.Tensor | None) -> None: ...

    def forward_step(self, microbatch: Any) -> torch.Tensor: ...

    def loss_func(self, output: torch.Tensor, microbatch: Any) -> torch.Tensor: ...

    def pipeline_tensor_shape(self, microbatch: Any) -> tuple[int, ...]: ...


def is_pipeline_module(module: Any) -> bool:
    return isinstance(module, PipelineModule)


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split a batch (a tensor, or a dict/list/tuple of tensors, batch dimension first)
    into ``num_microbatches`` equal microbatches."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension: {sorted(sizes)}")
    size = sizes.pop()
    if size % num_microbatches:
        raise ValueError(
            f"the per-rank batch of {size} samples does not split into num_microbatches="
            f"{num_microbatches} equal microbatches. Make the DataLoader batch size a multiple of "
            f"{num_microbatches}, or change num_microbatches."
        )
    chunks = [leaf.chunk(num_microbatches) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    return [
        tree_unflatten([c[i] if c is not None else leaf for c, leaf in zip(chunks, leaves)], spec)
        for i in range(num_microbatches)
    ]


def has_model_chunks(module: Any) -> bool:
    return callable(getattr(module, "model_chunks", None))


class ModuleChunk:
    """Chunk ``index`` of a pipelined LightningModule, as the interleaved schedule sees it."""

    def __init__(self, module: Any, index: int) -> None:
        self.module, self.index = module, index

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.module.set_input_tensor(tensor, chunk=self.index)

    def parameters(self):
        return self.module.model_chunks()[self.index].parameters()

    def forward_step(self, microbatch: Any) -> torch.Tensor:
        return self.module.forward_step(microbatch, chunk=self.index)
