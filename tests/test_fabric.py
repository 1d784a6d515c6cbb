"""Lightning Fabric: ``lightning_mhc.fabric.MHCParallelStrategy`` through the public door.

- examples/fabric_train.py as a user runs it (TP 2 x PP 2, 4 processes, mhc_block, dropout 0.1):
  the same per-step losses as Trainer.fit of the same run; save at step 3, resume (in processes
  started by torchrun instead of Fabric's launcher), the same losses as the uninterrupted loop;
- a plain module under ``strategy="mhc_parallel"`` (DP 2): replicas, distinct samples, gradient
  accumulation, global-norm clipping and save/load against a one-process replay;
- the example's TP 2 x PP 2 checkpoint loaded by Fabric on DP 2, TP 2 and PP 2; its last
  checkpoint and the Trainer's of the same run loaded by Fabric (model and optimizer) agree;
  ``MHCGPTModule.training_step`` called in a Fabric loop.
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from script_runs import fit_gpt, left_behind, run_on_ranks, run_script
from subprocess_env import child_env

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "fabric_train.py"


def run_example(cwd: pathlib.Path, *args: str, launcher: tuple[str, ...] = ()) -> dict[int, float]:
    out = cwd / f"losses{len(list(cwd.glob('losses*.json')))}.json"
    proc = subprocess.run([sys.executable, *launcher, str(EXAMPLE), "--out", str(out), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "step 1: loss" in proc.stdout or "--resume" in args, proc.stdout[-2000:]
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


# ---------------------------------------------------------------- no processes
def test_fabric_finds_the_strategy_by_name_and_class():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    # importing lightning_mhc.fabric (next line) registers "mhc_parallel" with Fabric
    from lightning_mhc.fabric import MHCParallelStrategy
    from lightning_mhc.strategies.processes import StrategyProcesses
    from lightning_mhc.strategies.runtime import ParallelRuntime
    from lightning_mhc.lightning import MHCParallelStrategy as TrainerStrategy

    assert STRATEGY_REGISTRY["mhc_parallel"]["strategy"] is MHCParallelStrategy
    assert type(Fabric(accelerator="cpu", devices=1, strategy="mhc_parallel").strategy) is MHCParallelStrategy
    strategy = MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_microbatches=4)
    assert Fabric(accelerator="cpu", devices=4, strategy=strategy).strategy is strategy
    # one implementation of the shared parts: both strategies hold the same runtime and inherit the
    # processes' plumbing, neither overrides it
    shared = ["_start_processes", "distributed_sampler_kwargs", "layout", "settings", "root_device",
              "set_world_ranks", "barrier", "broadcast"]
    for cls in (MHCParallelStrategy, TrainerStrategy):
        assert issubclass(cls, StrategyProcesses)
        assert all(name not in vars(cls) for name in shared), cls
    assert type(strategy.runtime) is ParallelRuntime
    assert type(TrainerStrategy(tensor_model_parallel_size=2).runtime) is ParallelRuntime
    # the checkpoint's model and optimizer states too come through the runtime, not around it
    import inspect
    for cls in (MHCParallelStrategy, TrainerStrategy):
        source = inspect.getsource(inspect.getmodule(cls))
        assert not re.search(r"checkpoint\.(model|optimizer)_state\(", source), cls


def test_fabric_strategy_rejects_a_bad_layout_before_starting():
    from lightning_mhc import ConfigError
    from lightning_mhc.fabric import MHCParallelStrategy

    with pytest.raises(ConfigError, match="tensor_model_parallel_size=0"):
        MHCParallelStrategy(tensor_model_parallel_size=0)


# ------------------------------------------------------------- with processes
@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """examples/fabric_train.py as written: 6 steps, checkpoints at steps 3 and 6."""
    cwd = tmp_path_factory.mktemp("fabric_example")
    return cwd, run_example(cwd)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """The example's run through Trainer.fit (tests/scripts/fit_gpt.py), checkpoint at step 6."""
    return fit_gpt(tmp_path_factory.mktemp("trainer_of_example"), "--devices", "4", "--tp", "2", "--pp", "2",
                   "--policy", "mhc_block", "--scenario", "fabric_example", "--steps", "6")


@pytest.mark.slow
def test_fabric_example_matches_trainer_fit(example_run, trainer_run):
    cwd, fabric_losses = example_run
    trainer = trainer_run["losses"]
    diff = max(abs(a - b) for a, b in zip(trainer, [fabric_losses[s] for s in range(1, 7)]))
    print(f"Fabric vs Trainer (TP2 x PP2, mhc_block, dropout 0.1), 6 steps: max |loss diff| = {diff:.3g}; "
          f"losses {[round(x, 6) for x in trainer]}")
    assert len(trainer) == 6 and diff <= 1e-6
    assert len(set(trainer)) > 1  # a run that trains


