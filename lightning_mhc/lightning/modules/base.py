"""What the two LightningModules share: the recompute policy they build their model with, the
steps that hand a batch to the strategy's schedule, and the global names their checkpoints are
keyed by."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_mhc.recompute.policy import RecomputePolicy


class PipelinedLMModule(pl.LightningModule):
    """Base of ``MHCGPTModule`` and ``ParallelLMModule``: a language model whose training,
    validation and test steps run the whole pipeline schedule over the batch through
    ``MHCParallelStrategy.forward_backward`` (the loss is then the mean over its microbatches
    and the data-parallel replicas). A subclass implements the pipeline contract
    (``forward_step``, ``loss_func``, ``set_input_tensor``, ``pipeline_tensor_shape``,
    ``model_chunks``) and :meth:`global_name_in_model`."""

    recompute_policy: RecomputePolicy | None = None
    """The recompute policy ``configure_model`` builds the model with (None: none was chosen)."""

    def configure_recompute(self, policy: str | Any) -> None:
        """Build the model with ``policy`` (a name or a :class:`RecomputePolicy`); called before
        ``configure_model`` (``MHCRecomputeCallback`` calls it in ``setup``). A policy this module's
        model cannot run is refused here, before anything is built."""
        policy = RecomputePolicy.of(policy)
        self.check_recompute_policy(policy)
        self.recompute_policy = policy

    def check_recompute_policy(self, policy: RecomputePolicy) -> None:
        """Refuse a policy this module's model cannot run (each module knows its model)."""

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("val_loss", loss, prog_bar=True)
        self.on_validation_loss(loss)
        return loss

    def test_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.trainer.strategy.forward_backward(self, batch, forward_only=True)
        self.log("test_loss", loss)
        return loss

    def on_validation_loss(self, loss: Tensor) -> None:
        """Called with each validation batch's loss (``MHCGPTModule`` keeps a history)."""

    def global_parameter_name(self, name: str) -> str:
        """A state-dict name of this rank's stage as the one-process module names it: the key of
        checkpoints, which therefore load under any layout."""
        prefix = "model."
        if not name.startswith(prefix) or self.model is None:
            return name
        return prefix + self.global_name_in_model(name[len(prefix):])

    def global_name_in_model(self, name: str) -> str:
        """``name`` (relative to ``self.model`` on this rank) in the whole model."""
        raise NotImplementedError
