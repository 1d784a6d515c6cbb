"""Data-parallel gradient reduction overlapped with backward (megatron's ``overlap_grad_reduce``).

The parameters of each model chunk are cut into the same buckets as the
post-backward reduction (reverse parameter order, up to ``bucket_bytes``). The
schedule calls :meth:`OverlappedGradReduction.start` right before a chunk's last
backward of the step; from then on a ``post_accumulate_grad`` hook counts the
gradients that are final, and a bucket whose gradients are all final starts its
asynchronous all-reduce at once, while backward goes on through the earlier
layers. :meth:`finish` (before the optimizer step) starts what is left (buckets
with parameters that got no gradient), waits for every bucket and writes the
averages back. The sums are the post-backward reduction's, bucket by bucket:
the same numbers.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_mhc.distributed.grads import DEFAULT_BUCKET_BYTES, buckets
from lightning_mhc.distributed.layout import ParallelLayout


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], chunk: int) -> None:
        self.params, self.chunk = params, chunk
        self.ready: set[int] = set()
        self.grads: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.work = None


class OverlappedGradReduction:
    """Hooks on every parameter of ``chunks`` (a rank's stage, or its virtual-pipeline chunks)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], layout: ParallelLayout,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.layout = layout
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._active = [False] * len(chunks)
        self.overlapped = 0
        """Buckets of the last step whose all-reduce started during backward."""
        for index, chunk in enumerate(chunks):
            params = [p for p in reversed(list(chunk.parameters())) if p.requires_grad]
            for bucket_params in buckets(params, bucket_bytes):
                bucket = _Bucket(bucket_params, index)
                self.buckets.append(bucket)
                for p in bucket_params:
                    self._bucket_of[id(p)] = bucket
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
            self._launch(bucket)
            self.overlapped += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.grads = [p.grad for p in bucket.params if p.grad is not None]
        bucket.flat = _flatten_dense_tensors(bucket.grads)
        bucket.work = dist.all_reduce(bucket.flat, group=self.layout.dp_group, async_op=True)

    def finish(self) -> int:
        """Start the buckets still waiting, wait for all, write the DP averages into ``.grad``;
        returns how many buckets had started during backward."""
        world = self.layout.data_parallel_size
        for bucket in self.buckets:
            if bucket.work is None and any(p.grad is not None for p in bucket.params):
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.flat /= world
                for grad, reduced in zip(bucket.grads, _unflatten_dense_tensors(bucket.flat, bucket.grads)):
                    grad.copy_(reduced)
            bucket.ready, bucket.grads, bucket.flat, bucket.work = set(), [], None, None
        self._active = [False] * len(self._active)
        overlapped, self.overlapped = self.overlapped, 0
        return overlapped

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
