"""Lightning runs of MHCGPTModule for the strategy tests: on ranks forked by
``script_runs.run_on_ranks`` (``fit_gpt``), or launched as a script where the launch is the
subject (``--scenario fail``: Lightning's subprocess launcher re-runs it once per extra device).

    python fit_gpt.py --devices 4 --tp 2 --pp 2 [--sp] [--vp 2] --scenario equivalence --out losses.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH, STEPS_PER_EPOCH = 16, 8, 3


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class FinalCheckpointAndLogits(Callback):
    """At the end of training (before the strategy tears down): save ``final.ckpt`` and the
    logits of a fixed batch computed on the training layout (vocab-parallel pieces gathered)."""

    def __init__(self, out_dir: pathlib.Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, module) -> None:
        import torch
        import torch.distributed as dist

        trainer.save_checkpoint(self.out_dir / "final.ckpt")
        tokens = torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(0))
        captured = []

        def logits_step(microbatch, chunk=0):
            stage = module.model_chunks()[chunk]
            return stage(microbatch["tokens"] if stage.pre_process else None)  # no labels: logits [b, s, V/tp]

        module.forward_step = logits_step
        module.loss_func = lambda output, mb: (captured.append(output.detach().clone()), output.sum() * 0)[1]
        trainer.strategy.forward_backward(module, {"tokens": tokens, "labels": tokens}, forward_only=True)
        del module.forward_step, module.loss_func
        layout = trainer.strategy.layout
        if captured:  # the last stage: gather the vocabulary over TP
            logits = torch.cat(captured, dim=0)
            pieces = [torch.empty_like(logits) for _ in range(layout.tensor_model_parallel_size)]
            dist.all_gather(pieces, logits.contiguous(), group=layout.tp_group)
            if layout.tensor_model_parallel_rank == 0 and layout.data_parallel_rank == 0:
                torch.save(dict(tokens=tokens, logits=torch.cat(pieces, dim=-1)), self.out_dir / "logits.pt")


class FailingModule(MHCGPTModule):
    """Raises inside the schedule, in the forward of a microbatch of step 2, on rank
    ``FAIL_RANK`` only; writes the time of the raise to ``FAILED_AT`` (if set)."""

    FAIL_RANK, FAILED_AT = 1, None

    def forward_step(self, microbatch, chunk=0):
        if self.global_step == 1 and self.trainer.global_rank == self.FAIL_RANK:
            if self.FAILED_AT:
                pathlib.Path(self.FAILED_AT).write_text(repr(__import__("time").time()))
            raise RuntimeError(f"boom on rank {self.FAIL_RANK} at step 2")
        return super().forward_step(microbatch, chunk)


class SGDModule(MHCGPTModule):
    """A user's own optimizer: SGD with momentum, no scheduler."""

    def configure_optimizers(self):
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StateBytes(Callback):
    """At the end of training: every rank's optimizer-state bytes, in rank order, and how many of
    the distributed optimizer's buckets started reducing during the last backward (rank 0)."""

    def __init__(self) -> None:
        self.per_rank: list[int] = []
        self.overlapped: int | None = None

    def on_train_end(self, trainer, module) -> None:
        import torch.distributed as dist

        runtime = trainer.strategy.runtime
        mine = runtime.optimizer_state_bytes(trainer.optimizers)
        self.per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(self.per_rank, mine)
        if runtime.distributed_optimizer is not None:
            self.overlapped = runtime.distributed_optimizer.overlapped_buckets


ZERO_STEPS, ZERO_SAVE_AT = 6, 3
"""The distributed optimizer's runs: steps, and the step of the checkpoints resumed from
(tests/test_distributed_optimizer.py reads the same numbers)."""


