"""What the benchmarks share: interleaved timing, result files and the optional plot backend."""
from __future__ import annotations

import json
import pathlib
import statistics
import threading
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


def gpt_training_step(cfg, policy: str, tokens, labels, autocast=None) -> tuple[Callable[[], None], int]:
    """A ``GPTModel`` of ``cfg`` under recompute ``policy`` with AdamW, on the device of ``tokens``:
    ``(step, retained bytes)``, where ``step()`` is forward + backward + optimizer step (waiting for
    the GPU) and the bytes are what one training forward leaves for backward. ``autocast``: a dtype
    to run the forward under (bf16-mixed), or None."""
    import torch

    from lightning_mhc.model import GPTModel
    from lightning_mhc.recompute import ActivationMemoryMeter, RecomputePolicy, attach_recompute

    model = GPTModel(RecomputePolicy(policy).apply(cfg)).to(tokens.device)
    attach_recompute(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = tokens.device.type

    def forward():
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            return model(tokens, labels=labels).float().mean()

    with ActivationMemoryMeter(model) as meter:
        loss = forward()
    loss.backward()
    optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        forward().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(tokens.device)

    return step, meter.result.retained_bytes


def sublayer_step(forward: Callable, x, modules, device="cpu") -> tuple[Callable[[], None], int]:
    """One sub-layer's timed step (forward and backward of ``forward()``, ``x``'s gradient cleared)
    and the activation bytes its first forward keeps for backward, measured on ``modules``
    (``ActivationMemoryMeter``: their parameters are not activations)."""
    import torch

    from lightning_mhc.recompute import ActivationMemoryMeter

    with ActivationMemoryMeter(*modules) as meter:
        out = forward()
    grad = torch.randn_like(out)
    out.backward(grad)

    def step() -> None:
        forward().backward(grad)
        x.grad = None
        synchronize(device)

    return step, meter.result.retained_bytes


def synchronize(device) -> None:
    """Wait for the GPU's queued work (timings are of work done, not launched)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    return statistics.median(values)


def measured_on() -> dict:
    """Where and on what code a result was taken: the git commit (``+dirty`` with uncommitted
    changes to the code measured, the package or the benchmarks; None outside a checkout), the UTC
    date, the CPUs and the machine's 1-minute load at the end (a benchmark beside other work says
    so)."""
    import datetime
    import os
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lightning_mhc", "benchmarks"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                cpus=os.cpu_count(), load_1min=round(os.getloadavg()[0], 2))


def write_json(path: pathlib.Path, payload: dict) -> None:
    """``payload`` and :func:`measured_on` as ``measured``, to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "measured": measured_on()}, indent=2))
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


def save_figure(fig, path: pathlib.Path, dpi: int = 120) -> None:
    """Lay the figure out tightly and write it as a PNG."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")


def resident_mib() -> tuple[float, float]:
    """``(anonymous, file-backed)`` resident MiB of this process (``/proc/self/status``): the
    memory it allocated, and the pages of mapped files (memory-mapped files, such as safetensors
    weights: the kernel's page cache, shared by every process that reads the file)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:")):
                name, value, _ = line.split()
                fields[name] = int(value) / 1024
    return fields["RssAnon:"], fields["RssFile:"]


class PeakGrowth:
    """The peak growth of this process's anonymous and file-backed resident memory inside the
    block, sampled every millisecond (the lifetime peak, ``ru_maxrss``, is set by the imports)."""

    def __enter__(self) -> "PeakGrowth":
        self.start = resident_mib()
        self.peak = self.start
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self._record()
            time.sleep(0.001)

    def _record(self) -> None:
        now = resident_mib()
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self._record()
        self.anon_mib, self.file_mib = (self.peak[0] - self.start[0], self.peak[1] - self.start[1])
