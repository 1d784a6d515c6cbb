"""The training entry point: ``lightning-mhc-train`` / ``python -m lightning_mhc.cli.train``.

    lightning-mhc-train                                   # tiny model, stdlib bytes, CPU, ~1 minute
    lightning-mhc-train model=small parallel=tp2pp2 trainer.devices=4 recompute=mhc_block
    lightning-mhc-train -m recompute=none,mhc_block parallel=single,tp2pp2 trainer.devices=4
    lightning-mhc-train ... ckpt_path=outputs/<date>/<time>/checkpoints/<checkpoint>   # resume exactly
    lightning-mhc-train ... hydra.run.dir=outputs/<date>/<time> ckpt_path=last          # newest one of that run
    lightning-mhc-train ... mode=validate ckpt_path=<checkpoint>   # evaluate it (any layout; mode=test too)

Everything checkable is checked before Hydra makes a directory or any process
starts (``lightning_mhc.cli.preflight``): the command line's overrides (every job of a multirun), the config's
keys, types and ranges (the dataclasses of ``lightning_mhc.cli.schema``), the data
(``check_data``), the GPUs asked for and the checkpoint to resume from. An
invalid run prints ``lightning-mhc-train: invalid configuration: <message>``
(a multirun: one line per invalid job, and no job runs), exits with status 2
and leaves no run directory. Each run directory (a fresh one per run) holds
the resolved config (``.hydra/``), metrics (``metrics.csv`` or wandb),
checkpoints (the final step's always) and ``summary.json``; a multirun also
gets ``summary.csv`` / ``summary.json`` in its sweep directory, a row per job
as each job ends (a failed job's row says so).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mhc.cli import preflight
from lightning_mhc.cli.schema import TrainConfig
from lightning_mhc.cli.run_dir import started_by_a_launcher
from lightning_mhc.errors import ConfigError
from lightning_mhc.cli.preflight import (
    CONF_DIR,
    check_command_line,
    check_machine,
    resolve_ckpt_path,
    say_invalid,
    to_train_config,
    warn_oversubscription,
)


def build_logger(cfg: TrainConfig, output_dir: Path, resolved: dict[str, Any], resumed_step: int | None = None):
    from lightning.pytorch.loggers import WandbLogger

    if cfg.logger.name == "none":
        return False
    if cfg.logger.name == "csv":
        return _csv_logger(output_dir, _csv_version(output_dir, resumed_step))
    if cfg.logger.name == "wandb":
        return WandbLogger(project=cfg.logger.project, name=cfg.name, save_dir=str(output_dir),
                           offline=cfg.logger.offline, config=resolved)
    raise ConfigError(f"logger.name={cfg.logger.name!r}: choose csv, wandb or none.")


def _csv_logger(output_dir: Path, version: str):
    """Lightning's CSVLogger in the run directory (``version``: ``_csv_version``). Its writer warns
    of any non-empty directory that "previous log files ... will be deleted", and deletes only a
    ``metrics.csv`` there; a run directory always holds Hydra's files, and never an earlier run's
    ``metrics.csv`` (``_csv_version`` writes beside it), so that warning is never true here."""
    from lightning.pytorch.loggers import CSVLogger

    class RunDirCSVLogger(CSVLogger):
        @property
        def experiment(self):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
                return super().experiment

    return RunDirCSVLogger(save_dir=str(output_dir), name="", version=version)


def _csv_version(output_dir: Path, resumed_step: int | None) -> str:
    """``metrics.csv`` in the run directory; a run resumed in a directory that has an earlier run's
    logs already (``ckpt_path=last``) writes to ``resumed_from_step_<N>/`` instead, because
    Lightning's CSVLogger deletes an existing ``metrics.csv`` (and rewrites ``hparams.yaml``)."""
    if not any((output_dir / name).exists() for name in ("metrics.csv", "hparams.yaml")):
        return ""
    base = f"resumed_from_step_{resumed_step if resumed_step is not None else 0}"
    version, n = base, 1
    while (output_dir / version).exists():
        n += 1
        version = f"{base}_{n}"
    return version


def _checkpoint_step(ckpt_path: str | None) -> int | None:
    from lightning_mhc.checkpoint import read_metadata

    return read_metadata(Path(ckpt_path)).get("global_step") if ckpt_path else None


def run(cfg: TrainConfig, output_dir: Path, resolved: dict[str, Any] | None = None,
        ckpt_path: str | None = None) -> dict[str, Any]:
    """Train one configuration (from ``ckpt_path`` if given); returns (and on rank 0 writes) the
    run's summary."""
    import lightning.pytorch as pl
    import torch

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision(cfg.trainer.float32_matmul_precision)  # every rank runs this
    launched_here = not started_by_a_launcher()
    strategy = _build_strategy(cfg)
    trainer, checkpoints = _build_trainer(cfg, strategy, output_dir, resolved, ckpt_path)
    module, data = _build_module_and_data(cfg, output_dir)
    if cfg.mode != "fit":
        return _evaluate(cfg, trainer, module, data, ckpt_path, output_dir, launched_here)
    _fit(trainer, module, data, ckpt_path, output_dir, launched_here)
    return _finish(trainer, output_dir, _fit_summary(cfg, trainer, module, strategy, checkpoints, ckpt_path),
                   launched_here)


