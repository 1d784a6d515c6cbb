"""Hydra configs (compose API), validation before launch, the entry point, sweeps, examples."""
from __future__ import annotations

import csv
import json
import pathlib
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from hydra.errors import ConfigCompositionException

from lightning_mhc import ConfigError
from lightning_mhc.cli.schema import TrainConfig
from lightning_mhc.cli.preflight import CONF_DIR
from script_runs import run_on_ranks
from subprocess_env import child_env
from train_cli import run_train as _train, run_train_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
# overrides some group options need to form a valid run
COMPANIONS = {
    ("parallel", "dp2"): ["trainer.devices=2"],
    ("parallel", "tp2"): ["trainer.devices=2"],
    ("parallel", "pp2"): ["trainer.devices=2"],
    ("parallel", "tp2pp2"): ["trainer.devices=4"],
    ("parallel", "pp4"): ["trainer.devices=4"],
    ("parallel", "tp2sp"): ["trainer.devices=2"],
    ("parallel", "pp2v2"): ["trainer.devices=2"],
    ("parallel", "cp2"): ["trainer.devices=2"],
    ("parallel", "tp2cp2"): ["trainer.devices=4"],
    ("data", "text"): [f"data.path={ROOT / 'README.md'}"],
    ("data", "megatron"): ["data.blend=[corpus_text_document]", "data.tokenizer=sample"],  # files: checked at launch
    ("model", "gpt_125m"): ["data.seq_length=64"],
}


@pytest.fixture(autouse=True)
def _clean_hydra():
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def compose_config(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    train = OmegaConf.to_object(cfg)
    train.check_model()
    return train


def _options():
    for group_dir in sorted(p for p in pathlib.Path(CONF_DIR).iterdir() if p.is_dir()):
        for option in sorted(group_dir.glob("*.yaml")):
            yield group_dir.name, option.stem


@pytest.mark.parametrize("group, option", list(_options()))
def test_every_config_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):  # a Hugging Face config to build (on the meta device)
        pytest.importorskip("transformers")
        from transformers import LlamaConfig

        LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    vocab_size=300).save_pretrained(tmp_path)
        overrides.append(f"model.config={tmp_path}")
    cfg = compose_config(*overrides, *COMPANIONS.get((group, option), []))
    assert isinstance(cfg, TrainConfig)
    if cfg.model.is_hf:
        assert cfg.model.hf_dir == str(tmp_path)
    else:
        assert cfg.transformer_config().num_layers == cfg.model.num_layers


def test_the_gpt_keys_are_the_model_configs_fields():
    """The model group's GPT keys are MHCTransformerConfig's fields (``activation`` the CLI's own
    spelling of two): each typed as the model's field, null allowed, and filled with the model's
    default (``_gpt_defaults``: the schema's small sizes and the nulls the model resolves aside);
    the shared ``mhc_implementation`` defaults as the model and the hyper-connections of a
    Hugging Face model do; the recompute group as the policy does."""
    import dataclasses
    import typing

    from lightning_mhc.cli.schema import (GPT_SIZES, NULL_IS_A_CHOICE, ModelConfig, RecomputeConfig,
                                          _gpt_defaults)
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings
    from lightning_mhc.recompute import RecomputePolicy

    def allowed(annotation) -> set:  # the types a field's annotation admits (ours are strings: future annotations)
        if isinstance(annotation, str):
            annotation = eval(annotation, vars(typing))
        if typing.get_origin(annotation) is typing.Literal:  # a choice of values: the CLI types it by their type
            return {type(value) for value in typing.get_args(annotation)}
        return {t for arg in (typing.get_args(annotation) or [annotation]) for t in
                (allowed(arg) if typing.get_origin(arg) is typing.Literal else {arg})}

    model = {f.name: f for f in dataclasses.fields(MHCTransformerConfig)}
    schema = typing.get_type_hints(ModelConfig)
    keys = [k for k in ModelConfig(source="gpt").own_keys if k != "activation"] + ["init_seed", "mhc_implementation"]
    assert {"enable_hyper_connections", "num_residual_streams", "mhc_sinkhorn_iterations",
            "mhc_init_gating_factor"} <= set(keys)
    defaults = _gpt_defaults()
    for key in keys:
        assert key in model, f"model.{key} is no MHCTransformerConfig field"
        if schema[key] is typing.Any:  # a union of two types (moe_layer_freq: int or list), which OmegaConf cannot type
            assert len(allowed(model[key].type) - {type(None)}) > 1, key
        else:  # the same types, but for megatron's per-layer lists of MoE values: the CLI takes one for every layer
            cli, own = allowed(schema[key]) - {type(None)}, allowed(model[key].type) - {type(None)}
            assert cli <= own and all(typing.get_origin(t) is list for t in own - cli), key
        if key not in (*GPT_SIZES, *NULL_IS_A_CHOICE, "mhc_implementation"):
            assert defaults[key] == model[key].default, key
    implementation = ModelConfig.mhc_implementation
    assert implementation == model["mhc_implementation"].default == HyperConnectionSettings.implementation
    recompute = RecomputeConfig()
    assert (recompute.policy, recompute.recompute_modules, recompute.mhc_recompute_layer_num) == (
        RecomputePolicy().name, RecomputePolicy().modules, RecomputePolicy().layer_num)


