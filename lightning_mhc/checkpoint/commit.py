"""The commit protocol of a checkpoint directory: visible only once complete.

A checkpoint is a directory that many ranks write files into (``format.py`` says which);
``metadata.json``, written last by rank 0, lists every file with its size.

Crash safety: a kill -9 at any moment of a save or a removal never leaves a directory
that a resume accepts but cannot load (the commit protocol of megatron-core's and
torch.distributed.checkpoint's savers):

- a save (:func:`begin_save` on rank 0, every rank writes, :func:`commit` on rank 0) writes
  into a staging directory ``<name>.tmp-<token>`` next to the target; after every rank
  wrote its files, rank 0 writes ``metadata.json`` last and renames the directory into
  place (an existing target is first renamed to ``<name>.trash-<token>``, then deleted);
- a removal (:func:`remove`) renames the directory to ``<name>.trash-<token>`` before
  deleting anything;
- a directory is a checkpoint only if its ``metadata.json`` exists and every file it lists
  is there with its recorded size (:func:`read_metadata`); staging and trash directories
  are never accepted, and :func:`latest_complete` skips them;
- the staging and trash directories a crash left behind (and the metadata-less
  directories of the earlier in-place saves) are deleted by the next save into the same
  folder, before it writes: a checkpoint folder belongs to one run at a time.

``LIGHTNING_MHC_CHECKPOINT_FAULT=<phase>[@<n>]`` is a fault-injection hook for tests: the
process SIGKILLs itself the n-th time (default: the first) it reaches ``<phase>``, one of
:data:`FAULT_PHASES`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
from pathlib import Path
from typing import Any

import torch

METADATA = "metadata.json"
FAULT_ENV = "LIGHTNING_MHC_CHECKPOINT_FAULT"
FAULT_PHASES = ("during_shards", "after_shards", "before_metadata", "before_rename", "during_replace",
                "after_rename", "during_remove", "during_cleanup")

_LEFTOVER = re.compile(r"^.+\.(tmp|trash)-[0-9a-f]{16}$")
# the files of a checkpoint (this format's and the per-(tp, pp) format's), for recognising the
# metadata-less directories of the earlier in-place saves
_CHECKPOINT_FILE = re.compile(
    r"^((model_tp\d+_pp\d+|rng_rank\d+|trainer_state)\.pt|metadata\.json|\.metadata|__\d+_\d+\.distcp)(\.tmp)?$")


class IncompleteCheckpointError(FileNotFoundError):
    """A directory that is not a complete checkpoint (a ``FileNotFoundError``, as before)."""


def is_leftover(path: Path) -> bool:
    """A staging (``<name>.tmp-<token>``) or trash (``<name>.trash-<token>``) directory."""
    return bool(_LEFTOVER.match(Path(path).name))


def is_complete(path: Path) -> bool:
    try:
        read_metadata(path)
    except FileNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------------ saving
def begin_save(path: Path) -> Path:
    """Rank 0, before any rank writes: delete what crashed saves and removals left in the
    target's folder, then create and return a fresh staging directory next to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path.parent)
    staging = _unique(path, "tmp")
    staging.mkdir()
    return staging


