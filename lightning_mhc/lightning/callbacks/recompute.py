"""``MHCRecomputeCallback``: chooses the recompute policy and attaches the managers."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_mhc.errors import ConfigError
from lightning_mhc.lightning.modules.parallel_lm import ParallelLMModule
from lightning_mhc.recompute.policy import attach_recompute, configure_recompute, recompute_fields


class MHCRecomputeCallback(Callback):
    """Select a recompute policy (``none``, ``selective``, ``mhc_block``, ``full``).

    With a ``ParallelLMModule`` (a model split by ``parallelize``) the policy (``none``,
    ``selective``, ``full``) is handed to the module, whose ``self.parallelize(...)`` builds the
    blocks with it.

    Invalid combinations raise at construction; ones that depend on the model
    (``mhc_block`` without hyper-connections) raise in ``setup``, before the
    model is built. The policy is set on the module before ``configure_model``;
    at fit start one ``MHCBlockRecomputeManager`` per recompute block is
    attached through forward hooks, which act only in training forwards with
    grad enabled, so evaluation is untouched.
    """

    def __init__(
        self,
        policy: str = "mhc_block",
        recompute_modules: list[str] | None = None,
        mhc_recompute_layer_num: int | None = None,
    ) -> None:
        self.kwargs: dict[str, Any] = {}
        if recompute_modules is not None:
            self.kwargs["recompute_modules"] = list(recompute_modules)
        if mhc_recompute_layer_num is not None:
            self.kwargs["mhc_recompute_layer_num"] = mhc_recompute_layer_num
        recompute_fields(policy, **self.kwargs)  # validates the combination now
        self.policy = policy

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(pl_module, ParallelLMModule):  # a model as written: the policies apply to its blocks
            if self.kwargs:
                raise ConfigError(f"MHCRecomputeCallback({self.policy!r}, {self.kwargs}): for a model split by "
                                  "parallelize(), name the selectively recomputed modules with "
                                  "parallelize(recompute_modules=[patterns]).")
            pl_module.configure_recompute(self.policy)
            return
        if not hasattr(pl_module, "recompute_policy") or not hasattr(pl_module, "model_config"):
            raise ConfigError(
                f"MHCRecomputeCallback({self.policy!r}) needs a module that builds its model from a "
                f"recompute policy (MHCGPTModule and its subclasses); {type(pl_module).__name__} is not one."
            )
        configure_recompute(pl_module.model_config, self.policy, **self.kwargs)  # raises before any step
        pl_module.recompute_policy = self.policy
        pl_module.recompute_kwargs = dict(self.kwargs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(pl_module, ParallelLMModule):
            pl_module.check_recompute()
            return
        attach_recompute(pl_module)
