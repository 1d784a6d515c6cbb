"""The Trainer's subprocess launcher: Lightning's, with the job-aware children of
``lightning_mhc.strategies.launcher`` (Hydra multirun, launcher watch)."""
from __future__ import annotations

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_mhc.strategies.launcher import JobLauncherMixin


class MHCSubprocessLauncher(JobLauncherMixin, _SubprocessScriptLauncher):
    """The Trainer's launcher (``Trainer(devices=N)`` re-runs the script N - 1 times)."""
