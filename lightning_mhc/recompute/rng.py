"""Capture and restore every RNG state that exists, so a recomputed dropout
mask is bit-identical to the forward one: the CPU generator, the CUDA
generators when CUDA is initialised, and any registered tracker (the parallel
RNG tracker registers itself here)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import torch


class _Source(NamedTuple):
    get_states: Callable[[], Any]
    set_states: Callable[[Any], None]


_SOURCES: dict[str, _Source] = {}


def register_rng_state_source(
    name: str, get_states: Callable[[], Any], set_states: Callable[[Any], None]
) -> None:
    """Add an RNG whose state recompute must capture and restore (re-registering replaces)."""
    _SOURCES[name] = _Source(get_states, set_states)


def get_all_rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    for name, source in _SOURCES.items():
        states[name] = source.get_states()
    return states


def set_all_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    for name, source in _SOURCES.items():
        if name in states:
            source.set_states(states[name])


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    """Run a block and put every RNG back as it was before it."""
    saved = get_all_rng_states()
    try:
        yield
    finally:
        set_all_rng_states(saved)
