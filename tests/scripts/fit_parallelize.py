"""Bring your own model: ``Trainer.fit`` of Hugging Face GPT-2 / Llama and a plain PyTorch
transformer split by ``parallelize``, several cases per process group.

    python fit_parallelize.py --devices 4 --cases gpt2:tp2pp2 llama:tp2pp2 --out result.json
    python fit_parallelize.py --devices 1 --cases gpt2:single ...        # the one-process references

A case is ``<model>:<layout>[:<flags>]``, the flags joined by ``-``; DP is what the devices leave. ``single`` trains the unmodified
model (``build_recorded_module``: the same initial weights) as a plain LightningModule. Every case
fits a shuffled DataLoader for ``STEPS`` steps and records the per-step losses, the whole model's
final weights by name (gathered from every rank's pieces), and each rank's materialised share.

With ``--checkpoints DIR`` a parallel case (but a family's: ``lm_models.FAMILIES``) also saves ``DIR/<model>/step=2.ckpt`` (mid-run),
``DIR/<model>/final.ckpt`` and the logits of a fixed batch on its layout (``logits.pt``); a case
``<model>:<layout>:resume`` continues from ``step=2.ckpt`` on its own layout (resharding).
The flag ``dropout`` trains with dropout 0.1 and records, per rank, a digest of each dropout
module's mask in the first forward; ``full`` / ``block``: with the full / block (``mhc_block``)
recompute. ``gather`` gathers the logits over TP (``loss_parallel=False``). ``pretrained``
starts from ``--weights`` (``parallelize(weights=...)``; one process: ``from_pretrained``), or from
``--family-weights DIR/<model>`` where that exists. ``hc``: with 4 hyper-connection streams
(``parallelize(hyper_connections=4)``; one process: ``add_hyper_connections`` on the materialised
model); its checkpoints go to ``DIR/<model>-hc``. ``start``: records the logits of a fixed batch
before the first step (``start_logits``, the last stage's, gathered over TP). ``zero``: with the
distributed optimizer.
``peft`` / ``peftafter``: PEFT's LoRA (``lora_config``: the attention's q/v/o and the MLP's down
projection, column and row layers, and the hyper-connections in ``modules_to_save``) injected
into the recorded model before ``parallelize`` (with ``hc``: the hyper-connections added first,
``add_hyper_connections`` on the meta model) / into the split model after it; one process: the
recorded model's, materialised by ``build_recorded_module``. With ``--checkpoints`` a parallel
``peft`` case saves ``DIR/<model>-peft/final.ckpt`` and ``logits.pt``. ``unplaced``: a trainable
parameter added to the split model after ``parallelize``, ``loradropout``: ``peft`` with
``lora_dropout=0.1``; both record each rank's ``ConfigError``.
``gcbefore`` / ``gcafter``: the module calls ``model.gradient_checkpointing_enable()`` before /
after ``parallelize`` (its recomputes replay the randomizer's streams: with ``dropout``, the run of
the case without it, bit for bit).
A case ``<model>:<layout>:nolabels`` fits batches without ``labels`` and records each rank's
``ConfigError`` message (or ``None``): every rank must refuse them, before the schedule.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import pathlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lm_models import FAMILIES, MODELS, SEQ, VOCAB
from lightning_mhc import ConfigError, MHCParallelStrategy, ParallelLMModule
from lightning_mhc.data.sources import SyntheticTokens
from lightning_mhc.any_model import add_hyper_connections, build_recorded_module, parallelize, record_module_init

GLOBAL_BATCH, STEPS, SEED, LR = 8, 4, 5, 0.5
STREAMS = 4
PEFT_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def lora_config(model, dropout: float = 0.0):
    import peft

    from lightning_mhc import hyper_connection_modules

    saved = hyper_connection_modules(model) if getattr(model, "hyper_connection_settings", None) else None
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS, modules_to_save=saved, lora_dropout=dropout)


def peft_model(make, hyper_connections, dropout: float = 0.0):
    """The recorded model (with hyper-connections added on the meta device) and PEFT's LoRA on it."""
    import peft

    with record_module_init():
        model = make()
    if hyper_connections:
        add_hyper_connections(model, hyper_connections, seed=SEED)
    return peft.get_peft_model(model, lora_config(model, dropout))
"""Hyper-connection streams of the ``hc`` cases."""


def sgd(parameters):
    """SGD with momentum: a weight difference then measures a gradient difference. (AdamW divides by
    sqrt(v): on elements whose exact gradient is zero, such as a key bias, fp32 rounding noise
    becomes a full-size step.)"""
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)
LAYOUTS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "pp2v2": (1, 2, 2), "tp2pp2": (2, 2, 1),
           "tp2sp": (2, 1, 1), "tp2pp2sp": (2, 2, 1), "ep2pp2": (1, 2, 1)}