def zero_runs(args, layouts: dict, ckpt: pathlib.Path | None, out_dir: pathlib.Path) -> dict:
    """Each layout of ``layouts`` with and without the distributed optimizer: ``ZERO_STEPS`` AdamW
    steps with clipping (losses, optimizer-state bytes per rank); SGD with momentum on the first;
    with ``ckpt`` (saved at step ``ZERO_SAVE_AT``): the steps after it, with and without."""
    result = {}
    for name, layout in layouts.items():
        for zero in (False, True):
            state = StateBytes()
            key = f"{name}{'_zero' if zero else ''}"
            saving = zero and name in ("dp4", "tp2_dp2")
            ckpt_dir = out_dir / f"{key}_ckpt" if saving else None
            result[key], trainer = fit(args, ZERO_STEPS, dropout=0.0, layout=layout, use_distributed_optimizer=zero,
                                       extra_callbacks=[state], ckpt_dir=str(ckpt_dir) if saving else None,
                                       every_n_train_steps=ZERO_SAVE_AT, num_samples=80)
            result[f"{key}_state_bytes"] = state.per_rank
            result[f"{key}_overlapped_buckets"] = state.overlapped
            if saving:
                result[f"{key}_checkpoint"] = str(next(ckpt_dir.glob(f"*step={ZERO_SAVE_AT}.ckpt")))
    if "dp4" in layouts:  # its checkpoints onto other TP/PP layouts, with and without it
        for source, target, zero in (("dp4", "tp2_dp2", True), ("dp4", "pp2_dp2", True),
                                     ("tp2_dp2", "pp2_dp2", False), ("tp2_dp2", "dp4", True)):
            result[f"{source}_zero_to_{target}{'_zero' if zero else ''}"], trainer = fit(
                args, ZERO_STEPS, dropout=0.0, layout=layouts[target], use_distributed_optimizer=zero,
                ckpt_path=result[f"{source}_zero_checkpoint"], num_samples=80)
    first = next(iter(layouts.values()))
    for zero in (False, True):
        result[f"sgd{'_zero' if zero else ''}"], trainer = fit(args, ZERO_STEPS, dropout=0.0, layout=first, module_cls=SGDModule,
                                                             use_distributed_optimizer=zero, num_samples=80)
    if ckpt is not None:
        for zero in (False, True):
            result[f"resumed{'_zero' if zero else ''}"], trainer = fit(
                args, ZERO_STEPS, dropout=0.0, layout=first, use_distributed_optimizer=zero, ckpt_path=str(ckpt),
                num_samples=80)
    if args.devices == 2:  # every other recompute policy (mhc_block is the default)
        for policy in ("none", "full", "selective"):
            result[f"zero_{policy}"], trainer = fit(args, ZERO_STEPS, dropout=0.0, layout=first, use_distributed_optimizer=True,
                                                    num_samples=80, policy=policy)
    if args.devices <= 2:  # bf16 weights, fp32 main weights; with the distributed optimizer a resume
        for zero in (False, True):
            key, state = f"bf16{'_zero' if zero else ''}", StateBytes()
            bf16_ckpt = out_dir / f"{key}_ckpt"
            result[key], trainer = fit(args, ZERO_STEPS, dropout=0.0, layout=first, use_distributed_optimizer=zero,
                                       precision="bf16-true", num_samples=80, ckpt_dir=str(bf16_ckpt),
                                       every_n_train_steps=ZERO_SAVE_AT, extra_callbacks=[state])
            result[f"{key}_state_bytes"] = state.per_rank
            result[f"{key}_resumed"], trainer = fit(
                args, ZERO_STEPS, dropout=0.0, layout=first, use_distributed_optimizer=zero, precision="bf16-true",
                num_samples=80, ckpt_path=str(next(bf16_ckpt.glob(f"*step={ZERO_SAVE_AT}.ckpt"))))
    return result, trainer


def linger(seconds: float) -> None:
    """Keep this failed process alive as a launcher that waits for its ranks does (the CLI's
    ``_end_job``), so that its peers cannot learn of the failure from a closed connection:
    the launching process waits up to ``seconds`` for its children, another rank sleeps."""
    import os
    import subprocess
    import time

    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                                                     text=True).stdout.split()]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (not children or any(_alive(pid) for pid in children)):
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    import os

    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def model_config(dropout: float, **extra) -> dict:
    return dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                max_sequence_length=SEQ, hidden_dropout=dropout, attention_dropout=dropout,
                mhc_sinkhorn_iterations=4, **extra)


