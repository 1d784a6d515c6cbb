"""The watch a launched rank keeps on the process that launched it."""
from __future__ import annotations

import os
import threading
import time

LAUNCHER_PID = "LIGHTNING_MHC_LAUNCHER_PID"
"""Set by the launcher for the ranks it starts (``strategies/launcher.py``)."""


def watch_launcher(poll_s: float = 1.0) -> None:
    """In a rank started by the strategies' launchers: exit when the launching process is gone.

    Without it, a rank whose launcher died (kill -9, OOM) before the process group formed keeps
    waiting for the rendezvous store until its timeout; during training gloo notices the lost
    peer anyway. ``import lightning_mhc`` calls it, so the watch begins as the rank's script
    imports the package, not after the model and the Trainer are built (on a loaded machine
    that is tens of seconds). The launcher's pid comes through the environment (the rank may be
    re-parented before this runs); the rank takes it out of its environment, so a process it
    starts (a spawned DataLoader worker) never watches a launcher that is not its parent."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    started_by_it = os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    if launcher is None or not started_by_it or int(launcher) == os.getpid():
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(poll_s)
        os.write(2, f"[pid {os.getpid()}] the launching process {launcher} is gone: exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch, name="lightning_mhc-launcher-watch", daemon=True).start()
