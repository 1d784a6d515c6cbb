"""Hydra config schemas and their registration in Hydra's ConfigStore; the user's ``./conf``
folder on Hydra's search path."""
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

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


CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The packaged config groups."""
USER_CONF = "conf"
"""The user's own config folder, in the directory ``lightning-mhc-train`` runs in."""


class UserConfSearchPath(SearchPathPlugin):
    """``./conf``, when the command runs where there is one, on Hydra's search path after the
    packaged groups: a user's ``conf/experiment/my_run.yaml`` is ``experiment=my_run``, and any
    packaged group can gain options there (the packaged ones win a name both have). Only for
    this package's configs: another Hydra app in the same process is left alone."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = Path.cwd() / USER_CONF
        ours = any(element.path in (str(CONF_DIR), f"file://{CONF_DIR}") for element in search_path.get_path())
        if ours and folder.is_dir() and folder.resolve() != CONF_DIR:
            search_path.append("lightning_mhc-user", f"file://{folder.resolve()}")


def register_configs() -> None:
    """``train_schema`` is the first default of conf/config.yaml: every group file is merged onto
    its typed node, so unknown keys and wrong types fail at composition. Also registers the
    ``mhc_unique_dir`` resolver of conf/config.yaml's run and sweep directories, and
    :class:`UserConfSearchPath`."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_resolver()
    Plugins.instance().register(UserConfSearchPath)


__all__ = ["TrainConfig", "register_configs", *[cls.__name__ for cls in SCHEMAS.values()], "OptimConfig"]
