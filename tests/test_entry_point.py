"""``lightning-mhc-train`` end to end: data parallelism against one process, exact resume,
and checkpoint paths refused before any process starts."""
from __future__ import annotations

import csv
import json
import math
import pathlib
import shutil

import pytest
import torch

from lightning_mhc.checkpoint import commit
from lightning_mhc.checkpoint.format import LEGACY_FORMAT
from train_cli import check_before_launch, run_train, run_train_on_ranks, stream_divergences, train_losses

# 6 steps of the tiny mHC model on synthetic tokens (64 steps per epoch at a global batch of 4)
QUICK = ["trainer=debug", "data=synthetic", "trainer.log_every_n_steps=1"]
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0"]


def _fit(tmp_path: pathlib.Path, name: str, *overrides: str) -> pathlib.Path:
    """The run directory of ``lightning-mhc-train *QUICK *overrides`` on ranks forked from the
    preloaded server: these tests are about what a run computes and writes; the launch itself
    (the console script, Lightning's launcher, a run directory from the clock) keeps its real
    runs here (resuming with ``ckpt_path=last``, a refused checkpoint), in test_hydra.py and in
    test_preemption.py."""
    cwd = tmp_path / name
    cwd.mkdir()
    run_train_on_ranks(cwd, *QUICK, *overrides, f"hydra.run.dir={cwd / 'run'}")
    return cwd / "run"


def test_data_parallel_runs_match_one_process(tmp_path, cli_reference_losses, cli_reference_run):
    """Global batch 8: one process (2 microbatches of 4; conftest's ``cli_reference_losses``) vs
    DP = 2 (micro-batch 4 per rank) vs PP = 2 x DP = 2 (2 microbatches of 2 per rank), per-step
    training losses. The DP 2 run sets ``trainer.float32_matmul_precision=high`` (torch's fp32
    matmuls on this CPU unchanged by it, checked; ``medium`` would make them bf16 here), which its
    summary reads back from the training process."""
    batch = ["data.global_batch_size=8", *NO_DROPOUT]
    dp2 = _fit(tmp_path, "dp2", *batch, "data.micro_batch_size=4", "parallel=dp2", "trainer.devices=2",
               "trainer.float32_matmul_precision=high")
    pp2dp2 = _fit(tmp_path, "pp2dp2", *batch, "data.micro_batch_size=2", "parallel=pp2", "trainer.devices=4")
    reference = cli_reference_losses
    assert len(reference) == 6
    for run_dir in (dp2, pp2dp2):
        losses = train_losses(run_dir / "metrics.csv")
        assert losses.keys() == reference.keys(), run_dir
        diff = max(abs(losses[k] - reference[k]) for k in reference)
        print(f"lightning-mhc-train {run_dir.parent.name}: max |loss - one process| over 6 steps = {diff:.3g}")
        torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(list(reference.values())),
                                   rtol=0, atol=1e-5, msg=lambda m: f"{run_dir}: {m}")
    # the streams' divergence of every layer, every step: on PP 2 the second stage's layers too
    # (gathered to the logging rank); the tiny GPT's streams differ from its first step
    layers = {f"decoder.layers.{i}" for i in range(4)}
    for run_dir in (cli_reference_run, dp2, pp2dp2):
        divergences = stream_divergences(run_dir / "metrics.csv")
        assert divergences.keys() == reference.keys(), run_dir
        assert all(d.keys() == layers and all(0 < v < 2 for v in d.values()) for d in divergences.values()), divergences
    summary = json.loads((dp2 / "summary.json").read_text())
    assert summary["data_parallel_size"] == 2 and summary["timed_steps"] == 5
    assert summary["float32_matmul_precision"] == "high"
    assert summary["tokens_per_sec_p25"] <= summary["tokens_per_sec"] <= summary["tokens_per_sec_p75"]


