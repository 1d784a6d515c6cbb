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
