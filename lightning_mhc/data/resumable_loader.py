"""Mid-epoch resume for any training DataLoader: skip what the restored run already consumed.

A loader whose sampler is a ``ConsumedSamplesSampler`` (our data modules') skips by position:
the sampler starts at the restored ``consumed_samples`` and no earlier sample is read. Any other
loader skips by reading, as described next.

Lightning resumes a loader mid-epoch only if the loader is *stateful*
(``state_dict`` / ``load_state_dict``); otherwise it restarts the epoch's
iterator from the first batch while its counters continue, so a resumed run
trains on other batches than the uninterrupted one. ``ResumableLoader``
makes any loader stateful the simple, deterministic way: after a restore,
the first ``next()`` of the resumed epoch draws and discards the batches the
checkpointed run had completed in that epoch (the count comes from
Lightning's own restored batch progress, so it is right whatever the fetcher
prefetched). With a sampler seeded per epoch (the ``DistributedSampler``
that ``MHCParallelStrategy`` makes Lightning insert) the resumed run then sees
exactly the batches the uninterrupted run saw.

The data position is also recorded as ``consumed_samples`` (batches completed x per-rank batch
x data-parallel size, Megatron's name). A checkpoint resumes on another data-parallel size when
the global batch stays the same (``lightning-mhc-train`` keeps ``data.global_batch_size``): the
``DistributedSampler`` deals the epoch's permutation round-robin, so the first ``k`` global
batches are the same samples under every DP size. A different global batch is refused.

The sampler's epoch is set here too, to the trainer's ``current_epoch``, when
an epoch's iteration starts. Lightning sets it from its *processed* epoch
count, which is one ahead after a resume from a checkpoint saved in
``on_train_epoch_end`` (the default ``ModelCheckpoint`` without validation):
every later epoch would then be shuffled as the next one.

The inner iterator is created lazily, at the first ``next()``: Lightning
calls ``iter()`` on a resumed loader before it calls ``set_epoch``, and a
loader with workers would otherwise draw its indices from epoch 0's order.
Loaders that are already stateful (e.g. torchdata's ``StatefulDataLoader``)
are left alone by the strategy.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mhc.data.samplers import ConsumedSamplesSampler
from lightning_mhc.errors import ConfigError

_OWN = frozenset({"_loader", "_position", "_resuming", "_data_parallel_size"})


class ResumableLoader:
    """A training loader wrapper; every other attribute is the wrapped loader's.

    Args:
        loader: the DataLoader (or any sized/unsized iterable) Lightning prepared.
        position: returns the fit loop's ``(current epoch, batches of it completed)``.
        data_parallel_size: the number of ranks that read different samples.
    """

    def __init__(self, loader: Any, position: Callable[[], tuple[int, int]], data_parallel_size: int = 1) -> None:
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_position", position)
        object.__setattr__(self, "_resuming", False)
        object.__setattr__(self, "_data_parallel_size", data_parallel_size)

    @property
    def global_batch_size(self) -> int | None:
        batch = getattr(self._loader, "batch_size", None)
        return batch * self._data_parallel_size if batch else None

    # ----------------------------------------------------- Lightning's _Stateful
    def state_dict(self) -> dict[str, Any]:
        """The data position: the restore reads Lightning's own restored batch counters, and
        checks that the global batch is the saving run's."""
        epoch, batches = self._position()
        state = {"epoch": int(epoch), "batches_completed": int(batches)}
        if self.global_batch_size:  # consumed_samples: Megatron's name for the data position
            state.update(global_batch_size=self.global_batch_size, consumed_samples=int(batches) * self.global_batch_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, current = state.get("global_batch_size"), self.global_batch_size
        if saved and current and saved != current:
            raise ConfigError(
                f"the checkpoint's run read {state.get('consumed_samples')} samples of epoch {state.get('epoch')} "
                f"in global batches of {saved} (per-rank batch x data-parallel size); this run's global batch is "
                f"{current} ({getattr(self._loader, 'batch_size', None)} x {self._data_parallel_size}). Resume with "
                f"a global batch of {saved}: per-rank batch_size = {saved} / data-parallel size "
                "(lightning-mhc-train: keep data.global_batch_size)."
            )
        object.__setattr__(self, "_resuming", True)

    # ------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        iterator = _LazySkippingIterator(self._loader, self._position, skip=self._resuming)
        object.__setattr__(self, "_resuming", False)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    # ------------------------------------------------------------ delegation
    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)

    def __repr__(self) -> str:
        return f"ResumableLoader({self._loader!r})"


class _LazySkippingIterator:
    """At the first ``next()``: sets the sampler's epoch, creates the loader's iterator and, when
    resuming, discards the batches of this epoch already completed (the position is read then:
    Lightning resets its restored progress between ``iter()`` and the first ``next()``)."""

    def __init__(self, loader: Any, position: Callable[[], tuple[int, int]], skip: bool) -> None:
        self._loader, self._position, self._skip, self._iterator = loader, position, skip, None

    def __iter__(self) -> "_LazySkippingIterator":
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            epoch, completed = self._position()
            _set_sampler_epoch(self._loader, epoch)
            skip = completed if self._skip else 0
            sampler = getattr(self._loader, "sampler", None)
            if skip and isinstance(sampler, ConsumedSamplesSampler):
                sampler.start_at(skip * sampler.global_batch_size)
                rank_zero_info(f"resuming mid-epoch at consumed_samples={skip * sampler.global_batch_size} "
                               f"(batch {skip} of epoch {epoch}): no earlier sample is read")
                skip = 0
            self._iterator = iter(self._loader)
            if skip:
                rank_zero_info(f"resuming mid-epoch: skipping the {skip} batches this epoch already consumed")
                for _ in range(skip):
                    next(self._iterator)
        return next(self._iterator)