@pytest.mark.slow
def test_fabric_resume_under_torchrun_continues_like_the_uninterrupted_loop(example_run):
    """The step-3 checkpoint of the run Fabric's launcher started, resumed in processes started by
    torchrun (TorchElasticEnvironment: the strategy joins them): steps 4-6 as uninterrupted."""
    cwd, uninterrupted = example_run
    assert (cwd / "fabric_ckpt" / "step-3" / "metadata.json").is_file()
    resumed = run_example(cwd, "--resume", "fabric_ckpt/step-3", "--ckpt-dir", "resumed_ckpt",
                          launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"))
    assert sorted(resumed) == [4, 5, 6]
    diff = max(abs(resumed[s] - uninterrupted[s]) for s in resumed)
    print(f"Fabric resume from step 3 under torchrun (TP2 x PP2, dropout 0.1): max |loss diff| over steps 4-6 "
          f"= {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.slow
def test_fabric_plain_data_parallel_and_resharded_loads(example_run, trainer_run, tmp_path):
    cwd, _ = example_run
    out = tmp_path / "result.json"
    # its Fabrics' 2 devices, on forked ranks (the example's own launch is test_fabric_example_matches_trainer_fit's)
    run_on_ranks("fabric_checks.py", 2, "--out", str(out), "--gpt-ckpt", str(cwd / "fabric_ckpt" / "step-3"),
                 "--gpt-final", str(cwd / "fabric_ckpt" / "step-6"), "--trainer-final", trainer_run["checkpoint"],
                 timeout=600)
    result = json.loads(out.read_text())
    assert result["strategy"] == "lightning_mhc.fabric.strategy.MHCParallelStrategy"  # strategy="mhc_parallel"

    plain = result["plain"]
    initial, synced, final = torch.tensor(plain["initial"]), torch.tensor(plain["synced"]), torch.tensor(plain["final"])
    assert not torch.equal(initial[0], initial[1])  # the ranks initialised different weights ...
    assert torch.equal(synced[0], synced[1]) and torch.equal(synced[0], initial[0])  # ... setup gave rank 0's to all
    assert torch.equal(final[0], final[1])  # replicas identical after training
    logs = plain["logs"]
    seen = [[i for step in map(str, range(1, 6)) for batch in log[step] for i in batch] for log in logs]
    assert all(not set(a) & set(b) for a, b in zip(logs[0]["1"], logs[1]["1"]))  # distinct samples per step
    first_epoch = [set(s[:16]) for s in seen]  # 4 batches of 4 per rank: one epoch of the 32 samples
    assert not first_epoch[0] & first_epoch[1] and first_epoch[0] | first_epoch[1] == set(range(32))

    reference = result["reference"]
    weight_diff = (final[0] - torch.tensor(reference["final"])).abs().max().item()
    norm_diff = max(abs(logs[0]["norms"][s] - reference["norms"][s]) for s in reference["norms"])
    print(f"Fabric DP2 plain module vs one-process replay of the global batches, 5 steps (one accumulated, "
          f"clipped at {0.05}): max |weight diff| = {weight_diff:.3g}, max |global norm diff| = {norm_diff:.3g}")
    assert weight_diff <= 1e-6 and norm_diff <= 1e-5
    assert min(reference["norms"].values()) > 0.05  # clipping was active on every step
    assert plain["resumed_step"] == 5 and torch.equal(torch.tensor(plain["resumed"]), final[0])

    gpt = result["gpt"]
    losses = gpt["eval_loss"]
    spread = max(losses.values()) - min(losses.values())
    print(f"TP2 x PP2 Fabric checkpoint loaded by Fabric on DP2 / TP2 / PP2: eval losses {losses}, spread {spread:.3g}")
    assert spread <= 1e-6
    assert all(keys == ["scheduler", "step"] for keys in gpt["remainder_keys"].values())  # not asked for: returned
    trained = gpt["trained"]
    after = {name: run["eval_loss"] for name, run in trained.items()}
    step_diff = max(abs(a - b) for run in trained.values() for a, b in zip(run["losses"], trained["pp2"]["losses"]))
    print(f"Fabric training from it, 2 AdamW steps (dropout 0, clipped): eval losses after {after}; max |step loss "
          f"- PP2's| = {step_diff:.3g}")
    assert set(after) == {"dp2", "dp2_accumulate2", "tp2", "pp2", "dp2_zero"}
    assert max(after.values()) - min(after.values()) <= 1e-5 and step_diff <= 1e-5
    assert all(abs(after[name] - losses[name.split("_")[0]]) > 1e-4 for name in after)  # the steps changed it
    bf16, fp32 = gpt["bf16_true_pp2"], trained["pp2"]["losses"][0]
    print(f"bf16-true on PP2: first training loss {bf16['loss']:.6f} (fp32: {fp32:.6f}), parameters {bf16['param_dtypes']}")
    assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["loss"] != fp32 and abs(bf16["loss"] - fp32) < 2e-2
    assert gpt["recompute_attached"] == {"dp2": True, "tp2": True, "pp2": True}  # mhc_block managers hooked
    fabric_final, trainer_final = gpt["final"]["fabric"], gpt["final"]["trainer"]
    diffs = {key: (torch.tensor(fabric_final[key]) - torch.tensor(trainer_final[key])).abs().max().item()
             for key in ("weights", "moments")}
    print(f"step-6 checkpoints of the same run by Fabric and by the Trainer, both loaded by Fabric on DP2: eval "
          f"loss {fabric_final['eval_loss']:.6f} vs {trainer_final['eval_loss']:.6f}, max |diff| {diffs}")
    assert fabric_final["steps"] == trainer_final["steps"] == [6]
    zero = gpt["final"]["fabric_into_zero"]  # the same checkpoint into the distributed optimizer
    print(f"... and into the distributed optimizer: eval loss {zero['eval_loss']:.6f}, sum of AdamW's second "
          f"moments over DP {zero['moment_sum']:.9g} vs {fabric_final['moment_sum']:.9g}")
    assert zero["steps"] == [6] and abs(zero["eval_loss"] - fabric_final["eval_loss"]) <= 1e-6
    assert zero["moment_sum"] == pytest.approx(fabric_final["moment_sum"], rel=1e-9)
    assert abs(fabric_final["eval_loss"] - trainer_final["eval_loss"]) <= 1e-6 and max(diffs.values()) <= 1e-6
    assert gpt["training_step"]["grads"] and 5.0 < gpt["training_step"]["loss"] < 6.0  # MHCGPTModule.training_step
    refused = gpt["refused"]
    assert refused["missing"].startswith("FileNotFoundError") and "does not exist" in refused["missing"]
    assert refused["unfinished"].startswith("IncompleteCheckpointError") and "metadata.json" in refused["unfinished"]
    assert refused["other_model"].startswith("ConfigError") and "does not fit this model" in refused["other_model"]
    assert "Set up the module first" in gpt["refused"]["optimizer_before_stage"]
    assert "pipeline contract" in gpt["refused"]["plain_module_tp"]
    assert "forward_backward" in gpt["refused"]["backward_on_pipeline"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1], ids=["first_stage_the_launcher", "last_stage"])
def test_an_uncaught_exception_in_a_fabric_loop_ends_every_rank_naming_it(tmp_path, rank):
    """PP 2 under Fabric's launcher: rank ``rank`` raises at step 2 and nothing catches it. Every
    rank ends within seconds (not the 10-minute timeout), no process is left, and the other
    rank's error names the failed rank and its exception (published from ``sys.excepthook``:
    Fabric has no ``on_exception``; rank 0 hosts the store, so it lingers two polls before it
    exits)."""
    import time

    stamp = tmp_path / "failed_at"
    proc = run_script("fabric_fail.py", "--fail-rank", str(rank), "--stamp", str(stamp), timeout=120)
    since = time.time() - float(stamp.read_text())
    print(f"rank {rank} raised: every rank ended {since:.1f} s later")
    assert proc.returncode != 0 and since < 20, since
    other = 1 - rank
    assert (f"PeerFailure: rank {other} (TP rank 0, PP rank {other}, DP rank 0) stops: rank {rank} (TP rank 0, "
            f"PP rank {rank}, DP rank 0) failed: RuntimeError: boom on rank {rank} at step 2") in proc.stderr, \
        proc.stderr[-4000:]
    assert not left_behind(proc.pgid), "processes left behind"


@pytest.mark.slow
def test_fabric_context_parallel_equals_one_process(tmp_path):
    """examples/fabric_train.py with --cp 2 on 2 processes (mhc_block, dropout 0): the one-process
    loop's losses within 1e-5. Its subject is what CP computes, so both runs are ranks forked from
    the preloaded server (``run_on_ranks``, as under torchrun): how the example's processes start
    is the two tests above, which launch it as written and under torchrun."""
    common = ("--tp", "1", "--pp", "1", "--dropout", "0", "--steps", "3", "--save-every", "0")
    runs = {}
    for name, devices, cp in (("single", 1, ()), ("cp2", 2, ("--cp", "2"))):
        out = tmp_path / f"{name}.json"
        run_on_ranks(str(EXAMPLE), devices, "--devices", str(devices), *cp, *common, "--out", str(out), cwd=tmp_path,
                     timeout=300)
        runs[name] = {int(k): v for k, v in json.loads(out.read_text()).items()}
    single, cp2 = runs["single"], runs["cp2"]
    assert sorted(single) == sorted(cp2) == [1, 2, 3]
    diff = max(abs(single[s] - cp2[s]) for s in single)
    print(f"Fabric CP 2 vs one process (mhc_block, dropout 0), 3 steps: max |loss diff| = {diff:.3g}")
    assert diff < 1e-5 and len(set(single.values())) > 1
