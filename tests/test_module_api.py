"""The user-facing API of the Lightning layer: ``strategy="mhc_parallel"`` after ``import
lightning_mhc.lightning`` / ``.fabric``, MHCGPTModule's saved hyperparameters, and LightningCLI's config dump."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch.nn.functional as F
import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_mhc import ConfigError, MHCGPTModule, MHCParallelStrategy, MHCTransformerConfig
from lightning_mhc.model.config import with_parallel_layout
from lightning_mhc.model.config_dict import model_config_from_dict, model_config_to_dict
from lightning_mhc.distributed.layout import ParallelLayout
from subprocess_env import child_env

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, max_sequence_length=8,
            hidden_dropout=0.0, attention_dropout=0.0)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=child_env())


# --------------------------------------------------------- registration by name
# Each strategy registers ``"mhc_parallel"`` when the room that defines it is imported (plain
# registration, no import hook): the Trainer's by ``import lightning_mhc.lightning`` or any public
# name loaded from it through ``lightning_mhc``, Fabric's by ``import lightning_mhc.fabric``. A
# bare ``import lightning_mhc`` imports no Lightning, so it registers nothing (docs/trainer.md).
_TRAINER_BY_NAME = """
    import lightning.pytorch as pl
    trainer = pl.Trainer(strategy="mhc_parallel", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy).__module__ == "lightning_mhc.lightning.strategy", type(trainer.strategy)
"""
_FABRIC_BY_NAME = """
    from lightning.fabric import Fabric
    fabric = Fabric(strategy="mhc_parallel", accelerator="cpu", devices=1)
    assert type(fabric.strategy).__module__ == "lightning_mhc.fabric.strategy", type(fabric.strategy)
"""

def test_strategy_name_works_after_the_documented_imports():
    """``strategy="mhc_parallel"`` names the Trainer's strategy in a Trainer after ``from lightning_mhc
    import MHCParallelStrategy`` and Fabric's in Fabric after ``import lightning_mhc.fabric``, with
    Lightning imported first (the other order: the next test), in a fresh interpreter."""
    proc = run_python("import lightning.pytorch, lightning.fabric\n"
                      "from lightning_mhc import MHCParallelStrategy\n" + textwrap.dedent(_TRAINER_BY_NAME)
                      + "import lightning_mhc.fabric\n" + textwrap.dedent(_FABRIC_BY_NAME) + "print('OK')")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_lower_layers_do_not_import_lightning():
    """``import lightning_mhc`` and the layers below lightning_mhc.lightning load no Lightning; the
    Trainer's room imported afterwards (Lightning not yet imported) registers the strategy."""
    proc = run_python(textwrap.dedent("""
        import sys
        import lightning_mhc
        import lightning_mhc.model, lightning_mhc.recompute, lightning_mhc.checkpoint
        import lightning_mhc.distributed.layout, lightning_mhc.distributed.random, lightning_mhc.distributed.grads
        import lightning_mhc.distributed.grad_overlap, lightning_mhc.distributed.pipeline
        import lightning_mhc.distributed.pipeline.protocol, lightning_mhc.model.export, lightning_mhc.model.stages
        import lightning_mhc.any_model, lightning_mhc.testing.launch
        from lightning_mhc import parallelize, ParallelLayout, MHCTransformerConfig
        assert "lightning.pytorch" not in sys.modules
        loaded = [m for m in sys.modules
                  if m == "lightning" or m.startswith(("lightning.", "lightning_mhc.lightning"))]
        assert not loaded, loaded
        import lightning_mhc.lightning
    """) + textwrap.dedent(_TRAINER_BY_NAME) + "print('OK')")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


# ------------------------------------------------------------ hyperparameters
def _same_config(a: MHCTransformerConfig, b: MHCTransformerConfig) -> list[str]:
    """Fields that differ (init-method partials compared by function and arguments)."""
    def norm(v):
        return (v.func, v.args, v.keywords) if isinstance(v, functools.partial) else v
    return [f.name for f in dataclasses.fields(a) if norm(getattr(a, f.name)) != norm(getattr(b, f.name))]


def test_config_dict_is_minimal_plain_and_round_trips():
    config = MHCTransformerConfig(**TINY, activation_func=F.silu, gated_linear_unit=True,
                                  tensor_model_parallel_size=2, recompute_granularity="selective")
    as_dict = model_config_to_dict(config)
    # the user's fields, swiglu by name; no derived (ffn_hidden_size), layout or recompute field
    assert as_dict == {**TINY, "activation": "swiglu"}
    assert yaml.safe_load(yaml.safe_dump(as_dict)) == as_dict
    rebuilt = model_config_from_dict(as_dict)
    swiglu = MHCTransformerConfig(**TINY, activation_func=F.silu, gated_linear_unit=True)
    assert _same_config(rebuilt, swiglu) == []

    unusual = MHCTransformerConfig(**TINY, activation_func=F.relu, params_dtype=__import__("torch").bfloat16)
    as_dict = model_config_to_dict(unusual)
    assert as_dict["activation_func"] == "torch.nn.functional.relu" and as_dict["params_dtype"] == "bfloat16"
    assert _same_config(model_config_from_dict(as_dict), unusual) == []
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['hidden'\]"):
        model_config_from_dict({**TINY, "hidden": 3})

    anonymous = MHCTransformerConfig(**TINY, activation_func=lambda x: x)
    with pytest.raises(ConfigError, match="activation_func=<function .* has no plain"):
        model_config_to_dict(anonymous)
    with pytest.warns(UserWarning, match="recorded by its repr"):
        assert MHCGPTModule(anonymous).hparams["model_config"]["activation_func"].startswith("<function")