def _build_strategy(cfg: TrainConfig):
    from lightning_mhc.lightning import MHCParallelStrategy

    return MHCParallelStrategy(cfg.settings)


def _build_trainer(cfg: TrainConfig, strategy, output_dir: Path, resolved: dict[str, Any] | None,
                   ckpt_path: str | None):
    """The Trainer with the recompute callback and the checkpoint callback (also returned: the
    summary names its last checkpoint)."""
    import lightning.pytorch as pl

    from lightning_mhc.lightning import MHCRecomputeCallback
    from lightning_mhc.lightning.callbacks.final_step import FinalStepCheckpoint
    from lightning_mhc.lightning.callbacks.progress import step_progress_bar

    t = cfg.trainer
    recompute = MHCRecomputeCallback(cfg.recompute_policy)
    bar = step_progress_bar() if t.enable_progress_bar else None
    # names without '=' (Lightning's default 'epoch=0-step=5'), so that ckpt_path=<path> needs no quoting in Hydra
    checkpoints = FinalStepCheckpoint(
        dirpath=str(output_dir / "checkpoints"), filename="step-{step:06d}", auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=1, save_last=False, resumed_from=ckpt_path)
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy, precision=t.precision,
        max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val, val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.limit_val_batches,
        limit_test_batches=t.limit_val_batches,  # mode=test: the held-out split, as validation reads it
        log_every_n_steps=t.log_interval, enable_progress_bar=t.enable_progress_bar,
        detect_anomaly=t.detect_anomaly,
        logger=build_logger(cfg, output_dir, resolved or {}, _checkpoint_step(ckpt_path)),
        callbacks=[recompute, checkpoints, *([bar] if bar is not None else [])],
        default_root_dir=str(output_dir),
    )
    return trainer, checkpoints


