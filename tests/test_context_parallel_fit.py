"""Context parallelism through ``Trainer.fit`` (``MHCParallelStrategy(context_parallel_size=...)``)
against one process, in one 4-rank group (tests/scripts/fit_context_parallel.py): CP 4, CP 2 x PP 2,
CP 2 x TP 2 with sequence parallelism, CP 2 x DP 2 with the distributed optimizer, each with the
``mhc_block`` recompute and a loss mask spread unevenly over the CP ranks: per-step losses, the
validation loss and the final weights within 1e-5 (fp32). With dropout 0.1 (CP 2 x DP 2),
``mhc_block`` and ``full`` (which re-runs the attention and its K/V gather) equal ``none`` bit for
bit. With hidden dropout 0.1 and ``exact_hidden_dropout`` (attention dropout 0): CP 4 and CP 2 x TP 2
with sequence parallelism (``mhc_block``) equal one process, CP 2 x DP 2 with the distributed
optimizer (``full``) equals TP 2 x DP 2 and CP 2 x PP 2 equals TP 2 x PP 2 (``mhc_block``; DP ranks
draw their own samples' masks and stages from their own streams, so the reference is the layout
with TP in place of CP, which the option makes equal to TP 1), all within 1e-5.
A checkpoint saved at CP 2 x DP 2 after step 2 continues at CP 1 as the uninterrupted run.
And ``lightning-mhc-train parallel=cp2`` against the same command on one process.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from script_runs import run_on_ranks
from train_cli import run_train_on_ranks, train_losses

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "fit_context_parallel.py"
CASES = ["cp4", "cp2pp2", "cp2tp2sp", "cp2dp2"]
DROPOUT = ["cp2dp2_dropout_none", "cp2dp2_dropout_mhc_block", "cp2dp2_dropout_full"]
# exact_hidden_dropout: case -> the case it equals (1e-5); "single_exact" runs in one process
EXACT = {"cp4_exact": "single_exact", "cp2tp2sp_exact": "single_exact",
         "cp2dp2_exact_dropout_full": "tp2dp2_exact", "cp2pp2_exact": "tp2pp2_exact"}


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 4
    return max(abs(x - y) for x, y in zip(a, b))


def run_group(directory: pathlib.Path, devices: int, cases: list[str], compare: list[str] = ()) -> dict:
    out = directory / f"devices{devices}.json"
    run_on_ranks(SCRIPT.name, devices, "--devices", str(devices), "--cases", *cases, "--out", str(out),
                 "--dir", str(directory), "--compare", *compare, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_context_parallel_fit_equals_one_process(tmp_path):
    four = run_group(tmp_path, 4, CASES + DROPOUT + list(EXACT) + ["tp2dp2_exact", "tp2pp2_exact"])
    compare = ([f"single:{case}" for case in CASES + ["resume"]] + [f"{DROPOUT[0]}:{case}" for case in DROPOUT[1:]]
               + [f"{want}:{case}" for case, want in EXACT.items()])
    one = run_group(tmp_path, 1, ["single", "resume", "single_exact"], compare)
    reference = one["single"]
    assert len(reference["losses"]) == 4
    for case in CASES:
        got = four[case]
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
        weights = one["weight_diffs"][f"single:{case}"]
        print(f"{case}: max |loss - one process| over 4 steps {loss_diff:.3g}, "
              f"val {abs(got['val_loss'] - reference['val_loss']):.3g}, weights {weights:.3g}")
        assert len(got["losses"]) == 4 and loss_diff < 1e-5, (case, got["losses"], reference["losses"])
        assert abs(got["val_loss"] - reference["val_loss"]) < 1e-5
        assert weights < 1e-5
    # resumed at CP 1 from the CP 2 x DP 2 checkpoint of step 2: steps 3 and 4 as the uninterrupted run
    resumed = one["resume"]["losses"]
    assert len(resumed) == 2 and max(abs(a - b) for a, b in zip(resumed, reference["losses"][2:])) < 1e-5
    assert one["weight_diffs"]["single:resume"] < 1e-5
    # dropout: the recompute policies replay the forward's masks (and the K/V gather) exactly
    for case in DROPOUT[1:]:
        assert four[case]["losses"] == four[DROPOUT[0]]["losses"], case
        assert one["weight_diffs"][f"{DROPOUT[0]}:{case}"] == 0.0, case
    assert four[DROPOUT[0]]["losses"] != four["cp2dp2"]["losses"]  # dropout is on
    # exact hidden dropout: the masks of the layout without CP (and TP), bit for bit, under recompute
    results = {**four, **one}
    for case, want in EXACT.items():
        loss_diff = _max_diff(results[case]["losses"], results[want]["losses"])
        weights = one["weight_diffs"][f"{want}:{case}"]
        print(f"{case} against {want}: max |loss diff| {loss_diff:.3g}, weights {weights:.3g}")
        assert loss_diff < 1e-5 and weights < 1e-5, (case, results[case]["losses"], results[want]["losses"])
        assert abs(results[case]["val_loss"] - results[want]["val_loss"]) < 1e-5
    assert _max_diff(one["single_exact"]["losses"], reference["losses"]) > 1e-3  # dropout is on


def _cli_losses(tmp_path: pathlib.Path, *overrides: str) -> dict[int, float]:
    # ranks forked from the preloaded server: the subject is what CP 2 computes, not the launch
    tmp_path.mkdir()
    run_train_on_ranks(tmp_path, "trainer=debug", "data=synthetic", "recompute=mhc_block", "model.hidden_dropout=0",
                       "model.attention_dropout=0", *overrides, f"hydra.run.dir={tmp_path / 'run'}", timeout=900)
    return train_losses(tmp_path / "run" / "metrics.csv")


@pytest.mark.slow
def test_lightning_mhc_train_parallel_cp2_equals_one_process(tmp_path):
    """``lightning-mhc-train parallel=cp2 trainer.devices=2`` (6 steps, mhc_block): the logged losses
    of the one-process run, within 1e-5."""
    single = _cli_losses(tmp_path / "single")
    cp2 = _cli_losses(tmp_path / "cp2", "parallel=cp2", "trainer.devices=2")
    assert sorted(single) == sorted(cp2) and len(single) == 6
    assert max(abs(single[step] - cp2[step]) for step in single) < 1e-5, (single, cp2)
