"""Data-parallel gradient reduction overlapped with backward (megatron's ``overlap_grad_reduce``).

The parameters of each model chunk are cut into buckets (reverse parameter order, up to
``bucket_bytes``). The schedule calls :meth:`OverlappedGradReduction.start` right before a
chunk's last backward of the step; from then on a ``post_accumulate_grad`` hook counts the
gradients that are final, and a bucket whose gradients are all final starts its asynchronous
reduction at once, while backward goes on through the earlier layers. :meth:`finish` (before the
optimizer step) starts what is left, waits for every bucket and completes it.

A bucket decides what its reduction is: :class:`AllReduceBucket` sums the gradients over the
ranks that hold its parameters (``grads.reduction_group``: DP x CP, or expert-DP for an expert's;
a bucket holds dense or expert parameters, never both), divides by DP, and writes them back into ``.grad``
(the same sums as the post-backward reduction, bucket by bucket); the distributed optimizer's buckets reduce-scatter them instead
(``lightning_mhc.distributed.optimizer``). Without :meth:`start`, :meth:`finish` alone is the
post-backward reduction over the same buckets.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_mhc.distributed.grads import DEFAULT_BUCKET_BYTES, buckets, by_reduction_group, gradient_divisor
from lightning_mhc.distributed.layout import ParallelLayout


class AllReduceBucket:
    """Gradients summed over ``group`` and divided by DP in place: one flat all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], chunk: int, group) -> None:
        self.params, self.chunk, self.group = params, chunk, group
        self.ready: set[int] = set()
        self.work = None
        self._grads: list[torch.Tensor] = []
        self._flat: torch.Tensor | None = None

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def launch(self) -> None:
        self._grads = [p.grad for p in self.params if p.grad is not None]
        self._flat = _flatten_dense_tensors(self._grads)
        self.work = dist.all_reduce(self._flat, group=self.group, async_op=True)

    def complete(self, divisor: int) -> None:
        self.work.wait()
        self._flat /= divisor
        for grad, reduced in zip(self._grads, _unflatten_dense_tensors(self._flat, self._grads)):
            grad.copy_(reduced)
        self._grads, self._flat = [], None

    def reset(self) -> None:
        self.ready, self.work = set(), None


def all_reduce_buckets(chunks: Sequence[torch.nn.Module], layout: ParallelLayout,
                       bucket_bytes: int) -> list[AllReduceBucket]:
    return [AllReduceBucket(bucket_params, index, group)
            for index, chunk in enumerate(chunks)
            for group, params in by_reduction_group(
                [p for p in reversed(list(chunk.parameters())) if p.requires_grad], layout)
            for bucket_params in buckets(params, bucket_bytes)]


class OverlappedGradReduction:
    """Hooks on every parameter of the buckets (of a rank's stage, or its virtual-pipeline chunks;
    by default :func:`all_reduce_buckets` of ``chunks``)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], layout: ParallelLayout,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, bucket_list: Sequence | None = None) -> None:
        self.layout = layout
        self.buckets = list(bucket_list) if bucket_list is not None else all_reduce_buckets(chunks, layout, bucket_bytes)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._active = [False] * len(chunks)
        self.overlapped = 0
        """Buckets of the last step whose reduction started during backward."""
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for bucket in self.buckets for p in bucket.params]

    def start(self, chunk: int) -> None:
        """Chunk ``chunk``'s next backward is its last of this step: reduce as gradients finish."""
        self._active[chunk] = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if not self._active[bucket.chunk] or bucket.work is not None:
            return
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            bucket.launch()
            self.overlapped += 1

    def finish(self) -> int:
        """Start the buckets still waiting, wait for all and complete them; returns how many
        buckets had started during backward."""
        divisor = gradient_divisor(self.layout)
        for bucket in self.buckets:
            if bucket.work is None and bucket.has_grads():
                bucket.launch()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.complete(divisor)
            bucket.reset()
        self._active = [False] * len(self._active)
        overlapped, self.overlapped = self.overlapped, 0
        return overlapped

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
