"""Hydra config schemas and their registration in Hydra's ConfigStore."""
from hydra.core.config_store import ConfigStore

from lightning_mhc.cli.run_dir import register_resolver
from lightning_mhc.cli.schema import (
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainConfig,
    TrainerConfig,
)

SCHEMAS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """``train_schema`` is the first default of conf/config.yaml: every group file is merged onto
    its typed node, so unknown keys and wrong types fail at composition. Also registers the
    ``mhc_unique_dir`` resolver of conf/config.yaml's run and sweep directories."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_resolver()


__all__ = ["TrainConfig", "register_configs", *[cls.__name__ for cls in SCHEMAS.values()], "OptimConfig"]
