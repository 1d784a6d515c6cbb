"""Bring your own model against Lightning's ``ModelParallelStrategy``: the same tiny Hugging Face
Llama, tensor parallel over 2 processes, trained through ``Trainer.fit``.

    python benchmarks/byom_vs_model_parallel.py [--rounds 3] [--steps 12] [--out PATH]

- **user lines**: the code lines (no blank, comment or docstring lines) of the LightningModule a
  user writes for each, below: :class:`LightningTP` (the model in ``__init__``, a DTensor TP plan
  applied with ``parallelize_module`` on the strategy's ``tensor_parallel`` mesh, the loss and the
  optimizer) and :class:`OursTP` (the model built under ``record_module_init`` and
  ``self.parallelize(model, plan="llama")``; the loss, the optimizer and the pipeline contract
  come with ``ParallelLMModule``). The Trainer line is one line for both.
- **step time**: seconds from one training batch's start to the next one's (forward, backward,
  optimizer step), after ``WARMUP`` steps, median per fit; each round runs one fit of each
  variant, one after the other (each a fresh 2-process group launched by Lightning), and the ratio
  is of the medians over all rounds. TP only: Lightning's strategy has no pipeline.

Both use TP = 2, DP = 1, AdamW (lr 1e-3, betas 0.9/0.95), fp32, eager attention, the same
synthetic token batches. Differences that are the designs, not the benchmark: Lightning's plan
gathers the logits over the vocabulary (``ColwiseParallel(output_layouts=Replicate())``) for
``F.cross_entropy``; ours keeps them split and uses megatron's vocab-parallel cross entropy.
Initial weights differ (each framework's own init), so the losses are shown only as a sanity check.

Writes JSON (default ``benchmarks/results/byom_vs_model_parallel.json``).
"""
from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import tokenize

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from _harness import RESULTS, median, write_json

SEQ, BATCH, VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 8, 2048, 256, 4, 8, 4
WARMUP = 2


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                       max_position_embeddings=SEQ, attn_implementation="eager")


# ------------------------------------------------------------------ what each user writes
class LightningTP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        from transformers import LlamaForCausalLM
        self.model = LlamaForCausalLM(llama_config())

    def configure_model(self):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        plan = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["tokens"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def _ours():
    from lightning_mhc import ParallelLMModule, record_module_init

    class OursTP(ParallelLMModule):
        def configure_model(self):
            if self.model is None:
                from transformers import LlamaForCausalLM
                with record_module_init():
                    model = LlamaForCausalLM(llama_config())
                self.model = self.parallelize(model, plan="llama")

    return OursTP


def user_lines(source: str) -> int:
    """Code lines of ``source``: no blank, comment-only or docstring lines."""
    skip: set[int] = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens):
        if token.type == tokenize.STRING and (i == 0 or tokens[i - 1].type in (tokenize.INDENT, tokenize.NEWLINE,
                                                                             tokenize.DEDENT, tokenize.NL)):
            skip.update(range(token.start[0], token.end[0] + 1))  # a docstring
    lines = source.splitlines()
    return sum(1 for n, line in enumerate(lines, 1)
               if line.strip() and not line.strip().startswith("#") and n not in skip)


def _ours_source() -> str:
    source = inspect.getsource(_ours)
    start = source.index("    class OursTP")
    end = source.index("    return OursTP")
    return source[start:end]


# ------------------------------------------------------------------ one fit (a launched group)
class StepTimes(pl.Callback):
    """Seconds from each training batch's start to the next one's, on rank 0."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        trainer.strategy.barrier()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))

    def on_train_end(self, trainer, module) -> None:
        trainer.strategy.barrier()
        self.starts.append(time.perf_counter())


def fit(variant: str, steps: int) -> dict:
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy
    from lightning_mhc.data.sources import SyntheticTokens

    if variant == "lightning":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, module = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), LightningTP()
    else:
        strategy, module = MHCParallelStrategy(tensor_model_parallel_size=2), _ours()()
    times = StepTimes()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[times])
    data = DataLoader(SyntheticTokens(steps * BATCH, SEQ, vocab_size=VOCAB), batch_size=BATCH)
    trainer.fit(module, train_dataloaders=data)
    durations = [b - a for a, b in zip(times.starts, times.starts[1:])]
    return dict(step_seconds=durations[WARMUP:], losses=times.losses, rank=trainer.global_rank)


def run_fit(variant: str, steps: int) -> dict:
    """One fit in a fresh process group (this script with ``--variant``; Lightning launches rank 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "fit.json"
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(steps),
                               "--fit-out", str(out)], capture_output=True, text=True, env=env, timeout=900,
                              cwd=pathlib.Path(__file__).parent)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} fit failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="training steps per fit (the first 2 untimed)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "byom_vs_model_parallel.json")
    parser.add_argument("--variant", choices=["lightning", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--fit-out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} untimed warm-up steps")
    if args.variant:  # one launched fit
        result = fit(args.variant, args.steps)
        if result.pop("rank") == 0:
            args.fit_out.write_text(json.dumps(result))
        return
    lines = {"lightning": user_lines(inspect.getsource(LightningTP)), "ours": user_lines(_ours_source())}
    fits: dict[str, list[dict]] = {"lightning": [], "ours": []}
    for r in range(args.rounds):
        for variant in fits:
            fits[variant].append(run_fit(variant, args.steps))
            print(f"round {r + 1}/{args.rounds} {variant}: median step "
                  f"{median(fits[variant][-1]['step_seconds']) * 1e3:.1f} ms", flush=True)
    step = {v: median([s for f in runs for s in f["step_seconds"]]) for v, runs in fits.items()}
    payload = dict(
        model=dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB, seq=SEQ, batch=BATCH),
        layout="TP=2, DP=1 (2 CPU processes, gloo)", rounds=args.rounds, steps=args.steps, warmup=WARMUP,
        torch=torch.__version__, lightning=pl.__version__,
        user_lines=lines, median_step_seconds=step,
        first_losses={v: [f["losses"][0] for f in runs] for v, runs in fits.items()},
        step_seconds={v: [f["step_seconds"] for f in runs] for v, runs in fits.items()},
        ratios=dict(step_time_ours_vs_lightning=step["ours"] / step["lightning"],
                    user_lines_ours_vs_lightning=lines["ours"] / lines["lightning"]),
    )
    write_json(args.out, payload)
    print(f"user lines: ours {lines['ours']}, Lightning ModelParallelStrategy {lines['lightning']}; "
          f"median step: ours {step['ours'] * 1e3:.1f} ms, Lightning {step['lightning'] * 1e3:.1f} ms "
          f"(ratio {payload['ratios']['step_time_ours_vs_lightning']:.3f})")


if __name__ == "__main__":
    main()
