"""Activation memory of a training forward.

``ActivationMemoryMeter`` records every tensor the autograd graph saves
during a forward (``saved_tensors_hooks``) and, at exit, counts the unique
storages still alive and non-empty, excluding parameters: the bytes the
graph holds for backward. Deterministic and device-agnostic (storages freed
by recompute have size 0). On CUDA it also reports the peak allocated memory.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class ActivationMemory:
    retained_bytes: int
    """Unique live storages of saved tensors, parameters excluded."""
    saved_tensors: int
    """Tensors packed by the graph during the forward."""
    peak_cuda_bytes: int | None
    """torch.cuda.max_memory_allocated() over the forward, on CUDA; else None."""


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` is a view of: the storage's own identity rather than its address,
    which every meta tensor shares (0: the planner traces on the meta device, planning/hf_activations.py)."""
    return tensor.untyped_storage()._cdata


class ActivationMemoryMeter:
    """``with ActivationMemoryMeter(model) as meter: loss = model(...)``; then ``meter.result``."""

    def __init__(self, *exclude_modules: torch.nn.Module) -> None:
        self._exclude = exclude_modules
        self._saved: list[weakref.ref] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.result: ActivationMemory | None = None

    def _pack(self, tensor: torch.Tensor):
        self._saved.append(weakref.ref(tensor))
        return tensor

    @staticmethod
    def _unpack(tensor):
        return tensor

    def __enter__(self) -> "ActivationMemoryMeter":
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._hooks.__enter__()
        return self

    def live_bytes(self, extra: Iterable[torch.Tensor] = (),
                   where: Callable[[torch.Tensor], bool] | None = None) -> int:
        """Bytes of the unique live storages of the tensors saved so far, plus ``extra``
        tensors held outside the graph (e.g. a pipeline schedule's in-flight outputs);
        ``where``: only the tensors it accepts (e.g. those shaped like the residual stream)."""
        params = {
            storage_key(p)
            for module in self._exclude
            for p in module.parameters()
        }
        storages: dict[int, int] = {}
        tensors = [ref() for ref in self._saved] + list(extra)
        for tensor in tensors:
            if tensor is None or (where is not None and not where(tensor)):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage_key(tensor) in params:
                continue
            storages[storage_key(tensor)] = storage.nbytes()
        return sum(storages.values())

    def saved_itself(self, tensor: torch.Tensor) -> bool:
        """Whether the graph saved this tensor object itself (not a detached alias of its storage,
        as a checkpoint saves its inputs): then it is counted as long as something keeps it alive."""
        return any(ref() is tensor for ref in self._saved)

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        peak = None
        if self._cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        self.result = ActivationMemory(self.live_bytes(), len(self._saved), peak)
