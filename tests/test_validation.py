"""Faults and bad input (issue 10): everything checkable is refused before any process starts,
with exit status 2 and ``lightning-mhc-train: invalid configuration: <message>``, no traceback
and no run directory; runs never share a directory; the final step is checkpointed; a sweep
checks every job first and tables the jobs that fail at runtime."""
from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_mhc import ConfigError, ParallelLayout
from lightning_mhc.cli import run_dir
from lightning_mhc.data.sources import check_data
from lightning_mhc.model.config import (
    UNSUPPORTED_OPTIONS,
    MHCTransformerConfig,
    requested_parallel_layout,
    with_parallel_layout,
)
from lightning_mhc.cli.preflight import CONF_DIR, PREFIX, to_train_config, warn_oversubscription
from subprocess_env import child_env
from train_cli import check_before_launch, run_train, run_train_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICK = ["trainer=debug", "data=synthetic", "logger=none"]
TINY = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=256, max_sequence_length=32)


@pytest.fixture(autouse=True)
def _clean_hydra():
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_train_config(compose(config_name="config", overrides=list(overrides)))


def _assert_refused(proc, message: str, cwd: pathlib.Path, what) -> None:
    assert proc.returncode == 2, (what, proc.returncode, proc.stderr[-3000:])
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith(PREFIX)]  # one line, one form
    assert message in line, (what, line)
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stderr, (what, proc.stderr[-3000:])
    assert not (cwd / "outputs").exists() and not (cwd / "multirun").exists(), (what, "a run directory was left")


