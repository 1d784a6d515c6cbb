"""The config dataclasses, where users imported them before the ``cli`` room existed; they live in
``lightning_mhc.cli.schema`` (kept for one release)."""
from lightning_mhc.cli.config_store import SCHEMAS, register_configs  # noqa: F401
from lightning_mhc.cli.schema import (  # noqa: F401
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainConfig,
    TrainerConfig,
)
