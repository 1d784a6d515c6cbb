"""The planner's traffic against a run's counted bytes (``distributed.collectives``), for the tests
that check it (the mHC GPT's and a Hugging Face model's)."""
from __future__ import annotations

from typing import Any


def traffic_misses(case: Any, stages: list[Any], rows: list[tuple[int, tuple, int, dict]]) -> list[tuple]:
    """Where a run's counted bytes differ from the planner's ``stages`` (``StageTraffic``, one per
    stage): ``rows`` holds every rank's ``(stage, its expert group's ranks, its index in the DP x CP
    group, {(dimension, op): bytes})``. Each rank must send its stage's bytes (``of_data_rank``: under
    ZeRO-1 its own pieces') exactly, except EP's all-to-all, which follows the routing:
    the planner's (a balanced router's) must be the mean over each expert group."""
    misses = []
    groups: dict[tuple, list[int]] = {}
    for rank, (stage, experts, data_rank, got) in enumerate(rows):
        got = {key: sent for key, sent in got.items() if sent}  # receives, a broadcast's other ranks
        want = dict(stages[stage].of_data_rank(data_rank))
        want.pop(("expert", "all_to_all"), None)
        groups.setdefault(experts, []).append(got.pop(("expert", "all_to_all"), 0))
        if got != want:
            misses.append((case, rank, sorted(got.items()), sorted(want.items())))
    routed = stages[0].bytes.get(("expert", "all_to_all"), 0)
    for experts, sent in groups.items():
        if sum(sent) != routed * len(sent):
            misses.append((case, experts, sent, routed))
    return misses
