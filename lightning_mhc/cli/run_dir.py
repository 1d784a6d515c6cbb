"""``${mhc_unique_dir:outputs/%Y-%m-%d/%H-%M-%S}``: a run (or sweep) directory no other run shares.

conf/config.yaml names its run and sweep directories with this resolver. The first time a process
resolves a pattern, the current time is formatted into it (``time.strftime``) and the directory is
reserved with an atomic ``os.mkdir``; when it exists already (a run started in the same second,
from the same directory) ``-1``, ``-2`` ... is appended until a ``mkdir`` succeeds. The answer is
cached for the process, so every later resolution (Hydra resolves the key several times, and
Lightning passes ``hydra.run.dir=<this directory>`` to the processes it launches) names the same
directory. It is returned as an absolute path, so it means the same after Hydra's ``chdir``.

Processes started by an external launcher (``torchrun``, ``srun``) reserve
nothing: each of them resolves the pattern on its own, so they must agree on the name; they get
the plain formatted time (pass ``hydra.run.dir=<dir>`` to be sure).
"""
from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

RESOLVER = "mhc_unique_dir"
_reserved: dict[str, str] = {}


def started_by_a_launcher() -> bool:
    """This process is one rank of a job whose processes something else started (Lightning's
    launcher, torchrun, SLURM's ``srun``): it neither checks the command line, nor reserves a run
    directory, nor launches."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return "LOCAL_RANK" in os.environ or "RANK" in os.environ or SLURMEnvironment.detect()


def unique_dir(pattern: str) -> str:
    """The absolute directory reserved for ``pattern`` (``strftime`` fields) in this process."""
    if pattern not in _reserved:
        base = os.path.abspath(time.strftime(pattern))
        if started_by_a_launcher():
            _reserved[pattern] = base
        else:
            os.makedirs(os.path.dirname(base), exist_ok=True)
            candidate, n = base, 0
            while True:
                try:
                    os.mkdir(candidate)
                    break
                except FileExistsError:
                    n += 1
                    candidate = f"{base}-{n}"
            _reserved[pattern] = candidate
    return _reserved[pattern]


def register_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, unique_dir)
