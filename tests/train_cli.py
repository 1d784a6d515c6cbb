"""Running ``python -m lightning_mhc.cli.train`` as a user would, its check before launch in this
process, and reading what a run wrote."""
from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

from subprocess_env import child_env


def run_train(cwd: pathlib.Path, *args: str, timeout: float = 600, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "lightning_mhc.cli.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=child_env(**(env or {})))


def train_losses(metrics_csv: pathlib.Path) -> dict[int, float]:
    """``{step: train_loss}`` from a CSVLogger's metrics.csv (``trainer.log_every_n_steps=1``)."""
    with open(metrics_csv) as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")}


def stream_divergences(metrics_csv: pathlib.Path) -> dict[int, dict[str, float]]:
    """``{step: {block: divergence}}`` from a CSVLogger's metrics.csv (the ``stream_divergence/<block>``
    columns), for the steps that logged them."""
    prefix = "stream_divergence/"
    with open(metrics_csv) as handle:
        rows = list(csv.DictReader(handle))
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        values = {k[len(prefix):]: float(v) for k, v in row.items() if k.startswith(prefix) and v}
        if values:
            by_step.setdefault(int(row["step"]), {}).update(values)
    return by_step


def check_before_launch(argv: list[str], cwd: pathlib.Path, monkeypatch, capsys) -> tuple[int, str]:
    """What ``lightning-mhc-train`` runs before Hydra makes a directory or starts a process
    (``preflight.check_command_line``: the whole pre-launch decision), in this process: ``(exit
    status, stderr)``. Seconds cheaper than a subprocess, which a few tests keep to prove the door."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_mhc.cli import preflight

    capsys.readouterr()
    GlobalHydra.instance().clear()
    monkeypatch.chdir(cwd)
    try:
        preflight.check_command_line(list(argv))
        status = 0
    except SystemExit as exit:
        status = exit.code
    finally:
        GlobalHydra.instance().clear()
        preflight.checked = False
    return status, capsys.readouterr().err
