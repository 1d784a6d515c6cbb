"""MHCParallelStrategy, MHCRecomputeCallback and MHCGPTModule under Lightning (CPU, gloo).

Multi-device runs are scripts (tests/scripts/): Lightning's subprocess launcher
re-runs the script once per extra device, as it does for users.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mhc import ConfigError, MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.checkpoint import commit
from lightning_mhc.checkpoint.format import LEGACY_FORMAT
from lightning_mhc.checkpoint import format as checkpoint_format
from lightning_mhc.distributed.pipeline.protocol import split_microbatches
from lightning_mhc.distributed.fail_fast import FailFast, PeerFailure
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.testing.launch import free_port
from script_runs import SCRIPTS, fit_gpt, left_behind, run_on_ranks, run_script
from subprocess_env import child_env


def test_tp2_pp2_matches_one_device(tmp_path):
    """devices=4, TP=2, PP=2, mhc_block recompute == devices=1 on the same global batches; and
    the same with sequence parallelism and two virtual-pipeline chunks per stage (interleaved
    1F1B) through Trainer.fit."""
    single = fit_gpt(tmp_path / "one", "--devices", "1", "--scenario", "equivalence")
    parallel = fit_gpt(tmp_path / "four", "--devices", "4", "--tp", "2", "--pp", "2", "--scenario", "equivalence",
                       "--then-sp-v2")  # a second Trainer in the same 4 processes
    assert len(single["losses"]) == len(parallel["losses"]) == len(parallel["losses_sp_v2"]) == 6
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(single["losses"]), rtol=0, atol=1e-5)
    assert single["losses"][3] < single["losses"][0]  # it trains
    torch.testing.assert_close(torch.tensor(parallel["losses_sp_v2"]), torch.tensor(single["losses"]), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("devices, tp, pp", [(1, 1, 1), (2, 1, 2)], ids=["single", "pp2"])
def test_resume_mid_epoch_is_exact(tmp_path, devices, tp, pp):
    """7 uninterrupted steps (shuffled loader, 3 per epoch, dropout 0.1, mhc_block) vs resuming
    from the step checkpoints of steps 2 and 4 (mid-epoch) and 6 (an epoch boundary), and from
    the end-of-epoch checkpoint (on_train_epoch_end) of step 3. (TP 2 x PP 2 resumes exactly through
    lightning-mhc-train: tests/test_entry_point.py.)"""
    result = fit_gpt(tmp_path, "--devices", str(devices), "--tp", str(tp), "--pp", str(pp), "--scenario", "resume")
    uninterrupted = torch.tensor(result["uninterrupted"])
    assert len(uninterrupted) == 7
    assert sorted(result["resumed"]) == ["2", "4", "6", "epoch_end_3"]
    for name, resumed in result["resumed"].items():
        step = int(name.removeprefix("epoch_end_"))
        assert len(resumed) == 7 - step, name
        diff = (torch.tensor(resumed) - uninterrupted[step:]).abs().max().item()
        print(f"Trainer.fit TP={tp} PP={pp}, resumed from {name}: max |loss - uninterrupted| = {diff:.3g}")
        torch.testing.assert_close(torch.tensor(resumed), uninterrupted[step:], rtol=0, atol=1e-6,
                                   msg=lambda m: f"resumed from {name}: {m}")
    expected = {"metadata.json", ".metadata", "trainer_state.pt"} | {f"rng_rank{r}.pt" for r in range(devices)} | {
        f"__{r}_0.distcp" for r in range(devices)}
    assert set(result["checkpoint_files"]) == expected


def test_boring_model_trains_data_parallel(tmp_path):
    out = tmp_path / "boring.json"
    proc = run_script("fit_boring.py", str(out))
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["global_step"] == 4 and len(result["val"]) == 1
    assert result["replicas_identical"]  # replicas started from rank 0 and were averaged
    assert result["sampler_ranks"] == {"num_replicas": 2, "rank": 0}
    # gloo left to interpreter finalization can abort a finished run (SIGABRT): the strategy's
    # exit hook destroys the group first, in both processes
    assert proc.stderr.count("process group alive at exit: False") == 2, proc.stderr[-3000:]


def test_boring_model_under_torchrun(tmp_path):
    """Processes started by torchrun (TorchElasticEnvironment): the strategy joins them."""
    out = tmp_path / "boring.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "fit_boring.py"), str(out)],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["global_step"] == 4 and result["replicas_identical"]


@pytest.mark.slow
@pytest.mark.parametrize("rank, layout, where", [
    (0, ["--pp", "2"], "PP 2: the first stage, the launching process"),
    (1, ["--pp", "2"], "PP 2: the last stage"),
    (1, ["--tp", "2"], "TP 2: one TP rank, its peer in a TP collective")], ids=["first", "last", "tp_rank"])
def test_an_exception_on_one_rank_ends_every_rank_within_seconds(tmp_path, rank, layout, where):
    """2 processes, the strategy's default 10-minute timeout: rank ``rank`` raises inside the
    schedule at step 2 and its process stays alive afterwards (as the CLI's launcher does while it
    waits for its ranks), so its peer cannot learn of it from a closed connection, whether it
    waits in a point-to-point receive (PP) or a collective (TP). The other rank stops within
    seconds, saying which rank failed with what; no process is left."""
    out = tmp_path / "result.json"
    proc = run_script("fit_gpt.py", "--devices", "2", *layout, "--scenario", "fail", "--timeout", "600",
                      "--fail-rank", str(rank), "--linger", "120", "--out", str(out), timeout=110)
    ended = time.time()
    assert proc.returncode != 0
    since = ended - float((tmp_path / "failed_at").read_text())
    print(f"rank {rank} ({where}) raised: every rank ended {since:.1f} s later")
    assert since < 20, since
    boom = f"failed: RuntimeError: boom on rank {rank} at step 2"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lightning_mhc: rank ")]
    assert any(line.startswith(f"lightning_mhc: rank {rank} (") and line.endswith(boom) for line in lines), lines
    other = 1 - rank
    assert any(line.startswith(f"lightning_mhc: rank {other} (") and f"stops: rank {rank} (" in line
               and line.endswith(boom) for line in lines), (other, lines)
    assert not left_behind(proc.pgid), "processes left behind"


def test_the_fail_fast_watch_is_one_per_process_and_ends_before_the_interpreter():
    """A second run's watch replaces the first's, and the watch thread is joined before shutdown:
    a daemon thread returning from a store call into a finalizing interpreter aborts the process
    (exit 134), which failed finished runs."""
    env = {**child_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fail_fast_exit.py")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["watches: 1", "watch alive at shutdown: []"], proc.stdout


def test_fail_fast_names_the_failed_peer_only_for_errors_of_the_wait():
    """A rank waiting on its peers after another failed: gloo's error becomes PeerFailure naming
    both; this rank's own error (a refusal every rank raises) stays itself."""
    watch = FailFast()
    watch._seen = "rank 0 (TP rank 0, PP rank 0, DP rank 0) failed: ValueError: bad"
    with pytest.raises(PeerFailure, match=r"rank 0 stops: rank 0 \(TP rank 0.*failed: ValueError: bad"):
        with watch.waiting():
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(ConfigError, match="needs labels"):
        with watch.waiting():
            raise ConfigError("needs labels")


