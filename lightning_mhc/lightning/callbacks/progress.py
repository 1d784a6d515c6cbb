"""``step_progress_bar``: the progress bar of a run bounded by ``max_steps`` (the CLI's).

A Trainer given ``max_steps`` and no ``max_epochs`` runs with ``max_epochs=-1``: Lightning's rich
bar writes its epoch as ``Epoch 0/-2`` (``max_epochs - 1``) and counts the batches of the epoch
against the steps left, which a run resumed mid-epoch shows as ``8/3``. This bar counts the
optimizer steps of ``max_steps`` (``5/8`` after a resume from step 5 too) under ``Epoch <n>``.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


def step_progress_bar() -> Callback | None:
    """The bar for a Trainer's ``callbacks``, or None where rich is not installed (Lightning's tqdm
    bar then, which writes no epoch bound)."""
    if not _RICH_AVAILABLE:
        return None
    from lightning.pytorch.callbacks import RichProgressBar

    class StepProgressBar(RichProgressBar):
        def _by_steps(self) -> bool:
            trainer = self.trainer
            return trainer.max_epochs in (None, -1) and trainer.max_steps is not None and trainer.max_steps > 0

        @property
        def total_train_batches(self) -> int | float:
            return self.trainer.max_steps if self._by_steps() else super().total_train_batches

        def _get_train_description(self, current_epoch: int) -> str:
            if not self._by_steps():
                return super()._get_train_description(current_epoch)
            description = f"Epoch {current_epoch}"
            # padded as Lightning pads its own, so that the bar does not move under validation's
            return f"{description:{max(len(description), len(self.validation_description))}}"

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_epoch_start(trainer, pl_module)
            if self._by_steps():
                self._update(self.train_progress_bar_id, trainer.global_step)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self._by_steps():
                self._update(self.train_progress_bar_id, trainer.global_step)

    return StepProgressBar()