"""(TP, PP, v); ``...sp``: with sequence parallelism; ``ep2...``: with the experts split over 2 ranks
(an MoE model's, ``any_model/experts.py``)."""


class ParallelLM(ParallelLMModule):
    def __init__(self, model: str, dropout: float = 0.0, recompute: str = "none", loss_parallel: bool = True,
                 weights: str | None = None, hyper_connections: int | None = None,
                 hf_checkpointing: str | None = None, hand_layout: bool = True, peft: str | None = None,
                 unplaced: bool = False, lora_dropout: float = 0.0) -> None:
        super().__init__()
        self.peft, self.unplaced, self.lora_dropout = peft, unplaced, lora_dropout
        self.model_name, self.dropout, self.recompute, self.loss_parallel = model, dropout, recompute, loss_parallel
        self.weights, self.hyper_connections = weights, hyper_connections
        self.hf_checkpointing = hf_checkpointing
        """``"before"`` / ``"after"``: the user's ``model.gradient_checkpointing_enable()`` before or
        after ``parallelize`` (transformers' idiom)."""
        self.hand_layout = hand_layout
        """False: ``parallelize`` is not handed ``layout=self.layout`` (refused under TP or PP: no
        layout is found in a global)."""

    def configure_model(self) -> None:
        if self.model is None:
            make, plan = MODELS[self.model_name]
            hyper_connections = self.hyper_connections
            if self.peft == "before":
                model, hyper_connections = peft_model(make, hyper_connections, self.lora_dropout), None
            else:
                with record_module_init():
                    model = make(dropout=self.dropout)
            if self.hf_checkpointing == "before":
                model.gradient_checkpointing_enable()
            self.model = parallelize(model, plan, layout=self.layout if self.hand_layout else None, seed=SEED,
                                     recompute=self.recompute,
                                     loss_parallel=self.loss_parallel, weights=self.weights,
                                     hyper_connections=hyper_connections)
            if self.peft == "after":  # injected in place into the split model's modules
                import peft

                peft.get_peft_model(self.model, lora_config(model))
            if self.unplaced:  # a trainable tensor nothing placed over TP
                self.model.chunks[0].extra_scale = torch.nn.Parameter(torch.ones(()))
            if self.hf_checkpointing == "after":
                model.gradient_checkpointing_enable()  # the first chunk is the recorded model, materialised

    def configure_optimizers(self):
        return sgd(self.parameters())


class ReferenceLM(pl.LightningModule):
    """The unmodified model in one process: its own forward, cross entropy on its logits."""

    def __init__(self, model: str, weights: str | None = None, hyper_connections: int | None = None,
                 peft: bool = False) -> None:
        super().__init__()
        make, _ = MODELS[model]
        if peft:  # the adapters and the hyper-connections every layout draws, by name
            # the model PEFT wraps, with its adapters: trained by its own forward
            self.model = build_recorded_module(peft_model(make, hyper_connections), seed=SEED)
            return
        with record_module_init():
            meta = make()
        # pretrained: Hugging Face's own loading of the same files
        self.model = type(meta).from_pretrained(weights) if weights else build_recorded_module(meta, seed=SEED)
        if hyper_connections:
            add_hyper_connections(self.model, hyper_connections, seed=SEED)

    def training_step(self, batch, batch_idx):
        output = self.model(input_ids=batch["tokens"])
        logits = output if isinstance(output, torch.Tensor) else output.logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return sgd(self.parameters())


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


class FinalCheckpointAndLogits(Callback):
    """At the end of training, on the training layout: ``final.ckpt``, and the logits of a fixed
    batch (the last stage's vocabulary slices gathered over TP) in ``logits.pt``."""

    def __init__(self, out_dir: pathlib.Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, module) -> None:
        trainer.save_checkpoint(self.out_dir / "final.ckpt")
        logits = fixed_batch_logits(trainer, module)
        layout = trainer.strategy.layout
        if logits is not None and layout.tensor_model_parallel_rank == 0 and layout.data_parallel_rank == 0:
            tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
            torch.save(dict(tokens=tokens, logits=logits), self.out_dir / "logits.pt")


