"""Running ``python -m lightning_mhc.cli.train`` as a user would, or its entry point on ranks
forked from the preloaded fork server; its check before launch in this process; reading what a
run wrote."""
from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys
import threading

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


def _train_rank(rank: int, world_size: int, args: list[str], cwd: str) -> None:
    """One rank of ``run_train_on_ranks``: ``lightning-mhc-train *args`` in ``cwd``. The variables
    torchrun sets (``RANK`` ...) make ``main`` skip the check before launch, as in a launched rank."""
    from lightning_mhc.cli import train
    from script_runs import run_as_main

    run_as_main(cwd, ["lightning-mhc-train", *args], train.main)


_checking = threading.Lock()
"""Held while ``run_train_on_ranks`` checks a command line: tests run several from threads."""


def run_train_on_ranks(cwd: pathlib.Path, *args: str, timeout: float = 600) -> None:
    """``lightning-mhc-train *args`` on ``trainer.devices`` ranks (1 unless given), forked from
    ``spawn_ranks``' preloaded fork server with the variables torchrun sets: for runs whose subject
    is what the run computes and writes, not how its processes start (a fresh interpreter per rank
    spends about 7 s of CPU on imports; the launch keeps its own tests, through ``run_train``).
    The command line is checked here first, as ``main`` checks it before it launches (a rejected
    one exits 2 here); ``hydra.run.dir`` must be given, as under torchrun, whose ranks would each
    name a directory from their own clock otherwise. A failing rank raises ``RankError`` with its
    traceback."""
    from hydra.core.global_hydra import GlobalHydra

    from lightning_mhc.cli import preflight
    from lightning_mhc.testing.launch import spawn_ranks

    if not any(arg.startswith("hydra.run.dir=") for arg in args):
        raise ValueError("run_train_on_ranks needs hydra.run.dir=<dir>: its ranks cannot agree on one otherwise")
    devices = int(next((arg.split("=", 1)[1] for arg in args if arg.startswith("trainer.devices=")), 1))
    with _checking:  # the check runs in cwd, and the working directory and Hydra are the process's
        here = os.getcwd()
        os.chdir(cwd)
        try:
            GlobalHydra.instance().clear()
            preflight.check_command_line(list(args))
        finally:
            GlobalHydra.instance().clear()
            preflight.checked = False
            os.chdir(here)
    spawn_ranks(_train_rank, devices, list(args), str(cwd), timeout_s=timeout, init_group=False)
