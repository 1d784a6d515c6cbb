"""Gradient reduction after the last microbatch, and the global gradient norm.

megatron-core's DistributedDataParallel needs CUDA (contiguous grad buffers on
the current device); this is the device-agnostic equivalent for gloo and NCCL:
a bucketed all-reduce over the DP group (DP x CP with context parallelism: every CP rank holds
the same parameters and saw a part of each sample, so its gradient is a partial sum; averaged over
DP only, see :func:`reduction_group`), under sequence parallelism the
all-reduce over TP of the parameters replicated across TP (norms,
hyper-connections, row-parallel biases: each TP rank saw only its part of the
sequence; megatron's ``_allreduce_layernorm_grads``), the all-reduce of the
tied embedding/output-layer gradients between the first and last stage, and
the gradient norm over TP, PP and DP with each replicated parameter counted
once. Every function takes the :class:`ParallelLayout`.

Under expert parallelism an expert's parameters (``ParameterPlacement.expert``, ``placement.py``)
live on the ranks of one EP rank only: their gradients are reduced over the expert-data-parallel
group (:func:`reduction_group`, the one place a parameter's group is chosen) but divided by the
whole data-parallel size like every other gradient, since each already sums the tokens its EP
peers sent it (megatron's ``expert_gradient_scaling_factor``).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import placement_of
from lightning_mhc.errors import ConfigError

DEFAULT_BUCKET_BYTES = 25 * 2**20


def buckets(grads: list[torch.Tensor], bucket_bytes: int,
            alone: Callable[[torch.Tensor], bool] | None = None) -> Iterable[list[torch.Tensor]]:
    """Consecutive same-dtype gradients (or parameters), up to ``bucket_bytes`` per bucket; a
    tensor for which ``alone`` is true gets a bucket of its own."""
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        single = alone is not None and alone(grad)
        if bucket and (single or size + nbytes > bucket_bytes or grad.dtype != bucket[0].dtype
                       or (alone is not None and alone(bucket[0]))):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket


def by_reduction_group(params: Iterable[torch.nn.Parameter], layout: ParallelLayout
                       ) -> list[tuple[object, list[torch.nn.Parameter]]]:
    """``params`` split into (group, its parameters in order): the dense ones, then the experts'."""
    params = list(params)
    expert = [placement_of(p).expert for p in params]
    split = [[p for p, e in zip(params, expert) if not e], [p for p, e in zip(params, expert) if e]]
    return [(reduction_group(part[0], layout), part) for part in split if part]


def _allreduce_flat(grads: list[torch.Tensor], group, bucket_bytes: int, divisor: int = 1) -> int:
    """Sum ``grads`` in buckets over ``group``, then divide by ``divisor``; returns the number of
    buckets."""
    count = 0
    for bucket in buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat /= divisor
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)
        count += 1
    return count


def _parameters(models: torch.nn.Module | Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The parameters of one module or of a rank's model chunks, in order."""
    if isinstance(models, torch.nn.Module):
        models = [models]
    return [p for model in models for p in model.parameters()]


def reduction_group(param: torch.nn.Parameter, layout: ParallelLayout, name: str | None = None):
    """The one place that says over which ranks a parameter's gradient is reduced: the ranks that
    hold a replica of it. What TP does not split is replicated over DP x CP (``dp_cp_group``); an
    expert's parameters (``ParameterPlacement.expert``) over the expert-data-parallel
    ranks only (``expert_dp_group``). The sum is divided by DP (:func:`gradient_divisor`)
    in either case: the CP ranks' losses are parts of one sample's loss (each rank's loss is its
    tokens' sum over the sample's whole token count), so their gradients add up, not average.

    Under TP a trainable parameter no builder placed (``ParameterPlacement.placed``: one added to a
    split model afterwards) is refused: whether its TP copies are one tensor or slices, and whether
    their gradients are whole or parts, is unknown, and each TP rank would train its own."""
    if layout.tensor_model_parallel_size > 1 and param.requires_grad and not placement_of(param).placed:
        raise ConfigError(
            f"{name or 'a parameter'} is trainable but its placement over the "
            f"{layout.tensor_model_parallel_size} tensor-parallel ranks is unknown (it was not built by "
            "parallelize or the model's parallel layers, nor placed as a PEFT LoRA adapter), so each TP rank "
            "would train its own copy: create it before parallelize(), or freeze it (requires_grad=False).")
    return layout.expert_dp_group if placement_of(param).expert else layout.dp_cp_group


def check_placements(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], layout: ParallelLayout) -> None:
    """:func:`reduction_group` of every parameter, at fit start: an unknown placement is refused
    before any step, naming the first such parameter."""
    for name, param in named_parameters:
        reduction_group(param, layout, name)


def gradient_divisor(layout: ParallelLayout) -> int:
    """What every reduced gradient is divided by: the data-parallel size (not DP x CP: the CP
    ranks' losses are parts of one sample's; nor expert-DP: an expert's gradient, reduced over
    fewer ranks, holds its EP peers' tokens already, megatron's ``expert_gradient_scaling_factor``)."""
    return layout.data_parallel_size


def has_replicas(layout: ParallelLayout) -> bool:
    """Whether any parameter is replicated over other ranks (DP x CP > 1): a gradient reduction runs."""
    return layout.data_parallel_size * layout.context_parallel_size > 1


