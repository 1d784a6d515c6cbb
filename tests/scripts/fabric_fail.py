"""A Fabric loop on PP 2 (2 processes, Fabric's launcher re-runs this script) in which one rank
raises at step 2, nothing catching it: every rank must end within seconds, and the other one
must name the failed rank and its exception (fail fast through ``sys.excepthook``; Fabric has
no ``on_exception``).

    python fabric_fail.py --fail-rank 1 --stamp failed_at
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from lightning.fabric import Fabric

from lightning_mhc import MHCGPTModule
from lightning_mhc.fabric import MHCParallelStrategy

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import fabric_train as example  # noqa: E402  (its model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--stamp", type=pathlib.Path, required=True, help="the time of the failure is written here")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=MHCParallelStrategy(pipeline_model_parallel_size=2))
    fabric.launch()
    module = MHCGPTModule(example.model_config(0.0))
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
    tokens = torch.randint(0, 256, (8, example.SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    for step in range(1, 6):
        if step == 2 and fabric.global_rank == args.fail_rank:
            args.stamp.write_text(str(time.time()))
            raise RuntimeError(f"boom on rank {args.fail_rank} at step 2")
        fabric.strategy.forward_backward(model, batch)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
