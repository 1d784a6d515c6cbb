"""Data parallelism end to end: ``Trainer.fit`` on shuffled DataLoaders against one process.

One group of ranks per world size, forked from the preloaded fork server, runs all of its cases
(tests/scripts/fit_data_parallel.py);
the references run once, in one process, on the same global batches. Checked per step: the
loss (and, for a plain LightningModule, the final weights), and which samples each rank
trained on: disjoint across DP ranks, identical between TP/PP peers, together the reference's
global batch, every sample once per epoch, a new order in the next epoch. In the same groups, a
run stopped early (``should_stop``, ``max_steps``) and saved after ``fit`` resumes as the
uninterrupted run continues.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from script_runs import run_on_ranks

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "fit_data_parallel.py"
STEPS_PER_EPOCH, GLOBAL_BATCH = 3, 8


def run_group(tmp_path: pathlib.Path, devices: int, cases: list[str]) -> dict:
    out = tmp_path / f"devices{devices}.json"
    run_on_ranks(SCRIPT.name, devices, "--devices", str(devices), "--cases", *cases, "--out", str(out), timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    return run_group(tmp_path_factory.mktemp("reference"), 1,
                     ["single", "plain_single", "plain_adamw_single", "stop_resume"])


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict:
    return run_group(tmp_path_factory.mktemp("dp2"), 2, ["dp", "plain_dp", "plain_adamw_dp", "stop_resume"])


def check_data_split(result: dict, reference: dict) -> None:
    dp_ranks = result["dp_ranks"]
    assert sorted(set(dp_ranks)) == list(range(result["dp"])) and result["dp"] == 2
    epoch_samples: list[int] = []
    for step, (per_rank, (ref_batch,)) in enumerate(zip(result["indices"], reference["indices"])):
        by_dp: dict[int, list[int]] = {}
        for rank, indices in enumerate(per_rank):
            assert len(indices) == GLOBAL_BATCH // result["dp"]
            # TP and PP peers of one DP rank read the same samples
            assert by_dp.setdefault(dp_ranks[rank], indices) == indices, (step, rank)
        union = [i for dp in sorted(by_dp) for i in by_dp[dp]]
        assert len(set(union)) == GLOBAL_BATCH, f"step {step}: DP ranks overlap: {by_dp}"
        assert set(union) == set(ref_batch), f"step {step}: not the one-process global batch"
        epoch_samples += union
        if (step + 1) % STEPS_PER_EPOCH == 0:
            assert sorted(epoch_samples) == list(range(STEPS_PER_EPOCH * GLOBAL_BATCH))  # each sample once
            epoch_samples = []
    first, second = result["indices"][0], result["indices"][STEPS_PER_EPOCH]
    assert first != second  # set_epoch: the next epoch is shuffled anew


def check_losses(result: dict, reference: dict) -> None:
    assert len(result["losses"]) == len(reference["losses"]) == 5
    diff = (torch.tensor(result["losses"]) - torch.tensor(reference["losses"])).abs().max().item()
    print(f"TP={result['tp']} PP={result['pp']} DP={result['dp']}: max |loss - one process| over 5 steps = {diff:.3g}")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5)


def test_dp2_gpt_and_plain_module(dp2, references):
    """DP = 2 (2 processes): MHCGPTModule and a plain LightningModule (SGD, lr 0.2); the plain
    module with AdamW and a layer its loss never touches under ``use_distributed_optimizer=True``,
    against plain AdamW in one process: the same weights, the unused layer not moved."""
    result = dp2
    zero, single = result["plain_adamw_dp"], references["plain_adamw_single"]
    assert len(zero["weights"]) == 4 and zero["replicas_identical"]  # the layer, then the unused layer
    for mine, ref in zip(zero["weights"], single["weights"]):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(ref), rtol=0, atol=1e-6)
    for run in (zero, single):  # AdamW skips a parameter without a gradient: no weight decay, no momentum
        assert run["weights"][2:] == run["initial_weights"][2:]
    assert zero["weights"][:2] != zero["initial_weights"][:2]
    check_losses(zero, single)
    check_data_split(result["dp"], references["single"])
    check_losses(result["dp"], references["single"])
    check_data_split(result["plain_dp"], references["plain_single"])
    check_losses(result["plain_dp"], references["plain_single"])
    assert result["plain_dp"]["replicas_identical"]
    assert len(result["plain_dp"]["weights"]) == 2  # weight and bias
    weight_diff = max((torch.tensor(m) - torch.tensor(r)).abs().max().item()
                      for m, r in zip(result["plain_dp"]["weights"], references["plain_single"]["weights"]))
    print(f"plain LightningModule DP=2: max |weight - one process| after 5 SGD steps = {weight_diff:.3g}")
    for mine, ref in zip(result["plain_dp"]["weights"], references["plain_single"]["weights"]):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(ref), rtol=0, atol=1e-6)


def test_pp2_dp2_and_tp2_dp2(tmp_path, references):
    """(PP 2, DP 2) and (TP 2, DP 2) on 4 processes."""
    result = run_group(tmp_path, 4, ["pp2", "tp2"])
    for case in ("pp2", "tp2"):
        check_data_split(result[case], references["single"])
        check_losses(result[case], references["single"])


def test_tp2_pp2_dp2(tmp_path, references):
    """(TP 2, PP 2, DP 2) on 8 processes."""
    result = run_group(tmp_path, 8, ["tp2pp2"])
    check_data_split(result["tp2pp2"], references["single"])
    check_losses(result["tp2pp2"], references["single"])


STOPPED_AT = {"should_stop_mid_epoch": 2, "should_stop_at_epoch_end": 3, "max_steps_mid_epoch": 2,
              "max_steps_at_epoch_end": 3, "final_step_mid_epoch": 4, "epochs_should_stop_mid_epoch": 5}
"""fit_data_parallel.py's STOPS: the step each first run stops at (3 steps an epoch)."""