def allreduce_data_parallel_grads(
    params: Iterable[torch.nn.Parameter], layout: ParallelLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Sum gradients over their :func:`reduction_group` in buckets (in reverse parameter order,
    the order backward produces them), divided by DP. Returns the number of buckets (0 without
    replicas)."""
    if not has_replicas(layout):
        return 0
    count = 0
    for group, group_params in by_reduction_group(reversed(list(params)), layout):
        grads = [p.grad for p in group_params if p.grad is not None]
        count += _allreduce_flat(grads, group, bucket_bytes, divisor=gradient_divisor(layout))
    return count


def is_partial_over_tp(param: torch.nn.Parameter, layout: ParallelLayout) -> bool:
    """A TP-replicated parameter applied to this rank's part of the activations, so that its
    gradient is a partial sum over the TP ranks: a norm on this rank's part of the sequence
    (megatron marks it ``sequence_parallel``; with SP on), or a module the plan runs on this
    rank's heads (``partial_over_tp``: a per-head norm, ``parallelize``'s ``ReplicateOnSplit``)."""
    placement = placement_of(param)
    if placement.split:
        return False
    return placement.partial_over_tp or (layout.sequence_parallel and placement.sequence_parallel)


def sum_partial_grads_over_tp(pairs: Iterable[tuple[torch.nn.Parameter, torch.Tensor | None]],
                              layout: ParallelLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Sum over TP the gradients (a parameter's own or its piece's) of the parameters
    :func:`is_partial_over_tp`; returns the number of buckets."""
    if layout.tensor_model_parallel_size == 1:
        return 0
    grads = [grad for param, grad in pairs if grad is not None and is_partial_over_tp(param, layout)]
    return _allreduce_flat(grads, layout.tp_group, bucket_bytes) if grads else 0


def sum_embedding_grads(grads: list[torch.Tensor], layout: ParallelLayout) -> None:
    """Sum the gradients of the tied word embedding (first stage) and its output-layer copy
    (last stage) in place, so both copies take the same step. Nothing to do without PP."""
    if grads and layout.pipeline_model_parallel_size > 1 and layout.embedding_group is not None:
        _allreduce_flat(grads, layout.embedding_group, DEFAULT_BUCKET_BYTES)


def allreduce_embedding_grads(params: Iterable[torch.nn.Parameter], layout: ParallelLayout) -> None:
    """:func:`sum_embedding_grads` on the parameters' own gradients (zeros where a stage has none)."""
    shared = [p for p in params if placement_of(p).shared_embedding]
    if layout.pipeline_model_parallel_size == 1 or layout.embedding_group is None or not shared:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shared]
    sum_embedding_grads(grads, layout)
    for p, grad in zip(shared, grads):
        p.grad = grad


def finalize_model_grads(models: torch.nn.Module | Iterable[torch.nn.Module], layout: ParallelLayout,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlapped=None) -> None:
    """Everything between the last backward and the optimizer step (megatron's name), for one
    module or a rank's model chunks: the DP average (``overlapped``: the
    ``OverlappedGradReduction`` that started it during backward, finished here), then the TP
    sum of the parameters that saw part of the activations, then the tied embedding."""
    params = _parameters(models)
    if overlapped is not None:
        overlapped.finish()
    else:
        allreduce_data_parallel_grads(params, layout, bucket_bytes)
    sum_partial_grads_over_tp([(p, p.grad) for p in params], layout, bucket_bytes)
    allreduce_embedding_grads(params, layout)


def _counted_once(param: torch.nn.Parameter, layout: ParallelLayout) -> bool:
    """Replicated across TP: count on TP rank 0 only; the last stage's tied copy: not at all."""
    placement = placement_of(param)
    if not placement.split and layout.tensor_model_parallel_rank > 0:
        return False
    if placement.shared_embedding and not layout.is_first_stage:
        return False
    return True


def norm_of(grads: Iterable[tuple[torch.nn.Parameter, torch.Tensor]], layout: ParallelLayout, group=None,
            device: torch.device | None = None) -> float:
    """The L2 norm over ``group`` of ``(parameter, gradient)`` pairs, each parameter counted once
    (``_counted_once``): the gradient may be the parameter's own or a piece of it (the
    distributed optimizer's). With a ``group`` (the model-parallel ranks: every DP rank holds the
    whole model) the experts' squares are summed over the EP ranks too, which hold different
    experts; ``None`` (the world) counts them already."""
    grads = list(grads)
    device = device or (grads[0][1].device if grads else torch.device("cpu"))
    dense, experts = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
    for param, grad in grads:
        if _counted_once(param, layout):
            (experts if placement_of(param).expert else dense).add_(grad.detach().float().pow(2).sum())
    if group is not None and layout.expert_model_parallel_size > 1:
        dist.all_reduce(experts, group=layout.ep_group)
    square = dense + experts
    dist.all_reduce(square, group=group)
    return math.sqrt(square.item())


def scale_to_norm_(grads: Iterable[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm``
    (nothing for a non-finite norm)."""
    scale = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and scale < 1.0:
        for grad in grads:
            grad.detach().mul_(scale)


def global_grad_norm(params: Iterable[torch.nn.Parameter], layout: ParallelLayout) -> float:
    """L2 norm of the whole model's gradient across TP and PP (DP replicas are identical
    after reduction), each parameter counted once."""
    return norm_of([(p, p.grad) for p in params if p.grad is not None], layout, layout.model_parallel_group)


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, layout: ParallelLayout) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, layout)
    scale_to_norm_([p.grad for p in params], max_norm, norm)
    return norm
