"""Crash-safe checkpoints: a kill -9 at any moment of a save or a removal never leaves a
directory that a resume accepts but cannot load, and the next save cleans what the crash left.

The in-process tests check the protocol functions of ``lightning_mhc.checkpoint.commit``; the multi-process
test SIGKILLs real devices=2 Trainer.fit runs at every fault point (``tests/scripts/checkpoint_faults.py``).
"""
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

from lightning_mhc.checkpoint import commit as sc
from lightning_mhc.checkpoint import format as cf
from script_runs import left_behind
from subprocess_env import child_env
from train_cli import check_before_launch

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "checkpoint_faults.py"
FILES = {"metadata.json", ".metadata", "__0_0.distcp", "rng_rank0.pt", "trainer_state.pt"}


class _Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def _checkpoint(step: int) -> dict:
    return dict(state_dict={"w": torch.full((3,), float(step))}, optimizer_states=[], global_step=step, loops={})


def _write(staging: pathlib.Path, step: int) -> None:
    cf.write(_checkpoint(step), staging, 0)


def _save(path: pathlib.Path, step: int) -> None:
    """What MHCParallelStrategy.save_checkpoint does, for one rank."""
    cf.save(_checkpoint(step), path, None, 0)


def _load(path: pathlib.Path) -> dict:
    return cf.load(path, _Weights(), [], None, 0)


def _leftovers(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if sc.is_leftover(p))


def test_save_commits_by_rename_and_replaces_atomically(tmp_path):
    path = tmp_path / "step-1.ckpt"
    staging = sc.begin_save(path)
    assert staging.parent == tmp_path and staging.name.startswith("step-1.ckpt.tmp-") and sc.is_leftover(staging)
    _write(staging, 1)
    assert not path.exists() and sc.latest_complete(tmp_path) is None  # nothing visible before the commit
    sc.commit(staging, path, dict(global_step=1))
    assert {p.name for p in path.iterdir()} == FILES and not staging.exists()
    meta = sc.read_metadata(path)
    assert meta["files"] == [".metadata", "__0_0.distcp", "rng_rank0.pt", "trainer_state.pt"] and meta["global_step"] == 1
    assert meta["file_sizes"] == {name: (path / name).stat().st_size for name in meta["files"]}
    _save(path, 2)  # a replace: the old directory goes to the trash, then is deleted
    assert _load(path)["state_dict"]["w"].tolist() == [2.0] * 3
    assert _leftovers(tmp_path) == [] and {p.name for p in tmp_path.iterdir()} == {"step-1.ckpt"}


