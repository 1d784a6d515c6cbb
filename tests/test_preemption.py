"""Faults by signal, as SLURM, systemd, Ctrl-C and the OOM killer send them: real processes,
real signals, every wait bounded, no process left behind (the run's process group is checked
empty and killed in any case)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_mhc.checkpoint import commit as checkpoint_commit
from script_runs import group_alive, run_on_ranks
from subprocess_env import child_env

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "fit_long.py"
EXIT_BOUND_S = 30  # the target on CPU; the strategy's collective timeout is 120 s here

pytestmark = pytest.mark.slow


class Run:
    """``fit_long.py`` in its own session (process group); lines ``STEP <n> <loss>`` on stdout."""

    def __init__(self, tmp_path: pathlib.Path, *args: str) -> None:
        self.stderr_path = tmp_path / f"stderr-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                                     stderr=open(self.stderr_path, "w"), text=True, env=child_env(),
                                     start_new_session=True)
        self.losses: dict[int, float] = {}

    def read_until_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if line.startswith("STEP "):
                _, n, loss = line.split()
                self.losses[int(n)] = float(loss)
                if int(n) >= step:
                    return
            assert time.monotonic() < deadline, "no progress"
        raise AssertionError(f"the run ended before step {step}: {self.stderr_path.read_text()[-3000:]}")

    def finish(self, timeout: float = 240) -> int:
        for line in self.proc.stdout:
            if line.startswith("STEP "):
                _, n, loss = line.split()
                self.losses[int(n)] = float(loss)
        return self.proc.wait(timeout=timeout)

    def group_alive(self) -> bool:
        return group_alive(self.proc.pid)

    def cleanup(self) -> None:
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()


def _losses_on_forked_ranks(*args: str) -> dict[int, float]:
    """``{step: loss}`` of ``fit_long.py *args`` run to its end on ``--devices`` ranks forked from
    the preloaded fork server (``run_on_ranks``): rank 0 prints the ``STEP`` lines."""
    devices = int(args[args.index("--devices") + 1])
    printed = run_on_ranks(SCRIPT.name, devices, *args, timeout=240)[0]
    return {int(n): float(loss) for _, n, loss in (line.split() for line in printed.splitlines()
                                                     if line.startswith("STEP "))}


def _signal_and_time(run: Run, send) -> tuple[int, float]:
    """Send, then time until the launcher has exited *and* no process of its group is left."""
    start = time.monotonic()
    send()
    code = run.proc.wait(timeout=EXIT_BOUND_S + 60)
    while run.group_alive() and time.monotonic() - start < EXIT_BOUND_S + 60:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    assert not run.group_alive(), "processes left behind"
    return code, elapsed


def test_sigterm_to_every_rank_checkpoints_and_resume_is_exact(tmp_path):
    """PP 2: ``kill -TERM -- -<pgid>`` at step 3: both stages stop at one step boundary, save it,
    exit 143 within the bound; resuming from it continues as the uninterrupted run. (The stop is
    agreed by one all-reduce over every rank whatever the layout; resharding a checkpoint across
    TP and PP is tests/test_checkpoint_reshard.py's.)"""
    layout = ["--devices", "2", "--pp", "2"]
    # the uninterrupted reference and the resume are what the run computes, not how its processes
    # start or stop: ranks forked from the preloaded server (the signal goes to a real launch)
    reference = _losses_on_forked_ranks(*layout, "--ckpt-dir", str(tmp_path / "ref"), "--stop-at", "10")
    run = Run(tmp_path, *layout, "--ckpt-dir", str(tmp_path / "ckpt"))
    try:
        run.read_until_step(3)
        code, elapsed = _signal_and_time(run, lambda: os.killpg(run.proc.pid, signal.SIGTERM))
    finally:
        run.cleanup()
    print(f"SIGTERM to both ranks: exit {code} after {elapsed:.1f} s")
    assert code == 143, run.stderr[-3000:]
    assert elapsed < EXIT_BOUND_S
    (checkpoint,) = list((tmp_path / "ckpt").glob("preempted-step-*.ckpt"))
    step = checkpoint_commit.read_metadata(checkpoint)["global_step"]
    assert 3 <= step <= 7, step
    resumed = _losses_on_forked_ranks(*layout, "--ckpt-dir", str(tmp_path / "resumed"), "--ckpt-path",
                                      str(checkpoint), "--stop-at", str(step + 3))
    steps = list(range(step + 1, step + 4))
    assert sorted(resumed) == steps
    torch.testing.assert_close(torch.tensor([resumed[s] for s in steps]),
                               torch.tensor([reference[s] for s in steps]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sig, target, code", [(signal.SIGTERM, "launcher", 143), (signal.SIGINT, "group", 130)],
                         ids=["sigterm-launcher-only", "sigint-group"])
def test_signal_stops_data_parallel_ranks(tmp_path, sig, target, code):
    """DP = 2: SIGTERM to the launching process alone (it forwards it), or Ctrl-C to the group."""
    run = Run(tmp_path, "--devices", "2", "--ckpt-dir", str(tmp_path / "ckpt"))
    try:
        run.read_until_step(2)
        send = (lambda: os.kill(run.proc.pid, sig)) if target == "launcher" else (lambda: os.killpg(run.proc.pid, sig))
        got, elapsed = _signal_and_time(run, send)
    finally:
        run.cleanup()
    print(f"{sig.name} to the {target}: exit {got} after {elapsed:.1f} s")
    assert got == code, run.stderr[-3000:]
    assert elapsed < EXIT_BOUND_S
    (checkpoint,) = list((tmp_path / "ckpt").glob("preempted-step-*.ckpt"))
    assert checkpoint_commit.read_metadata(checkpoint)["global_step"] >= 2


def test_sigkill_of_one_rank_ends_the_run(tmp_path):
    """kill -9 of a non-launching rank: the others fail fast (gloo sees the peer gone), non-zero."""
    run = Run(tmp_path, "--devices", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--timeout", "60")
    try:
        run.read_until_step(2)
        children = subprocess.run(["pgrep", "-P", str(run.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        code, elapsed = _signal_and_time(run, lambda: os.kill(int(children[0]), signal.SIGKILL))
    finally:
        run.cleanup()
    print(f"SIGKILL to rank 1: exit {code} after {elapsed:.1f} s")
    assert code != 0
    assert elapsed < 60 + 10  # within the collective timeout at worst


@pytest.mark.parametrize("when", ["startup", "training"])
def test_sigkill_of_the_launcher_leaves_no_rank(tmp_path, when):
    """kill -9 of the launching process, while its rank is still starting (before the rendezvous)
    or during training: the rank it started exits too, within seconds."""
    run = Run(tmp_path, "--devices", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--timeout", "60")
    try:
        if when == "training":
            run.read_until_step(2)
        deadline = time.monotonic() + 120
        while not subprocess.run(["pgrep", "-P", str(run.proc.pid)], capture_output=True).stdout:
            assert time.monotonic() < deadline, "the second rank never started"
            time.sleep(0.05)
        code, elapsed = _signal_and_time(run, lambda: os.kill(run.proc.pid, signal.SIGKILL))
    finally:
        run.cleanup()
    print(f"SIGKILL to the launcher ({when}): the other rank gone after {elapsed:.1f} s")
    assert code == -signal.SIGKILL
    assert elapsed < 20


def test_a_rank_watches_its_launcher_from_its_first_import_of_the_package():
    """The watch begins at ``import lightning_mhc`` (not once the model and the Trainer are built):
    a rank whose launcher is already gone exits there; one whose launcher lives goes on, and takes
    the launcher's mark out of its environment, so what it starts (a spawned worker) never watches
    a process that is not its parent."""
    probe = "import os, time, lightning_mhc; time.sleep(1.5); print(os.environ.get('LIGHTNING_MHC_LAUNCHER_PID'))"
    env = dict(child_env(), LOCAL_RANK="1")
    orphan = subprocess.run([sys.executable, "-c", probe], env=dict(env, LIGHTNING_MHC_LAUNCHER_PID="1"),
                            capture_output=True, text=True, timeout=60)
    assert orphan.returncode == 1 and "the launching process 1 is gone" in orphan.stderr, orphan
    watched = subprocess.run([sys.executable, "-c", probe], env=dict(env, LIGHTNING_MHC_LAUNCHER_PID=str(os.getpid())),
                             capture_output=True, text=True, timeout=60)
    assert watched.returncode == 0 and watched.stdout.strip() == "None", watched


def test_entry_point_preempted_then_resumed_with_last(tmp_path):
    """``lightning-mhc-train`` (PP 2): SIGTERM to the process group after the step-3 checkpoint:
    exit 143, summary.json says preempted and names the checkpoint; ``ckpt_path=last`` in the same
    run directory resumes from it."""
    from train_cli import run_train_on_ranks

    args = ["trainer=debug", "data=synthetic", "parallel=pp2", "trainer.devices=2", "trainer.max_steps=500",
            "trainer.limit_val_batches=0", "trainer.checkpoint_every_n_steps=3"]
    proc = subprocess.Popen([sys.executable, "-m", "lightning_mhc.cli.train", *args], cwd=tmp_path, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("outputs/*/*/checkpoints/step-000003.ckpt/metadata.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=EXIT_BOUND_S + 60)
        while group_alive(proc.pid) and time.monotonic() - start < EXIT_BOUND_S + 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        assert not group_alive(proc.pid), "processes left behind"
        stderr = proc.stderr.read()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"lightning-mhc-train PP=2, SIGTERM to the group: exit {code} after {elapsed:.1f} s")
    assert code == 143, stderr[-3000:]
    assert elapsed < EXIT_BOUND_S
    (run_dir,) = list(tmp_path.glob("outputs/*/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] >= 3
    checkpoint = pathlib.Path(summary["last_checkpoint"])
    assert checkpoint.name == f"preempted-step-{summary['steps']:06d}.ckpt"
    assert checkpoint_commit.latest_complete(run_dir / "checkpoints") == checkpoint
    # the resume is what the run computes: its ranks forked from the preloaded server (a resume with
    # ckpt_path=last launched as users launch it is tests/test_entry_point.py's)
    run_train_on_ranks(tmp_path, *args[:-3], "trainer.limit_val_batches=0",
                       f"trainer.max_steps={summary['steps'] + 2}", f"hydra.run.dir={run_dir}", "ckpt_path=last",
                       "optim.override_scheduler=true")  # 2 more steps, not the 500 of the schedule saved
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(checkpoint) and summary["steps"] == int(checkpoint.name[-11:-5]) + 2
