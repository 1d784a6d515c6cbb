"""Fabric runs on 2 processes (ranks forked by tests/script_runs.run_on_ranks, or Fabric's launcher
re-running this script), several phases in one launch.

    python fabric_checks.py --out result.json [--gpt-ckpt DIR]

1. ``strategy="mhc_parallel"``, a plain module, DP = 2: replicas after setup and after training,
   the samples each rank saw, a gradient-accumulation step (``no_backward_sync``), global-norm
   clipping, save at step 2 / load into fresh objects / continue, and a one-process replay of
   the same global batches as the reference.
2. With ``--gpt-ckpt`` (a checkpoint of examples/fabric_train.py, saved on TP 2 x PP 2): load it
   on DP 2, TP 2 and PP 2 in turn (a new Fabric each time, same processes) and evaluate a fixed
   batch, then train two steps from it (dropout 0; on DP 2 also with 2-call accumulation) and
   evaluate again; refusals of misuse on the way; with ``--gpt-final`` and ``--trainer-final``,
   the example's and the Trainer's last checkpoints of the same run, loaded with their optimizers.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from lightning_mhc import ConfigError, MHCGPTModule
from lightning_mhc.fabric import MHCParallelStrategy

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import fabric_train as example  # noqa: E402  (its model, data sizes and cycle())

STEPS, SAVE_AT, ACCUMULATE_AT, MAX_NORM, BATCH = 5, 2, 3, 0.05, 4
MAX_NORM_GPT = 0.5


class Indexed(Dataset):
    """Sample ``i``: ``(i, x_i, y_i)`` drawn from a generator seeded by ``i``."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return torch.tensor(i), x, x[:1] * 2 - x[1:2]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(fabric, model, optimizer, batches, state, log):
    """Steps ``state["step"] + 1 .. STEPS``; step ACCUMULATE_AT takes two batches."""
    while state["step"] < STEPS:
        step = state["step"] + 1
        micro = 2 if step == ACCUMULATE_AT else 1
        for k in range(micro):
            index, x, y = next(batches)
            state["consumed"] += 1
            log.setdefault(step, []).append(index.tolist())
            with fabric.no_backward_sync(model, enabled=k < micro - 1):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        log.setdefault("norms", {})[step] = norm.item()
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step
        if step == SAVE_AT and "ckpt" in state:
            fabric.save(state["ckpt"], {k: v for k, v in state.items() if k != "ckpt"})


def phase_plain(fabric: Fabric, out_dir: pathlib.Path) -> dict:
    rank = fabric.global_rank
    module = make_model(100 + rank)  # different on each rank: setup must sync them
    initial = fabric.all_gather(flat(module))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    synced = fabric.all_gather(flat(model))
    loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
    ckpt = str(out_dir / "plain-2")
    state = dict(model=model, optimizer=optimizer, step=0, consumed=0, ckpt=ckpt)
    log: dict = {}
    train(fabric, model, optimizer, example.cycle(loader), state, log)
    final = fabric.all_gather(flat(model))

    # a fresh model and optimizer (other weights), loaded from step 2, continued
    module2 = make_model(7 + rank)
    model2, optimizer2 = fabric.setup(module2, torch.optim.SGD(module2.parameters(), lr=0.1, momentum=0.9))
    resumed = dict(model=model2, optimizer=optimizer2, step=0, consumed=0)
    fabric.load(ckpt, resumed)
    batches = example.cycle(fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True)))
    for _ in range(resumed["consumed"]):
        next(batches)
    resumed_log: dict = {}
    train(fabric, model2, optimizer2, batches, resumed, resumed_log)
    logs = [None] * fabric.world_size
    dist.all_gather_object(logs, log)
    return dict(initial=initial.tolist(), synced=synced.tolist(), final=final.tolist(),
                resumed=flat(model2).tolist(), resumed_step=resumed["step"], logs=logs,
                sampler=dict(fabric.strategy.distributed_sampler_kwargs))


