"""The training entry point: ``lightning-mhc-train`` / ``python -m lightning_mhc.train``.

    lightning-mhc-train                                   # tiny model, stdlib bytes, CPU, ~1 minute
    lightning-mhc-train model=small parallel=tp2pp2 trainer.devices=4 recompute=mhc_block
    lightning-mhc-train -m recompute=none,mhc_block parallel=single,tp2pp2 trainer.devices=4

The composed config is turned into the dataclasses of ``lightning_mhc.config``
first, so every constraint is checked before any process starts; an invalid
config exits with status 2, its message, and no run directory. Each run
directory holds the resolved config (``.hydra/``), metrics (``metrics.csv``
or wandb), checkpoints and ``summary.json``; a multirun also gets
``summary.csv`` in its sweep directory.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mhc.config import TrainConfig, register_configs
from lightning_mhc.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The validated dataclasses of a composed config (raises ConfigError / OmegaConf errors)."""
    return OmegaConf.to_object(cfg)


def build_logger(cfg: TrainConfig, output_dir: Path, resolved: dict[str, Any]):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    if cfg.logger.name == "none":
        return False
    if cfg.logger.name == "csv":
        return CSVLogger(save_dir=str(output_dir), name="", version="")
    if cfg.logger.name == "wandb":
        return WandbLogger(project=cfg.logger.project, name=cfg.name, save_dir=str(output_dir),
                           offline=cfg.logger.offline, config=resolved)
    raise ConfigError(f"logger.name={cfg.logger.name!r}: choose csv, wandb or none.")


def run(cfg: TrainConfig, output_dir: Path, resolved: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one configuration; returns (and on rank 0 writes) the run's summary."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mhc.lightning import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
    from lightning_mhc.lightning.data import TokenDataModule

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    launched_here = "LOCAL_RANK" not in os.environ
    t, p, d = cfg.trainer, cfg.parallel, cfg.data
    strategy = MHCParallelStrategy(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        num_microbatches=cfg.num_microbatches,
        deallocate_pipeline_outputs=p.deallocate_pipeline_outputs,
        timeout=datetime.timedelta(seconds=p.timeout_s),
        seed=cfg.seed,
        measure_activation_memory=True,
    )
    recompute = MHCRecomputeCallback(
        cfg.recompute.policy,
        recompute_modules=cfg.recompute.modules(),
        mhc_recompute_layer_num=cfg.recompute.mhc_recompute_layer_num,
    )
    checkpoints = ModelCheckpoint(dirpath=str(output_dir / "checkpoints"), every_n_train_steps=t.checkpoint_every_n_steps,
                                  save_top_k=1, save_last=False)
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, strategy=strategy, precision=t.precision,
        max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val, val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None, limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        logger=build_logger(cfg, output_dir, resolved or {}), callbacks=[recompute, checkpoints],
        default_root_dir=str(output_dir),
    )
    module = MHCGPTModule(cfg.transformer_config(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                          warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio)
    data = TokenDataModule(source=d.source, batch_size=d.global_batch_size // cfg.data_parallel_size,
                           seq_length=d.seq_length, path=d.path, val_fraction=d.val_fraction, max_bytes=d.max_bytes,
                           synthetic_samples=d.synthetic_samples, vocab_size=cfg.model.vocab_size,
                           num_workers=d.num_workers)
    trainer.fit(module, datamodule=data)
    summary = dict(
        name=cfg.name, policy=cfg.recompute.policy, devices=t.devices,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        data_parallel_size=cfg.data_parallel_size, steps=trainer.global_step,
        final_train_loss=float(trainer.callback_metrics.get("train_loss", float("nan"))),
        initial_val_loss=module.val_history[0][1] if module.val_history else None,
        final_val_loss=module.val_history[-1][1] if module.val_history else None,
        tokens_per_sec=sum(module.throughput) / len(module.throughput) if module.throughput else None,
        activation_bytes=strategy.activation_bytes,
    )
    if trainer.global_rank == 0:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    # the next job of a multirun builds its own process group and launches its own processes
    if dist.is_initialized():
        dist.destroy_process_group()
    launcher = trainer.strategy.launcher
    if launched_here and launcher is not None and hasattr(launcher, "finish"):
        launcher.finish()
    return summary


def _reject(error: BaseException) -> None:
    """Print the configuration error, remove the run directory Hydra made, exit 2."""
    from hydra.core.hydra_config import HydraConfig

    print(f"lightning-mhc-train: invalid configuration: {error}", file=sys.stderr)
    if HydraConfig.initialized():
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        original = Path(hydra.utils.get_original_cwd())
        os.chdir(original)
        shutil.rmtree(output_dir, ignore_errors=True)
        for parent in output_dir.parents:  # the empty date folders Hydra made for it
            if parent == original or not parent.is_relative_to(original) or any(parent.iterdir()):
                break
            parent.rmdir()
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    try:
        train_cfg = to_train_config(cfg)
    except (ConfigError, OmegaConfBaseException, ValueError) as error:
        _reject(error)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    summary = run(train_cfg, Path(HydraConfig.get().runtime.output_dir), resolved)
    return summary["final_val_loss"]


if __name__ == "__main__":
    main()