def write_metadata(path: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its files: ``meta`` plus the list of files (with their
    sizes) goes into ``metadata.json``, atomically."""
    path = Path(path)
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != METADATA)
    meta = dict(meta, files=files, file_sizes={name: (path / name).stat().st_size for name in files})
    tmp = path / (METADATA + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / METADATA)
    _fsync_dir(path)


def commit(staging: Path, path: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its files into ``staging``: the commit point of the save.
    ``metadata.json`` goes in last, then the directory is renamed to ``path`` (an existing
    ``path`` is renamed away to a trash name first and deleted once the new one is in place)."""
    staging, path = Path(staging), Path(path)
    fault_point("before_metadata")
    write_metadata(staging, meta)
    fault_point("before_rename")
    trash = None
    if path.exists() or path.is_symlink():
        trash = _unique(path, "trash")
        os.replace(path, trash)
        fault_point("during_replace")
    os.replace(staging, path)
    _fsync_dir(path.parent)
    fault_point("after_rename")
    if trash is not None:
        _delete(trash)


def remove(path: Path) -> None:
    """Delete a checkpoint: renamed to a trash name first, so it never looks complete while its
    files go (a crash leaves the trash directory, which the next save deletes)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        trash = _unique(path, "trash")
        os.replace(path, trash)
        _fsync_dir(path.parent)
        _delete(trash, fault="during_remove")


def clean_stale(directory: Path) -> list[Path]:
    """Delete the staging and trash directories of crashed saves and removals in ``directory``,
    and the directories the earlier in-place saves left without ``metadata.json`` (only
    checkpoint files in them). Returns what was deleted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if not entry.is_symlink() and entry.is_dir() and (is_leftover(entry) or _is_unfinished_in_place(entry)):
            _delete(entry, fault="during_cleanup")
            removed.append(entry)
    return removed


# ----------------------------------------------------------------------------- reading
def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint; a clear error (a ``FileNotFoundError``) for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist.")
    if is_leftover(path):
        raise IncompleteCheckpointError(
            f"{path} is not a checkpoint: it is the staging or trash directory of a save or removal that "
            "was interrupted (the next save into its folder deletes it)."
        )
    if not (path / METADATA).is_file():
        raise IncompleteCheckpointError(
            f"{path} is not a complete lightning_mhc checkpoint ({METADATA} is missing: the save did "
            "not finish, or this is not a sharded checkpoint directory)."
        )
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, ValueError) as error:
        raise IncompleteCheckpointError(f"{path}: {METADATA} cannot be read ({error}).") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), list):
        raise IncompleteCheckpointError(f"{path}: {METADATA} is not a lightning_mhc checkpoint's metadata.")
    missing, wrong_size = [], []
    for name in meta["files"]:
        try:
            size = (path / name).stat().st_size
        except OSError:
            missing.append(name)
            continue
        if meta.get("file_sizes", {}).get(name, size) != size:
            wrong_size.append(name)
    if missing or wrong_size:
        problems = []
        if missing:
            problems.append(f"missing: {', '.join(missing)}")
        if wrong_size:
            problems.append(f"not the size it was saved with: {', '.join(wrong_size)}")
        raise IncompleteCheckpointError(
            f"{path} is not a complete lightning_mhc checkpoint: files listed in its {METADATA} are "
            f"{'; '.join(problems)} (a removal or a copy was interrupted)."
        )
    return meta


def latest_complete(directory: Path) -> Path | None:
    """The complete checkpoint of ``directory`` with the highest global step (None if there is none);
    staging and trash directories and incomplete checkpoints are skipped."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best, best_key = None, None
    for entry in directory.iterdir():
        if is_leftover(entry) or not entry.is_dir():
            continue
        try:
            key = (read_metadata(entry).get("global_step") or 0, entry.stat().st_mtime)
        except FileNotFoundError:
            continue
        if best_key is None or key > best_key:
            best, best_key = entry, key
    return best


# ----------------------------------------------------------------------------- helpers
def _unique(path: Path, kind: str) -> Path:
    return path.with_name(f"{path.name}.{kind}-{secrets.token_hex(8)}")


def _is_unfinished_in_place(path: Path) -> bool:
    """A directory of the earlier in-place saves that never got its ``metadata.json``."""
    entries = [p.name for p in path.iterdir()]
    return bool(entries) and METADATA not in entries and all(_CHECKPOINT_FILE.match(n) for n in entries)


def _delete(path: Path, fault: str | None = None) -> None:
    """Delete a (renamed-away) checkpoint directory, ``metadata.json`` last."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for i, entry in enumerate(sorted(path.iterdir(), key=lambda p: (p.name == METADATA, p.name))):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        if i == 0 and fault:
            fault_point(fault)
    shutil.rmtree(path, ignore_errors=True)


def atomic_save(obj: Any, target: Path) -> None:
    """``torch.save`` to ``<target>.tmp``, fsync, rename: a file is whole or absent."""
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (a power loss, not only a killed process)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_fault_counts: dict[str, int] = {}


def fault_point(phase: str) -> None:
    """Fault injection for tests: SIGKILL this process at ``LIGHTNING_MHC_CHECKPOINT_FAULT=<phase>[@<n>]``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name != phase:
        return
    _fault_counts[phase] = _fault_counts.get(phase, 0) + 1
    if _fault_counts[phase] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
