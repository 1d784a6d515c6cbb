"""Gradient reduction after the last microbatch, and the global gradient norm.

megatron-core's DistributedDataParallel needs CUDA (contiguous grad buffers on
the current device); this is the device-agnostic equivalent for gloo and NCCL:
a bucketed all-reduce over the DP group, the all-reduce of the tied
embedding/output-layer gradients between the first and last stage, and the
gradient norm over TP, PP and DP with each replicated parameter counted once.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_BYTES = 25 * 2**20


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive same-dtype gradients, up to ``bucket_bytes`` per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or grad.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket


def _allreduce_flat(grads: list[torch.Tensor], group, bucket_bytes: int, average: bool) -> int:
    """All-reduce ``grads`` in buckets over ``group``; returns the number of buckets."""
    world = dist.get_world_size(group)
    count = 0
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        if average:
            flat /= world
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)
        count += 1
    return count


def allreduce_data_parallel_grads(
    params: Iterable[torch.nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Average gradients over the DP group in buckets (in reverse parameter order, the order
    backward produces them). Returns the number of buckets (0 when DP = 1)."""
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return 0
    grads = [p.grad for p in reversed(list(params)) if p.grad is not None]
    return _allreduce_flat(grads, group, bucket_bytes, average=True)


def allreduce_embedding_grads(model: torch.nn.Module) -> None:
    """Sum the gradients of the tied word embedding (first stage) and its output-layer copy
    (last stage), so both copies take the same step. Nothing to do without PP."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    shared = [p for p in model.parameters() if getattr(p, "shared_embedding", False)]
    if not shared:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shared]
    _allreduce_flat(grads, parallel_state.get_embedding_group(), DEFAULT_BUCKET_BYTES, average=False)
    for p, grad in zip(shared, grads):
        p.grad = grad


def finalize_model_grads(model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Everything between the last backward and the optimizer step (megatron's name)."""
    allreduce_data_parallel_grads(model.parameters(), bucket_bytes)
    allreduce_embedding_grads(model)


def _counted_once(param: torch.nn.Parameter) -> bool:
    """Replicated across TP: count on TP rank 0 only; the last stage's tied copy: not at all."""
    if not getattr(param, "tensor_model_parallel", False) and parallel_state.get_tensor_model_parallel_rank() > 0:
        return False
    if getattr(param, "shared_embedding", False) and not parallel_state.is_pipeline_first_stage():
        return False
    return True


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of the whole model's gradient across TP and PP (DP replicas are identical
    after reduction), each parameter counted once."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if _counted_once(p):
            square += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(square, group=parallel_state.get_model_parallel_group())
    return math.sqrt(square.item())


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if not math.isfinite(norm):
        return norm
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in params:
            p.grad.detach().mul_(scale)
    return norm