def fit(args, max_steps: int, dropout: float, ckpt_dir: str | None = None, ckpt_path: str | None = None,
        module_cls=MHCGPTModule, every_n_train_steps: int = STEPS_PER_EPOCH, layout: dict | None = None,
        model_extra: dict | None = None, extra_callbacks: list | None = None, config: dict | None = None,
        seq: int = SEQ, global_batch: int = GLOBAL_BATCH, num_samples: int = STEPS_PER_EPOCH * GLOBAL_BATCH,
        lr: float = 1e-3, warmup_steps: int = 2, max_grad_norm: float = 1.0, use_distributed_optimizer: bool = False,
        precision: str = "32-true", policy: str | None = None) -> list[float]:
    layout = layout or dict(tp=args.tp, pp=args.pp, sp=args.sp, vp=args.vp)
    dp = args.devices // (layout["tp"] * layout["pp"])
    loader = DataLoader(SyntheticTokens(num_samples, seq), batch_size=global_batch // dp, shuffle=True)
    recorder = LossRecorder()
    callbacks = [recorder, MHCRecomputeCallback(policy or args.policy), *(extra_callbacks or [])]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=every_n_train_steps))
        # Lightning's default kind too: saved in on_train_epoch_end
        callbacks.append(ModelCheckpoint(dirpath=f"{ckpt_dir}_epochs", save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=max_steps, logger=False, precision=precision,
        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=max_grad_norm,
        strategy=MHCParallelStrategy(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                                     sequence_parallel=layout["sp"], virtual_pipeline_model_parallel_size=layout["vp"],
                                     timeout=datetime.timedelta(seconds=args.timeout),
                                     use_distributed_optimizer=use_distributed_optimizer),
        callbacks=callbacks,
    )
    module = module_cls(config or model_config(dropout, **(model_extra or {})), lr=lr, warmup_steps=warmup_steps)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return recorder.losses, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--vp", type=int, default=1, help="virtual pipeline chunks per stage")
    parser.add_argument("--policy", default="mhc_block")
    parser.add_argument("--then-sp-v2", action="store_true",
                        help="equivalence: then, in the same processes, the same with SP and 2 virtual chunks")
    parser.add_argument("--scenario", choices=["equivalence", "resume", "reshard", "fail", "fabric_example", "zero"],
                        required=True)
    parser.add_argument("--steps", type=int, default=6, help="fabric_example: training steps")
    parser.add_argument("--ckpt", type=pathlib.Path, help="reshard: the checkpoint to continue from (else: save one)")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--fail-rank", type=int, default=1, help="fail: the rank that raises")
    parser.add_argument("--linger", type=float, default=0.0, help="fail: seconds the failed process stays alive")
    args = parser.parse_args()
    result = {}
    if args.scenario == "equivalence":
        result["losses"], trainer = fit(args, 6, dropout=0.0)
        if args.then_sp_v2:
            result["losses_sp_v2"], trainer = fit(args, 6, dropout=0.0, layout=dict(tp=args.tp, pp=args.pp, sp=True, vp=2))
    elif args.scenario == "resume":
        # 7 steps with a checkpoint every 2 (3 steps per epoch): resuming from step 2 and 4 starts
        # mid-epoch, from step 6 at an epoch boundary, from the end-of-epoch checkpoint of step 3
        # after a finished epoch; each must continue exactly as uninterrupted
        ckpt_dir = args.out.parent / "ckpt"
        result["uninterrupted"], trainer = fit(args, 7, dropout=0.1, ckpt_dir=str(ckpt_dir), every_n_train_steps=2)
        saved = {int(p.stem.split("step=")[1]): p for p in ckpt_dir.glob("*.ckpt")}
        result["checkpoint_files"] = sorted(p.name for p in saved[4].iterdir()) if 4 in saved else []
        saved["epoch_end_3"] = next(pathlib.Path(f"{ckpt_dir}_epochs").glob("*step=3.ckpt"))
        result["resumed"] = {}
        for step in (2, 4, 6, "epoch_end_3"):
            result["resumed"][step], trainer = fit(args, 7, dropout=0.1, ckpt_path=str(saved[step]))
    elif args.scenario == "reshard":
        # without --ckpt: 5 steps on TP 2 x PP 2 (4 devices) with a checkpoint at step 2 (mid-epoch),
        # then continue from it on TP 2 x PP 2, PP 2 x DP 2, PP 4 and TP 2 x SP x PP 2 x v 2; with
        # --ckpt: continue from it on --tp/--pp (steps 3 to 5). SwiGLU (a strided TP split) and
        # tied embeddings (a copy on the last stage)
        extra = dict(activation="swiglu", share_embeddings_and_output_weights=True)
        layouts = {"tp2_pp2": dict(tp=2, pp=2, sp=False, vp=1), "pp2_dp2": dict(tp=1, pp=2, sp=False, vp=1),
                   "pp4": dict(tp=1, pp=4, sp=False, vp=1), "tp2_sp_pp2_v2": dict(tp=2, pp=2, sp=True, vp=2)}
        if args.ckpt is None:
            ckpt_dir = args.out.parent / "ckpt"
            result["uninterrupted"], trainer = fit(args, 5, dropout=0.0, ckpt_dir=str(ckpt_dir), every_n_train_steps=2,
                                                   layout=layouts["tp2_pp2"], model_extra=extra,
                                                   extra_callbacks=[FinalCheckpointAndLogits(args.out.parent)])
            result["checkpoint"] = str(next(ckpt_dir.glob("*step=2.ckpt")))
            result["checkpoint_files"] = sorted(p.name for p in pathlib.Path(result["checkpoint"]).iterdir())
            for name, layout in layouts.items():
                result[name], trainer = fit(args, 5, dropout=0.0, ckpt_path=result["checkpoint"], layout=layout,
                                            model_extra=extra)
        else:
            result["continued"], trainer = fit(args, 5, dropout=0.0, ckpt_path=str(args.ckpt), model_extra=extra)
    elif args.scenario == "zero":
        # the distributed optimizer: DP 4, TP 2 x DP 2 (also with SP) and PP 2 x DP 2 (also with 2
        # virtual chunks) on 4 devices (DP 4 saves at step 5); DP 2 on 2 devices; one process;
        # --ckpt: continue from DP 4's checkpoint
        one = dict(tp=1, pp=1, sp=False, vp=1)
        layouts = {4: {"dp4": one, "tp2_dp2": dict(one, tp=2), "pp2_dp2": dict(one, pp=2),
                       "tp2_sp_dp2": dict(one, tp=2, sp=True), "pp2_v2_dp2": dict(one, pp=2, vp=2)},
                   2: {"dp2": one}, 1: {"single": one}}[args.devices]
        result, trainer = zero_runs(args, layouts, args.ckpt, args.out.parent)
    elif args.scenario == "fabric_example":
        # examples/fabric_train.py's run (model, data, optimizer, clipping, dropout 0.1, mhc_block)
        # through Trainer.fit: the Fabric loop must give the same losses
        sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
        import fabric_train as example

        ckpt_dir = args.out.parent / "ckpt"
        result["losses"], trainer = fit(
            args, args.steps, dropout=0.1, ckpt_dir=str(ckpt_dir), every_n_train_steps=args.steps,
            config=example.model_config(0.1), seq=example.SEQ,
            global_batch=example.GLOBAL_BATCH, num_samples=example.NUM_SAMPLES, lr=example.LR,
            warmup_steps=example.WARMUP_STEPS, max_grad_norm=example.MAX_GRAD_NORM)
        result["checkpoint"] = str(next(ckpt_dir.glob(f"*step={args.steps}.ckpt")))
    else:
        FailingModule.FAIL_RANK = args.fail_rank
        FailingModule.FAILED_AT = str(args.out.parent / "failed_at") if args.out else None
        try:
            result["losses"], trainer = fit(args, 6, dropout=0.0, module_cls=FailingModule)
        except RuntimeError:
            linger(args.linger)
            raise
    if trainer.global_rank == 0 and args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
