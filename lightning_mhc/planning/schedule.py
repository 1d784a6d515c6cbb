"""The pipeline schedule's idle share of a step, as the planner ranks layouts by it."""
from __future__ import annotations


def bubble(p: int, v: int, m: int) -> float:
    """The idle fraction of a pipeline's step: (p - 1) / (v m + p - 1) for ``p`` stages, ``v``
    chunks per stage and ``m`` micro-batches (1F1B: v = 1; megatron's interleaved schedule shrinks
    the warm-up by v)."""
    return (p - 1) / (v * m + p - 1)