def test_sample_corpus_experiment_from_another_directory(tmp_path, monkeypatch, capsys):
    """``experiment=sample_corpus`` started in a directory without ``conf/`` or ``data/``: the packaged
    experiment, its ``data.blend=sample`` indexed into the cache on first use (a fresh cache here), and
    the check before launch passes (it opens the indexed pair and counts the samples the run needs)."""
    from train_cli import check_before_launch

    monkeypatch.setenv("LIGHTNING_MHC_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status, err = check_before_launch(["experiment=sample_corpus", "trainer.max_steps=2"], elsewhere, monkeypatch,
                                      capsys)
    assert status == 0, err[-3000:]
    assert len(list((tmp_path / "cache").glob("sample-*/sample_text_document.idx"))) == 1
    assert not list(elsewhere.iterdir()), "the check wrote into the directory it ran in"


def test_mhc_implementation_reaches_the_model_config():
    assert compose_config().transformer_config().mhc_implementation == "auto"
    assert compose_config("model.mhc_implementation=reference").transformer_config().mhc_implementation == "reference"


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["recompute=mhc_block", "model.enable_hyper_connections=false", "model.num_residual_streams=1"],
         ConfigError, "recompute.policy=mhc_block needs model.enable_hyper_connections=true"),
        (["recompute=mhc_block", "recompute.recompute_mlp=true"], ConfigError, "recompute.recompute_mlp=true"),
        (["recompute=mhc_block", "recompute.recompute_modules=[layernorm,mlp]"], ConfigError,
         r"recompute.recompute_modules=\['layernorm', 'mlp'\]"),
        (["parallel=tp2pp2", "trainer.devices=2"], ConfigError,
         "parallel.tensor_model_parallel_size=2 \\* parallel.pipeline_model_parallel_size=2 = 4 does not divide trainer.devices x trainer.num_nodes = 2"),
        (["parallel=pp4", "trainer.devices=4", "model.num_layers=6"], ConfigError,
         "model.num_layers=6 cannot be split evenly over parallel.pipeline_model_parallel_size=4"),
        (["parallel=tp2", "trainer.devices=2", "model.num_attention_heads=3", "model.hidden_size=66"], ConfigError,
         "model.num_attention_heads=3 is not divisible by parallel.tensor_model_parallel_size=2"),
        (["parallel=dp2", "trainer.devices=2", "data.global_batch_size=6", "data.micro_batch_size=4"], ConfigError,
         "data.global_batch_size=6 must be a positive multiple of data.micro_batch_size=4 x data-parallel size 2"),
        (["parallel.num_microbatches=3"], ConfigError, "parallel.num_microbatches=3 disagrees"),
        (["parallel=cp2", "trainer.devices=2", "data.seq_length=66"], ConfigError,
         r"parallel.context_parallel_size=2 cuts data.seq_length=66 into 2 \* 2 chunks: use a sequence length "
         "divisible by 4"),
        (["parallel=tp2cp2", "trainer.devices=4", "data.seq_length=68"], ConfigError,
         "and parallel.sequence_parallel=true splits each over parallel.tensor_model_parallel_size=2 ranks: use a "
         "sequence length divisible by 8"),
        (["data=text"], ConfigError, "data.source=text needs data.path"),
        (["model.mhc_implementation=fast"], ConfigError,
         "model.mhc_implementation='fast': must be one of auto, fused, reference, triton"),
        (["model.no_such_key=1"], ConfigCompositionException, "Could not override 'model.no_such_key'"),
        (["model.num_layers=abc"], ConfigCompositionException, "model.num_layers=abc"),
    ],
)
def test_invalid_combinations_fail_with_their_message(overrides, error, match):
    with pytest.raises(error, match=match):
        compose_config(*overrides)


