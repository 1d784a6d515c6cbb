"""The examples run as written."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_model_demo_tensor_parallel_loss_falls():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples/model_demo.py"), "--tp", "2", "--steps", "6"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP=2" in proc.stdout and "loss" in proc.stdout