def one_process_replay(initial: list[float], logs: list[dict]) -> dict:
    """The same steps in one process on the global batches (both ranks' samples)."""
    model = make_model(0)
    torch.nn.utils.vector_to_parameters(torch.tensor(initial), model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, norms = Indexed(), {}
    for step in range(1, STEPS + 1):
        for micro in range(len(logs[0][step])):
            per_rank = []
            for log in logs:
                batch = [data[i] for i in log[step][micro]]
                x, y = torch.stack([b[1] for b in batch]), torch.stack([b[2] for b in batch])
                per_rank.append(torch.nn.functional.mse_loss(model(x), y))
            (sum(per_rank) / len(per_rank)).backward()  # DP averages the ranks' gradients
        norms[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        optimizer.step()
        optimizer.zero_grad()
    return dict(final=flat(model).tolist(), norms=norms)


def phase_gpt(ckpt: str, final: str | None, trainer_final: str | None) -> dict:
    """Load a TP 2 x PP 2 checkpoint of the example on DP 2, TP 2 and PP 2 and evaluate one batch;
    on DP 2 also load the example's final checkpoint and the Trainer's of the same run (model and
    optimizer) and compare them."""
    tokens = torch.randint(0, 256, (4, example.SEQ + 1), generator=torch.Generator().manual_seed(3))
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    result: dict = {"eval_loss": {}, "refused": {}}
    for name, tp, pp in (("dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=MHCParallelStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
        fabric.launch()
        module = MHCGPTModule(example.model_config(0.1), recompute_policy="mhc_block")
        if name == "tp2":
            try:  # an optimizer made before the stage exists holds the wrong parameters
                fabric.setup(module, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
            except ConfigError as exc:
                result["refused"]["optimizer_before_stage"] = str(exc)
            try:  # a plain module cannot be tensor-parallel
                fabric.setup_module(torch.nn.Linear(4, 4))
            except ConfigError as exc:
                result["refused"]["plain_module_tp"] = str(exc)
            module = MHCGPTModule(example.model_config(0.1), recompute_policy="mhc_block")
        model = fabric.setup_module(module)
        blocks = [m for m in module.modules() if hasattr(m, "recompute_block_ranges")]
        result.setdefault("recompute_attached", {})[name] = bool(blocks) and all(
            getattr(b, "mhc_recompute_attached", False) for b in blocks)
        remainder = fabric.load(ckpt, {"model": model})
        model.eval()
        loss = fabric.strategy.forward_backward(model, batch, forward_only=True)
        result["eval_loss"][name] = loss.item()
        result.setdefault("remainder_keys", {})[name] = sorted(remainder)
        trained = result.setdefault("trained", {})
        trained[name] = _train_two_steps(fabric, ckpt, batch)
        if name == "dp2":
            trained["dp2_accumulate2"] = _train_two_steps(fabric, ckpt, batch, accumulate=2)
        if name == "pp2":
            try:
                fabric.backward(loss.requires_grad_())
            except ConfigError as exc:
                result["refused"]["backward_on_pipeline"] = str(exc)
            model.train()  # the LightningModule's own training_step under Fabric (self.trainer.strategy)
            step_loss = model.training_step(batch, 0)
            result["training_step"] = dict(loss=step_loss.item(), grads=all(
                p.grad is not None for p in module.parameters() if p.requires_grad))
        if name == "dp2":
            result["refused"].update(_bad_loads(fabric, model, ckpt))
        if name == "dp2" and final and trainer_final:
            result["final"] = {source: _load_with_optimizer(fabric, path, batch)
                               for source, path in (("fabric", final), ("trainer", trainer_final))}
        fabric.strategy.teardown()
    # the distributed optimizer under Fabric: the same two steps, and the final checkpoint (saved
    # without it) loaded into it with its optimizer
    fabric = Fabric(accelerator="cpu", devices=2, strategy=MHCParallelStrategy(use_distributed_optimizer=True))
    fabric.launch()
    result["trained"]["dp2_zero"] = _train_two_steps(fabric, ckpt, batch)
    if final:
        result["final"]["fabric_into_zero"] = _load_with_optimizer(fabric, final, batch)
    fabric.strategy.teardown()
    result["bf16_true_pp2"] = _bf16_true_step(ckpt)
    return result


def _bf16_true_step(ckpt: str) -> dict:
    """``precision="bf16-true"`` on PP 2: the stage in bf16, the first training loss of
    ``_train_two_steps``."""
    fabric = Fabric(accelerator="cpu", devices=2, precision="bf16-true",
                    strategy=MHCParallelStrategy(pipeline_model_parallel_size=2))
    fabric.launch()
    model = fabric.setup_module(MHCGPTModule(example.model_config(0.0), recompute_policy="mhc_block"))
    fabric.load(ckpt, {"model": model})
    tokens = torch.randint(0, 256, (8, example.SEQ + 1), generator=torch.Generator().manual_seed(10))
    loss = fabric.strategy.forward_backward(model, dict(tokens=tokens[:, :-1], labels=tokens[:, 1:]))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    fabric.strategy.teardown()
    return dict(loss=loss.item(), param_dtypes=dtypes)


def _train_two_steps(fabric: Fabric, ckpt: str, eval_batch: dict, accumulate: int = 1) -> dict:
    """From ``ckpt`` (dropout 0): two AdamW steps, clipped, on two fixed global batches of 8 (each
    DP rank its slice; with ``accumulate``, in that many calls, all but the last without DP
    sync), then the loss of ``eval_batch``."""
    module = MHCGPTModule(example.model_config(0.0), recompute_policy="mhc_block", warmup_steps=0)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers()["optimizer"])
    fabric.load(ckpt, {"model": model})
    layout = fabric.strategy.layout
    losses = []
    for step in range(2):
        tokens = torch.randint(0, 256, (8, example.SEQ + 1), generator=torch.Generator().manual_seed(10 + step))
        mine = tokens.chunk(layout.data_parallel_size)[layout.data_parallel_rank]
        parts = mine.chunk(accumulate)
        total = 0.0
        for k, part in enumerate(parts):
            with fabric.no_backward_sync(model, enabled=k < accumulate - 1):
                total += fabric.strategy.forward_backward(
                    model, dict(tokens=part[:, :-1], labels=part[:, 1:]), accumulate=accumulate).item()
        losses.append(total / accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM_GPT)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return dict(losses=losses, eval_loss=fabric.strategy.forward_backward(model, eval_batch, forward_only=True).item())


def _bad_loads(fabric: Fabric, model, ckpt: str) -> dict[str, str]:
    """fabric.load of a missing path, of a directory without metadata.json (a save that did not
    finish), and of the checkpoint into a model of another size: each refused with its reason."""
    refused = {}
    unfinished = pathlib.Path(ckpt).parent / "unfinished"
    if fabric.global_rank == 0:
        unfinished.mkdir(exist_ok=True)
    fabric.barrier()
    bigger = fabric.setup_module(MHCGPTModule({**example.model_config(0.1), "hidden_size": 128}))
    for name, path, target in (("missing", pathlib.Path(ckpt).parent / "nowhere", model),
                               ("unfinished", unfinished, model), ("other_model", pathlib.Path(ckpt), bigger)):
        try:
            fabric.load(path, {"model": target})
        except (FileNotFoundError, ConfigError) as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    return refused


def _load_with_optimizer(fabric: Fabric, path: str, batch: dict) -> dict:
    module = MHCGPTModule(example.model_config(0.1))
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers(max_steps=6)["optimizer"])
    fabric.load(path, {"model": model, "optimizer": optimizer})
    model.eval()
    moments = torch.cat([s["exp_avg_sq"].reshape(-1) for s in optimizer.state_dict()["state"].values()])
    moment_sum = moments.double().sum()
    if fabric.strategy.runtime.distributed_optimizer is not None:  # each DP rank holds its pieces
        dist.all_reduce(moment_sum, group=fabric.strategy.layout.dp_group)
    return dict(eval_loss=fabric.strategy.forward_backward(model, batch, forward_only=True).item(),
                weights=flat(model).tolist(), moments=moments.tolist(), moment_sum=moment_sum.item(),
                steps=sorted({int(s["step"]) for s in optimizer.state_dict()["state"].values()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--gpt-ckpt")
    parser.add_argument("--gpt-final", help="the example's last checkpoint")
    parser.add_argument("--trainer-final", help="the Trainer's last checkpoint of the same run")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="mhc_parallel")
    fabric.launch()
    result = dict(strategy=type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__)
    result["plain"] = phase_plain(fabric, args.out.parent)
    fabric.strategy.teardown()
    if args.gpt_ckpt:
        result["gpt"] = phase_gpt(args.gpt_ckpt, args.gpt_final, args.trainer_final)
    if dist.get_rank() == 0:
        result["reference"] = one_process_replay(result["plain"]["synced"][0], result["plain"]["logs"])
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