# ------------------------------------------------------------------ through the CLI
def test_bad_input_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    """Each bad input: exit 2, one line naming key, value and fix, no traceback, no process group,
    no run directory. Relative data paths are taken from the directory the command was started in
    (the message names the absolute path). The first case (a data error) runs as ``python -m
    lightning_mhc.cli.train``; every case, that one too, through the same check in this process
    (``check_before_launch``: what the entry point runs before Hydra, and all it runs for a
    refused command line), seconds each instead of a fresh interpreter's 10 s. Hydra's own errors
    (an unknown option) and range errors through the door are
    test_sweep_lists_every_invalid_job_and_runs_none's."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "short.txt").write_text("far too short for one batch of 64-byte windows\n" * 4)
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 300)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 2000)
    text = ["data=text"]
    cases = [
        (text + ["data.path=missing.txt"], f"data.path='{tmp_path / 'missing.txt'}': no such file"),
        (text + ["data.path=empty.txt"], f"data.path='{tmp_path / 'empty.txt'}' is empty (0 bytes)"),
        (text + ["data.path=empty_dir"], f"data.path='{tmp_path / 'empty_dir'}': no such file, or a folder without files"),
        (text + ["data.path=short.txt"], f"data.path='{tmp_path / 'short.txt'}' gives 188 bytes; its training split "
                                         "(178 bytes, 1 - data.val_fraction=0.05) holds 2 window(s) of "
                                         "data.seq_length+1=65 bytes, fewer than one global batch "
                                         "(data.global_batch_size=8)"),
        (text + ["data.path=weights.bin"], f"the file '{tmp_path / 'weights.bin'}' holds a NUL byte"),
        (text + ["data.path=latin1.txt"], f"the file '{tmp_path / 'latin1.txt'}' is not UTF-8 text"),
        (["optim.lr=0"], "optim.lr=0.0: must be > 0"),
        (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio=1.5: must be in [0, 1]"),
        (["trainer.max_steps=0"], "trainer.max_steps=0: must be >= 1"),
        (["trainer.checkpoint_every_n_steps=0"], "trainer.checkpoint_every_n_steps=0: must be >= 1"),
        (["parallel.timeout_s=0"], "parallel.timeout_s=0.0: must be positive"),
        (["+foo=1"], "foo=1: the top level has no key 'foo', so nothing would read it. Remove the addition"),
        (["+model.bar=2"], "model.bar=2: the model group has no key 'bar'"),
        (["model.num_layer=3"], "model.num_layer=3: the model group has no key 'num_layer' (did you mean "
                                "model.num_layers?)"),
        (["model.num_layers=abc"], "model.num_layers=abc: Value 'abc' of type 'str' could not be converted to "
                                   "Integer; model.num_layers takes an integer"),
        (["model=huge"], "model=huge: the model group has no option 'huge'. Choose one of gpt_125m, gpt_moe_tiny, hf, llama3_70b, small, tiny"),
        (["model.mhc_init_gating_factor=-1"], "model.mhc_init_gating_factor=-1.0: the initial value of the gating "
                                              "scalars"),
        (["trainer=gpu", "trainer.precision=16-mixed"], "trainer.precision=16-mixed with trainer.accelerator=gpu: the "
                                                        "pipeline schedule runs its own backward without a gradient "
                                                        "scaler"),
        (["optim.name=adafactor", "optim.use_distributed_optimizer=true"],
         "the distributed optimizer cuts parameters into pieces, which only an element-wise update allows; Adafactor "
         "is not one of SGD"),
    ]
    overrides, message = cases[0]
    _assert_refused(run_train(tmp_path, *QUICK[:1], *overrides, timeout=120), message, tmp_path, overrides)
    for overrides, message in cases:
        status, err = check_before_launch([*QUICK[:1], *overrides], tmp_path, monkeypatch, capsys)
        (line,) = err.strip().splitlines()
        assert status == 2 and line.startswith(PREFIX) and message in line, (overrides, err)
        assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists(), overrides


def test_a_refused_moe_config_says_only_its_own_line(tmp_path, monkeypatch, capsys):
    """MoE configs this layout refuses (experts over EP, with sequence parallelism), without
    ``model.moe_ffn_hidden_size``: megatron's "moe_ffn_hidden_size is not set" warning of the model
    alone is not said before the one line; a config that runs still hears it."""
    import warnings

    for overrides, message in (
            (["model.num_moe_experts=3", "parallel.expert_model_parallel_size=2", "trainer.devices=2"],
             "model.num_moe_experts=3 does not split over parallel.expert_model_parallel_size=2"),
            (["model.num_moe_experts=4", "parallel=tp2sp", "trainer.devices=2"],
             "model.num_moe_experts=4 with parallel.sequence_parallel=true is not implemented")):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            status, err = check_before_launch([*QUICK[:1], *overrides], tmp_path, monkeypatch, capsys)
        (line,) = err.strip().splitlines()
        assert status == 2 and message in line, (overrides, err)
        assert not [str(w.message) for w in said if "moe_ffn_hidden_size" in str(w.message)], overrides
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        status, _ = check_before_launch([*QUICK[:1], "model.num_moe_experts=4"], tmp_path, monkeypatch, capsys)
    assert status == 0 and any("moe_ffn_hidden_size is not set" in str(w.message) for w in said)


def test_relative_data_path_and_final_step_checkpoint(tmp_path):
    """``data.path`` relative to where the command started (Hydra runs in the run directory, here
    a relative one too); 5 steps with a checkpoint every 3: step 3 (periodic) and step 5 (the final
    step) are saved. What the run reads and writes, on a rank forked from the preloaded server
    started in ``tmp_path`` (``run_train_on_ranks``), not a fresh interpreter: the launch and its
    default run directory are test_runs_started_together_get_their_own_directories'."""
    (tmp_path / "corpus.txt").write_text((ROOT / "README.md").read_text())
    run_train_on_ranks(tmp_path, "trainer=debug", "logger=none", "data=text", "data.path=corpus.txt",
                       "trainer.max_steps=5", "trainer.checkpoint_every_n_steps=3", "hydra.run.dir=outputs/day/time")
    (run,) = list((tmp_path / "outputs").glob("*/*"))
    saved = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt") if (p / "metadata.json").is_file())
    assert saved == ["step-000003.ckpt", "step-000005.ckpt"], saved
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["last_checkpoint"] == str(run / "checkpoints" / "step-000005.ckpt")
    assert json.loads((run / "checkpoints" / "step-000005.ckpt" / "metadata.json").read_text())["global_step"] == 5


