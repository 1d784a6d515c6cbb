"""torch's process-wide fp32 matmul precision, set for a block; a Trainer's ``precision`` applied to
modules built outside a Trainer."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def float32_matmul_precision(setting: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(setting)`` inside the block; the setting before it is
    restored after (it holds for the whole process: a test or benchmark must not leak it)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


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
