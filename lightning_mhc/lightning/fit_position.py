"""Where a resumed ``fit`` continues, for a checkpoint saved after training ended.

A fit that ends (``max_steps`` reached, ``trainer.should_stop`` set, an epoch limit) closes its
last epoch as finished: the fit loop's epoch counters are all advanced, whether the epoch read
all its batches or was cut short. The epoch loop's batch counters still count that epoch. A
checkpoint taken then (``trainer.save_checkpoint`` after ``fit`` returns, or in
``on_train_end``: ``FinalStepCheckpoint``'s final step) resumes in Lightning (2.6) as follows:

- cut short after ``k`` batches: the next epoch, at its batch ``k`` (the rest of the stopped
  epoch is never read, and the next epoch loses its first ``k`` batches);
- after the epoch's last batch, step-based (``max_steps``): the next epoch starts already at its
  end, so it is skipped whole.

``continue_where_fit_stopped`` rewrites that loop state, as it is loaded, into the state the
uninterrupted run was in: a cut-short epoch is still in progress with ``k`` batches done (the
state of a checkpoint taken mid-epoch, which Lightning and ``ResumableLoader`` resume exactly);
a finished one is followed by an epoch that has read nothing yet (what the fit loop does when the
next epoch starts). The resumed run then reads the batches the uninterrupted run read, under the
same epoch numbers. The hooks of the cut-short epoch's end (``on_train_epoch_end``) have run in
the stopped run and run again when the resumed run finishes that epoch.
"""
from __future__ import annotations

from typing import Any

_BATCHES = "epoch_loop.batch_progress"


def continue_where_fit_stopped(checkpoint: dict[str, Any]) -> None:
    """Rewrite ``checkpoint["loops"]["fit_loop"]`` in place when it was saved after training
    ended (the module docstring); any other checkpoint is left as it is."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not fit_loop or "epoch_progress" not in fit_loop or _BATCHES not in fit_loop:
        return
    epochs = fit_loop["epoch_progress"]["total"]
    ended = epochs["completed"] >= 1 and len({epochs[k] for k in ("ready", "started", "processed", "completed")}) == 1
    if not ended:  # saved during an epoch or at its end hooks: Lightning resumes it exactly
        return
    batches = fit_loop[_BATCHES]
    if batches["is_last_batch"]:  # the next epoch has read no batch (the epoch loop resumes from these counts)
        batches["current"] = dict.fromkeys(batches["current"], 0)
    else:  # cut short: the epoch is in progress again, its end hooks not yet run
        for counts in (fit_loop["epoch_progress"]["total"], fit_loop["epoch_progress"]["current"]):
            counts["processed"] -= 1
            counts["completed"] -= 1