def test_hparams_rebuild_the_module_and_are_logged_plainly(tmp_path):
    config = MHCTransformerConfig(**TINY, activation_func=F.silu, gated_linear_unit=True)
    module = MHCGPTModule(config, lr=1e-3)
    assert module.hparams["model_config"] == {**TINY, "activation": "swiglu"}
    assert module.hparams["lr"] == 1e-3
    assert _same_config(MHCGPTModule(**module.hparams).model_config, config) == []

    user = {**TINY, "activation": "swiglu", "ffn_hidden_size": 48}
    from_dict = MHCGPTModule(user, warmup_steps=5)
    assert from_dict.hparams["model_config"] == user  # the user's dict, as given
    again = MHCGPTModule(**from_dict.hparams)
    assert _same_config(again.model_config, from_dict.model_config) == [] and again.hparams == from_dict.hparams

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skipping ... not possible to safely dump to YAML"
        logger = CSVLogger(tmp_path)
        logger.log_hyperparams(module.hparams_initial)
        logger.save()
    written = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert written["model_config"] == {**TINY, "activation": "swiglu"}
    assert MHCGPTModule(**written).hparams["model_config"] == written["model_config"]


def test_subclass_passing_a_config_object_records_a_plain_dict():
    class Sub(MHCGPTModule):
        def __init__(self, model_config, extra: int = 3, **kwargs):
            super().__init__(model_config, **kwargs)

    module = Sub(MHCTransformerConfig(**TINY), lr=0.1)
    assert module.hparams["model_config"] == TINY and module.hparams["extra"] == 3
    assert module.hparams_initial["model_config"] == TINY


# ------------------------------------------------------------- parallel layout
def test_layout_comes_from_the_strategy():
    config = MHCTransformerConfig(**TINY)
    built = with_parallel_layout(config, ParallelLayout(2, 2))
    assert (built.tensor_model_parallel_size, built.pipeline_model_parallel_size) == (2, 2)
    assert built.pipeline_dtype is not None  # megatron requires one with PP
    tp2 = ParallelLayout(2)
    agreeing = with_parallel_layout(config, tp2, requested={"tensor_model_parallel_size": 2})
    assert agreeing.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="model_config sets tensor_model_parallel_size=1, but the strategy runs "
                                          "tensor_model_parallel_size=2"):
        with_parallel_layout(config, tp2, requested={"tensor_model_parallel_size": 1})
    with pytest.raises(ConfigError, match="model_config sets sequence_parallel=True, but the strategy runs "
                                          ".*sequence_parallel=False"):
        with_parallel_layout(config, tp2, requested={"sequence_parallel": True})
    assert with_parallel_layout(config, ParallelLayout(2, sequence_parallel=True),
                                requested={"sequence_parallel": True}).sequence_parallel


def _attach_layout(module: MHCGPTModule, tp: int, pp: int) -> MHCGPTModule:
    layout = ParallelLayout(tp, pp, world_size=tp * pp, tensor_model_parallel_rank=0, pipeline_model_parallel_rank=0,
                            data_parallel_rank=0)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(layout=layout))
    return module


def test_configure_model_takes_the_layout_from_the_strategy(model_parallel):
    module = _attach_layout(MHCGPTModule(TINY), tp=2, pp=1)  # megatron's groups here: TP = PP = 1
    module.configure_model()
    assert module.model.config.tensor_model_parallel_size == 2
    assert module.hparams["model_config"] == TINY  # the dump stays the user's

    module = _attach_layout(MHCGPTModule({**TINY, "tensor_model_parallel_size": 1}), tp=2, pp=1)
    with pytest.raises(ConfigError, match="model_config sets tensor_model_parallel_size=1"):
        module.configure_model()
    assert module.model is None


def _fit_one_step(module: MHCGPTModule, tmp_path) -> pl.Trainer:
    from torch.utils.data import DataLoader

    from lightning_mhc.data.sources import SyntheticTokens

    data = DataLoader(SyntheticTokens(8, 8, vocab_size=64), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), max_steps=1,
                         logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data)
    return trainer