def test_incomplete_checkpoints_are_refused_naming_the_missing_files(tmp_path):
    """The state a kill during the old in-place removal left: metadata.json without its files."""
    path = tmp_path / "step-1.ckpt"
    _save(path, 1)
    (path / "__0_0.distcp").unlink()
    (path / "trainer_state.pt").unlink()
    for call in (lambda: sc.read_metadata(path), lambda: _load(path)):
        with pytest.raises(sc.IncompleteCheckpointError, match=r"missing: __0_0\.distcp, trainer_state\.pt"):
            call()
    assert issubclass(sc.IncompleteCheckpointError, FileNotFoundError)  # lightning-mhc-train refuses it (exit 2)
    assert not sc.is_complete(path) and sc.latest_complete(tmp_path) is None

    truncated = tmp_path / "step-2.ckpt"
    _save(truncated, 2)
    with open(truncated / "rng_rank0.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(sc.IncompleteCheckpointError, match=r"not the size it was saved with: rng_rank0\.pt"):
        sc.read_metadata(truncated)

    garbled = tmp_path / "step-3.ckpt"
    garbled.mkdir()
    (garbled / "metadata.json").write_text('{"format": ')
    with pytest.raises(sc.IncompleteCheckpointError, match="metadata.json cannot be read"):
        sc.read_metadata(garbled)

    staging = sc.begin_save(tmp_path / "step-4.ckpt")  # even a complete staging directory is not a checkpoint
    _write(staging, 4)
    sc.write_metadata(staging, dict(global_step=4))
    with pytest.raises(sc.IncompleteCheckpointError, match="staging or trash directory"):
        sc.read_metadata(staging)
    assert sc.latest_complete(tmp_path) is None


def test_latest_complete_skips_staging_trash_and_incomplete(tmp_path):
    _save(tmp_path / "step-1.ckpt", 1)
    _save(tmp_path / "step-2.ckpt", 2)
    broken = tmp_path / "step-3.ckpt"
    _save(broken, 3)
    (broken / "rng_rank0.pt").unlink()
    for kind in ("tmp", "trash"):  # complete copies of a later step under a staging / trash name
        leftover = tmp_path / f"step-9.ckpt.{kind}-0123456789abcdef"
        leftover.mkdir()
        _write(leftover, 9)
        sc.write_metadata(leftover, dict(global_step=9))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert sc.latest_complete(tmp_path) == tmp_path / "step-2.ckpt"
    assert sc.latest_complete(tmp_path / "nothing here") is None


def test_remove_renames_before_deleting(tmp_path, monkeypatch):
    path = tmp_path / "step-1.ckpt"
    _save(path, 1)
    seen = []

    def fault_point(phase):  # "during_remove": the first file is gone, metadata.json is still there
        (trash,) = tmp_path.iterdir()
        seen.append((phase, trash.name, sorted(p.name for p in trash.iterdir())))
        with pytest.raises(sc.IncompleteCheckpointError, match="staging or trash directory"):
            sc.read_metadata(trash)

    monkeypatch.setattr(sc, "fault_point", fault_point)
    sc.remove(path)
    monkeypatch.undo()
    (phase, name, files), = seen
    assert phase == "during_remove" and name.startswith("step-1.ckpt.trash-") and "metadata.json" in files
    assert len(files) == len(FILES) - 1 and sc.latest_complete(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    target = tmp_path / "target.ckpt"
    _save(target, 2)
    (tmp_path / "last.ckpt").symlink_to(target)  # save_last="link": remove the link, not its target
    sc.remove(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and sc.is_complete(target)
    sc.remove(tmp_path / "absent.ckpt")


def test_next_save_cleans_what_crashes_left(tmp_path):
    _save(tmp_path / "step-1.ckpt", 1)
    staging = tmp_path / "step-2.ckpt.tmp-00000000000000aa"  # a save killed before its commit
    staging.mkdir()
    _write(staging, 2)
    trash = tmp_path / "step-0.ckpt.trash-00000000000000bb"  # a removal killed halfway
    trash.mkdir()
    (trash / "metadata.json").write_text("{}")
    in_place = tmp_path / "step-5.ckpt"  # a save of the earlier in-place protocol, killed before metadata.json
    in_place.mkdir()
    (in_place / "model_tp0_pp0.pt").write_bytes(b"x")
    (in_place / "rng_rank0.pt.tmp").write_bytes(b"x")
    kept = {
        "notes": {"readme.txt": "a user's folder"},
        "empty": {},
        "step-6.ckpt": {"metadata.json": json.dumps(dict(files=["model_tp0_pp0.pt"]))},  # refused, but kept
    }
    for name, files in kept.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    _save(tmp_path / "step-7.ckpt", 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["step-1.ckpt", "step-7.ckpt", *kept])
    assert sc.latest_complete(tmp_path) == tmp_path / "step-7.ckpt"


def test_fault_hook(monkeypatch):
    kills = []
    monkeypatch.setattr(sc.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(sc, "_fault_counts", {})
    monkeypatch.delenv(sc.FAULT_ENV, raising=False)
    sc.fault_point("before_rename")
    monkeypatch.setenv(sc.FAULT_ENV, "before_rename@2")
    sc.fault_point("after_shards")
    sc.fault_point("before_rename")
    assert kills == []
    sc.fault_point("before_rename")
    assert kills == [(os.getpid(), signal.SIGKILL)]


def test_train_refuses_a_checkpoint_with_missing_files_before_launch(tmp_path, monkeypatch, capsys):
    """``lightning-mhc-train``'s check before launch, in this process (``check_before_launch``: an
    exception it let through, which would print a traceback, fails the test); a refused checkpoint
    through the real ``python -m lightning_mhc.cli.train`` is
    test_entry_point.py::test_bad_checkpoint_paths_are_refused_before_launch's first case."""
    broken = tmp_path / "step-000004.ckpt"
    _save(broken, 4)
    (broken / "__0_0.distcp").unlink()
    status, err = check_before_launch(["trainer=debug", "data=synthetic", f"ckpt_path={broken}"], tmp_path,
                                      monkeypatch, capsys)
    assert status == 2, err[-3000:]
    assert "missing: __0_0.distcp" in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "outputs").exists()


# ------------------------------------------------------------------ real processes, real SIGKILL
@pytest.mark.slow
def test_sigkill_at_every_fault_point_leaves_only_loadable_checkpoints(tmp_path):
    """devices=2 (DP=2), ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True):
    first a fit started by Lightning's launcher, killed while it removes the previous step's
    checkpoint (os.killpg of its session), then one forked fit per fault point, each resuming
    from latest_complete. After every kill each directory is refused cleanly or loads for every
    rank, the resume starts at the latest complete step, and the next save removed the leftovers."""
    out = tmp_path / "result.json"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--workdir", str(tmp_path), "--out", str(out),
                             "--launch-fault", "during_remove@1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
        assert not left_behind(proc.pid), "processes left behind (the driver kills the sessions it starts)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    print(f"{time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, log[-6000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["fault"] for r in runs] == ["during_remove@1", "during_remove@1", "during_shards@1", "after_shards@1",
                                          "before_metadata@1", "before_rename@1", "during_replace@1",
                                          "after_rename@4", "during_cleanup@1", None]
    assert runs[0]["launcher"] and runs[0]["returncode"] == -signal.SIGKILL, runs[0]
    previous = runs[0]
    for run in runs:
        where = f"after {run['fault']} ({'launcher' if run.get('launcher') else 'forked ranks'})"
        if run is not runs[0]:
            if run["fault"] is None:
                assert run["ended"] == ["exit 0", "exit 0"], (where, run.get("logs"))
            else:  # the rank that reached the fault point killed itself, the other was killed
                assert "SIGKILL" in run["ended"], (where, run["ended"], run.get("logs"))
                assert set(run["ended"]) <= {"SIGKILL", "killed by driver", "exit 1"}, (where, run.get("logs"))
            # the resume from latest_complete loaded it: training went on from its step
            assert run["resumed_from"] == previous["latest"], where
            assert run["record"]["start_step"] == previous["latest_step"], (where, run.get("logs"))
            if run["fault"] != "during_cleanup@1":  # (killed while cleaning)
                stale = {n for n, e in previous["entries"].items() if "refused" in e} & set(run["entries"])
                assert not stale, f"{where}: the save did not delete what the previous kill left: {stale}"
        for name, entry in run["entries"].items():
            assert "load_error" not in entry, f"{where}: {name} is accepted but cannot be loaded: {entry}"
            if "refused" in entry:
                assert entry["type"] == "IncompleteCheckpointError" and not entry["refused"].startswith("[Errno"), \
                    (where, name, entry)
                assert sc.is_leftover(pathlib.Path(name)), f"{where}: {name} is refused: {entry['refused']}"
        assert run["latest"] is not None and run["entries"][run["latest"]]["loaded"], where
        previous = run
    final = runs[-1]
    assert final["record"]["end_step"] == final["record"]["start_step"] + 3
    assert not any(sc.is_leftover(pathlib.Path(n)) for n in final["entries"]), final["entries"]
    assert final["latest_step"] == final["record"]["end_step"]
