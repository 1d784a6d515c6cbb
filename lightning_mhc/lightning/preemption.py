"""Preemption: SIGTERM / SIGINT end every rank in bounded time, after a consistent checkpoint.

What SLURM preemption, ``scancel``, systemd and Ctrl-C send. Lightning's own
SIGTERM handler runs a ``dist.broadcast`` *inside the signal handler*: a rank
that is in the middle of a tensor- or pipeline-parallel collective then never
meets it, and the job waits for the collective timeout (10 minutes by
default). Here, as in torchrun's agent:

1. the handler only records the signal (no collective in a handler), forwards
   it to the ranks this process launched, and arms a watchdog;
2. at the next step boundary every rank takes part in one all-reduce of the
   flag (any rank signalled -> all stop), so they all stop at the same step,
   save a step checkpoint together (``save_on_preemption``) and leave with
   ``128 + signal`` (143 for SIGTERM) through ``SIGTERMException``;
3. if that does not happen within ``grace_s`` seconds (a rank is stuck in a
   collective with a dead peer, a save is too slow), the watchdog ends the
   process with the same status: the bound does not depend on the collective
   timeout. A checkpoint interrupted that way is never taken for a complete
   one (see ``lightning_mhc.checkpoint.commit``).

Under SLURM with ``auto_requeue`` Lightning's requeue convention (checkpoint and
requeue on the requeue signal) stays in charge of that signal.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionState:
    """This rank's view: the signal received (if any) and the watchdog."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._watchdog: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum or signal.SIGTERM)

    def notify(self, signum: int) -> None:
        """Called from the signal handler: record, arm the watchdog (once)."""
        if self.signum is None:
            self.signum = signum
            self._watchdog = threading.Timer(self.grace_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expire(self) -> None:
        os.write(2, f"[rank pid {os.getpid()}] no clean stop {self.grace_s:.0f} s after signal {self.signum}: "
                    f"exiting with {self.exit_code}\n".encode())
        os._exit(self.exit_code)

    def wait_for(self, procs: list) -> None:
        """The launching rank waits (within the grace period) for the ranks it started."""
        for proc in procs:
            try:
                proc.wait(timeout=self.grace_s)
            except Exception:  # still running: the watchdog bounds this process, theirs bound them
                pass

    def cancel(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


class PreemptionSignalConnector(_SignalConnector):
    """Lightning's signal connector with a handler that only records (no collective), also for
    SIGINT, and forwards the signal to the ranks this process launched."""

    def __init__(self, trainer: pl.Trainer, state: PreemptionState) -> None:
        super().__init__(trainer)
        self.state = state

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()  # SIGTERM (and SLURM's requeue signal) -> our notifier
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._sigterm_notifier_fn)

    def _sigterm_notifier_fn(self, signum: Any, _: Any) -> None:
        first = self.state.signum is None
        self.state.notify(int(signum))
        if first:
            launcher = self.trainer.strategy.launcher
            if launcher is not None and getattr(launcher, "procs", None):
                launcher.kill(signum)


def _quiet_child_observer() -> None:
    """In the launching process: Lightning's child-process observer SIGKILLs every rank, this one
    included, when it sees a rank exit non-zero; after a preemption the ranks leave with 143 on
    purpose, and the launching one (which goes last, see ``wait_for``) must not be killed for it.
    The watchdog bounds every rank meanwhile."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_run"):
            thread._run = lambda: True


def agree_to_stop(state: PreemptionState, device: torch.device) -> bool:
    """One all-reduce (MAX) of the flag over every rank, at a step boundary."""
    flag = torch.tensor([0 if state.signum is None else int(state.signum)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and state.signum is None:
        state.notify(int(flag.item()))  # another rank was signalled: same exit code, same bound
    return bool(flag.item())


def preemption_checkpoint_path(trainer: pl.Trainer) -> Path:
    """Next to the ModelCheckpoint's files when there is one (so ``ckpt_path=last`` finds it)."""
    callback = trainer.checkpoint_callback
    directory = Path(callback.dirpath) if callback is not None and callback.dirpath else (
        Path(trainer.default_root_dir) / "checkpoints")
    return directory / f"preempted-step-{trainer.global_step:06d}.ckpt"


def stop_preempted(trainer: pl.Trainer, state: PreemptionState, save: bool) -> None:
    """Every rank: save the step checkpoint together (optional), then leave with 128 + signal."""
    _quiet_child_observer()
    if save:
        path = preemption_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"preempted by signal {state.signum} at step {trainer.global_step}: saved {path}; "
                       f"resume with ckpt_path={path}")
    else:
        rank_zero_info(f"preempted by signal {state.signum} at step {trainer.global_step}")
    raise SIGTERMException(state.exit_code)
