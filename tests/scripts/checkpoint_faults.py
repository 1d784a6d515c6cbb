"""SIGKILL a devices=2 (DP=2) ``Trainer.fit`` of a tiny MHCGPTModule at the fault points of a
sharded checkpoint save or removal, check the checkpoint folder after each kill, and resume.

    python checkpoint_faults.py --workdir DIR --out result.json [--faults during_remove,after_shards,...]

``ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)``: every step saves
``step-<N>.ckpt`` (a new directory), removes the previous step's, and replaces ``last.ckpt``.
The fault comes from ``LIGHTNING_MHC_CHECKPOINT_FAULT=<phase>[@<n>]`` (the rank SIGKILLs
itself there; the driver then SIGKILLs the other rank). Each run after the first resumes
from ``checkpoint_commit.latest_complete`` of the folder and carries the next fault, so one
launch covers every kill point. This process imports torch and Lightning once and forks the
two ranks of each run (as torchrun would start them: ``LOCAL_RANK``, ``MASTER_PORT``...).

``--launch-fault <phase>[@<n>]`` first runs one fit the way users start it, with Lightning's
own subprocess launcher (the script re-run with ``--launch``), in its own session; after the
fault killed rank 0, the session's process group is SIGKILLed (``os.killpg``) and the chain
continues from what it left. This process is a child subreaper, so it reaps the orphans.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy
from lightning_mhc.checkpoint import commit as checkpoint_commit
from lightning_mhc.checkpoint import format as checkpoint_format
from lightning_mhc.data.sources import SyntheticTokens
from lightning_mhc.testing.launch import free_port

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fit_gpt import model_config  # noqa: E402

SEQ, GLOBAL_BATCH, DEVICES = 16, 4, 2
# one run per fault, in this order (each resumes from what the previous left): a removal; each phase
# of a save into a new directory (step-3.ckpt); replacing last.ckpt (after_rename@4: the 2nd step's
# replace, which leaves last.ckpt's trash); the next save's cleaning of that trash
DEFAULT_FAULTS = ("during_remove@1", "during_shards@1", "after_shards@1", "before_metadata@1", "before_rename@1",
                  "during_replace@1", "after_rename@4", "during_cleanup@1")


class Recorder(Callback):
    def __init__(self, path: pathlib.Path | None) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if self.path is not None and trainer.global_rank == 0:
            self.path.write_text(json.dumps(dict(start_step=trainer.global_step)))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.path is not None and trainer.global_rank == 0:
            record = json.loads(self.path.read_text())
            self.path.write_text(json.dumps(dict(record, end_step=trainer.global_step)))


def fit(ckpt_dir: pathlib.Path, ckpt_path: str | None, max_steps: int, record: pathlib.Path | None) -> None:
    torch.set_num_threads(1)
    loader = DataLoader(SyntheticTokens(32 * GLOBAL_BATCH, SEQ), batch_size=GLOBAL_BATCH // DEVICES, shuffle=True)
    checkpoints = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step-{step}", auto_insert_metric_name=False,
                                  every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=DEVICES, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=MHCParallelStrategy(timeout=datetime.timedelta(seconds=60)),
        callbacks=[checkpoints, Recorder(record)],
    )
    # each run of the chain trains 3 steps past its checkpoint (max_steps grows): its schedule is its own
    module = MHCGPTModule(dict(model_config(0.0), num_layers=2), lr=1e-3, warmup_steps=2, override_scheduler=True)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)


def run_ranks(ckpt_dir: pathlib.Path, ckpt_path: str | None, fault: str | None, max_steps: int,
              record: pathlib.Path, log: pathlib.Path, timeout: float = 120) -> list[str]:
    """Fork the two ranks of one fit; returns how each ended ('exit 0', 'SIGKILL', 'killed by driver')."""
    port = free_port()
    pids = []
    for rank in range(DEVICES):
        pid = os.fork()
        if pid == 0:  # a rank
            code = 1
            try:
                fd = os.open(log.with_suffix(f".rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1), os.dup2(fd, 2)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(DEVICES),
                                  NODE_RANK="0", LOCAL_RANK=str(rank))
                os.environ.pop(checkpoint_commit.FAULT_ENV, None)
                if fault:
                    os.environ[checkpoint_commit.FAULT_ENV] = fault
                fit(ckpt_dir, ckpt_path, max_steps, record)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    outcome: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outcome) < len(pids):
        for pid in pids:
            if pid in outcome:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFSIGNALED(status):
                    outcome[pid] = signal.Signals(os.WTERMSIG(status)).name
                else:
                    outcome[pid] = f"exit {os.WEXITSTATUS(status)}"
        if outcome and len(outcome) < len(pids) and any(v != "exit 0" for v in outcome.values()) \
                or time.monotonic() > deadline:
            for pid in pids:  # one rank died: the other waits in a collective; end it too
                if pid not in outcome:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    outcome[pid] = "killed by driver"
        time.sleep(0.05)
    return [outcome[pid] for pid in pids]


def inspect(ckpt_dir: pathlib.Path) -> dict:
    """Every entry of the folder: refused by read_metadata (its message) or loaded for every rank."""
    entries = {}
    for path in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        try:
            meta = checkpoint_commit.read_metadata(path)
        except FileNotFoundError as error:
            entries[path.name] = dict(refused=str(error), type=type(error).__name__)
            continue
        try:  # every tensor whole, and rank 0's state
            assert checkpoint_format.read_tensors(path) and checkpoint_format.read_tensors(path, "optimizer_states.")
            assert "loops" in checkpoint_format.read_trainer_state(path)
            entries[path.name] = dict(loaded=True, global_step=meta.get("global_step"))
        except BaseException as error:  # accepted but cannot be loaded: what must never happen
            entries[path.name] = dict(load_error=f"{type(error).__name__}: {error}")
    latest = checkpoint_commit.latest_complete(ckpt_dir)
    return dict(entries=entries, latest=latest.name if latest else None,
                latest_step=checkpoint_commit.read_metadata(latest).get("global_step") if latest else None)


def launch(args) -> dict:
    """One fit under Lightning's launcher (rank 1 re-runs this script), killed at ``args.launch_fault``."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
    env = dict(os.environ, **{checkpoint_commit.FAULT_ENV: args.launch_fault})
    start = time.monotonic()
    with open(args.workdir / "launch.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--workdir", str(args.workdir), "--launch"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1, blocked in a collective (or already gone)
        except ProcessLookupError:
            pass
        returncode = proc.wait()
    while True:  # reap rank 1, whose parent (rank 0) died
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
    return dict(fault=args.launch_fault, launcher=True, returncode=returncode,
                seconds=round(time.monotonic() - start, 1), **inspect(args.workdir / "checkpoints"))


def chain(args) -> dict:
    ckpt_dir = args.workdir / "checkpoints"
    runs = [launch(args)] if args.launch_fault else [dict(fault=None, before_any_run=True, **inspect(ckpt_dir))]
    print(json.dumps(runs[0]), flush=True)
    faults = [f for f in args.faults.split(",") if f] + [None]
    for i, fault in enumerate(faults):
        latest = checkpoint_commit.latest_complete(ckpt_dir)
        record = args.workdir / f"run{i}.json"
        max_steps = (checkpoint_commit.read_metadata(latest)["global_step"] if latest else 0) + 3
        start = time.monotonic()
        ended = run_ranks(ckpt_dir, str(latest) if latest else None, fault, max_steps, record,
                          args.workdir / f"run{i}")
        run = dict(fault=fault, resumed_from=latest.name if latest else None, ended=ended,
                   seconds=round(time.monotonic() - start, 1),
                   record=json.loads(record.read_text()) if record.exists() else None, **inspect(ckpt_dir))
        if any(e not in ("exit 0", "SIGKILL", "killed by driver") for e in ended):
            run["logs"] = {r: args.workdir.joinpath(f"run{i}.rank{r}.log").read_text()[-3000:] for r in range(DEVICES)}
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "logs"}), flush=True)
    return dict(runs=runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--faults", default=",".join(DEFAULT_FAULTS))
    parser.add_argument("--launch", action="store_true", help="one fit under Lightning's launcher")
    parser.add_argument("--launch-fault", help="first kill a fit started by Lightning's launcher there")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    if args.launch:
        fit(args.workdir / "checkpoints", None, args.max_steps, None)
        return
    result = chain(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
