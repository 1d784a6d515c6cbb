"""The retrofit's first result: a pretrained model continued plain and with hyper-connections added.

    python benchmarks/retrofit.py [--hidden 128] [--layers 2] [--seq 64] [--batch 8]
                                  [--pretrain-steps 600] [--steps 400] [--seeds 0 1] [--eval-every 50]
                                  [--max-bytes N] [--out PATH] [--plot PATH]
    python benchmarks/retrofit.py --large      # a GPU-sized run of the same protocol

1. **Corpus** (offline, built from this machine's Python): every docstring of the standard
   library (``lightning_mhc.data.sample.stdlib_docstrings``, uncapped: about 2.3 MB of English
   about code, 1,215 modules), tokenized with the package's sample BPE (2,048 tokens; about 0.79 M
   tokens), one ``<|endoftext|>`` between modules; every 20th module held out for validation.
2. **Pretraining**: a Hugging Face Llama drawn from seed 1234 (``--hidden``, ``--layers``), AdamW
   with warm-up and cosine decay, over the training tokens in order; saved with
   ``save_pretrained``.
3. **Continuation**, per seed: the saved model read back with ``from_pretrained`` and continued on
   the same tokens in the same order (the order drawn from the seed) plain, and with 4 streams
   (``add_hyper_connections``, the parameters drawn from the seed) at gating factor 0 (exactly the
   model at step 0) and 0.01; AdamW at a constant learning rate. The variants run in lockstep, one
   step each in turn, so the step-time ratio is taken side by side.

Reported per variant and seed: the validation loss every ``--eval-every`` steps (the same held-out
tokens; at equal tokens, since every variant sees the same batches), the median step time and its
ratio to the plain model's, and the final divergence of the streams per block
(``lightning_mhc.model.divergence``). The scale is small and is stated as such: a CPU result of a
few million parameters and under a million tokens, not a claim about large models.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile
import time

import torch

from _harness import RESULTS, median, pyplot, save_figure, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
STREAMS = 4
VARIANTS = (("plain", None), ("mHC, gate 0", 0.0), ("mHC, gate 0.01", 0.01))
"""(label, hyper-connections' initial gating factor; None: no hyper-connections)."""
LARGE = dict(hidden=1024, layers=12, seq=1024, batch=32, pretrain_steps=2000, steps=2000, eval_every=100)
"""``--large``: a GPU-sized run (the corpus then repeats: it holds under a million tokens)."""


def corpus(seq: int, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(train chunks, validation chunks, description)``: ``[chunks, seq + 1]`` token ids."""
    from tokenizers import Tokenizer

    from lightning_mhc.data.sample import EOD, SAMPLE_DIR, stdlib_docstrings

    texts = stdlib_docstrings(max_bytes=max_bytes)
    tokenizer = Tokenizer.from_file(str(SAMPLE_DIR / "tokenizer.json"))
    eod = tokenizer.token_to_id(EOD)
    streams: dict[str, list[int]] = {"train": [], "validation": []}
    for index, encoding in enumerate(tokenizer.encode_batch(texts)):
        streams["validation" if index % 20 == 19 else "train"].extend([*encoding.ids, eod])

    def chunks(ids: list[int]) -> torch.Tensor:
        count = (len(ids) - 1) // seq
        if count < 1:
            sys.exit(f"retrofit: the corpus ({len(texts)} modules) has no whole chunk of {seq + 1} tokens to hold out; "
                     "raise --max-bytes")
        return torch.tensor(ids[:count * seq + 1]).unfold(0, seq + 1, seq)

    description = dict(name="the standard library's docstrings", modules=len(texts),
                       megabytes=round(sum(len(t.encode()) for t in texts) / 1e6, 2),
                       tokens={k: len(v) for k, v in streams.items()}, vocab=tokenizer.get_vocab_size())
    return chunks(streams["train"]), chunks(streams["validation"]), description


def llama(args, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=args.hidden, intermediate_size=(8 * args.hidden // 3 + 63) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), vocab_size=vocab, max_position_embeddings=args.seq,
        tie_word_embeddings=False))


def loss_of(model, chunk: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=chunk[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())


@torch.no_grad()
def validation_loss(model, validation: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [loss_of(model, validation[i:i + batch]).item() for i in range(0, len(validation), batch)]
    model.train()
    return sum(losses) / len(losses)


def batches(train: torch.Tensor, batch: int, steps: int, seed: int):
    """``steps`` batches of ``batch`` chunks, in an order drawn from ``seed`` (epochs repeat it)."""
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order += torch.randperm(len(train), generator=generator).tolist()
    return [train[order[i * batch:(i + 1) * batch]] for i in range(steps)]


def pretrain(args, train: torch.Tensor, validation: torch.Tensor, vocab: int, out: pathlib.Path) -> dict:
    model = llama(args, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.pretrain_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.9 * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.pretrain_steps)))))
    losses = []
    for step, chunk in enumerate(batches(train, args.batch, args.pretrain_steps, seed=1234)):
        loss = loss_of(model, chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == args.pretrain_steps - 1:
            print(f"pretraining step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    return dict(steps=args.pretrain_steps, final_train_loss=losses[-1],
                validation_loss=validation_loss(model, validation, args.batch),
                parameters=sum(p.numel() for p in model.parameters()))


def continue_variants(args, train: torch.Tensor, validation: torch.Tensor, saved: pathlib.Path, seed: int) -> dict:
    """Every variant from the saved model, in lockstep over the same batches."""
    from transformers import LlamaForCausalLM

    from lightning_mhc import add_hyper_connections
    from lightning_mhc.model.divergence import StreamDivergenceMonitor
    from lightning_mhc.any_model.hyper_connections import hyper_connection_blocks
    from lightning_mhc.roles import assign_roles

    runs = {}
    for label, gate in VARIANTS:
        model = LlamaForCausalLM.from_pretrained(saved)
        if gate is not None:
            add_hyper_connections(model, STREAMS, seed=seed, init_gating_factor=gate)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        runs[label] = dict(model=model, optimizer=optimizer, step_s=[], validation={0: validation_loss(
            model, validation, args.batch)})
    for step, chunk in enumerate(batches(train, args.batch, args.steps, seed=seed), start=1):
        for label, run in runs.items():
            start = time.perf_counter()
            loss = loss_of(run["model"], chunk)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(run["model"].parameters(), 1.0)
            run["optimizer"].step()
            run["optimizer"].zero_grad(set_to_none=True)
            run["step_s"].append(time.perf_counter() - start)
        if step % args.eval_every == 0 or step == args.steps:
            for label, run in runs.items():
                run["validation"][step] = validation_loss(run["model"], validation, args.batch)
            print(f"seed {seed} step {step}: " + ", ".join(
                f"{label} {run['validation'][step]:.4f}" for label, run in runs.items()), flush=True)
    results = {}
    plain_step = median(runs["plain"]["step_s"][1:])
    for label, run in runs.items():
        blocks = hyper_connection_blocks(run["model"])
        divergence = None
        if blocks:
            monitor = StreamDivergenceMonitor(STREAMS)
            for block in blocks:
                assign_roles(block, hyper_connection_observer=monitor.observe)
            monitor.armed = True
            with torch.no_grad():
                run["model"].eval()
                loss_of(run["model"], validation[:args.batch])
            divergence = monitor.take()
        results[label] = dict(validation=run["validation"], median_step_s=median(run["step_s"][1:]),
                              step_time_vs_plain=median(run["step_s"][1:]) / plain_step,
                              divergence=divergence,
                              mean_divergence=sum(divergence.values()) / len(divergence) if divergence else None)
        del run["model"], run["optimizer"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--max-bytes", type=int, default=2**62, help="cap the corpus (a quick check); default: all")
    parser.add_argument("--large", action="store_true", help=f"a GPU-sized run: {LARGE}")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "retrofit.json")
    parser.add_argument("--plot", type=pathlib.Path, default=ROOT / "docs" / "benchmarks" / "retrofit.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's JSON, run nothing")
    args = parser.parse_args()
    if args.plot_only:
        import json

        return plot(json.loads(args.out.read_text()), args.plot)
    if args.large:
        vars(args).update(LARGE)
    device_note = f"CPU, {torch.get_num_threads()} threads"
    started = time.monotonic()
    train, validation, described = corpus(args.seq, args.max_bytes)
    print(f"corpus: {described}; {len(train)} training and {len(validation)} validation chunks of {args.seq + 1}",
          flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        saved = pathlib.Path(scratch) / "pretrained"
        pretrained = pretrain(args, train, validation, described["vocab"], saved)
        print(f"pretrained: {pretrained}", flush=True)
        seeds = {seed: continue_variants(args, train, validation, saved, seed) for seed in args.seeds}
    result = dict(corpus=described, device=device_note, model=dict(family="llama", hidden=args.hidden,
                  layers=args.layers, seq=args.seq, batch=args.batch, parameters=pretrained["parameters"]),
                  pretraining=pretrained, continuation=dict(steps=args.steps, lr=args.lr, streams=STREAMS,
                  tokens=args.steps * args.batch * args.seq), seeds=seeds,
                  summary=summarise(seeds), seconds=round(time.monotonic() - started, 1))
    report(result)
    write_json(args.out, result)
    plot(result, args.plot)


def summarise(seeds: dict) -> dict:
    """Per variant, over seeds: the final validation loss (mean and each), the step-time ratio and
    the final mean divergence; and the largest step-0 difference from the plain model."""
    summary = {}
    for label, _ in VARIANTS:
        rows = [runs[label] for runs in seeds.values()]
        finals = [row["validation"][max(row["validation"])] for row in rows]
        divergences = [row["mean_divergence"] for row in rows if row["mean_divergence"] is not None]
        summary[label] = dict(final_validation=finals, mean_final_validation=sum(finals) / len(finals),
                              step_time_vs_plain=[row["step_time_vs_plain"] for row in rows],
                              mean_divergence=divergences or None,
                              step0_vs_plain=max(abs(runs[label]["validation"][0] - runs["plain"]["validation"][0])
                                                 for runs in seeds.values()))
    return summary


def report(result: dict) -> None:
    c, m = result["corpus"], result["model"]
    print(f"\n{c['name']} ({c['megabytes']} MB, {c['tokens']['train']:,} training tokens), Llama {m['parameters']:,} "
          f"parameters ({m['layers']} layers, hidden {m['hidden']}), {result['continuation']['steps']} continuation steps "
          f"x {m['batch']} x {m['seq']} tokens, {result['device']}")
    print(f"{'variant':<16} {'final validation loss (per seed)':<36} {'step time / plain':<20} divergence")
    for label, row in result["summary"].items():
        finals = ", ".join(f"{v:.4f}" for v in row["final_validation"])
        ratios = ", ".join(f"{v:.2f}" for v in row["step_time_vs_plain"])
        divergence = ", ".join(f"{v:.4f}" for v in row["mean_divergence"]) if row["mean_divergence"] else "-"
        print(f"{label:<16} {row['mean_final_validation']:.4f} ({finals}){'':<6} {ratios:<20} {divergence}")


def plot(result: dict, path: pathlib.Path) -> None:
    """Left: each variant's validation loss; right: each mHC variant's minus the plain model's, on
    the same tokens (the differences are too small to see on the left)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, runs in result["seeds"].items():
        curves = {label: sorted((int(step), value) for step, value in runs[label]["validation"].items())
                  for label, _ in VARIANTS}
        for (label, _), style in zip(VARIANTS, ("-", "--", ":")):
            steps = [s for s, _ in curves[label]]
            left.plot(steps, [v for _, v in curves[label]], style, label=f"{label}, seed {seed}")
            if label != "plain":
                right.plot(steps, [v - p for (_, v), (_, p) in zip(curves[label], curves["plain"])], style,
                           marker=".", label=f"{label}, seed {seed}")
    right.axhline(0, color="grey", linewidth=0.8)
    left.set(xlabel="continuation step (same tokens for every variant)", ylabel="validation loss",
             title="a pretrained Llama continued")
    right.set(xlabel="continuation step", ylabel="validation loss - plain's", title="4 streams against plain")
    for ax in (left, right):
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