# ------------------------------------------------------------------ in-process checks
def _tiny_module(cls=MHCGPTModule, **config) -> MHCGPTModule:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                max_sequence_length=8, hidden_dropout=0.0, attention_dropout=0.0)
    return cls({**base, **config})


def _trainer(strategy, callbacks=()):
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks))


def test_bad_layout_fails_when_the_trainer_is_made():
    """The world (devices x nodes) is known when the Trainer is made: a layout it cannot hold is
    refused there, before any process starts."""
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 \* pipeline_model_parallel_size=2 = 4 "
                                          r"does not divide world_size=1"):
        _trainer(MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))


def test_plain_module_cannot_ask_for_model_parallelism():
    """What every process checks when it starts, before the rendezvous (``runtime.start``)."""
    strategy = MHCParallelStrategy(tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match="BoringModel does not implement the pipeline contract"):
        strategy.runtime.check_module(BoringModel())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(policy="mhc_block", recompute_modules=["layernorm", "mlp"]), "Remove 'mlp'"),
        (dict(policy="nonsense"), "policy='nonsense' is not a recompute policy"),
        (dict(policy="full", recompute_modules=["layernorm"]), "only used by the 'selective' and 'mhc_block'"),
    ],
)
def test_bad_policy_fails_at_construction(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MHCRecomputeCallback(**kwargs)


def test_mhc_block_without_hyper_connections_fails_before_training():
    trainer = _trainer(MHCParallelStrategy(), [MHCRecomputeCallback("mhc_block")])
    with pytest.raises(ConfigError, match="needs enable_hyper_connections=True"):
        trainer.fit(_tiny_module(enable_hyper_connections=False, num_residual_streams=1))
    assert trainer.global_step == 0


def test_a_gradient_scaler_is_refused_before_training():
    """``16-mixed`` scales the loss on CUDA, but the pipeline schedule runs the backward itself,
    unscaled: the Trainer refuses it before any step, as Fabric's ``forward_backward`` does. (On CPU
    Lightning's 16-mixed has no scaler, so the plugin is given one here, as CUDA's would be.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaling = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, plugins=[scaling])
    with pytest.raises(ConfigError, match="without a gradient scaler: use precision='bf16-mixed'"):
        trainer.fit(_tiny_module())
    assert trainer.global_step == 0


def test_strategy_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "mhc_parallel" in StrategyRegistry
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="mhc_parallel", logger=False)
    assert isinstance(trainer.strategy, MHCParallelStrategy)


def test_split_microbatches():
    batch = dict(tokens=torch.arange(12).view(6, 2), labels=torch.arange(12).view(6, 2), note="x")
    parts = split_microbatches(batch, 3)
    assert [p["tokens"].shape for p in parts] == [(2, 2)] * 3 and parts[1]["note"] == "x"
    with pytest.raises(ValueError, match="num_microbatches=4"):
        split_microbatches(batch, 4)


def test_incomplete_or_mismatched_checkpoint(tmp_path):
    layout = ParallelLayout(2, 2, world_size=4, tensor_model_parallel_rank=0, pipeline_model_parallel_rank=0,
                            data_parallel_rank=0)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "model_tp0_pp0.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="metadata.json is missing"):
        checkpoint_format.load(tmp_path / "partial", None, [], layout, 0)
    done = tmp_path / "done"  # the earlier per-(tp, pp) format: refused on any layout, naming the conversion
    done.mkdir()
    commit.write_metadata(done, dict(format=LEGACY_FORMAT, world_size=2, tensor_model_parallel_size=1,
                                     pipeline_model_parallel_size=2, data_parallel_size=1))
    with pytest.raises(ConfigError, match=r"per-\(tp, pp\) format .* saved on TP=1 x PP=2\), which no loader reads: "
                                          r"convert it once with torchrun --nproc-per-node 2 -m lightning_mhc.cli.convert"):
        checkpoint_format.load(done, None, [], layout, 0)


def _fit_in_process(module, precision="32-true", **strategy_kwargs) -> pl.Trainer:
    from torch.utils.data import DataLoader

    from lightning_mhc.data.sources import SyntheticTokens

    data = DataLoader(SyntheticTokens(8, 8, vocab_size=64), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(**strategy_kwargs),
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         precision=precision, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    return trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_precisions_and_logged_metrics(precision):
    trainer = _fit_in_process(_tiny_module(), precision=precision)
    metrics = trainer.callback_metrics
    for key in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "max_rss_mb"):
        assert key in metrics, (key, sorted(metrics))
    assert torch.isfinite(metrics["train_loss"]) and torch.isfinite(metrics["val_loss"])


def test_distributed_sampler_for_other_ranks_is_refused():
    """A user's DistributedSampler must split over the data-parallel group, not the world."""
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_mhc.data.sources import SyntheticTokens

    data = SyntheticTokens(8, 8, vocab_size=64)
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    trainer = _trainer(MHCParallelStrategy())
    with pytest.raises(ConfigError, match="num_replicas=2, rank=1, but this process is data-parallel rank 0 of 1"):
        trainer.fit(_tiny_module(), train_dataloaders=loader)
    assert trainer.global_step == 0


def test_throughput_meter_counts_whole_job_tokens_after_warmup():
    from lightning_mhc.lightning.modules.throughput import ThroughputMeter

    meter = ThroughputMeter(warmup_steps=1)
    assert not meter.record(10.0, 100)  # warm-up
    for seconds in (1.0, 2.0, 4.0, 1.0, 100.0):
        assert meter.record(seconds, 400)
    summary = meter.summary()
    assert summary["timed_steps"] == 5 and summary["tokens_per_sec"] == 200.0 and summary["step_time_ms"] == 2000.0
    assert summary["tokens_per_sec_p25"] <= 200.0 <= summary["tokens_per_sec_p75"]
    meter.start_fit()
    assert not meter.record(1.0, 400)  # a new fit warms up again


class _NaNLoss(MHCGPTModule):
    def loss_func(self, per_token_loss, microbatch):
        return per_token_loss.mean() * float("nan")


def test_nonfinite_loss_is_reported_with_the_step():
    """Stops by default (FloatingPointError naming the step); with raise_on_nonfinite_loss=False
    it warns and skips the optimizer step, so the weights never become NaN."""
    with pytest.raises(FloatingPointError, match="non-finite training loss nan at global step 0"):
        _fit_in_process(_tiny_module(_NaNLoss))
    module = _tiny_module(_NaNLoss)
    with pytest.warns(UserWarning, match="non-finite gradient norm nan at global step 0.*optimizer step skipped"):
        with pytest.warns(UserWarning, match="non-finite training loss nan at global step 0"):
            _fit_in_process(module, raise_on_nonfinite_loss=False)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_nonfinite_gradient_of_a_plain_module_stops_training():
    """A plain LightningModule's loss is not checked, but its NaN gradients are (global norm)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class NaNBoring(BoringModel):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)["loss"] * float("nan")

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    with pytest.raises(FloatingPointError, match="non-finite gradient norm nan at global step 0"):
        trainer.fit(NaNBoring())


def _idioms(tmp_path, devices: int) -> dict:
    out = tmp_path / f"devices{devices}" / "result.json"
    out.parent.mkdir(parents=True)
    run_on_ranks("fit_idioms.py", devices, "--devices", str(devices), "--out", str(out), timeout=600)
    return json.loads(out.read_text())


def test_lightning_idioms_on_pp2_and_tp2_match_one_process(tmp_path):
    """What users write around fit (tests/scripts/fit_idioms.py), on PP 2 and TP 2 against one
    process: a LightningDataModule, gradient accumulation, ModelCheckpoint(monitor="val_loss",
    save_top_k=2), LearningRateMonitor; after fit, on the same Trainer: save_checkpoint, validate,
    test, a second fit resuming from the saved checkpoint, predict (refused with its reason where
    the model is split); a bf16-mixed Trainer stopped by EarlyStopping on every rank."""
    (single,) = _idioms(tmp_path, 1).values()
    both = _idioms(tmp_path, 2)
    assert "predict" in single and len(single["predict"]) == 1  # one process generates
    for name in ("pp2", "tp2"):
        run = both[name]
        losses = run["losses"] + run["resumed_losses"]
        reference = single["losses"] + single["resumed_losses"]
        assert len(run["losses"]) == 12 and len(run["resumed_losses"]) == 4 and run["global_step"] == 8, name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=1e-5)
        assert {"metadata.json", "__0_0.distcp", "__1_0.distcp"} <= set(run["saved"])
        for key in ("validate", "test", "best_score"):
            assert abs(run[key] - single[key]) <= 1e-5, (name, key, run[key], single[key])
        assert run["top_k"] == single["top_k"] and len(run["top_k"]) == 2
        assert "predict_step generates with the whole model" in run["predict_refused"]
        assert {"lr-AdamW/pg1", "train_loss", "val_loss", "test_loss"} <= set(run["logged"])
        assert run["early_stopped_at"] == single["early_stopped_at"] == 4  # of max_steps=20
        gap = max(abs(a - b) for a, b in zip(run["bf16_mixed_losses"], single["bf16_mixed_losses"]))
        print(f"{name}: idioms against one process, max |loss diff| fp32 "
              f"{max(abs(a - b) for a, b in zip(losses, reference)):.2g}, bf16-mixed {gap:.2g}")
        assert gap <= 2e-3  # bf16 autocast: the layouts round partial sums differently (measured 1.5e-4)
