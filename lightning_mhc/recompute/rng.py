"""RNG states: the multi-dimensional parallel randomizer and the
capture/restore that recompute uses.

``MultiDimParallelRandomizer`` hands out a randomizer per set of parallel
dimensions that must draw the SAME numbers: ``fork("tensor")`` for dropout on
activations replicated across TP (hidden and embedding dropout),
``fork()`` for dropout inside TP-split regions (attention probabilities). Any
dimension not named differs (every fork differs across DP and PP). A fork
swaps the device's default generator (CPU, and CUDA when initialised), so
``F.dropout`` and SDPA need no change. Without an installed randomizer
(one process), ``fork`` is a no-op.

``get_all_rng_states`` / ``set_all_rng_states`` cover the CPU generator, the
CUDA generators when CUDA is initialised, the installed randomizer, and any
source registered with ``register_rng_state_source``; recomputed dropout is
therefore bit-identical. Forks nest (a replicated region inside a TP-split
one), and a recompute re-enters the fork that was open when its states were
taken (``active_fork``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, NamedTuple

import torch


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


_ACTIVE: list["_Randomizer"] = []
"""The randomizers whose fork is open, innermost last: the device generators hold the innermost
one's stream; the others' streams are in their ``cpu_state`` / ``cuda_state``."""


class _Randomizer:
    """CPU (and CUDA) generator states seeded once and advanced only inside ``fork``.

    Forks nest: entering another randomizer's fork inside this one parks this stream and
    resumes it afterwards (a dropout on replicated activations inside a TP-split region draws
    from the replicated stream, and the region's own draws continue where they stopped);
    re-entering the fork that is already innermost continues its stream.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if _cuda_active() else []):
            torch.manual_seed(seed)
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state() if _cuda_active() else None

    def _park(self) -> None:
        """The device generators' state (this stream, live) into ``cpu_state`` / ``cuda_state``."""
        self.cpu_state = torch.get_rng_state()
        if _cuda_active():
            self.cuda_state = torch.cuda.get_rng_state()

    def _resume(self) -> None:
        torch.set_rng_state(self.cpu_state)
        if _cuda_active():
            if self.cuda_state is None:  # CUDA initialised after this randomizer was made
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self.cuda_state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer = _ACTIVE[-1] if _ACTIVE else None
        if outer is self:
            yield
            return
        saved = None
        if outer is None:
            saved = torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda_active() else None)
        else:
            outer._park()
        self._resume()
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self._park()
            if outer is not None:
                outer._resume()
            else:
                torch.set_rng_state(saved[0])
                if saved[1] is not None:
                    torch.cuda.set_rng_state(saved[1])


