"""Loaded by every Python process started under ``pytest -p cpu_time`` (which puts this folder on
``PYTHONPATH``): at exit, the process appends its own CPU seconds to ``LIGHTNING_MHC_CPU_LOG``
under the test that was running when it started. A rank that Lightning's launcher or torchrun
starts may outlive its reaper or never be waited for, so the pytest process's
``RUSAGE_CHILDREN`` cannot be trusted to hold it; each process reporting itself can."""
import atexit
import json
import os
import resource

_log, _test = os.environ.get("LIGHTNING_MHC_CPU_LOG"), os.environ.get("LIGHTNING_MHC_CPU_TEST")


def _report() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps({"test": _test, "pid": os.getpid(), "cpu_s": usage.ru_utime + usage.ru_stime})
    with open(_log, "a") as handle:
        handle.write(line + "\n")


if _log and _test:
    atexit.register(_report)
