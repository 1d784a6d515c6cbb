"""The mHC GPT on a :class:`ParallelRuntime` in a rank of a spawned group, as the strategy sets it up
(without Lightning's Trainer): for the tests that run the runtime's schedule on it and measure."""
from __future__ import annotations

from typing import Any

import torch


def lightning_precision(precision: str):
    """The precision plugin Lightning's Trainer makes for ``precision`` (``32-true`` or ``bf16-true``),
    for the planner grids that build the runtime's modules without a Trainer: the strategy converts
    the module with its ``convert_module`` at setup, and Lightning runs each training step in its
    ``train_step_context`` (``bf16-true``: torch's default dtype bf16)."""
    from lightning.pytorch.plugins.precision import HalfPrecision, Precision

    if precision == "32-true":
        return Precision()
    if precision == "bf16-true":
        return HalfPrecision("bf16-true")
    raise ValueError(f"precision {precision!r}: the planner grids run 32-true or bf16-true")


def gpt_on_runtime(layout: Any, num_microbatches: int, model: dict[str, Any], policy: str = "none",
                   precision: str = "32-true", **settings: Any) -> tuple[Any, Any]:
    """``(runtime, module)``: ``layout`` built over the group, the module's stage made on it (seeded),
    its recompute policy attached, converted to ``precision`` as the Trainer's plugin converts it;
    ``settings``: more :class:`ParallelSettings` fields."""
    from lightning_mhc.lightning.modules.gpt import MHCGPTModule
    from lightning_mhc.recompute.policy import attach_recompute
    from lightning_mhc.strategies.runtime import ParallelRuntime
    from lightning_mhc.strategies.settings import ParallelSettings

    runtime = ParallelRuntime(ParallelSettings(layout=layout, num_microbatches=num_microbatches, **settings))
    runtime.layout, runtime.device = layout.build(), torch.device("cpu")
    module = MHCGPTModule(model, recompute_policy=policy)
    module.handed_layout = runtime.layout
    torch.manual_seed(0)
    module.configure_model()
    attach_recompute(module)
    lightning_precision(precision).convert_module(module)
    return runtime, module


def train_schedule(runtime: Any, module: Any, batch: dict[str, torch.Tensor], precision: str = "32-true",
                   where: str = "planner grid") -> None:
    """One training step's forwards and backwards through the runtime's schedule as Lightning runs
    them under ``precision``: the batch converted by the plugin (``bf16-true``: the loss mask bf16),
    the schedule in its ``train_step_context``."""

    plugin = lightning_precision(precision)
    with plugin.train_step_context():
        runtime.run_schedule(module, plugin.convert_input(batch), forward_only=False, accumulate=1, where=where)


def hf_on_runtime(layout: Any, num_microbatches: int, recorded: Any, policy: str = "none",
                  hyper_connections: int | None = None, precision: str = "32-true", **settings: Any) -> tuple[Any, Any]:
    """``(runtime, module)`` for a Hugging Face model recorded on the meta device: ``layout`` built
    over the group, the model split by ``parallelize`` with ``policy`` (seeded) in a ``ParallelLMModule``,
    converted to ``precision`` as the Trainer's plugin converts it."""
    from lightning_mhc.lightning.modules.parallel_lm import ParallelLMModule
    from lightning_mhc.strategies.runtime import ParallelRuntime
    from lightning_mhc.strategies.settings import ParallelSettings

    runtime = ParallelRuntime(ParallelSettings(layout=layout, num_microbatches=num_microbatches, **settings))
    runtime.layout, runtime.device = layout.build(), torch.device("cpu")
    module = ParallelLMModule()
    module.handed_layout = runtime.layout
    module.model = module.parallelize(recorded, "auto", recompute=policy, hyper_connections=hyper_connections)
    return runtime, lightning_precision(precision).convert_module(module.train())