class MultiDimParallelRandomizer:
    """Randomizers keyed by the parallel dimensions that share a seed (the randomizer's table).

    ``ranks`` and ``sizes`` map dimension names (e.g. ``tensor``, ``data``,
    ``pipeline``) to this rank's index and the dimension's size. The seed of
    ``get_randomizer(*same)`` is ``base_seed + same_code * prod(sizes) +
    sum(rank_d * stride_d for d not in same)``: equal exactly across the
    named dimensions.

    ``named_seeds``: further streams by name, each with a seed the caller chose (a stream that must
    equal one another layout draws, which no ``same_groups`` expresses: ``get_named_randomizer``).
    They are captured, restored and forked like the others.
    """

    def __init__(self, base_seed: int, ranks: dict[str, int], sizes: dict[str, int],
                 named_seeds: dict[str, int] | None = None) -> None:
        self.base_seed = base_seed
        self.names = list(sizes)
        self.ranks = ranks
        self.sizes = dict(sizes)
        self.strides = [1]
        for name in self.names:
            self.strides.append(self.strides[-1] * sizes[name])
        self.named_seeds = dict(named_seeds or {})
        self._randomizers: dict[tuple[bool, ...] | str, _Randomizer] = {}

    def seed_of(self, *same_groups: str) -> int:
        unknown = set(same_groups) - set(self.names)
        if unknown:
            raise ValueError(f"unknown parallel dimensions {sorted(unknown)}; known: {self.names}")
        same = tuple(name in same_groups for name in self.names)
        offset = sum(2**i for i, s in enumerate(same) if s) * self.strides[-1]
        offset += sum(self.ranks[n] * self.strides[i] for i, n in enumerate(self.names) if not same[i])
        return self.base_seed + offset

    def get_randomizer(self, *same_groups: str) -> _Randomizer:
        key = tuple(name in same_groups for name in self.names)
        if key not in self._randomizers:
            self._randomizers[key] = _Randomizer(self.seed_of(*same_groups))
        return self._randomizers[key]

    def get_named_randomizer(self, name: str) -> _Randomizer:
        if name not in self.named_seeds:
            raise ValueError(f"no stream named {name!r}; named streams: {sorted(self.named_seeds)}")
        if name not in self._randomizers:
            self._randomizers[name] = _Randomizer(self.named_seeds[name])
        return self._randomizers[name]

    def get_states(self) -> dict:
        """Every stream's state; taken inside a fork, the live stream is read from the generators
        and ``ACTIVE_KEY`` names the innermost fork (see :func:`active_fork`)."""
        keys = {id(r): k for k, r in self._randomizers.items()}
        innermost = _ACTIVE[-1] if _ACTIVE and id(_ACTIVE[-1]) in keys else None
        if innermost is not None:
            innermost._park()
        states: dict = {k: (r.cpu_state.clone(), None if r.cuda_state is None else r.cuda_state.clone())
                        for k, r in self._randomizers.items()}
        states[ACTIVE_KEY] = keys[id(innermost)] if innermost is not None else None
        return states

    def set_states(self, states: dict) -> None:
        """Restore :meth:`get_states` (outside any fork)."""
        states = {k: v for k, v in states.items() if k != ACTIVE_KEY}
        for key, (cpu, cuda) in states.items():
            randomizer = self._randomizers.get(key)
            if randomizer is None:
                randomizer = self._randomizers[key] = _Randomizer(self.base_seed)
            randomizer.cpu_state, randomizer.cuda_state = cpu.clone(), (None if cuda is None else cuda.clone())
        for key in set(self._randomizers) - set(states):  # created after the capture
            del self._randomizers[key]


ACTIVE_KEY = "active"
"""The entry of ``MultiDimParallelRandomizer.get_states()`` naming the fork open when they were taken."""

_RANDOMIZER: MultiDimParallelRandomizer | None = None


def set_parallel_randomizer(randomizer: MultiDimParallelRandomizer | None) -> None:
    global _RANDOMIZER
    _RANDOMIZER = randomizer


def get_parallel_randomizer() -> MultiDimParallelRandomizer | None:
    return _RANDOMIZER


def rng_fork(*same_groups: str):
    """The randomizer's fork for ``same_groups``; a no-op without an installed randomizer."""
    if _RANDOMIZER is None:
        return contextlib.nullcontext()
    return _RANDOMIZER.get_randomizer(*same_groups).fork()


# ------------------------------------------------------- capture and restore
class _Source(NamedTuple):
    get_states: Callable[[], Any]
    set_states: Callable[[Any], None]


_SOURCES: dict[str, _Source] = {}


def register_rng_state_source(
    name: str, get_states: Callable[[], Any], set_states: Callable[[Any], None]
) -> None:
    """Add an RNG whose state recompute must capture and restore (re-registering replaces)."""
    _SOURCES[name] = _Source(get_states, set_states)


def get_tracked_rng_states() -> dict[str, Any]:
    """States beyond torch's own generators: the parallel randomizer and registered sources."""
    states: dict[str, Any] = {name: source.get_states() for name, source in _SOURCES.items()}
    if _RANDOMIZER is not None:
        states["parallel_randomizer"] = _RANDOMIZER.get_states()
    return states


def set_tracked_rng_states(states: dict[str, Any]) -> None:
    for name, source in _SOURCES.items():
        if name in states:
            source.set_states(states[name])
    if _RANDOMIZER is not None and "parallel_randomizer" in states:
        _RANDOMIZER.set_states(states["parallel_randomizer"])


