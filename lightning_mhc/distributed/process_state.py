"""What a strategy's run changes in its process outside itself, owned for the run's lifetime.

A run installs the parallel randomizer, seeds torch's generators, registers the context-parallel
attention and mask functions in transformers' global registries, and makes torch's and
transformers' checkpoint functions replay the randomizer's streams (``recompute/rng.py``).
:class:`ProcessState` (made by the strategy's runtime when its processes start) records each such
change with the way to undo it, and :meth:`ProcessState.release` (at the strategy's teardown)
undoes them in reverse order, so a process that fits twice (another layout, CP then none) is
left as the first run found it. The model-parallel groups are the layout's: the Fabric strategy
destroys them at teardown; the Trainer's strategy keeps them after ``fit`` for
``trainer.save_checkpoint`` (they go when another layout is built, or at exit).

Left global on purpose, as pure memoisation of facts that do not change in a process: the classes
made for hyper-connected blocks (one per base class and role), the fused kernels' backend
capability check; and the per-thread stack of running hyper-connected blocks, which is empty
outside a forward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint

from lightning_mhc.recompute.rng import (get_parallel_randomizer, replaying_tracked_rng,
                                         set_parallel_randomizer)

_CURRENT: "ProcessState | None" = None
_ABSENT = object()


def current_process_state() -> "ProcessState | None":
    """The state of the run now holding this process (None outside a strategy's run): library code
    that registers something global records its undo there."""
    return _CURRENT


def register_for_the_run(mapping: dict, key: Any, value: Any) -> None:
    """``mapping[key] = value`` in a registry global to the process (transformers' attention
    functions): taken out again at the teardown of the run holding the process
    (:meth:`ProcessState.register`); outside a run (a model split by hand) left in place, as the
    registry's own ``register`` leaves it."""
    state = current_process_state()
    if state is None:
        mapping[key] = value
    else:
        state.register(mapping, key, value)


class ProcessState:
    """The undo of each change a run made to its process, released once at teardown."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._previous: ProcessState | None = None

    def enter(self) -> None:
        """Take the process: its RNG (torch's generators, the installed randomizer) is put back at
        release, and torch's and transformers' checkpoint functions replay the randomizer's streams
        until then (a user's ``torch.utils.checkpoint.checkpoint`` of a block, and Hugging Face's
        ``gradient_checkpointing_enable()`` called during the run)."""
        global _CURRENT
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        randomizer = get_parallel_randomizer()

        def restore_rng() -> None:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            set_parallel_randomizer(randomizer)

        self._undo.append(restore_rng)
        self.patch(torch.utils.checkpoint, "checkpoint", replaying_tracked_rng(torch.utils.checkpoint.checkpoint))
        try:
            import transformers.modeling_utils as hf_modeling
        except ImportError:
            hf_modeling = None
        if hf_modeling is not None and callable(getattr(hf_modeling, "checkpoint", None)):
            self.patch(hf_modeling, "checkpoint", replaying_tracked_rng(hf_modeling.checkpoint))
        self._previous, _CURRENT = _CURRENT, self

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until release (then the earlier value, or none, is put back)."""
        old = owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name, _ABSENT)
        setattr(owner, name, value)
        self._undo.append(lambda: delattr(owner, name) if old is _ABSENT else setattr(owner, name, old))

    def register(self, mapping: dict, key: Any, value: Any) -> None:
        """``mapping[key] = value`` until release (then the earlier value, or none, is put back)."""
        old = mapping.get(key, _ABSENT)
        mapping[key] = value
        self._undo.append(lambda: mapping.pop(key, None) if old is _ABSENT else mapping.__setitem__(key, old))

    def release(self) -> None:
        """Undo every recorded change, the latest first; then the process is no longer this run's."""
        global _CURRENT
        while self._undo:
            self._undo.pop()()
        if _CURRENT is self:
            _CURRENT, self._previous = self._previous, None
