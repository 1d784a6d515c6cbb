"""The smallest mHC training loop with Lightning Fabric: TP 2 x PP 2 on 4 CPU processes.

    python examples/fabric_train.py                                   # 6 steps, checkpoint every 3
    python examples/fabric_train.py --resume fabric_ckpt/step-3       # continue from step 3

Fabric starts the 4 processes (it re-runs this script); ``MHCParallelStrategy`` builds the
TP/PP/DP groups, ``fabric.setup_module`` builds this rank's pipeline stage with mHC block
recompute, and ``fabric.strategy.forward_backward`` runs the 1F1B schedule over the batch's
microbatches and reduces the gradients. Checkpoints are reshardable: ``--resume`` works under
another ``--tp`` / ``--pp`` too (exactly with ``--dropout 0``: dropout streams are per layout).
``--cp 2`` splits each sequence over 2 ranks (context parallelism; ``--devices`` = TP x CP x PP x DP).
"""
from __future__ import annotations

import argparse
import json

from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule
from lightning_mhc.fabric import MHCParallelStrategy
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH, NUM_SAMPLES = 16, 8, 24
LR, WARMUP_STEPS, MAX_GRAD_NORM = 1e-3, 2, 1.0


def model_config(dropout: float) -> dict:
    return dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                max_sequence_length=SEQ, hidden_dropout=dropout, attention_dropout=dropout,
                mhc_sinkhorn_iterations=4)


def cycle(loader):
    """Endless batches; each pass over ``loader`` is a new epoch (Fabric reshuffles its sampler)."""
    while True:
        yield from loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--ckpt-dir", default="fabric_ckpt")
    parser.add_argument("--resume", help="a checkpoint directory to continue from")
    parser.add_argument("--out", help="write {step: loss} as JSON here (rank 0)")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=MHCParallelStrategy(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, context_parallel_size=args.cp))
    fabric.launch()

    module = MHCGPTModule(model_config(args.dropout), lr=LR, warmup_steps=WARMUP_STEPS, recompute_policy="mhc_block")
    model = fabric.setup_module(module)  # builds this rank's stage; the optimizer comes after
    optimization = module.configure_optimizers(max_steps=args.steps)  # AdamW + warm-up/cosine
    optimizer = fabric.setup_optimizers(optimization["optimizer"])
    scheduler = optimization["lr_scheduler"]["scheduler"]
    data_parallel = fabric.strategy.layout.data_parallel_size
    loader = fabric.setup_dataloaders(  # each data-parallel rank gets its own samples
        DataLoader(SyntheticTokens(NUM_SAMPLES, SEQ), batch_size=GLOBAL_BATCH // data_parallel, shuffle=True))

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, step=0)
    if args.resume:
        fabric.load(args.resume, state)  # any layout's checkpoint; restores state["step"] too
    batches = cycle(loader)
    for _ in range(state["step"]):  # skip the batches the saved run consumed
        next(batches)

    losses = {}
    while state["step"] < args.steps:
        loss = fabric.strategy.forward_backward(model, next(batches))  # 1F1B + gradient reduction
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_GRAD_NORM)  # global norm
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        losses[state["step"]] = loss.item()
        fabric.print(f"step {state['step']}: loss {loss.item():.6f}, grad norm {norm.item():.4f}")
        if args.save_every and state["step"] % args.save_every == 0:
            fabric.save(f"{args.ckpt_dir}/step-{state['step']}", state)

    if args.out and fabric.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