@pytest.mark.parametrize("devices", [1, 2], ids=["one_process", "dp2"])
def test_a_run_stopped_early_resumes_where_it_stopped(devices, references, dp2):
    """A run that ends before the uninterrupted run's 9 steps: ``trainer.should_stop`` set by a
    callback mid-epoch, after an epoch's last batch, and in epoch-based training; ``max_steps``
    mid-epoch and at an epoch's end; each saved by ``trainer.save_checkpoint`` after ``fit``
    returns, and ``max_steps`` mid-epoch saved by ``FinalStepCheckpoint`` in ``on_train_end``
    (the CLI's final step). Resumed with ``ckpt_path``, it trains the uninterrupted run's
    remaining steps: the same (epoch, batch index), the same samples on every rank, the same
    losses (bit-exact: the same arithmetic). Lightning alone resumed these in the next epoch, some
    of its batches skipped, or an epoch skipped whole (lightning_mhc/lightning/fit_position.py)."""
    result = (references if devices == 1 else dp2)["stop_resume"]
    uninterrupted = result["uninterrupted"]
    assert len(uninterrupted["losses"]) == 9 and uninterrupted["positions"][-1] == [2, 2]
    assert sorted(result) == sorted(["uninterrupted", *STOPPED_AT, *(f"{name}_first" for name in STOPPED_AT)])
    for name, step in STOPPED_AT.items():
        first, resumed = result[f"{name}_first"], result[name]
        assert first["global_step"] == step and first["indices"] == uninterrupted["indices"][:step], name
        assert resumed["positions"] == uninterrupted["positions"][step:], name
        assert resumed["indices"] == uninterrupted["indices"][step:], name
        assert resumed["losses"] == uninterrupted["losses"][step:], name
        assert (resumed["global_step"], resumed["epoch"]) == (9, 3), name
