"""A pytest plugin for ``gpu_check.py``: one JSON line per test, written as each test starts and
ends, to the file named by ``GPU_TEST_LOG``.

JUnit XML is written only when pytest exits, so a run killed at its time limit would leave nothing;
these lines survive the kill, and name the test that was running when it came.

    GPU_TEST_LOG=out/gpu_tests.jsonl pytest -p gpu_test_log ...     (benchmarks/ on PYTHONPATH)

Lines: ``{"test": name, "event": "started"}``, then ``{"test": name, "event": "finished",
"outcome": "passed" | "failed" | "skipped", "seconds": s, "message": why}`` (a skip's reason, a
failure's last lines).
"""
from __future__ import annotations

import json
import os

_reports: dict[str, list] = {}


def _write(line: dict) -> None:
    with open(os.environ["GPU_TEST_LOG"], "a") as log:
        log.write(json.dumps(line) + "\n")


def _name(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def pytest_runtest_logstart(nodeid, location):
    _write({"test": _name(nodeid), "event": "started"})


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid, location):
    reports = _reports.pop(nodeid, [])
    failed = [r for r in reports if r.failed]
    skipped = [r for r in reports if r.skipped]
    if failed:
        outcome, message = "failed", failed[0].longreprtext[-1500:]
    elif skipped:
        # a skip's longrepr is (file, line, "Skipped: reason")
        repr_ = skipped[0].longrepr
        outcome, message = "skipped", (repr_[2] if isinstance(repr_, tuple) else str(repr_)).removeprefix("Skipped: ")
    else:
        outcome, message = "passed", ""
    _write({"test": _name(nodeid), "event": "finished", "outcome": outcome,
            "seconds": round(sum(r.duration for r in reports), 2), "message": message})
