"""Running the scripts of tests/scripts/ as users run them (Lightning's launcher re-runs a script
once per extra device)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

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


def fit_gpt(tmp_path: pathlib.Path, *args: str, timeout: float = 420) -> dict:
    out = tmp_path / "result.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_script("fit_gpt.py", *args, "--out", str(out), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
