"""Sequence parallelism: the layer's token-wise part on ``s / TP`` tokens per tensor-parallel rank.

Under ``sequence_parallel`` the residual stream ``[s/TP, b, n*C]``, the norms, the
hyper-connections (their mappings are per token: no communication), the
bias-dropout-add and its dropout run on this rank's slice of the sequence. The
sequence is all-gathered before every column-parallel linear and reduce-scattered
after every row-parallel one (Megatron-LM's layout, arXiv 2205.05198).

megatron-core's own sequence-parallel mappings allocate on the current CUDA
device; these autograd functions use the input's device and the collectives
gloo and NCCL both provide (``all_gather_single``, ``reduce_scatter_single``; the
``*_tensor`` names before torch 2.13).
The TP group is megatron's, as for its tensor-parallel layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mhc.distributed.placement import place, placement_of
from lightning_mhc.errors import ConfigError


# torch >= 2.13 names them *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group():
    from megatron.core import parallel_state  # (here: planning a layout imports no megatron-core)

    return parallel_state.get_tensor_model_parallel_group()


def all_gather_sequence(x: Tensor) -> Tensor:
    """``[s/TP, ...]`` -> ``[s, ...]`` over the TP group (no autograd)."""
    world = dist.get_world_size(_group())
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=_group())
    return out


def _shards(x: Tensor) -> int:
    """The TP size, checked to divide the sequence (dim 0) of ``x``."""
    world = dist.get_world_size(_group())
    if x.shape[0] % world:
        raise ConfigError(f"sequence parallelism splits the sequence across {world} tensor-parallel ranks, "
                          f"but it has {x.shape[0]} tokens: make the sequence length a multiple of {world}.")
    return world


def reduce_scatter_sequence(x: Tensor) -> Tensor:
    """``[s, ...]`` -> this rank's ``[s/TP, ...]`` of the sum over the TP group (no autograd)."""
    out = torch.empty((x.shape[0] // _shards(x), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=_group())
    return out


def split_sequence(x: Tensor) -> Tensor:
    """``[s, ...]`` -> this rank's ``[s/TP, ...]`` (no autograd)."""
    return x.chunk(_shards(x), dim=0)[dist.get_rank(_group())].contiguous()


class _SequenceMapping(torch.autograd.Function):
    """A sequence communication ``forward`` (one of the dim-0 mappings above) whose gradient is
    ``backward``, on the sequence dimension ``dim`` of its input (0 in the project's GPT,
    ``[s, b, C]``; 1 in a batch-first model split by ``parallelize``, ``[b, s, C]``)."""

    @staticmethod
    def forward(ctx, x, forward, backward, dim):
        ctx.backward_mapping, ctx.dim = backward, dim
        return _on_dim(forward, x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _on_dim(ctx.backward_mapping, grad, ctx.dim), None, None, None


def _on_dim(mapping, x: Tensor, dim: int) -> Tensor:
    """``mapping`` (of dim 0) applied along ``dim`` of ``x``."""
    if dim == 0:
        return mapping(x.contiguous())
    return mapping(x.transpose(0, dim).contiguous()).transpose(0, dim).contiguous()


def sequence_mapping(x: Tensor, forward, backward, dim: int = 0) -> Tensor:
    """``forward(x)`` along the sequence dimension ``dim``, differentiable: its gradient is
    ``backward`` of the output's gradient (e.g. ``reduce_scatter_sequence`` / ``all_gather_sequence``)."""
    return _SequenceMapping.apply(x, forward, backward, dim)


def reduce_scatter_to_sequence_parallel_region(x: Tensor) -> Tensor:
    """``[s, ...]`` partial sums -> this rank's ``[s/TP, ...]`` of their sum (backward: all-gather):
    after a row-parallel linear."""
    return sequence_mapping(x, reduce_scatter_sequence, all_gather_sequence)


def scatter_to_sequence_parallel_region(x: Tensor) -> Tensor:
    """``[s, ...]`` replicated -> this rank's ``[s/TP, ...]`` (backward: all-gather): the
    embedding output."""
    return sequence_mapping(x, split_sequence, all_gather_sequence)


def mark_sequence_parallel_parameters(module: torch.nn.Module) -> None:
    """Mark the parameters replicated across TP that act on the sequence-parallel region
    (norms, hyper-connections, row-parallel biases) ``sequence_parallel`` (their
    ``ParameterPlacement``): their gradients are partial sums over TP, reduced by the runtime."""
    for p in module.parameters():
        if not placement_of(p).split:
            place(p, sequence_parallel=True)
