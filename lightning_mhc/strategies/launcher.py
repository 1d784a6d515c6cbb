"""Lightning's subprocess launchers (Fabric's and the Trainer's), made to work inside a Hydra
multirun; they record their pid for the watch a launched rank keeps on them
(``distributed/launcher_watch.py``).

Lightning re-runs ``sys.argv`` for every extra device; in a multirun that
would start the whole sweep again in each child. Here a child re-runs the
current *job*: its own overrides, its run directory, no ``-m``.
"""
from __future__ import annotations

import os
import subprocess
import sys

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_mhc.distributed.launcher_watch import LAUNCHER_PID

_DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _in_hydra_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return False
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_command(local_rank: int) -> tuple[list[str], str]:
    import __main__
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += list(hc.overrides.task)
    command += [f"hydra.run.dir={hc.runtime.output_dir}", "hydra.output_subdir=null",
                f"hydra.job.name=train_rank_{local_rank}"]
    return command, get_original_cwd()


class JobLauncherMixin:
    """For a subclass of a Lightning ``_SubprocessScriptLauncher``: in a Hydra multirun, start
    the ranks of the current job (not the sweep); record the launcher's pid for
    :func:`watch_launcher`; ``finish`` the job."""

    def _call_children_scripts(self) -> None:
        # the ranks started below inherit the launcher's pid; this process keeps no mark of it, or
        # every process it forks later (another run's ranks in the same process) would watch it
        previous = os.environ.get(LAUNCHER_PID)
        os.environ[LAUNCHER_PID] = str(os.getpid())
        try:
            self._start_children()
        finally:
            if previous is None:
                os.environ.pop(LAUNCHER_PID, None)
            else:
                os.environ[LAUNCHER_PID] = previous

    def _start_children(self) -> None:
        if not _in_hydra_multirun():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        env = os.environ
        env["MASTER_ADDR"] = self.cluster_environment.main_address
        env["MASTER_PORT"] = str(self.cluster_environment.main_port)
        env["NODE_RANK"] = str(self.cluster_environment.node_rank())
        env["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        env["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            child_env = dict(env, LOCAL_RANK=str(local_rank))
            command, cwd = _job_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=child_env, cwd=cwd))
        return None

    def finish(self, timeout_s: float = 600.0) -> None:
        """Wait for this job's children and clear the variables that mark a launched process,
        so the next job of a multirun launches its own."""
        for proc in getattr(self, "procs", []):
            proc.wait(timeout=timeout_s)
        for key in _DDP_ENV:
            os.environ.pop(key, None)


class MHCFabricLauncher(JobLauncherMixin, _SubprocessScriptLauncher):
    """Fabric's launcher (``Fabric(devices=N)`` re-runs the script N - 1 times)."""