def test_sweep_lists_every_invalid_job_and_runs_none(tmp_path):
    proc = run_train(tmp_path, "-m", *QUICK, "optim.lr=0,3e-3", "trainer.max_steps=0,2", "model=tiny,huge",
                     timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(PREFIX)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stderr
    # 8 jobs in the order of the sweep's product; only job 6 (optim.lr=0.003 trainer.max_steps=2 model=tiny) is valid
    assert len(lines) == 8 and lines[-1] == PREFIX + "7 of the sweep's 8 jobs are invalid; no job was started.", lines
    assert lines[0] == PREFIX + ("job 0 (optim.lr=0 trainer.max_steps=0 model=tiny): trainer.max_steps=0: must be >= 1. "
                                 "Set trainer.max_steps to the optimizer steps to train, >= 1."), lines
    assert lines[2].startswith(PREFIX + "job 2 (optim.lr=0 trainer.max_steps=2 model=tiny): optim.lr=0.0: must be > 0")
    assert lines[5].startswith(PREFIX + "job 5 (optim.lr=0.003 trainer.max_steps=0 model=huge): model=huge: the model "
                               "group has no option 'huge'"), lines
    assert [line.split(" (")[0].rsplit(" ", 1)[-1] for line in lines[:-1]] == ["0", "1", "2", "3", "4", "5", "7"]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_sweep_tables_a_failed_job_and_gives_each_job_its_wandb_run(tmp_path):
    """optim.lr=1e30 passes validation and makes the loss NaN at step 1 (trainer.raise_on_nonfinite_loss
    is on by default): that job fails, the next one still runs; the summary, rewritten at every job's
    end, has both rows; each job logged to its own (offline) wandb run (the CLI's check that
    ``logger=wandb`` stays offline: a single run builds its logger by the same ``build_logger``)."""
    proc = run_train(tmp_path, "-m", "trainer=debug", "data=synthetic", "logger=wandb", "optim.lr=1e30,3e-3",
                     "hydra.sweep.dir=sweep", env={"WANDB_MODE": "offline"}, timeout=400)
    assert proc.returncode == 1, proc.stderr[-5000:]  # a runtime failure, not an invalid configuration
    assert "FloatingPointError" in proc.stderr and PREFIX not in proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "completed")], rows
    assert rows[0]["error"].startswith("FloatingPointError: non-finite training loss") and rows[0]["steps"] == ""
    assert rows[0]["overrides"].endswith("optim.lr=1e+30") and rows[1]["steps"] == "6"
    assert json.loads((tmp_path / "sweep" / "summary.json").read_text())[1]["status"] == "completed"
    for job in ("0", "1"):
        assert len(list((tmp_path / "sweep" / job / "wandb").glob("offline-run-*"))) == 1, job


