"""Running the scripts of tests/scripts/ as users run them (Lightning's launcher re-runs a script
once per extra device), or on ranks forked from the preloaded fork server (``run_on_ranks``)."""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import time

from lightning_mhc.testing.launch import spawn_ranks
from subprocess_env import child_env

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def group_alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` is still running."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def run_script(name: str, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    """The script in a session of its own (its ranks join its process group), run to its end;
    ``.pgid`` names that group, so that a test can ask what it left behind (``left_behind``)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{name} {' '.join(args)} ran past {timeout} s (its process group killed); its "
                             f"output:\n{stdout[-3000:]}\n{stderr[-8000:]}") from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    result.pgid = proc.pid
    return result


def left_behind(pgid: int, wait_s: float = 2.0) -> bool:
    """Whether processes of the group ``pgid`` outlive ``wait_s`` seconds (they are then killed,
    so that no test leaves them to the next)."""
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not group_alive(pgid):
        return False
    os.killpg(pgid, signal.SIGKILL)
    return True


def run_as_main(cwd: str, argv: list[str], main) -> None:
    """``main()`` as a process started with ``argv`` in ``cwd`` runs it; a clean ``sys.exit`` is a
    return (a rank forked by ``spawn_ranks`` must return to report), any other exit raises."""
    os.chdir(cwd)
    sys.argv = argv
    try:
        main()
    except SystemExit as exit:
        if exit.code not in (None, 0):
            raise


def run_module_on_a_rank(module: str, *args: str, cwd: pathlib.Path = SCRIPTS, timeout: float = 300,
                         function: str = "main", program: str | None = None) -> str:
    """``python -m module *args`` (a command's ``main``, or ``function``; ``program``: its
    ``sys.argv[0]``, the module's name unless given, a console script's name for one) on one rank
    forked from the preloaded fork server, for a command whose subject is what it writes or prints,
    not how its process starts (which a fresh interpreter's 7 s of imports would check again).
    Returns what it printed; a failure raises ``RankError``."""
    (printed,) = spawn_ranks(_module_rank, 1, module, function, [program or module, *args], str(cwd),
                             timeout_s=timeout, init_group=False)
    return printed


def _module_rank(rank: int, world_size: int, module: str, function: str, argv: list[str], cwd: str) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        run_as_main(cwd, argv, getattr(importlib.import_module(module), function))
    return printed.getvalue()


def run_source_on_a_rank(source: str, cwd: pathlib.Path, timeout: float = 300) -> str:
    """Python ``source`` run as ``python -c source`` runs it, in ``cwd``, on one rank forked from the
    preloaded fork server (for a documented block whose subject is what it computes); returns what
    it printed, a failure raises ``RankError``."""
    (printed,) = spawn_ranks(_source_rank, 1, source, str(cwd), timeout_s=timeout, init_group=False)
    return printed


def _source_rank(rank: int, world_size: int, source: str, cwd: str) -> str:
    os.chdir(cwd)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


class _Tee(io.StringIO):
    """What a rank prints, kept and still written to its stdout (a failing rank's output stays
    readable beside its traceback)."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text)
        return super().write(text)


def _script_rank(rank: int, world_size: int, path: str, args: list[str], cwd: str) -> str:
    """One rank of ``run_on_ranks``: the script as ``python path *args`` runs it (its folder first
    on ``sys.path``, ``__name__ == "__main__"``), in ``cwd``; returns what it printed."""
    sys.path.insert(0, str(pathlib.Path(path).parent))
    with contextlib.redirect_stdout(_Tee(sys.stdout)) as printed:
        run_as_main(cwd, [path, *args], lambda: runpy.run_path(path, run_name="__main__"))
    return printed.getvalue()


def run_on_ranks(name: str, devices: int, *args: str, cwd: pathlib.Path = SCRIPTS,
                 timeout: float = 420) -> list[str]:
    """The script on ``devices`` ranks forked from ``spawn_ranks``' fork server, each with the
    variables torchrun sets: the strategy joins processes started outside it, as under torchrun,
    and makes the process group itself. For runs whose subject is what the script computes, not
    how its processes start: a fresh interpreter per rank (``run_script``) spends about 7 s of CPU
    importing torch, Lightning and megatron-core before its first step, the most of a small
    run's cost. Returns what each rank printed, in rank order; a failing rank raises ``RankError``
    with its traceback."""
    return spawn_ranks(_script_rank, devices, str(SCRIPTS / name), list(args), str(cwd), timeout_s=timeout,
                       init_group=False)


def fit_gpt(tmp_path: pathlib.Path, *args: str, timeout: float = 420) -> dict:
    """What ``fit_gpt.py *args`` wrote (``--devices`` of them: its ranks, by ``run_on_ranks``)."""
    out = tmp_path / "result.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
    run_on_ranks("fit_gpt.py", devices, *args, "--out", str(out), timeout=timeout)
    return json.loads(out.read_text())
