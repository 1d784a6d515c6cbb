"""How far the ``n`` residual streams have moved apart: a number per hyper-connected block, logged
every log step, so a user can watch a model leave the symmetric start where every stream is a copy
(a Hugging Face model retrofitted with ``add_hyper_connections`` starts there exactly; the
project's GPT starts from the embedding copied into the ``n`` streams).

The divergence of a block's output streams ``x`` (``[..., n*C]``, seen as ``[tokens, n, C]``) is,
averaged over tokens, the root-mean-square across-stream standard deviation over the streams' root
mean square:

    d = mean_t( sqrt(mean_c var_n x[t, :, c]) / sqrt(mean_{n,c} x[t, n, c]^2) )

0 when the streams are copies of each other; sqrt((n - 1) / n) when they are independent draws
of one zero-mean distribution (0.87 for n = 4).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def stream_divergence(streams: Tensor, n: int) -> float:
    """``d`` (the module docstring) of ``streams`` (``[..., n*C]``), computed in fp32 off the graph."""
    x = streams.detach().float().reshape(-1, n, streams.shape[-1] // n)
    spread = x.var(dim=1, unbiased=False).mean(dim=-1).sqrt()
    size = x.pow(2).mean(dim=(1, 2)).sqrt()
    return (spread / size.clamp_min(torch.finfo(torch.float32).tiny)).mean().item()


class StreamDivergenceMonitor:
    """The divergence of each block's output streams on the steps it is armed for (a training
    module arms it on log steps), the first forward of each block in the step only: later
    microbatches and the forwards a recompute re-runs in backward are not counted twice.

    ``observe(name, streams)`` records one block; the model calls it (a forward hook on the
    project's GPT layers, the retrofit's block output for a Hugging Face model); :meth:`take`
    returns the step's values and disarms."""

    def __init__(self, num_residual_streams: int) -> None:
        self.n = num_residual_streams
        self.armed = False
        self._values: dict[str, float] = {}

    def observe(self, name: str, streams: Tensor) -> None:
        if self.armed and name not in self._values:
            self._values[name] = stream_divergence(streams, self.n)

    def output_hook(self, name: str):
        """A forward hook recording the block's output (a tensor, or a tuple whose first item is)."""

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.observe(name, output if isinstance(output, Tensor) else output[0])

        return hook

    def take(self) -> dict[str, float]:
        values, self._values, self.armed = self._values, {}, False
        return values