def test_runs_started_together_get_their_own_directories(tmp_path):
    """Two runs started at once in one directory, whose default run directories (outputs/<date>/<time>)
    are all taken already for the next two minutes: each run reserves its own (``<time>-1``,
    ``<time>-2``, ...), never an existing one; the DP = 2 run's second process uses its parent's."""
    now = datetime.datetime.now()
    taken = set()
    for second in range(120):
        t = now + datetime.timedelta(seconds=second)
        path = tmp_path / "outputs" / t.strftime("%Y-%m-%d") / t.strftime("%H-%M-%S")
        path.mkdir(parents=True)
        (path / "earlier_run.txt").write_text("not yours")
        taken.add(path)
    commands = [[*QUICK], [*QUICK, "parallel=dp2", "trainer.devices=2"]]
    procs = [subprocess.Popen([sys.executable, "-m", "lightning_mhc.cli.train", *args], cwd=tmp_path, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in commands]
    results = [proc.communicate(timeout=400) for proc in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err[-5000:]
    runs = sorted(set((tmp_path / "outputs").glob("*/*")) - taken)
    assert len(runs) == 2, runs
    for run in runs:
        assert (run / "summary.json").is_file() and not (run / "earlier_run.txt").exists(), list(run.iterdir())
        assert run.name.rsplit("-", 1)[0] in {p.name for p in taken}  # <time>-<n>
    assert sorted(json.loads((run / "summary.json").read_text())["devices"] for run in runs) == [1, 2]
    assert not any((path / "summary.json").exists() for path in taken)


# ------------------------------------------------------------------ in process
@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
    (["optim.name=lion"], "optim.name='lion': must be one of adamw, sgd, adafactor"),
    (["trainer.num_nodes=0"], "trainer.num_nodes=0: must be >= 1"),
    (["parallel=tp2pp2", "trainer.devices=2", "trainer.num_nodes=3"],
     "= 4 does not divide trainer.devices x trainer.num_nodes = 6"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1: must be >= 0"),
    (["optim.min_lr_ratio=-0.1"], "optim.min_lr_ratio=-0.1: must be in [0, 1]"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0: must be >= 1"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0: must be >= 1"),
    (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches=-1: must be >= 0"),
    (["trainer.precision=fp8"], "trainer.precision='fp8': must be one of 32-true"),
    (["trainer.float32_matmul_precision=low"],
     "trainer.float32_matmul_precision='low': must be one of highest, high, medium"),
    (["parallel.timeout_s=-5"], "parallel.timeout_s=-5.0: must be positive"),
    (["parallel.timeout_s=inf"], "parallel.timeout_s=inf: must be a finite number of seconds"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size"
                                          " >= 2 (it is 1)"),
    (["parallel=tp2sp", "trainer.devices=2", "data.seq_length=63"],
     "parallel.sequence_parallel=true splits data.seq_length=63 over parallel.tensor_model_parallel_size=2 ranks"),
    (["parallel.virtual_pipeline_model_parallel_size=2"],
     "parallel.virtual_pipeline_model_parallel_size=2 needs parallel.pipeline_model_parallel_size >= 2 (it is 1)"),
    (["parallel=pp2v2", "trainer.devices=2", "model.num_layers=6"],
     "model.num_layers=6 cannot be split into parallel.pipeline_model_parallel_size=2 x "
     "parallel.virtual_pipeline_model_parallel_size=2 = 4 equal chunks"),
    (["parallel=pp2v2", "trainer.devices=2", "model.num_layers=4", "data.global_batch_size=4",
      "data.micro_batch_size=4"], "a number of microbatches (data.global_batch_size / (data.micro_batch_size x DP) = 1)"
                                  " that is a multiple of parallel.pipeline_model_parallel_size=2"),
    (["data.seq_length=0"], "data.seq_length=0: must be >= 1"),
    (["data.micro_batch_size=0"], "data.micro_batch_size=0: must be >= 1"),
    (["data.val_fraction=0"], "data.val_fraction=0.0: must be in (0, 1)"),
    (["model.num_attention_heads=0"], "model.num_attention_heads=0: must be >= 1"),
    (["model.hidden_dropout=1"], "model.hidden_dropout=1.0: must be in [0, 1)"),
    (["logger.name=tensorboard"], "logger.name='tensorboard': must be one of csv, wandb, none"),
    (["seed=-1"], "seed=-1: must be an integer in [0, 2**32)"),
    (["recompute=mhc_block", "recompute.mhc_recompute_layer_num=0"], "recompute.mhc_recompute_layer_num=0: a recompute "
                                                                      "block holds a whole, positive number of layers"),
    (["+trainer.max_step=5", "+parallel.zigzag=2"],
     "parallel.zigzag=2: the parallel group has no key 'zigzag'; "
     "trainer.max_step=5: the trainer group has no key 'max_step' (did you mean trainer.max_steps?)"),
])
def test_ranges_and_unknown_keys(overrides, message):
    with pytest.raises(ConfigError) as error:
        _compose(*overrides)
    assert message in str(error.value)


def test_sequence_parallel_and_virtual_pipeline_layouts_compose():
    sp = _compose("parallel=tp2sp", "trainer.devices=2")
    assert sp.parallel.sequence_parallel and sp.parallel.tensor_model_parallel_size == 2
    vp = _compose("parallel=pp2v2", "trainer.devices=2", "model.num_layers=4")
    assert vp.parallel.virtual_pipeline_model_parallel_size == 2 and vp.num_microbatches % 2 == 0


@pytest.mark.parametrize("name, value, instead", [
    ("fp32_residual_connection", True, "Leave it False"),
    ("hybrid_context_parallel", True, "Leave hybrid_context_parallel at its default (False)"),
])
def test_unsupported_megatron_options_are_refused_by_one_rule(name, value, instead):
    with pytest.raises(ConfigError) as built:
        MHCTransformerConfig(**TINY, **{name: value})
    assert f"MHCTransformerConfig sets {name}={value!r}, which" in str(built.value) and instead in str(built.value)
    if name == "hybrid_context_parallel":  # a layout key of a module's model_config dict: the same rule
        tail = str(built.value).split(", which", 1)[1]
        with pytest.raises(ConfigError) as requested:
            requested_parallel_layout({**TINY, name: value})
        assert str(requested.value) == f"model_config sets {name}={value!r}, which{tail}"
        with pytest.raises(ConfigError) as laid_out:
            with_parallel_layout(MHCTransformerConfig(**TINY), ParallelLayout(), requested={name: value})
        assert str(laid_out.value) == str(requested.value)
    assert name in UNSUPPORTED_OPTIONS


def test_context_parallel_size_is_a_degree_of_the_layout_now():
    """The model runs CP (docs/context_parallel.md): the config takes it; a module's model_config that
    asks for another CP size than the strategy's is refused like any layout degree."""
    assert MHCTransformerConfig(**TINY, context_parallel_size=2).context_parallel_size == 2
    assert "context_parallel_size" not in UNSUPPORTED_OPTIONS
    with pytest.raises(ConfigError, match="model_config sets context_parallel_size=2, but the strategy runs"):
        with_parallel_layout(MHCTransformerConfig(**TINY), ParallelLayout(), requested={"context_parallel_size": 2})


@pytest.mark.parametrize("kwargs, message", [
    (dict(mhc_init_gating_factor=-0.01), "mhc_init_gating_factor=-0.01: the initial value"),
    (dict(mhc_init_gating_factor=float("inf")), "mhc_init_gating_factor=inf"),
    (dict(mhc_recompute_layer_num=True), "mhc_recompute_layer_num=True: a recompute block holds a whole"),
    (dict(mhc_recompute_layer_num=1.5), "mhc_recompute_layer_num=1.5"),
    (dict(mhc_recompute_layer_num=0), "mhc_recompute_layer_num=0"),
])
def test_mhc_options_megatron_lm_refuses(kwargs, message):
    with pytest.raises(ConfigError) as error:
        MHCTransformerConfig(**TINY, **kwargs)
    assert message in str(error.value)
    assert MHCTransformerConfig(**TINY, mhc_init_gating_factor=0.0, mhc_recompute_layer_num=2).mhc_recompute_layer_num == 2


def test_check_data_reads_sizes_and_first_bytes(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("x" * 700)
    (folder / "b.txt").write_text("é" * 300 + "\n")  # multi-byte UTF-8, valid
    counts = check_data("text", str(folder), seq_length=16, max_bytes=10_000, global_batch_size=2)
    assert counts == dict(bytes=1301, train_windows=77, val_windows=4)
    (folder / "c.bin").write_bytes(b"\x00" * 10)  # within max_bytes: read, refused
    with pytest.raises(ConfigError, match="c.bin' holds a NUL byte"):
        check_data("text", str(folder), seq_length=16, max_bytes=10_000, global_batch_size=2)
    # beyond max_bytes it is never read (the first 1300 bytes come from a.txt and b.txt)
    check_data("text", str(folder), seq_length=16, max_bytes=1300, global_batch_size=2)
    with pytest.raises(ConfigError, match="validation split .* holds 4 window.* fewer than one global batch"):
        check_data("text", str(folder), seq_length=16, max_bytes=1300, global_batch_size=5)
    check_data("text", str(folder), seq_length=16, max_bytes=1300, global_batch_size=5, validate=False)
    with pytest.raises(ConfigError, match="data.synthetic_samples=6 gives 6 training"):
        check_data("synthetic", synthetic_samples=6, global_batch_size=8)


def test_unique_dir_reserves_a_fresh_directory_once_per_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_dir, "_reserved", {})
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    pattern = "outputs/fixed"
    (tmp_path / "outputs" / "fixed").mkdir(parents=True)
    (tmp_path / "outputs" / "fixed-1").mkdir()
    first = run_dir.unique_dir(pattern)
    assert first == str(tmp_path / "outputs" / "fixed-2") and os.path.isdir(first)
    monkeypatch.chdir(first)  # Hydra changes into it; the answer stays the same
    assert run_dir.unique_dir(pattern) == first
    monkeypatch.setattr(run_dir, "_reserved", {})  # another process
    assert run_dir.unique_dir(str(tmp_path / "outputs/fixed")) == str(tmp_path / "outputs" / "fixed-3")
    monkeypatch.setattr(run_dir, "_reserved", {})
    monkeypatch.setenv("LOCAL_RANK", "1")  # a torchrun rank: the plain name, nothing reserved
    assert run_dir.unique_dir(str(tmp_path / "outputs" / "%Y")) == str(tmp_path / "outputs" / time.strftime("%Y"))
    assert not (tmp_path / "outputs" / time.strftime("%Y")).exists()


def test_more_cpu_processes_than_cores_warns(capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    warn_oversubscription(_compose("parallel=tp2pp2", "trainer.devices=4"))
    assert "lightning-mhc-train: warning: trainer.devices=4 CPU processes on 2 CPU cores" in capsys.readouterr().err
    warn_oversubscription(_compose("parallel=tp2", "trainer.devices=2"))
    assert capsys.readouterr().err == ""
