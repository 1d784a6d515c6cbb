"""The suite's temporary files (tests/conftest.py): its child processes make theirs in a folder of
the suite's own, removed when the suite ends, so that a process ending without its exit handlers
(a rank ending in ``os._exit``, a process the fault tests kill) leaves nothing in the system's."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

from subprocess_env import child_env

TESTS = pathlib.Path(__file__).parent
CHILD = "import os, wandb.sdk.data_types._private as media; print(media.MEDIA_TMP.name); os._exit(0)"
"""What every process importing megatron-core does (its optional ``import wandb`` makes the folder
``tmp*wandb-media``, which only an exit handler removes), then an end without exit handlers."""
INNER_TEST = f'''
import os, pathlib, subprocess, sys

def test_a_child_ending_in_os_exit():
    made = subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True, text=True,
                          check=True).stdout.strip()
    pathlib.Path(os.environ["REPORT"]).write_text(repr((made, os.path.isdir(made), os.environ.get("TMPDIR"))))
'''


def test_a_childs_temporary_folder_left_by_os_exit_goes_with_the_suite(tmp_path):
    """A session of the suite's conftest whose test starts a child that makes wandb's folder and ends
    in ``os._exit``: the folder was left behind by the child, inside the session's own temporary
    folder, and neither is there once the session has ended."""
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    report = tmp_path / "report"
    env = child_env(PYTHONPATH=f"{TESTS}:{child_env().get('PYTHONPATH', '')}", REPORT=str(report))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                           "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    made, left_at_exit, session_tmp = eval(report.read_text())
    try:
        assert left_at_exit, f"{made}: the child removed it itself, so this test shows nothing"
        assert session_tmp and pathlib.Path(made).parent == pathlib.Path(session_tmp), (made, session_tmp)
        assert not pathlib.Path(made).exists() and not pathlib.Path(session_tmp).exists(), (made, session_tmp)
    finally:
        shutil.rmtree(made, ignore_errors=True)  # not to leave it where a broken conftest put it
