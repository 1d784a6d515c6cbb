"""``MHCRecomputeCallback``: hands the recompute policy to the module and attaches the managers."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_mhc.errors import ConfigError
from lightning_mhc.recompute.policy import RecomputePolicy, attach_recompute


class MHCRecomputeCallback(Callback):
    """Select a recompute policy (``none``, ``selective``, ``mhc_block``, ``full``).

    The policy (a name with its options, or a :class:`RecomputePolicy`) is checked when the
    callback is made; in ``setup``, before the model is built, it is handed to the module's
    ``configure_recompute(policy)`` (``MHCGPTModule`` and ``ParallelLMModule``), which refuses what
    its model cannot run (``mhc_block`` without hyper-connections). At fit start one
    ``MHCBlockRecomputeManager`` per recompute block is attached through forward hooks, which act
    only in training forwards with grad enabled, so evaluation is untouched.
    """

    def __init__(
        self,
        policy: str | Mapping[str, Any] | RecomputePolicy = "mhc_block",
        recompute_modules: list[str] | None = None,
        mhc_recompute_layer_num: int | None = None,
    ) -> None:
        if recompute_modules is not None or mhc_recompute_layer_num is not None:
            policy = RecomputePolicy(policy, recompute_modules, mhc_recompute_layer_num)
        self.policy = RecomputePolicy.of(policy)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        configure = getattr(pl_module, "configure_recompute", None)
        if not callable(configure):
            raise ConfigError(
                f"MHCRecomputeCallback({self.policy.name!r}) needs a module that builds its model with a recompute "
                f"policy, configure_recompute(policy) (MHCGPTModule, ParallelLMModule and their subclasses); "
                f"{type(pl_module).__name__} has none."
            )
        configure(self.policy)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        attach_recompute(pl_module)
