"""mHC for any model: what 4 hyper-connection streams cost a Hugging Face Llama, and how exact the
retrofit is for every built-in family.

    python benchmarks/mhc_any_model.py [--rounds 3] [--steps 8] [--out PATH] [--no-parallel]
                                       [--hidden 512] [--layers 8] [--plot PATH]

- **one process**: a ``LlamaForCausalLM`` (hidden 512, 8 layers, 8 heads, vocabulary 2048, sequence
  128, batch 4) split by ``parallelize`` at TP = PP = 1, without and with ``hyper_connections=4``:
  the training step time (forward, backward, AdamW step; 8 x ``--rounds`` interleaved rounds, median) and the activation
  bytes one training forward retains for backward (``ActivationMemoryMeter``) under the recompute
  policies ``none`` and ``mhc_block``.
- **TP 2 x PP 2**: the same model through ``Trainer.fit`` on 4 CPU processes (``MHCParallelStrategy``,
  4 microbatches; one intra-op thread each, as Lightning's launcher sets for 4 processes on 2 cores),
  without and with 4 streams, one fit of each per round alternated; the median step time (rank 0,
  barrier to barrier) after 2 warm-up steps. Then the same with sequence parallelism, which splits
  the hyper-connections' work over the TP ranks with the sequence (without it, each TP rank
  computes them for the whole sequence).
- **exactness**: each built-in family's small test model (``tests/scripts/lm_models.py``) with weights
  off any seed's: the largest logit difference between the model and the same model after
  ``add_hyper_connections`` (n = 4 and 3; fp32; the fused ops and the reference ones).

Writes JSON (default ``benchmarks/results/mhc_any_model.json``) and, with matplotlib, a plot in
``docs/benchmarks/mhc_any_model.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from _harness import RESULTS, interleaved_times, median, pyplot, save_figure, write_json

SEQ, BATCH, VOCAB, HIDDEN, LAYERS, HEADS = 128, 4, 2048, 512, 8, 8
STREAMS, WARMUP = 4, 2
ROOT = pathlib.Path(__file__).resolve().parents[1]


def llama(hidden: int = HIDDEN, layers: int = LAYERS):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mhc.any_model import record_module_init

    with record_module_init():
        return LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ,
            attn_implementation="eager"))


# ------------------------------------------------------------------ one process
def one_process(rounds: int, hidden: int, layers: int) -> dict:
    import torch.distributed as dist

    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.any_model import parallelize
    from lightning_mhc.recompute import ActivationMemoryMeter
    from lightning_mhc.testing.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    layout = ParallelLayout().build()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    steps, retained = {}, {}
    for label, streams, policy in (("plain, none", None, "none"), ("mHC, none", STREAMS, "none"),
                                   ("plain, full", None, "full"), ("mHC, mhc_block", STREAMS, "mhc_block")):
        model = parallelize(llama(hidden, layers), "llama", layout=layout, hyper_connections=streams,
                            recompute=policy).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with ActivationMemoryMeter(model) as meter:
            loss = model.loss(model(input_ids=tokens), tokens)
        loss.backward()
        optimizer.zero_grad(set_to_none=True)
        retained[label] = meter.result.retained_bytes

        def step(model=model, optimizer=optimizer) -> None:
            model.loss(model(input_ids=tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[label] = step
        print(f"{label}: {retained[label] / 2**20:.1f} MiB retained", flush=True)
    times = interleaved_times(steps, rounds)
    dist.destroy_process_group()
    seconds = {label: median(t) for label, t in times.items()}
    return dict(step_seconds=seconds, retained_bytes=retained,
                step_time_ratio=seconds["mHC, none"] / seconds["plain, none"],
                block_recompute_ratio=seconds["mHC, mhc_block"] / seconds["plain, none"],
                retained_ratio=retained["mHC, mhc_block"] / retained["plain, none"])


# ------------------------------------------------------------------ TP 2 x PP 2 (a launched group)
def fit(streams: int | None, steps: int, hidden: int, layers: int, sequence_parallel: bool) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy, ParallelLMModule
    from lightning_mhc.data.sources import SyntheticTokens

    class Llama(ParallelLMModule):
        def configure_model(self):
            if self.model is None:
                self.model = self.parallelize(llama(hidden, layers), plan="llama", hyper_connections=streams)

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            trainer.strategy.barrier()
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, module) -> None:
            trainer.strategy.barrier()
            self.starts.append(time.perf_counter())

    times = StepTimes()
    strategy = MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_microbatches=4,
                                   sequence_parallel=sequence_parallel)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[times])
    data = DataLoader(SyntheticTokens(steps * 4 * BATCH, SEQ, vocab_size=VOCAB), batch_size=4 * BATCH)
    trainer.fit(Llama(), train_dataloaders=data)
    durations = [b - a for a, b in zip(times.starts, times.starts[1:])]
    return dict(step_seconds=durations[WARMUP:], rank=trainer.global_rank, threads=torch.get_num_threads())


def run_fit(streams: int | None, steps: int, hidden: int, layers: int, sequence_parallel: bool) -> dict:
    """One fit in a fresh 4-process group (this script with ``--fit-streams``; Lightning launches the rest)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "fit.json"
        command = [sys.executable, __file__, "--fit-streams", str(streams or 1), "--steps", str(steps),
                   "--hidden", str(hidden), "--layers", str(layers), "--fit-out", str(out),
                   *(["--fit-sequence-parallel"] if sequence_parallel else [])]
        # (not this process's rendezvous: the one-process part set MASTER_ADDR / MASTER_PORT)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=pathlib.Path(__file__).parent,
                              env={**env, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            raise RuntimeError(f"fit with {streams} streams failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def tp2_pp2(rounds: int, steps: int, hidden: int, layers: int, sequence_parallel: bool) -> dict:
    fits: dict[str, list[float]] = {"plain": [], "mHC": []}
    name = "TP 2 x PP 2" + (" x SP" if sequence_parallel else "")
    for r in range(rounds):
        for label, streams in (("plain", None), ("mHC", STREAMS)):
            result = run_fit(streams, steps, hidden, layers, sequence_parallel)
            fits[label].append(median(result["step_seconds"]))
            print(f"{name} round {r + 1}/{rounds} {label}: median step {fits[label][-1] * 1e3:.0f} ms", flush=True)
    seconds = {label: median(values) for label, values in fits.items()}
    return dict(step_seconds=seconds, per_round=fits, step_time_ratio=seconds["mHC"] / seconds["plain"],
                threads_per_rank=result["threads"])


# ------------------------------------------------------------------ exactness per family
def exactness() -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from lm_models import FAMILIES, SEQ as TEST_SEQ, VOCAB as TEST_VOCAB, gpt2, llama as test_llama

    from lightning_mhc import add_hyper_connections

    families = {"gpt2": gpt2, "llama": test_llama, **{name: make for name, (make, _) in FAMILIES.items()}}
    tokens = torch.randint(0, TEST_VOCAB, (2, TEST_SEQ), generator=torch.Generator().manual_seed(0))
    table = {}
    for name, make in families.items():
        torch.manual_seed(1)
        model = make().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            before = model(input_ids=tokens).logits
        row = {}
        for streams, implementation in ((4, "auto"), (4, "reference"), (3, "auto"), (3, "reference")):
            copy = make().eval()
            copy.load_state_dict(state)
            add_hyper_connections(copy, streams, implementation=implementation)
            with torch.no_grad():
                row[f"n={streams} {implementation}"] = (copy(input_ids=tokens).logits - before).abs().max().item()
        table[name] = row
        print(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in row.items()), flush=True)
    return table


def plot(result: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    one = result["one_process"]
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = list(one["retained_bytes"])
    memory.bar(labels, [one["retained_bytes"][k] / 2**20 for k in labels], color=["#888", "#c55", "#bbb", "#35a"])
    memory.set_ylabel("MiB retained for backward")
    size = result["model"]
    memory.set_title(f"Llama {size['hidden']} x {size['layers']} layers, batch {BATCH} x {SEQ}: one forward")
    memory.tick_params(axis="x", labelrotation=20)
    ratios = {"1 process": one["step_time_ratio"], "1 process, mhc_block": one["block_recompute_ratio"]}
    for key, label in (("tp2_pp2", "TP 2 x PP 2"), ("tp2_pp2_sp", "TP 2 x PP 2 x SP")):
        if key in result:
            ratios[label] = result[key]["step_time_ratio"]
    speed.bar(list(ratios), list(ratios.values()), color="#35a")
    speed.axhline(1.25, color="#c55", linestyle="--", label="goal 1.25")
    speed.axhline(1.0, color="#888", linewidth=0.8)
    speed.set_ylabel("step time, 4 streams / plain")
    speed.tick_params(axis="x", labelrotation=20)
    speed.set_title("mHC step time on CPU")
    speed.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="training steps per TP 2 x PP 2 fit (2 untimed)")
    parser.add_argument("--no-parallel", action="store_true", help="skip the TP 2 x PP 2 fits")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "mhc_any_model.json")
    parser.add_argument("--plot", type=pathlib.Path, default=ROOT / "docs" / "benchmarks" / "mhc_any_model.png")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--fit-streams", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fit-out", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--fit-sequence-parallel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} untimed warm-up steps")
    if args.fit_streams:  # one launched fit
        result = fit(args.fit_streams if args.fit_streams > 1 else None, args.steps, args.hidden, args.layers,
                     args.fit_sequence_parallel)
        if result.pop("rank") == 0:
            args.fit_out.write_text(json.dumps(result))
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = dict(model=dict(hidden=args.hidden, layers=args.layers, heads=HEADS, vocab=VOCAB, seq=SEQ, batch=BATCH,
                             streams=STREAMS), torch=torch.__version__, exactness=exactness(),
                  one_process=one_process(args.rounds * 8, args.hidden, args.layers))
    one = result["one_process"]
    print(f"one process: step time 4 streams / plain {one['step_time_ratio']:.3f} (mhc_block "
          f"{one['block_recompute_ratio']:.3f}); retained mhc_block with mHC / plain none {one['retained_ratio']:.3f}")
    if not args.no_parallel:
        for key, sequence_parallel in (("tp2_pp2", False), ("tp2_pp2_sp", True)):
            result[key] = tp2_pp2(args.rounds, args.steps, args.hidden, args.layers, sequence_parallel)
            print(f"{key}: step time 4 streams / plain {result[key]['step_time_ratio']:.3f}", flush=True)
    write_json(args.out, result)
    plot(result, args.plot)


if __name__ == "__main__":
    main()