def test_fit_logs_hparams_and_rejects_a_contradicting_layout(tmp_path):
    module = MHCGPTModule({**TINY, "pipeline_model_parallel_size": 1}, warmup_steps=1)
    trainer = _fit_one_step(module, tmp_path)
    assert trainer.global_step == 1
    # the launcher keeps no mark of itself in this process: ranks forked from it later (another
    # run in the same process) would otherwise watch it as their launcher and exit at once
    assert "LIGHTNING_MHC_LAUNCHER_PID" not in os.environ
    written = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert written["model_config"] == {**TINY, "pipeline_model_parallel_size": 1}

    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=2, but the strategy runs"):
        _fit_one_step(MHCGPTModule({**TINY, "pipeline_model_parallel_size": 2}), tmp_path / "bad")


def _warmup_cosine_lr(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """The documented schedule, written out: linear warm-up, then cosine to ``min_ratio * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))))


def test_fit_resuming_another_schedule_is_refused_unless_overridden(tmp_path):
    """``Trainer.fit(ckpt_path=...)`` of MHCGPTModule: 2 steps with max_steps=2 saved, then resumed
    with max_steps=4: refused, naming max_steps and override_scheduler; with
    ``override_scheduler=True`` steps 2 and 3 run at the max_steps=4 schedule's rates (the resumed
    step included, which used to take the saved schedule's last rate). Another weight decay: the
    same."""
    from torch.utils.data import DataLoader

    from lightning_mhc.data.sources import SyntheticTokens

    def fit(module, max_steps, ckpt_path=None):
        rates = []

        class Rates(pl.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                rates.append(optimizer.param_groups[0]["lr"])

        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), max_steps=max_steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[Rates()])
        trainer.fit(module, train_dataloaders=DataLoader(SyntheticTokens(32, 8, vocab_size=64), batch_size=4),
                    ckpt_path=ckpt_path)
        return trainer, rates

    recipe = dict(lr=1e-2, warmup_steps=1, min_lr_ratio=0.1)
    trainer, rates = fit(MHCGPTModule(TINY, **recipe), 2)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert rates == pytest.approx([_warmup_cosine_lr(s, 1e-2, 1, 2, 0.1) for s in range(2)], rel=1e-6)
    with pytest.raises(ConfigError, match=r"max_steps=4 \(the step the cosine decay ends at; the checkpoint's 2\)"
                                          r".*set override_scheduler=True to follow this run's schedule from the "
                                          r"checkpoint's step 2 on"):
        fit(MHCGPTModule(TINY, **recipe), 4, tmp_path / "step2.ckpt")
    _, resumed = fit(MHCGPTModule(TINY, **recipe, override_scheduler=True), 4, tmp_path / "step2.ckpt")
    assert resumed == pytest.approx([_warmup_cosine_lr(s, 1e-2, 1, 4, 0.1) for s in (2, 3)], rel=1e-6)
    # the weight decay too (the optimizer's state holds the saved one): refused, or the new one
    with pytest.raises(ConfigError, match=r"weight_decay=0.05 \(the matrices' weight decay; the checkpoint's 0.1\)"):
        fit(MHCGPTModule(TINY, **recipe, weight_decay=0.05), 2, tmp_path / "step2.ckpt")
    module = MHCGPTModule(TINY, **recipe, weight_decay=0.05, override_scheduler=True)
    trainer, _ = fit(module, 3, tmp_path / "step2.ckpt")
    assert [group["weight_decay"] for group in trainer.optimizers[0].param_groups] == [0.05, 0.0]
    # what it saves is its own schedule: resumed under the same settings, nothing to override
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    trainer, _ = fit(MHCGPTModule(TINY, **recipe, weight_decay=0.05), 3, tmp_path / "step3.ckpt")
    assert trainer.global_step == 3


# --------------------------------------------------------------- LightningCLI
def test_lightning_cli_prints_the_users_model_config(capsys, monkeypatch):
    pytest.importorskip("jsonargparse")
    monkeypatch.setattr(sys, "argv", ["cli"])
    from lightning.pytorch.cli import LightningCLI

    args = ["--print_config", "--trainer.accelerator=cpu", "--trainer.devices=2",
            "--trainer.strategy=lightning_mhc.lightning.MHCParallelStrategy",
            "--trainer.strategy.tensor_model_parallel_size=2",
            '--model.model_config={"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}']
    with pytest.raises(SystemExit) as exit_:
        LightningCLI(MHCGPTModule, run=False, args=args, save_config_callback=None)
    assert exit_.value.code in (0, None)
    dump = yaml.safe_load(capsys.readouterr().out)
    assert dump["model"]["model_config"] == {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}
    assert dump["trainer"]["strategy"]["init_args"]["tensor_model_parallel_size"] == 2


def test_lightning_cli_instantiates_the_module_from_the_dict(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    monkeypatch.setattr(sys, "argv", ["cli"])
    from lightning.pytorch.cli import LightningCLI

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "strategy": "mhc_parallel"},
        "model": {"model_config": {**TINY, "activation": "swiglu"}, "lr": 0.01},
    }))
    cli = LightningCLI(MHCGPTModule, run=False, args=["--config", str(config_file)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, MHCParallelStrategy)
    assert cli.model.hparams["model_config"] == {**TINY, "activation": "swiglu"}
    assert cli.model.model_config.gated_linear_unit and cli.model.model_config.activation_func is F.silu