def fixed_batch_logits(trainer, module) -> torch.Tensor | None:
    """The logits of a fixed batch on the training layout (forward only; the last stage's
    vocabulary slices gathered over TP); None on other stages."""
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    captured = []
    module.loss_func = lambda logits, mb: (captured.append(logits.detach().clone()), logits.sum() * 0)[1]
    trainer.strategy.forward_backward(module, {"tokens": tokens, "labels": tokens}, forward_only=True)
    del module.loss_func
    if not captured:
        return None
    logits = torch.cat(captured, dim=0)
    layout = trainer.strategy.layout
    if getattr(module, "model", None) is not None and getattr(module.model, "vocab_parallel_logits", False):
        pieces = [torch.empty_like(logits) for _ in range(layout.tensor_model_parallel_size)]
        dist.all_gather(pieces, logits.contiguous(), group=layout.tp_group)
        logits = torch.cat(pieces, dim=-1)
    return logits


class StartLogits(Callback):
    """``fixed_batch_logits`` before the first step."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None

    def on_train_start(self, trainer, module) -> None:
        self.logits = fixed_batch_logits(trainer, module)


class DropoutMasks(Callback):
    """The mask of each dropout in its first call of the training run, by the whole model's name of
    the innermost module running it (``nn.Dropout`` modules, and ``F.dropout`` inside a module's
    forward, as Hugging Face's attention does): ``{name: [sha1 of the mask, its shape, the
    fraction dropped]}``."""

    def __init__(self) -> None:
        self.masks: dict[str, list] = {}
        self._running: list[str] = []
        self._dropout = None

    def on_train_start(self, trainer, module) -> None:
        for name, sub in module.model.named_modules():
            name = name.split(".", 2)[2] if name.startswith("chunks.") and name.count(".") >= 2 else name
            sub.register_forward_pre_hook(lambda *_, name=name: self._running.append(name))
            sub.register_forward_hook(lambda *_: self._leave(), always_call=True)
        self._dropout = F.dropout

        def dropout(input, p=0.5, training=True, inplace=False):
            output = self._dropout(input, p, training, inplace)
            name = self._running[-1] if self._running else "?"
            if training and p > 0 and name not in self.masks:
                dropped = (output == 0) & (input != 0)
                self.masks[name] = [hashlib.sha1(dropped.numpy().tobytes()).hexdigest(), list(dropped.shape),
                                    dropped.float().mean().item()]
            return output

        torch.nn.functional.dropout = dropout

    def _leave(self) -> None:
        self._running.pop()

    def on_train_end(self, trainer, module) -> None:
        torch.nn.functional.dropout = self._dropout


def _gather(value):
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def whole_weights(module: pl.LightningModule, strategy: MHCParallelStrategy) -> dict[str, list]:
    """The whole model's parameters by name, from every rank's pieces (TP slices joined, and an
    expert tensor's EP blocks: ``allreduce = False``, held by the EP ranks, which are DP ranks)."""
    layout = strategy.layout
    mine = {}
    for name, p in module.named_parameters():
        key = module.global_parameter_name(name) if hasattr(module, "global_parameter_name") else name
        mine[key.removeprefix("model.")] = (p.detach().cpu(), int(getattr(p, "partition_dim", -1))
                                            if getattr(p, "tensor_model_parallel", False) else None,
                                            int(getattr(p, "partition_stride", 1)), getattr(p, "allreduce", True))
    ep_rank = layout.expert_model_parallel_rank if layout.expert_model_parallel_size > 1 else 0
    pieces = _gather((layout.data_parallel_rank, layout.tensor_model_parallel_rank, ep_rank, mine))
    whole: dict[str, torch.Tensor] = {}
    for name in sorted({n for *_, m in pieces for n in m}):
        experts = {ep: m[name][0] for _, tp, ep, m in pieces if tp == 0 and name in m and m[name][3] is False}
        if experts:  # this EP rank's block of experts, along dim 0
            whole[name] = torch.cat([experts[ep] for ep in sorted(experts)])
            continue
        # one piece per TP rank (a tied tensor is held by the first and the last stage: same values)
        held = sorted({tp: m[name] for dp, tp, _, m in pieces if dp == 0 and name in m}.items(), key=lambda x: x[0])
        tensor, dim, stride, _ = held[0][1]
        if dim is None:
            whole[name] = tensor
            continue
        parts = [t.unflatten(dim, (stride, t.shape[dim] // stride)) for _, (t, *_) in held]
        whole[name] = torch.cat(parts, dim + 1).flatten(dim, dim + 1)
    return {name: t.flatten().tolist() for name, t in whole.items()}



def _refused_fit(trainer, module, loader) -> dict:
    """``trainer.fit`` that must refuse: every rank's message (None where it trained) and the steps."""
    try:
        trainer.fit(module, train_dataloaders=loader)
        refused = None
    except ConfigError as error:
        refused = str(error)
    return dict(refused=_gather(refused), steps=trainer.global_step)

def fit_case(case: str, devices: int, checkpoints: pathlib.Path | None, weights: str | None = None,
             family_weights: pathlib.Path | None = None) -> dict:
    model, layout_name, variant = (case.split(":") + [""])[:3]
    flags = set(variant.split("-")) - {""}
    tp, pp, v = LAYOUTS[layout_name]
    dp = devices // (tp * pp)
    streams = STREAMS if "hc" in flags else None
    # ":nolabels": a stage left waiting for the other fails in a minute, not the default ten
    deadline = dict(timeout=datetime.timedelta(minutes=1)) if variant == "nolabels" else {}
    strategy = MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=v, num_microbatches=2 if pp > 1 else 1,
                                   sequence_parallel=layout_name.endswith("sp"),
                                   expert_model_parallel_size=2 if layout_name.startswith("ep2") else 1,
                                   use_distributed_optimizer="zero" in flags, **deadline)
    losses, masks, start = Losses(), DropoutMasks(), StartLogits()
    callbacks, ckpt_path = [losses], None
    if "dropout" in flags:
        callbacks.append(masks)
    if "start" in flags:
        callbacks.append(start)
    saved = checkpoints / (model + ("-hc" if streams else "")) if checkpoints is not None else None
    if saved is not None and "resume" in flags:
        ckpt_path = next(saved.glob("*step=2.ckpt"))
    elif saved is not None and layout_name not in ("single", "ep2pp2") and "peft" in flags:
        saved = checkpoints / f"{model}-peft"
        callbacks.append(FinalCheckpointAndLogits(saved))
    elif saved is not None and layout_name not in ("single", "ep2pp2") and flags <= {"hc"} and model not in FAMILIES:
        callbacks += [ModelCheckpoint(dirpath=saved, filename="{step}", save_top_k=-1, every_n_train_steps=2),
                      FinalCheckpointAndLogits(saved)]
    saving = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    # "start": the logits before training are the point (one step: the run is checked to start)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                         max_steps=1 if "start" in flags else STEPS, logger=False,
                         enable_checkpointing=saving, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    if "pretrained" not in flags:
        weights = None
    elif family_weights is not None and (family_weights / model).is_dir():
        weights = str(family_weights / model)
    recompute = "full" if "full" in flags else "mhc_block" if "block" in flags else "none"
    peft = "before" if "peft" in flags else "after" if "peftafter" in flags else None
    if layout_name == "single":
        module = ReferenceLM(model, weights, streams, peft=peft is not None)
    else:
        module = ParallelLM(model, dropout=0.1 if "dropout" in flags else 0.0, recompute=recompute,
                            loss_parallel="gather" not in flags, weights=weights, hyper_connections=streams,
                            hf_checkpointing="before" if "gcbefore" in flags else "after" if "gcafter" in flags else None,
                            hand_layout="nolayout" not in flags, peft=peft, unplaced="unplaced" in flags,
                            lora_dropout=0.1 if "loradropout" in flags else 0.0)
    loader = DataLoader(SyntheticTokens(4 * GLOBAL_BATCH, SEQ, vocab_size=VOCAB), batch_size=GLOBAL_BATCH // dp,
                        shuffle=True, drop_last=True)
    if flags & {"nolayout", "unplaced", "loradropout"}:  # refused on every rank before any step
        return _refused_fit(trainer, module, loader)
    if variant == "nolabels":
        return _refused_fit(trainer, module,
                            DataLoader([{"input_ids": batch["tokens"]} for batch in loader], batch_size=None))
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    result = dict(losses=losses.losses, tp=tp, pp=pp, dp=dp,
                  weights=whole_weights(module, strategy) if "start" not in flags else None)
    if isinstance(module, ParallelLM):
        report = module.model.report
        result["materialised"] = _gather((report.rank_parameters, report.whole_parameters))
    if "start" in flags:  # the last stage's (each of its ranks holds the gathered logits)
        mine = start.logits.tolist() if start.logits is not None else None
        result["start_logits"] = next(r for r in _gather(mine) if r is not None)
    if "dropout" in flags:
        layout = strategy.layout
        result["masks"] = _gather(dict(tp=layout.tensor_model_parallel_rank, pp=layout.pipeline_model_parallel_rank,
                                       dp=layout.data_parallel_rank, masks=masks.masks))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--checkpoints", type=pathlib.Path, help="save checkpoints here / resume from them")
    parser.add_argument("--weights", help="the pretrained weights of the :pretrained cases (a save_pretrained dir)")
    parser.add_argument("--family-weights", type=pathlib.Path,
                        help="a directory of save_pretrained dirs by model name, for their :pretrained cases")
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    results = {case: fit_case(case, args.devices, args.checkpoints, args.weights, args.family_weights)
               for case in args.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