def test_a_short_run_logs_its_training_loss_and_counts_its_steps(tmp_path):
    """``lightning-mhc-train trainer.max_steps=5`` as a user starts it (the default ``trainer=cpu``,
    whose ``trainer.log_every_n_steps`` is left null): metrics.csv has the training loss of every
    step; the progress bar counts the 5 steps under ``Epoch 0`` (not Lightning's ``Epoch 0/-2`` of
    ``max_epochs=-1``); no warning that the run directory's logs will be deleted."""
    proc = run_train(tmp_path, "data=synthetic", "trainer.max_steps=5", "trainer.limit_val_batches=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("outputs/*/*"))
    assert sorted(train_losses(run_dir / "metrics.csv")) == [0, 1, 2, 3, 4]
    (bar,) = [line for line in proc.stdout.splitlines() if line.startswith("Epoch")]
    assert bar.startswith("Epoch 0 ") and "/-2" not in bar and " 5/5 " in bar, bar
    assert "exists and is not empty" not in proc.stderr and "will be deleted" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("layout", [["parallel=single"], ["parallel=tp2pp2", "trainer.devices=4", "recompute=mhc_block"]],
                         ids=["single", "tp2pp2"])
def test_resume_mid_epoch_continues_exactly(tmp_path, layout):
    """8 steps with a checkpoint at step 5 (mid-epoch, dropout 0.1), then a run resumed from it:
    steps 6-8 equal. One process resumes with ``ckpt_path=last`` in the same run directory."""
    steps = ["trainer.max_steps=8", "trainer.checkpoint_every_n_steps=5"]
    first = _fit(tmp_path, "first", *layout, *steps)
    uninterrupted = train_losses(first / "metrics.csv")
    assert sorted(uninterrupted) == list(range(8))
    (checkpoint,) = list((first / "checkpoints").glob("step-000005.ckpt"))
    # the final step is checkpointed too, next to the newest periodic checkpoint
    assert sorted(p.name for p in (first / "checkpoints").glob("*.ckpt")) == ["step-000005.ckpt", "step-000008.ckpt"]
    if layout == ["parallel=single"]:
        shutil.rmtree(first / "checkpoints" / "step-000008.ckpt")  # as if the run had stopped before step 8
        proc = run_train(tmp_path / "first", *QUICK, *layout, *steps, f"hydra.run.dir={first}", "ckpt_path=last")
        assert proc.returncode == 0, proc.stderr[-6000:]
        # resuming in its own directory: nothing there is deleted, and Lightning's warnings do not say so
        assert "exists and is not empty" not in proc.stderr, proc.stderr[-3000:]
        resumed = train_losses(first / "resumed_from_step_5" / "metrics.csv")
        assert train_losses(first / "metrics.csv") == uninterrupted  # the first run's log is kept
    else:
        resumed_dir = _fit(tmp_path, "resumed", *layout, *steps, f"ckpt_path={checkpoint}")
        resumed = train_losses(resumed_dir / "metrics.csv")
        assert json.loads((resumed_dir / "summary.json").read_text())["resumed_from"] == str(checkpoint)
    assert sorted(resumed) == [5, 6, 7]
    diff = max(abs(resumed[s] - uninterrupted[s]) for s in (5, 6, 7))
    print(f"lightning-mhc-train {' '.join(layout)}: resumed from step 5, max |loss - uninterrupted| = {diff:.3g}")
    torch.testing.assert_close(torch.tensor([resumed[s] for s in (5, 6, 7)]),
                               torch.tensor([uninterrupted[s] for s in (5, 6, 7)]), rtol=0, atol=1e-6)


def test_resuming_under_another_schedule_is_refused_or_follows_the_new_one(tmp_path, cli_reference_run,
                                                                        monkeypatch, capsys):
    """The final (step-6) checkpoint of conftest's ``cli_reference_run`` (lr 3e-3, 20 warm-up steps,
    decay to step 6): continued to ``trainer.max_steps=8`` it is refused before launch in one line
    naming the key and ``optim.override_scheduler``; with the override (and 2 warm-up steps) steps 6
    and 7 log the new schedule's rates, the resumed step included."""
    from conftest import CLI_REFERENCE_RUN

    checkpoint = cli_reference_run / "checkpoints" / "step-000006.ckpt"
    status, err = check_before_launch([*CLI_REFERENCE_RUN, "trainer.max_steps=8", f"ckpt_path={checkpoint}"],
                                      tmp_path, monkeypatch, capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert ("trainer.max_steps=8 (the step the cosine decay ends at; the checkpoint's 6). Resume with the "
            "checkpoint's values, or set optim.override_scheduler=true to follow this run's schedule from the "
            "checkpoint's step 6 on.") in err, err
    cwd = tmp_path / "override"
    cwd.mkdir()
    run_train_on_ranks(cwd, *CLI_REFERENCE_RUN, "optim.warmup_steps=2", "trainer.max_steps=8",
                       "optim.override_scheduler=true", f"ckpt_path={checkpoint}", f"hydra.run.dir={cwd / 'run'}")
    with open(cwd / "run" / "metrics.csv") as handle:
        rates = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(handle) if row.get("lr")}
    progress = {6: 4 / 6, 7: 5 / 6}  # (step - warm-up) / (max_steps - warm-up)
    expected = {s: 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))) for s, p in progress.items()}
    print(f"resumed at step 6 under the new schedule: lr {rates}, expected {expected}")
    assert rates.keys() == expected.keys() and all(abs(rates[s] - expected[s]) <= 1e-6 * expected[s] for s in rates)


def test_bad_checkpoint_paths_are_refused_before_launch(tmp_path, monkeypatch, capsys):
    """The first case through a real ``python -m lightning_mhc.cli.train`` (the door), the others
    through the same check before launch in this process."""
    partial = tmp_path / "partial.ckpt"
    partial.mkdir()
    (partial / "model_tp0_pp0.pt").write_bytes(b"")
    other_layout = tmp_path / "tp2.ckpt"
    other_layout.mkdir()
    commit.write_metadata(other_layout, dict(format=LEGACY_FORMAT, world_size=2, tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=1, data_parallel_size=1, global_step=3))
    earlier_run = tmp_path / "earlier_run"
    earlier_run.mkdir()
    (earlier_run / "metrics.csv").write_text("step,train_loss\n0,5.5\n")
    cases = [
        (["ckpt_path=does/not/exist"], "does not exist"),
        ([f"ckpt_path={partial}"], "metadata.json is missing"),
        ([f"ckpt_path={other_layout}"], "convert it once with torchrun --nproc-per-node 2 -m lightning_mhc.cli.convert"),
        ([f"hydra.run.dir={earlier_run}", "ckpt_path=nope"], "does not exist"),
    ]
    (overrides, message), *others = cases
    proc = run_train(tmp_path, *QUICK, *overrides, timeout=120)
    assert proc.returncode == 2, (overrides, proc.stderr[-3000:])
    assert message in proc.stderr and "Initializing distributed" not in proc.stderr, overrides
    for overrides, message in others:
        status, err = check_before_launch([*QUICK, *overrides], tmp_path, monkeypatch, capsys)
        assert status == 2 and message in err, (overrides, err[-3000:])
    assert not (tmp_path / "outputs").exists(), "a run directory was left behind"
    assert (earlier_run / "metrics.csv").read_text() == "step,train_loss\n0,5.5\n"  # an earlier run is never removed


@pytest.mark.slow
def test_validate_and_test_a_checkpoint_on_another_layout(tmp_path, cli_reference_run, monkeypatch, capsys):
    """mode=validate / mode=test: a one-process run's step-6 checkpoint (conftest's
    ``cli_reference_run``) evaluated on TP 2 x PP 2 (4 processes) and on one process gives the
    validation loss the run logged at step 6."""
    from conftest import CLI_REFERENCE_RUN

    first = cli_reference_run
    with open(first / "metrics.csv") as handle:
        logged = {int(row["step"]): float(row["val_loss"]) for row in csv.DictReader(handle) if row.get("val_loss")}
    checkpoint = first / "checkpoints" / "step-000006.ckpt"
    assert max(logged) == 5 and checkpoint.is_dir(), logged  # the logger's rows count from 0: after step 6
    logged[6] = logged[5]
    for name, mode, layout in (("validate_tp2pp2", "validate", ["parallel=tp2pp2", "trainer.devices=4"]),
                               ("test_single", "test", ["parallel=single"])):
        run_dir = _fit(tmp_path, name, *CLI_REFERENCE_RUN, *layout, f"mode={mode}", f"ckpt_path={checkpoint}")
        summary = json.loads((run_dir / "summary.json").read_text())
        key = "val_loss" if mode == "validate" else "test_loss"
        print(f"mode={mode} {' '.join(layout)}: {summary[key]:.6f}, logged at step 6: {logged[6]:.6f}")
        assert summary["mode"] == mode and abs(summary[key] - logged[6]) <= 1e-5, (summary, logged)
    status, err = check_before_launch([*QUICK, "mode=validate"], tmp_path, monkeypatch, capsys)
    assert status == 2 and "mode=validate evaluates a checkpoint: give ckpt_path=" in err
