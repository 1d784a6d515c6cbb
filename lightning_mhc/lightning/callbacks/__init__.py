"""Callbacks: ``MHCRecomputeCallback`` (the recompute policy of a run) and ``FinalStepCheckpoint``
(the checkpoint the CLI writes at the last step); ``progress.step_progress_bar`` (the CLI's bar of
``max_steps``)."""