def get_all_rng_states() -> dict[str, Any]:
    states = get_tracked_rng_states()
    states["cpu"] = torch.get_rng_state()
    if _cuda_active():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_all_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    set_tracked_rng_states(states)


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    """Run a block and put every RNG back as it was before it."""
    saved = get_all_rng_states()
    try:
        yield
    finally:
        set_all_rng_states(saved)


def active_fork(states: dict[str, Any]):
    """The randomizer fork that was innermost when ``states`` (``get_tracked_rng_states`` or
    ``get_all_rng_states``) were taken, or a no-op: a recompute of work that ran inside a fork
    re-enters it, so nested forks park and resume the same streams as in the forward."""
    key = (states.get("parallel_randomizer") or {}).get(ACTIVE_KEY)
    if _RANDOMIZER is None or key is None or key not in _RANDOMIZER._randomizers:
        return contextlib.nullcontext()
    return _RANDOMIZER._randomizers[key].fork()


@contextlib.contextmanager
def restored_tracked_rng_states(states: dict[str, Any]) -> Iterator[None]:
    """Run a block with the tracked states set to ``states`` (and inside the fork that was open
    when they were taken), then put them back."""
    current = get_tracked_rng_states()
    set_tracked_rng_states(states)
    try:
        with active_fork(states):
            yield
    finally:
        set_tracked_rng_states(current)


def replaying_tracked_rng(checkpoint_fn: Callable) -> Callable:
    """``checkpoint_fn`` (``torch.utils.checkpoint.checkpoint``'s signature, either mode, or a
    ``functools.partial`` of it, as Hugging Face's ``_gradient_checkpointing_func``) made to re-run
    its function with the tracked RNG states it had when first run: torch's checkpoint restores
    only the CPU/CUDA generators, so without this a recompute's dropout drew from the parallel
    randomizer's streams as they had moved on since the forward, other masks, and the gradients
    were silently wrong. The first call of the function is the forward (reentrant or not); every
    later call is a recompute. Wrapping a wrapped function returns it unchanged."""
    if getattr(checkpoint_fn, "replays_tracked_rng", False):
        return checkpoint_fn

    @functools.wraps(checkpoint_fn)
    def checkpoint(function: Callable, *args: Any, **kwargs: Any):
        states = get_tracked_rng_states()
        calls = 0

        def run(*inner_args: Any, **inner_kwargs: Any):
            nonlocal calls
            calls += 1
            if calls == 1:
                return function(*inner_args, **inner_kwargs)
            with restored_tracked_rng_states(states):
                return function(*inner_args, **inner_kwargs)

        return checkpoint_fn(run, *args, **kwargs)

    checkpoint.replays_tracked_rng = True
    return checkpoint


def hf_checkpointing_modules(model: Any) -> tuple[Any, ...]:
    """The modules of ``model`` that Hugging Face's ``gradient_checkpointing_enable()`` gives a
    checkpointing function: those with a ``gradient_checkpointing`` flag. Fixed when the model is
    built, so a caller on the training path finds them once, not every micro-batch."""
    return tuple(module for module in model.modules() if hasattr(module, "gradient_checkpointing"))


def replay_tracked_rng_in_hf_checkpointing(model: Any, modules: tuple[Any, ...] | None = None) -> None:
    """Every Hugging Face checkpointing function set on ``model``'s modules
    (``gradient_checkpointing_enable()`` sets ``_gradient_checkpointing_func`` on each) wrapped by
    :func:`replaying_tracked_rng`, so their recomputes draw the forward's dropout masks. Run again
    whenever it may have been turned on since (a wrapped one stays as it is); ``modules``, the
    model's :func:`hf_checkpointing_modules` found before, spares the walk over the model."""
    for module in hf_checkpointing_modules(model) if modules is None else modules:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None:
            module._gradient_checkpointing_func = replaying_tracked_rng(func)