def _build_module_and_data(cfg: TrainConfig, output_dir: Path):
    from lightning_mhc.lightning import MHCGPTModule

    if cfg.model.is_hf:
        from lightning_mhc.lightning.modules.hf import HFCausalLMModule

        m, o = cfg.model, cfg.optim
        module = HFCausalLMModule(m.hf_dir, pretrained=bool(m.pretrained), hyper_connections=m.hyper_connections,
                                  plan=m.plan, seed=m.init_seed, optimizer=o.name, lr=o.lr, weight_decay=o.weight_decay,
                                  warmup_steps=o.warmup_steps, min_lr_ratio=o.min_lr_ratio,
                                  implementation=m.mhc_implementation, peak_flops=_peak_flops(cfg),
                                  override_scheduler=o.override_scheduler,
                                  router_bias_update_rate=m.moe_router_bias_update_rate)
        return module, _build_data(cfg, output_dir)
    module = MHCGPTModule(cfg.transformer_config(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                          warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio,
                          optimizer=cfg.optim.name, peak_flops=_peak_flops(cfg),
                          override_scheduler=cfg.optim.override_scheduler)
    return module, _build_data(cfg, output_dir)


def _peak_flops(cfg: TrainConfig) -> float | None:
    """``trainer.peak_tflops`` in FLOP/s (None: a known GPU's figure, or no ``mfu``)."""
    return cfg.trainer.peak_tflops * 1e12 if cfg.trainer.peak_tflops else None


def _build_data(cfg: TrainConfig, output_dir: Path):
    d = cfg.data
    if d.source == "megatron":
        from lightning_mhc.data.megatron import MegatronDataModule

        return MegatronDataModule(
            blend=d.blend, tokenizer=d.tokenizer, seq_length=d.seq_length, global_batch_size=d.global_batch_size,
            split=d.split, seed=cfg.seed, cache_dir=d.cache_dir or str(output_dir / "data_cache"),
            num_samples=cfg.num_samples, num_workers=d.num_workers)
    from lightning_mhc.data.sources import TokenDataModule

    return TokenDataModule(source=d.source, global_batch_size=d.global_batch_size, seq_length=d.seq_length,
                           path=d.path, val_fraction=d.val_fraction, max_bytes=d.max_bytes,
                           synthetic_samples=d.synthetic_samples, vocab_size=cfg.vocab_size, seed=cfg.seed,
                           num_workers=d.num_workers)


def _fit(trainer, module, data, ckpt_path: str | None, output_dir: Path, launched_here: bool) -> None:
    """``trainer.fit``; a run that fails (or is preempted) ends its job and raises its own error."""
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except BaseException as error:
        if _is_preemption(error) and trainer.global_rank == 0:  # stopped by SIGTERM/SIGINT, checkpoint saved
            _write_preempted_summary(output_dir, trainer, error)
        try:
            _end_job(trainer, launched_here, failed=True)
        except Exception as cleanup:  # the run's own error is the one to report
            print(f"lightning-mhc-train: cleaning up after the failed run: {cleanup!r}", file=sys.stderr)
        raise


def _fit_summary(cfg: TrainConfig, trainer, module, strategy, checkpoints, ckpt_path: str | None) -> dict[str, Any]:
    import torch

    return dict(
        name=cfg.name, policy=cfg.recompute.policy, devices=cfg.trainer.devices, **cfg.layout.summary(),
        steps=trainer.global_step,
        final_train_loss=float(trainer.callback_metrics.get("train_loss", float("nan"))),
        initial_val_loss=module.val_history[0][1] if module.val_history else None,
        final_val_loss=module.val_history[-1][1] if module.val_history else None,
        **module.throughput.summary(),
        activation_bytes=strategy.activation_bytes,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        resumed_from=ckpt_path,
        last_checkpoint=checkpoints.last_saved,
    )


def _evaluate(cfg: TrainConfig, trainer, module, data, ckpt_path: str | None, output_dir: Path,
              launched_here: bool) -> dict[str, Any]:
    """``mode=validate`` / ``mode=test``: the checkpoint's loss on the held-out split (any layout)."""
    try:
        (metrics,) = getattr(trainer, cfg.mode)(module, datamodule=data, ckpt_path=ckpt_path)
    except BaseException:
        _end_job(trainer, launched_here, failed=True)
        raise
    key = "val_loss" if cfg.mode == "validate" else "test_loss"
    summary = dict(name=cfg.name, mode=cfg.mode, checkpoint=ckpt_path, devices=cfg.trainer.devices,
                   **cfg.layout.summary(), **{key: float(metrics[key])})
    return _finish(trainer, output_dir, summary, launched_here)


def _finish(trainer, output_dir: Path, summary: dict[str, Any], launched_here: bool) -> dict[str, Any]:
    """A run that ended well: rank 0 writes its summary, the job ends; returns the summary."""
    if trainer.global_rank == 0:
        _write_summary(output_dir, summary)
    _end_job(trainer, launched_here, failed=False)
    return summary


def _write_summary(output_dir: Path, summary: dict[str, Any]) -> None:
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _is_preemption(error: BaseException) -> bool:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(error, SIGTERMException)


def _write_preempted_summary(output_dir: Path, trainer, error: BaseException) -> None:
    from lightning_mhc.lightning.preemption import preemption_checkpoint_path

    checkpoint = preemption_checkpoint_path(trainer)
    summary = dict(status="preempted", exit_code=error.code, steps=trainer.global_step,
                   last_checkpoint=str(checkpoint) if checkpoint.exists() else None)
    _write_summary(output_dir, summary)
    print(f"lightning-mhc-train: preempted at step {trainer.global_step}; resume with ckpt_path={checkpoint}",
          file=sys.stderr)


def _end_job(trainer, launched_here: bool, failed: bool) -> None:
    """Leave nothing to the next job of a multirun (finished or failed): it builds its own process
    group, launches its own processes and logs to its own wandb run."""
    import torch.distributed as dist
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and trainer.global_rank == 0 and logger._experiment is not None:
            logger.experiment.finish(exit_code=1 if failed else 0)
    if dist.is_initialized():
        dist.destroy_process_group()
    launcher = trainer.strategy.launcher
    if launched_here and launcher is not None and hasattr(launcher, "finish"):
        launcher.finish()


def _reject(error: BaseException) -> None:
    """Print the configuration error, remove the run directory Hydra made for this call (never
    one that holds an earlier run's files), exit 2."""
    from hydra.core.hydra_config import HydraConfig

    say_invalid(str(error))
    if HydraConfig.initialized():
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        original = Path(hydra.utils.get_original_cwd())
        os.chdir(original)
        if any(p.name != ".hydra" and p.suffix != ".log" for p in output_dir.iterdir()):
            sys.exit(2)  # an existing run's directory (hydra.run.dir=...): keep everything in it
        shutil.rmtree(output_dir, ignore_errors=True)
        for parent in output_dir.parents:  # the empty date folders Hydra made for it
            if parent == original or not parent.is_relative_to(original) or any(parent.iterdir()):
                break
            parent.rmdir()
    sys.exit(2)


# ------------------------------------------------------------------ the run, inside Hydra
@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    """One run (a job of a multirun): validate, then train in ``hydra.runtime.output_dir``."""
    from hydra.core.hydra_config import HydraConfig

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    launched_here = not started_by_a_launcher()
    try:
        train_cfg = to_train_config(cfg)
        if launched_here and not preflight.checked:  # main checked it already; a launched child's parent did
            check_machine(train_cfg)
        ckpt_path = resolve_ckpt_path(train_cfg, output_dir)
    except (ConfigError, OmegaConfBaseException, ValueError) as error:
        _reject(error)
    if launched_here:
        warn_oversubscription(train_cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["data"]["path"] = train_cfg.data.path
    summary = run(train_cfg, output_dir, resolved, ckpt_path=ckpt_path)
    return summary.get("final_val_loss", summary.get("val_loss", summary.get("test_loss")))  # a sweep's objective


def main() -> None:
    """``lightning-mhc-train``: check the command line's run(s), then hand them to Hydra.

    Processes launched for a run (Lightning's children, torchrun's or srun's ranks) skip the
    check: their parent checked the same command line, or the launcher's ranks share it.
    """
    if not started_by_a_launcher():
        check_command_line(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
