"""``CheckpointWithoutOutput``: megatron-core's API and semantics, device-agnostic,
plus block recompute's ``ckpt_manager``.

``checkpoint(run_function, *args)`` runs the function without building a
graph, saves its (detached) inputs, and returns outputs that later ops may
save for their own backward. ``discard_output_and_register_recompute(hook)``
frees the outputs' storage (shape and metadata stay) and registers a gradient
hook on ``hook`` that recomputes them and writes the result back into the
same storage, before any op that saved them runs its backward.

Arguments may be nested tuples/lists (``x_with_bias``) and non-tensors
(dropout probability); outputs may contain ``None``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_mhc.recompute.rng import (
    active_fork,
    fork_rng,
    get_all_rng_states,
    replaying_tracked_rng,
    set_all_rng_states,
)


def _storage_bytes_needed(t: Tensor) -> int:
    if t.numel() == 0:
        return 0
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return (t.storage_offset() + extent) * t.element_size()


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Runs ``run_function`` without grad in forward; backward differentiates the recomputed graph."""

    @staticmethod
    def forward(ctx, run_function, ckpt: "CheckpointWithoutOutput", in_spec, *flat_args):
        with torch.no_grad():
            outputs = run_function(*tree_unflatten(list(flat_args), in_spec))
        flat_out, ckpt.out_spec = tree_flatten(outputs)
        is_tensor = [isinstance(a, Tensor) for a in flat_args]
        ctx.save_for_backward(
            *(_detach(a) if t else None for a, t in zip(flat_args, is_tensor))
        )
        ctx.non_tensors = [None if t else a for a, t in zip(flat_args, is_tensor)]
        ctx.in_spec = in_spec
        ctx.ckpt_name = ckpt.name
        ctx.inputs = ctx.outputs = None
        ckpt.ctx = ctx
        return tuple(flat_out)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.outputs is None:
            raise RuntimeError(
                f"CheckpointWithoutOutput {ctx.ckpt_name!r}: backward reached the checkpoint before "
                "its recompute hook ran. The hook tensor must be computed from the checkpoint's "
                "outputs (its gradient has to arrive first)."
            )
        pairs = [
            (out, grad)
            for out, grad in zip(ctx.outputs, grads)
            if isinstance(out, Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = ctx.inputs
        ctx.inputs = ctx.outputs = None
        arg_grads = tuple(inp.grad if isinstance(inp, Tensor) else None for inp in inputs)
        return (None, None, None) + arg_grads


def _detach(t: Tensor) -> Tensor:
    out = t.detach()
    out.requires_grad_(t.requires_grad)
    return out


class CheckpointWithoutOutput:
    """Checkpoint a function and release its output (megatron-core semantics).

    Args:
        fp8: kept for megatron's signature; FP8 (Transformer Engine) is not supported.
        ckpt_manager: when given, :meth:`checkpoint` registers this checkpoint with
            the manager and :meth:`discard_output_and_register_recompute` does nothing:
            the manager discards every output and recomputes them from one hook.
        name: a label for error messages and the manager's plan.
    """

    def __init__(self, fp8: bool = False, ckpt_manager=None, *, name: str | None = None) -> None:
        if fp8:
            raise NotImplementedError("CheckpointWithoutOutput(fp8=True) needs Transformer Engine")
        self.fp8 = False
        self.ckpt_manager = ckpt_manager
        self.name = name
        self.run_function: Callable | None = None
        self.rng_states = None
        self.ctx = None
        self.outputs: tuple | None = None
        self.out_spec = None
        self.recomputed = False

    def checkpoint(self, run_function: Callable, *args: Any):
        """Run ``run_function(*args)`` keeping only its inputs for backward."""
        if self.run_function is not None:
            raise RuntimeError(
                f"CheckpointWithoutOutput {self.name!r} already holds a checkpoint; use one object "
                "per checkpointed call."
            )
        if self.name is None:
            self.name = getattr(run_function, "__qualname__", repr(run_function))
        self.run_function = run_function
        self.rng_states = get_all_rng_states()
        flat_args, in_spec = tree_flatten(args)
        flat_out = CheckpointWithoutOutputFunction.apply(run_function, self, in_spec, *flat_args)
        self.outputs = tuple(flat_out)
        if self.ckpt_manager is not None:
            self.ckpt_manager.add_checkpoint(self)
        return tree_unflatten(list(flat_out), self.out_spec)

    @property
    def output_tensors(self) -> list[Tensor]:
        return [o for o in (self.outputs or ()) if isinstance(o, Tensor)]

    def discard_output(self) -> None:
        """Free the outputs' storage; shapes and metadata stay for autograd."""
        for output in self.output_tensors:
            output.untyped_storage().resize_(0)

    def discard_output_and_register_recompute(self, hook_tensor: Tensor) -> None:
        """Free the outputs and recompute them when ``hook_tensor``'s gradient is computed.

        A no-op with a ``ckpt_manager`` (the manager does both for the whole block),
        and when ``hook_tensor`` does not require grad (evaluation, ``no_grad``):
        then nothing would recompute the outputs, so they are kept.
        """
        if self.ckpt_manager is not None or not hook_tensor.requires_grad:
            return
        self.discard_output()
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad=None) -> None:
        """Recompute the outputs into their original storage (a gradient hook)."""
        if self.recomputed:
            raise RuntimeError(
                f"CheckpointWithoutOutput {self.name!r}: recompute triggered twice. A checkpoint is "
                "recomputed once per forward; do not run backward twice through discarded outputs "
                "(retain_graph=True) and do not register its recompute on two hook tensors."
            )
        if self.ctx is None:
            raise RuntimeError(f"CheckpointWithoutOutput {self.name!r}: nothing was checkpointed")
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "Checkpointing is not compatible with torch.autograd.grad(); use .backward() "
                f"(checkpoint {self.name!r})."
            )
        ctx = self.ctx
        saved = ctx.saved_tensors
        for i, t in enumerate(saved):
            if t is not None and t.untyped_storage().nbytes() < _storage_bytes_needed(t):
                raise RuntimeError(
                    f"CheckpointWithoutOutput {self.name!r}: input {i} was discarded and has not "
                    "been restored; checkpoints must be recomputed in forward order."
                )
        inputs = [
            _detach(t) if t is not None else ctx.non_tensors[i] for i, t in enumerate(saved)
        ]
        with fork_rng():
            set_all_rng_states(self.rng_states)
            with active_fork(self.rng_states), torch.enable_grad():
                outputs = self.run_function(*tree_unflatten(list(inputs), ctx.in_spec))
        flat_out, _ = tree_flatten(outputs)
        with torch.no_grad():
            for output, fresh in zip(self.outputs, flat_out):
                if isinstance(output, Tensor):
                    storage = output.untyped_storage()
                    storage.resize_(fresh.untyped_storage().nbytes())
                    storage.copy_(fresh.untyped_storage())
        ctx.outputs, ctx.inputs = flat_out, inputs
        self.run_function = self.rng_states = self.outputs = self.ctx = None
        self.recomputed = True


def checkpoint(function: Callable, *args: Any, **kwargs: Any):
    """``torch.utils.checkpoint`` (non-reentrant) that also restores the parallel randomizer
    and registered RNG sources when it recomputes (inside the fork that was open in the forward);
    torch restores the CPU/CUDA generators."""
    return _REPLAYING_CHECKPOINT(function, *args, use_reentrant=False, **kwargs)


_REPLAYING_CHECKPOINT = replaying_tracked_rng(torch.utils.checkpoint.checkpoint)