def test_invalid_config_exits_before_anything_starts(tmp_path, monkeypatch, capsys):
    """The check ``lightning-mhc-train`` runs before Hydra makes a directory or starts a process, in
    this process (``check_before_launch``); the refusal through a real ``python -m
    lightning_mhc.cli.train`` is test_validation.py's (test_bad_input_is_refused_before_launch's data
    error, test_sweep_lists_every_invalid_job_and_runs_none)."""
    from train_cli import check_before_launch

    status, err = check_before_launch(["recompute=mhc_block", "recompute.recompute_mlp=true"], tmp_path, monkeypatch,
                                      capsys)
    assert status == 2
    assert "recompute.recompute_mlp=true" in err and "Initializing distributed" not in err
    assert list(tmp_path.iterdir()) == [], "a run directory was left behind"


def test_train_writes_metrics_config_checkpoints_and_loss_falls(tmp_path):
    """What a run writes, on a rank forked from the preloaded server (``run_train_on_ranks``); the
    launch, its default run directory and its output keep their own tests."""
    run_dir = tmp_path / "run"
    run_train_on_ranks(tmp_path, "trainer.max_steps=40", "trainer.val_check_interval=20", "trainer.limit_val_batches=4",
                       "trainer.checkpoint_every_n_steps=20", "data.max_bytes=300000", "trainer.enable_progress_bar=false",
                       f"hydra.run.dir={run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["final_val_loss"] < summary["initial_val_loss"]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "metrics.csv").is_file()
    assert any((run_dir / "checkpoints").glob("*.ckpt/metadata.json"))


def test_two_job_multirun_writes_its_summary(tmp_path):
    """Each job launches and cleans up its own processes (DP = 2, then PP = 2)."""
    proc = _train(tmp_path, "-m", "parallel=dp2,pp2", "trainer.devices=2", "recompute=mhc_block", "trainer=debug",
                  "trainer.devices=2", "data=synthetic", "hydra.sweep.dir=sweep", timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [(r["data_parallel_size"], r["pipeline_model_parallel_size"]) for r in rows] == [("2", "1"), ("1", "2")]
    assert [(r["job"], r["status"], r["error"]) for r in rows] == [("0", "completed", ""), ("1", "completed", "")]
    assert all(int(r["activation_bytes"]) > 0 and float(r["tokens_per_sec"]) > 0 for r in rows)
    for r in rows:  # median tokens/s inside its quartiles, over the 5 timed steps (6 less the warm-up step)
        assert float(r["tokens_per_sec_p25"]) <= float(r["tokens_per_sec"]) <= float(r["tokens_per_sec_p75"])
        assert int(r["timed_steps"]) == 5 and float(r["step_time_ms"]) > 0
    assert not list((tmp_path / "sweep").glob("*/multirun")), "a child re-ran the sweep"


@pytest.mark.parametrize("script, expect", [
    ("minimal_trainer.py", "done: 5 steps"),
    ("sweep_recompute.py", "mhc_block"),
])
def test_examples_run_as_written(tmp_path, script, expect):
    """Launched as users launch them: Lightning's launcher of ``devices=2``, a sweep's subprocess."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert expect in proc.stdout


def test_custom_loss_example_runs_as_written(tmp_path):
    """examples/custom_loss.py (one device): its subject is the overridden loss a fit trains with,
    not how its one process starts (the two above launch theirs), so it runs as ``python
    custom_loss.py`` runs it (``__main__``, its folder on ``sys.path``) on a rank forked from the
    preloaded server (``run_on_ranks``), not a fresh interpreter importing torch and Lightning again."""
    (printed,) = run_on_ranks(str(ROOT / "examples" / "custom_loss.py"), 1, cwd=tmp_path, timeout=600)
    assert "done: 8 steps" in printed
