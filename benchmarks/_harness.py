"""What the benchmarks share: interleaved timing, result files and the optional plot backend."""
from __future__ import annotations

import json
import pathlib
import statistics
import time
from typing import Callable

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def interleaved_times(steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each step, measured round-robin (machine noise hits every variant
    alike); ``warmup`` untimed rounds first."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for r in range(warmup + rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            if r >= warmup:
                times[label].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt
