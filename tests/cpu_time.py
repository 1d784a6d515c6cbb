"""Per-test CPU time, for finding where the suite's time goes on a shared machine (wall time there
is noise): ``python -m pytest -p cpu_time FILE`` prints the tests that used most CPU, and with
``LIGHTNING_MHC_CPU_TIMES=path.jsonl`` appends one line per test to that file (one file for all
xdist workers: each line is written whole).

A test's CPU is the user + system time of three kinds of process:
- the pytest process itself, before and after the test (``getrusage(RUSAGE_SELF)``);
- every Python process started while it ran, each reporting its own CPU at exit
  (``cpu_time_site/sitecustomize.py``, on the children's ``PYTHONPATH``): Lightning's launcher
  and torchrun start ranks that nobody may reap into this process's ``RUSAGE_CHILDREN``;
- the ranks of ``spawn_ranks``, forked by the fork server, which exit without ``atexit``
  (``lightning_mhc.testing.launch`` sums what they report).
Processes killed by a signal report nothing (the fault tests' victims are undercounted), and the
fork server reports at the end of the run only (``pytest_unconfigure``), charged to no test: sum
the lines of ``LIGHTNING_MHC_CPU_LOG`` (one file per run) for a file's or a run's whole CPU."""
from __future__ import annotations

import json
import os
import pathlib
import resource
import tempfile

import pytest

_times: dict[str, float] = {}
_SITE = pathlib.Path(__file__).parent / "cpu_time_site"
_LOG = os.environ.setdefault("LIGHTNING_MHC_CPU_LOG", tempfile.mkstemp(prefix="cpu_time_", suffix=".jsonl")[1])
pathlib.Path(_LOG).touch()
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SITE), os.environ.get("PYTHONPATH")]))


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu(nodeid: str) -> float:
    total = 0.0
    with open(_LOG) as handle:
        for line in handle:
            record = json.loads(line)
            if record["test"] == nodeid:
                total += record["cpu_s"]
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from lightning_mhc.testing import launch

    # a fork server started during this test is charged to it, and reports nothing itself (os._exit)
    os.environ["LIGHTNING_MHC_CPU_TEST"] = item.nodeid
    before_self, before_ranks = _self_cpu(), launch.ranks_cpu_s
    yield
    own = _self_cpu() - before_self
    ranks = launch.ranks_cpu_s - before_ranks
    children = _children_cpu(item.nodeid)
    _times[item.nodeid] = own + children + ranks
    path = os.environ.get("LIGHTNING_MHC_CPU_TIMES")
    if path:
        line = json.dumps({"test": item.nodeid, "total_s": round(own + children + ranks, 2), "self_s": round(own, 2),
                           "children_s": round(children, 2), "ranks_s": round(ranks, 2)})
        with open(path, "a") as handle:
            handle.write(line + "\n")


def pytest_unconfigure(config):
    """The whole run's own line in the log: this process's CPU and its spawned ranks'. The fork
    server, a child started once per process, writes its line after this one, at its own exit:
    the sum of every line of the log is the run's CPU."""
    from lightning_mhc.testing import launch

    with open(_LOG, "a") as handle:
        handle.write(json.dumps({"test": "pytest", "pid": os.getpid(), "cpu_s": _self_cpu()}) + "\n")
        handle.write(json.dumps({"test": "ranks", "pid": os.getpid(), "cpu_s": launch.ranks_cpu_s}) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    total = sum(_times.values())
    terminalreporter.write_sep("-", f"CPU time: {total:.1f} s in {len(_times)} tests (this process)")
    for nodeid, seconds in sorted(_times.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
