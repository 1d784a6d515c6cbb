"""Parallel runtime pieces that need no more than one rank, and failure behaviour."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from lightning_mhc import ConfigError
from lightning_mhc.distributed.grads import clip_grad_norm_, global_grad_norm
from lightning_mhc.testing.launch import RankError, spawn_ranks
from lightning_mhc.model.sizes import partition_layers
from lightning_mhc.model.stages import build_gpt_chunks
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.recompute.rng import MultiDimParallelRandomizer
from model_utils import tiny_config


def test_check_layout():
    assert ParallelLayout(2, 2, world_size=8).data_parallel_size == 2
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 \* pipeline_model_parallel_size=3 = 6 "
                                          r"does not divide world_size=8"):
        ParallelLayout(2, 3, world_size=8)
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=None: must be a positive integer"):
        ParallelLayout(2, 2, virtual_pipeline_model_parallel_size=None)
    stages = ParallelLayout(1, 2, 3, pipeline_model_parallel_rank=1)
    assert (stages.num_virtual_stages, stages.local_virtual_stages()) == (6, [1, 3, 5])


@pytest.mark.parametrize(
    "layers, pp, first, last, expected",
    [
        (8, 2, None, None, [(0, 4), (4, 8)]),
        (8, 4, None, None, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (10, 4, 1, 3, [(0, 1), (1, 4), (4, 7), (7, 10)]),
        (7, 3, 1, None, [(0, 1), (1, 4), (4, 7)]),
        (4, 1, None, None, [(0, 4)]),
    ],
)
def test_partition_layers(layers, pp, first, last, expected):
    ranges = partition_layers(layers, pp, first, last)
    assert ranges[-1][1] == layers and ranges[0][0] == 0
    assert ranges == expected


@pytest.mark.parametrize("args", [(9, 2, None, None), (8, 3, None, None), (8, 2, 9, None), (8, 2, 4, 3)])
def test_partition_layers_errors(args):
    with pytest.raises(ConfigError, match="cannot be split"):
        partition_layers(*args)


def test_build_stage_materialises_only_its_layers(model_parallel, monkeypatch):
    layout = ParallelLayout(pipeline_model_parallel_size=4, pipeline_model_parallel_rank=2)
    built = []
    from lightning_mhc.model import transformer_layer

    original = transformer_layer.TransformerLayer.__init__
    monkeypatch.setattr(
        transformer_layer.TransformerLayer, "__init__",
        lambda self, config, number, init, *rest: built.append(number) or original(self, config, number, init, *rest),
    )
    (stage,) = build_gpt_chunks(tiny_config(num_layers=8), layout)
    assert built == [5, 6]  # global 1-based numbers of stage 2 of 4
    assert stage.embedding is None and stage.output_layer is None
    names = [stage.global_parameter_name(n) for n, _ in stage.named_parameters()]
    assert all(n.startswith(("decoder.layers.4.", "decoder.layers.5.")) for n in names), names


def test_randomizer_seeds_follow_the_table_of_seed_002():
    """8 ranks, TP = DP = PP = 2 (TP fastest, then DP, then PP): the randomizer's table."""
    table = {(): [0, 1, 2, 3, 4, 5, 6, 7], ("tensor",): [8, 8, 10, 10, 12, 12, 14, 14],
             ("tensor", "data"): [24, 24, 24, 24, 28, 28, 28, 28],
             ("tensor", "data", "pipeline"): [56] * 8}
    for rank in range(8):
        ranks = {"tensor": rank % 2, "data": (rank // 2) % 2, "pipeline": rank // 4}
        r = MultiDimParallelRandomizer(0, ranks, {"tensor": 2, "data": 2, "pipeline": 2})
        for groups, seeds in table.items():
            assert r.seed_of(*groups) == seeds[rank], (rank, groups)


def test_clip_grad_norm(model_parallel):
    layout = model_parallel
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    assert global_grad_norm(params, layout) == pytest.approx(2.0 * 7 ** 0.5)
    norm = clip_grad_norm_(params, 1.0, layout)
    assert norm == pytest.approx(2.0 * 7 ** 0.5)
    assert global_grad_norm(params, layout) == pytest.approx(1.0, rel=1e-5)


def _one_rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    buf = torch.empty(4)
    dist.recv(buf, src=1)  # would wait for ever without the launcher ending the group


def test_failure_in_one_rank_ends_the_group_with_its_error():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank one broke on purpose"):
        spawn_ranks(_one_rank_fails, 2, timeout_s=120)
    assert time.monotonic() - start < 60
    assert multiprocessing.active_children() == []


def _p2p_times_out(rank: int, world: int) -> str:
    import datetime

    from lightning_mhc.distributed.pipeline.p2p import PipelineP2P
    layout = ParallelLayout(1, 2).build()
    if rank == 1:
        p2p = PipelineP2P((2, 2), torch.float32, torch.device("cpu"), layout, timeout=datetime.timedelta(seconds=2))
        try:
            p2p.recv_forward()  # stage 0 never sends
        except RuntimeError as err:
            return str(err)
        return "no timeout"
    time.sleep(4)
    return "sender idle"


def test_p2p_wait_has_a_deadline():
    results = spawn_ranks(_p2p_times_out, 2, timeout_s=120)
    assert "no timeout" not in results[1] and "sender idle" == results[0]


def _cp_ep_groups(rank: int, world: int) -> dict:
    def ranks(group) -> list[int]:
        return dist.get_process_group_ranks(group)

    seen = {}
    for tp, cp, ep in ((2, 2, 2), (1, 2, 2), (1, 2, 4)):
        layout = ParallelLayout(tp, context_parallel_size=cp, expert_model_parallel_size=ep).build()
        seen[(tp, cp, ep)] = dict(
            tp=ranks(layout.tp_group), cp=ranks(layout.cp_group), dp=ranks(layout.dp_group),
            dp_cp=ranks(layout.dp_cp_group), ep=ranks(layout.ep_group), edp=ranks(layout.expert_dp_group),
            places=(layout.context_parallel_rank, layout.data_parallel_rank, layout.expert_model_parallel_rank),
            sizes=(layout.data_parallel_size, layout.expert_data_parallel_size))
    return seen


def test_context_and_expert_parallel_groups_follow_megatrons_rank_order():
    """TP fastest, then CP, then DP (then PP); DP x CP is where replicated gradients are reduced; EP is
    carved out of DP x CP ranks that hold the same TP shard, the rest replicate each expert."""
    with pytest.raises(ConfigError, match=r"\* context_parallel_size=2 = 4 does not divide world_size=6"):
        ParallelLayout(2, context_parallel_size=2, world_size=6)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=4 does not divide the 2 data- and context-"):
        ParallelLayout(2, expert_model_parallel_size=4, world_size=4)
    with pytest.raises(ConfigError, match=r"context_parallel_size=2 cuts seq_length=6 into 2 \* 2 chunks and "
                                          r"sequence_parallel=True splits each over tensor_model_parallel_size=2"):
        ParallelLayout(2, sequence_parallel=True, context_parallel_size=2).check_model({}, seq_length=6)
    per_rank = spawn_ranks(_cp_ep_groups, 4, timeout_s=120)
    r0, r3 = per_rank[0], per_rank[3]
    assert r0[(2, 2, 2)] == dict(tp=[0, 1], cp=[0, 2], dp=[0], dp_cp=[0, 2], ep=[0, 2], edp=[0], places=(0, 0, 0),
                                 sizes=(1, 1))
    assert r3[(2, 2, 2)] == dict(tp=[2, 3], cp=[1, 3], dp=[3], dp_cp=[1, 3], ep=[1, 3], edp=[3], places=(1, 0, 1),
                                 sizes=(1, 1))
    assert r3[(1, 2, 2)] == dict(tp=[3], cp=[2, 3], dp=[1, 3], dp_cp=[0, 1, 2, 3], ep=[2, 3], edp=[1, 3],
                                 places=(1, 1, 1), sizes=(2, 2))
    assert r3[(1, 2, 4)]["ep"] == [0, 1, 2, 3] and r3[(1, 2, 4)]["sizes"] == (2, 1)
