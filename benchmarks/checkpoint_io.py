"""Checkpoint save and load time and bytes per layout, for the ``small`` model (conf/model/small.yaml).

    python benchmarks/checkpoint_io.py [--layouts 1,tp2,pp2,tp2pp2] [--rounds 3] [--out PATH]

Each layout is a real ``Trainer.fit`` (devices = TP x PP, AdamW, one optimizer step) under
``MHCParallelStrategy``; at the end of training every rank saves the checkpoint (the crash-safe
DCP save: staging, commit) and loads it back (``strategy.load_checkpoint``: the DCP read of
this rank's pieces plus the optimizer state), ``--rounds`` times; medians of rank 0's wall
times, between barriers. Then the TP 2 x PP 2 checkpoint (or the last layout's) is read in
one process: ``MHCGPTModule.load_from_checkpoint`` and ``lightning-mhc-export``.

Bytes are the checkpoint directory's (model + AdamW moments + steps in fp32, RNG and trainer
state). Writes JSON (default ``benchmarks/results/checkpoint_io.json``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, median, write_json

LAYOUTS = {"1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2), "dp2": (1, 1, 2)}
SEQ = 256


def small_config() -> dict:
    import yaml

    from lightning_mhc.cli.config_store import CONF_DIR

    config = yaml.safe_load((CONF_DIR / "model" / "small.yaml").read_text())
    return {**config, "vocab_size": config["vocab_size"] or 256}  # null there: the data's (SyntheticTokens: 256)


def worker(args) -> None:
    """One layout: fit one step, then time save + load on every rank (rank 0 writes the result)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCGPTModule, MHCParallelStrategy
    from lightning_mhc.data.sources import SyntheticTokens

    tp, pp = args.tp, args.pp
    devices = tp * pp * args.dp

    class TimeCheckpoints(Callback):
        def on_train_end(self, trainer, module) -> None:
            saves, loads = [], []
            for r in range(args.rounds):
                path = args.workdir / f"{args.name}.ckpt"
                dist.barrier()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                dist.barrier()
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                checkpoint = trainer.strategy.load_checkpoint(path)
                trainer.strategy.load_model_state_dict(checkpoint)
                trainer.strategy.load_optimizer_state_dict(checkpoint)
                dist.barrier()
                loads.append(time.perf_counter() - start)
            if trainer.global_rank == 0:
                size = sum(p.stat().st_size for p in path.iterdir())
                result = dict(layout=args.name, devices=devices, save_s=median(saves), load_s=median(loads),
                              bytes=size, files=len(list(path.iterdir())), saves=saves, loads=loads,
                              parameters=sum(p.numel() for p in module.parameters()))
                (args.workdir / f"{args.name}.json").write_text(json.dumps(result))

    loader = DataLoader(SyntheticTokens(2 * args.dp, SEQ), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[TimeCheckpoints()],
                         strategy=MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    trainer.fit(MHCGPTModule(small_config(), warmup_steps=1), train_dataloaders=loader)


def one_process(path: pathlib.Path, workdir: pathlib.Path) -> dict:
    """Load the whole module from ``path`` and export it, each in a fresh process."""
    code = ("import time, sys; t = time.perf_counter(); from lightning_mhc import MHCGPTModule; "
            "m = MHCGPTModule.load_from_checkpoint(sys.argv[1]); print(time.perf_counter() - t)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    load_process = time.perf_counter() - start
    load_call = float(proc.stdout.strip().splitlines()[-1])
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lightning_mhc.cli.export", str(path), str(workdir / "export")],
                   capture_output=True, text=True, check=True)
    export_process = time.perf_counter() - start
    weights = workdir / "export" / "model.safetensors"
    return dict(load_from_checkpoint_s=load_call, load_from_checkpoint_process_s=load_process,
                export_process_s=export_process, export_bytes=weights.stat().st_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="1,tp2,pp2,tp2pp2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "checkpoint_io.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for name in args.layouts.split(","):
            tp, pp, *dp = LAYOUTS[name]
            subprocess.run([sys.executable, __file__, "--worker", "--name", name, "--tp", str(tp), "--pp", str(pp),
                            "--dp", str(dp[0] if dp else 1), "--rounds", str(args.rounds), "--workdir", str(workdir)],
                           check=True, capture_output=True, text=True)
            rows.append(json.loads((workdir / f"{name}.json").read_text()))
            row = rows[-1]
            print(f"{name:>7}: {row['devices']} ranks, {row['bytes']:,} bytes in {row['files']} files, "
                  f"save {row['save_s']:.3f} s, load {row['load_s']:.3f} s", flush=True)
        whole = one_process(workdir / f"{rows[-1]['layout']}.ckpt", workdir)
        print(f"one process from {rows[-1]['layout']}: load_from_checkpoint {whole['load_from_checkpoint_s']:.2f} s "
              f"(process {whole['load_from_checkpoint_process_s']:.2f} s), lightning-mhc-export process "
              f"{whole['export_process_s']:.2f} s, {whole['export_bytes']:,} bytes of safetensors")
    write_json(args.out, dict(model="small", seq_length=SEQ, rounds=args.rounds, layouts=rows, one_process=whole))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
