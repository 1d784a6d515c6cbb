"""Training throughput that can be trusted: whole-job tokens over measured step times.

A step is timed on this rank from ``on_train_batch_start`` to the end of the
optimizer step (gradient reduction included; checkpoint saving and
validation excluded). Its tokens are the *whole job's*: the per-rank batch
times the data-parallel size; TP and PP peers of one DP rank read the same
batch, so they are not counted again. The first steps of every ``fit`` call
(warm-up) are excluded; the summary reports medians and quartiles, robust
to the occasional slow step (a checkpoint, a noisy neighbour).
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Any

WINDOW = 10_000
"""Steps kept for the summary (the last ones)."""


class ThroughputMeter:
    def __init__(self, warmup_steps: int = 1) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.step_tokens: deque[int] = deque(maxlen=WINDOW)
        self._seen = 0

    def start_fit(self) -> None:
        """A new ``fit`` call: its first steps are warm-up again."""
        self._seen = 0

    def record(self, seconds: float, tokens: int) -> bool:
        """Record one step; returns False for a warm-up step (not recorded)."""
        self._seen += 1
        if self._seen <= self.warmup_steps or seconds <= 0:
            return False
        self.step_times.append(seconds)
        self.step_tokens.append(tokens)
        return True

    @property
    def rates(self) -> list[float]:
        return [tokens / seconds for tokens, seconds in zip(self.step_tokens, self.step_times)]

    def summary(self) -> dict[str, Any]:
        """Median tokens/s with its quartiles, and the median step time (None without steps)."""
        rates = self.rates
        if not rates:
            return dict(tokens_per_sec=None, tokens_per_sec_p25=None, tokens_per_sec_p75=None,
                        step_time_ms=None, timed_steps=0)
        p25, _, p75 = statistics.quantiles(rates, n=4) if len(rates) > 1 else (rates[0],) * 3
        return dict(
            tokens_per_sec=statistics.median(rates),
            tokens_per_sec_p25=p25,
            tokens_per_sec_p75=p75,
            step_time_ms=1000 * statistics.median(self.step_times),
            timed_steps=len(rates),
        )
