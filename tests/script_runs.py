"""Running the scripts of tests/scripts/ as users run them (Lightning's launcher re-runs a script
once per extra device)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from subprocess_env import child_env

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def run_script(name: str, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env())


def fit_gpt(tmp_path: pathlib.Path, *args: str, timeout: float = 420) -> dict:
    out = tmp_path / "result.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_script("fit_gpt.py", *args, "--out", str(out), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
