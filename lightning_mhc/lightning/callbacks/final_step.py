"""``FinalStepCheckpoint``: Lightning's ModelCheckpoint that also saves the step training ends at.

``every_n_train_steps`` saves steps N, 2N, ...; with ``max_steps`` not a multiple of N the last
steps would be lost. At the end of training the final step is saved too, under the same name
scheme, without removing the newest periodic checkpoint (``save_top_k`` applies to the periodic
ones), so a run ends with ``step-<last periodic>.ckpt`` and ``step-<final>.ckpt``.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn


class FinalStepCheckpoint(ModelCheckpoint):
    @property
    def last_saved(self) -> str | None:
        return self._last_checkpoint_saved or None

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if (trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step
                or trainer.state.fn != TrainerFn.FITTING or trainer.fast_dev_run):
            return
        filepath = self.format_checkpoint_name(self._monitor_candidates(trainer))
        if not self.file_exists(filepath, trainer):  # e.g. resumed from it with nothing left to train
            self._save_checkpoint(trainer, filepath)
