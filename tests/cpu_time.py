"""Per-test CPU time, for finding where the suite's time goes on a shared machine (wall time there
is noise): ``python -m pytest -p cpu_time FILE`` prints the tests that used most CPU, and with
``LIGHTNING_MHC_CPU_TIMES=path.jsonl`` appends one line per test to that file (one file for all
xdist workers: each line is written whole).

A test's CPU is user + system time of the pytest process and of its children, before and after
the test (``getrusage``): a child counts once it is reaped, which every helper here does before
the test ends (``spawn_ranks`` joins its ranks; ``subprocess.run`` waits). Ranks forked by the
fork server are its children, not pytest's: they are counted through the server's own reaping
only when the server exits, so for spawned groups the figure is read from the ranks themselves
(``lightning_mhc.testing.launch`` reports each rank's CPU, summed here per test)."""
from __future__ import annotations

import json
import os
import resource

import pytest

_times: dict[str, float] = {}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from lightning_mhc.testing import launch

    before_self, before_children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    before_ranks = launch.ranks_cpu_s
    yield
    own = _cpu(resource.RUSAGE_SELF) - before_self
    children = _cpu(resource.RUSAGE_CHILDREN) - before_children
    ranks = launch.ranks_cpu_s - before_ranks
    _times[item.nodeid] = own + children + ranks
    path = os.environ.get("LIGHTNING_MHC_CPU_TIMES")
    if path:
        line = json.dumps({"test": item.nodeid, "self_s": round(own, 2), "children_s": round(children, 2),
                           "ranks_s": round(ranks, 2)})
        with open(path, "a") as handle:
            handle.write(line + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    total = sum(_times.values())
    terminalreporter.write_sep("-", f"CPU time: {total:.1f} s in {len(_times)} tests (this process)")
    for nodeid, seconds in sorted(_times.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
