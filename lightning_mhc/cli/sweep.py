"""A Hydra callback that tables a multirun: one row per job, written as each job ends.

``summary.csv`` / ``summary.json`` in the sweep directory are rewritten at the end of every job,
so they hold a row for each job that ran, also when a later job fails or the sweep is stopped. A
finished job's row is its ``summary.json`` with ``status=completed``; a failed job's row has
``status=failed`` and ``error`` (the exception's type and message).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_mhc.cli.run_dir import started_by_a_launcher

COLUMNS = ["job", "overrides", "status", "error", "policy", "devices", "tensor_model_parallel_size",
           "pipeline_model_parallel_size", "data_parallel_size", "steps", "initial_val_loss", "final_val_loss",
           "final_train_loss", "tokens_per_sec", "tokens_per_sec_p25", "tokens_per_sec_p75", "step_time_ms",
           "timed_steps", "activation_bytes"]


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus, filter_overrides

        hc = HydraConfig.get()
        if hc.mode.name != "MULTIRUN" or started_by_a_launcher() or job_return is None:
            return
        job_dir = Path(hc.runtime.output_dir)
        sweep_dir = job_dir.parents[len(Path(str(hc.sweep.subdir)).parts) - 1]
        row: dict[str, Any] = dict(job=str(job_dir.relative_to(sweep_dir)),
                                   overrides=" ".join(filter_overrides(list(hc.overrides.task))))
        if job_return.status == JobStatus.COMPLETED:
            summary = job_dir / "summary.json"
            row.update(json.loads(summary.read_text()) if summary.is_file() else {})
            row["status"] = "completed"
        else:
            error = job_return._return_value
            row.update(status="failed", error=f"{type(error).__name__}: {error}".strip())
        self.rows[int(hc.job.num)] = row
        self._write(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.rows:
            sweep_dir = Path(config.hydra.sweep.dir)
            failed = sum(row["status"] == "failed" for row in self.rows.values())
            print(f"sweep summary: {sweep_dir / 'summary.csv'} ({len(self.rows)} jobs"
                  + (f", {failed} failed" if failed else "") + ")")

    def _write(self, sweep_dir: Path) -> None:
        rows = [self.rows[n] for n in sorted(self.rows)]
        for name, write in (("summary.csv", self._write_csv), ("summary.json", self._write_json)):
            partial = sweep_dir / f".{name}.partial"
            write(partial, rows)
            partial.replace(sweep_dir / name)  # a reader never sees a half-written table

    @staticmethod
    def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    @staticmethod
    def _write_json(path: Path, rows: list[dict[str, Any]]) -> None:
        path.write_text(json.dumps(rows, indent=2))
