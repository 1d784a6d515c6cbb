"""Layout-invariant parameter initialisation.

Every parameter is drawn from a generator seeded by ``(seed, global name)``.
Megatron's CPU initialisation draws the full ("master") weight and keeps this
rank's shard, so the weights of a model are the same under every TP and PP
layout, and replicated copies (a tied output layer on the last stage) are
initialised identically by giving them the same name.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def stable_seed(seed: int, name: str) -> int:
    """The generator seed of ``name`` under ``seed``: the same in every process and layout (CRC32, not
    Python's salted ``hash``). The Hugging Face wing seeds its recorded blocks' default generator with it."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


class ParamInit:
    """Hands out init methods for the parameters under ``prefix``.

    ``init.child("mlp").normal("linear_fc1.weight", std)`` returns a callable
    that fills a tensor from the generator of ``"<prefix>.mlp.linear_fc1.weight"``.
    """

    def __init__(self, seed: int, prefix: str = "") -> None:
        self.seed = seed
        self.prefix = prefix

    def child(self, name: str) -> "ParamInit":
        return ParamInit(self.seed, f"{self.prefix}.{name}" if self.prefix else name)

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(stable_seed(self.seed, self.key(name)))

    def normal(self, name: str, std: float) -> InitMethod:
        def init(tensor: torch.Tensor) -> torch.Tensor:
            gen = self.generator(name)  # fresh per call: the same name always gives the same values
            with torch.no_grad():
                sample = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                return tensor.copy_(sample)

        return init

    def normal_slice(self, name: str, std: float, full_shape: tuple[int, ...], start: int) -> InitMethod:
        """Like :meth:`normal`, for a tensor that is rows ``[start, start + len)`` (along dim 0) of
        a parameter of ``full_shape``: the whole parameter is drawn and this slice kept, so a
        rank holding some experts has the same values as one process holding all of them."""
        def init(tensor: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=self.generator(name))
                return tensor.copy_(full[start:start + tensor.shape[0]])

        return init


def scaled_std(std: float, num_layers: int) -> float:
    """Megatron's output-projection init: std / sqrt(2 * num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
