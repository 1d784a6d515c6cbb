"""Megatron's pretraining sampler for Lightning: global batches in order, a DP rank's slice of each,
from a ``consumed_samples`` position.

Step ``k`` of an epoch trains on the global batch ``order[k*G:(k+1)*G]`` (``G`` the global batch
size); data-parallel rank ``r`` of ``D`` reads the ``G/D`` samples ``r*G/D ... (r+1)*G/D - 1`` of
it. So the samples of a step are the same under every DP size, and a resumed run starts at
``consumed_samples`` by arithmetic: no earlier sample is read (``ResumableLoader`` sets the
position from the checkpoint). ``order`` is the dataset's own order (Megatron's ``GPTDataset``
shuffles itself) or, with ``shuffle``, a permutation seeded by ``seed + epoch``.

It is a ``DistributedSampler`` (by subclassing, with the same ``num_replicas`` / ``rank`` /
``set_epoch``): Lightning then leaves it in place instead of inserting its own, and the
strategy's check that a loader splits by data-parallel rank applies to it as to any.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_mhc.errors import ConfigError


class ConsumedSamplesSampler(DistributedSampler):
    """Sample indices of this DP rank, a global batch at a time (see the module docstring)."""

    def __init__(self, dataset: Dataset, global_batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = False, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        if global_batch_size < 1 or global_batch_size % num_replicas:
            raise ConfigError(f"global batch size {global_batch_size} must be a positive multiple of the "
                              f"data-parallel size {num_replicas}.")
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // num_replicas
        self._start = 0

    @property
    def global_batches(self) -> int:
        """Whole global batches in an epoch (a last partial one is dropped, as Megatron does)."""
        return len(self.dataset) // self.global_batch_size

    def __len__(self) -> int:
        return self.global_batches * self.per_rank

    def start_at(self, consumed_samples: int) -> None:
        """The next iteration (only) begins at this sample of the epoch: a whole number of global batches."""
        if consumed_samples % self.global_batch_size:
            raise ConfigError(f"consumed_samples={consumed_samples} is not a whole number of global batches of "
                              f"{self.global_batch_size}: resume with the global batch size of the saving run.")
        self._start = consumed_samples

    def __iter__(self) -> Iterator[int]:
        n = self.global_batches * self.global_batch_size
        if self.shuffle:
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order[:n].tolist()
        else:
            order = range(n)
        start, self._start = self._start, 0
        offset = self.rank * self.per_rank
        for base in range(start, n, self.global_batch_size):
            yield from order[base + offset:base + offset + self.per_rank]


def data_parallel_split(trainer: Any) -> tuple[int, int]:
    """``(data-parallel size, rank)`` of the run ``trainer`` belongs to; ``(1, 0)`` without one."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) if trainer else None
    if not kwargs:
        return 1, 0
    return kwargs["num_replicas"], kwargs["rank"]


def global_batch_loader(dataset: Dataset, global_batch_size: int, trainer: Any, shuffle: bool = False,
                        seed: int = 0, num_workers: int = 0) -> DataLoader:
    """A DataLoader of this DP rank's ``global_batch_size / DP`` samples per step."""
    replicas, rank = data_parallel_split(trainer)
    sampler = ConsumedSamplesSampler(dataset, global_batch_size, replicas, rank, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=sampler.per_rank, sampler=sampler, drop_last=True, num_workers=num_workers)
