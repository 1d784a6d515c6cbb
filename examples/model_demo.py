"""Forward/backward demo of the mHC GPT model on CPU, with optional tensor parallelism.

    python examples/model_demo.py                 # one process
    python examples/model_demo.py --tp 2          # two gloo ranks, tensor parallel

Trains ``conf/model/tiny.yaml`` for a few AdamW steps on the bytes of a
Python standard-library source file and prints the loss, which must fall.
"""
from __future__ import annotations

import argparse
import pathlib
import time

import torch
from omegaconf import OmegaConf

import lightning_mhc  # noqa: F401  (before megatron: silences its Transformer Engine/Apex notice)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def byte_batches(batch_size: int, seq_len: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows of a stdlib source file: tokens are bytes, labels the next byte."""
    import textwrap

    data = torch.tensor(list(pathlib.Path(textwrap.__file__).read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        window = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        batches.append((window[:, :-1], window[:, 1:]))
    return batches


def train(rank: int, world_size: int, args: argparse.Namespace) -> list[float]:
    from megatron.core import parallel_state

    from lightning_mhc.model import GPTModel, MHCTransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    config = MHCTransformerConfig(**OmegaConf.to_container(OmegaConf.load(args.model_config)))
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"mHC GPT: {config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_residual_streams} residual streams, TP={args.tp}, "
              f"{n_params:,} parameters on rank 0", flush=True)
    torch.manual_seed(1234)
    losses = []
    start = time.perf_counter()
    for step, (tokens, labels) in enumerate(byte_batches(args.batch_size, args.seq_len, args.steps)):
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            tok_s = (step + 1) * tokens.numel() / (time.perf_counter() - start)
            print(f"step {step:3d}  loss {loss.item():.4f}  {tok_s:,.0f} tokens/s", flush=True)
    parallel_state.destroy_model_parallel()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=str(ROOT / "conf/model/tiny.yaml"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    import os

    from lightning_mhc.parallel.launch import spawn_ranks

    threads = max(1, (os.cpu_count() or 1) // args.tp)
    losses = spawn_ranks(train, args.tp, args, timeout_s=900, threads_per_rank=threads)[0]
    first, last = losses[0], sum(losses[-5:]) / len(losses[-5:])
    print(f"loss {first:.4f} -> {last:.4f} (mean of the last 5 steps)")
    if not last < first:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
