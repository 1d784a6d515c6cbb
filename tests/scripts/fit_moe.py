"""The GPT with MoE layers and 4 hyper-connection streams through ``Trainer.fit`` and
``MHCParallelStrategy(expert_model_parallel_size=...)``, several layouts in one process group.

    python fit_moe.py --devices 1 --out reference.json          # the one-process reference
    python fit_moe.py --devices 4 --reference reference.json --out result.json

Every case fits the same global batches (8 sequences in 2 microbatches, shuffled loader) for
``STEPS`` steps with ``mhc_block`` recompute and records per step the loss and the logged
auxiliary losses; at the end every rank compares its weights and expert biases with the
reference's (its experts' slice) and reports the largest difference (SGD with momentum: see
``SGDModule``). With ``dropout`` the same
layout without recompute is the reference (dropout masks differ across data-parallel ranks, so
no one-process run draws them). The EP 2 case saves a checkpoint at step ``SAVE_AT``, which
EP 1 (DP 4) continues: its later steps' losses and final weights against EP 2's.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 16, 8, 4, 2
CASES = {  # name: (tp, pp, ep, distributed optimizer)
    "ep2": (1, 1, 2, False), "ep2_pp2": (1, 2, 2, False), "tp2_ep2": (2, 1, 2, False), "ep2_zero": (1, 1, 2, True),
}
AUX = ("moe/load_balancing_loss", "moe/z_loss")


def model_config(dropout: float) -> dict:
    return dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256,
                max_sequence_length=SEQ, hidden_dropout=dropout, attention_dropout=dropout,
                mhc_sinkhorn_iterations=4, num_residual_streams=4, add_bias_linear=False,
                num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.01, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


class SGDModule(MHCGPTModule):
    """SGD with momentum: AdamW's normalised update turns a gradient's last-bit difference into a
    weight difference of up to the learning rate where the gradient is tiny, so final weights are
    compared after SGD (the losses would do with either)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SaveAt(Callback):
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.path)


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.aux: list[list[float]] = []
        self.tokens: list[dict[str, float]] = []
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.aux.append([float(trainer.callback_metrics[k]) for k in AUX])
        self.norms.append(float(trainer.callback_metrics["grad_norm"]))
        self.tokens.append({k: float(v) for k, v in trainer.callback_metrics.items()
                            if "tokens_per_expert" in k or k.endswith("balance")})


def final_state(module: MHCGPTModule) -> dict[str, tuple[int, torch.Tensor]]:
    """Global name -> (first row it holds along dim 0, this rank's tensor): parameters and the
    expert biases; an expert tensor's rows start at its rank's first expert. A TP-split tensor
    is gathered over TP whole (megatron's strided split undone)."""
    starts = {}
    for _, layer in module.moe_layers():
        for p in layer.experts.parameters():
            starts[id(p)] = layer.local_expert_start
    state = {}
    for chunk in module.model_chunks():
        named = list(chunk.named_parameters()) + [(n, b) for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
        for name, tensor in named:
            state[chunk.global_parameter_name(name)] = (starts.get(id(tensor), 0), _whole_over_tp(tensor, module))
    return state


def _whole_over_tp(tensor: torch.Tensor, module: MHCGPTModule) -> torch.Tensor:
    layout = module.trainer.strategy.layout
    tp = layout.tensor_model_parallel_size
    if tp == 1 or not getattr(tensor, "tensor_model_parallel", False):
        return tensor.detach().clone()
    dim, stride = tensor.partition_dim, getattr(tensor, "partition_stride", 1)
    pieces = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=layout.tp_group)
    # stride s: each rank holds its part of each of the s blocks along dim
    blocks = [piece.chunk(stride, dim) for piece in pieces]
    return torch.cat([blocks[r][b] for b in range(stride) for r in range(tp)], dim)


def fit_case(tp: int, pp: int, ep: int, zero: bool, devices: int, dropout: float, policy: str,
             save: pathlib.Path | None = None, resume: pathlib.Path | None = None):
    strategy = MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   expert_model_parallel_size=ep, num_microbatches=2,
                                   use_distributed_optimizer=zero)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1, gradient_clip_val=0.05,
                         callbacks=[recorder, MHCRecomputeCallback(policy)] + ([SaveAt(save)] if save else []))
    module = SGDModule(model_config(dropout))
    dp = devices // (tp * pp)
    loader = DataLoader(SyntheticTokens(STEPS * GLOBAL_BATCH, SEQ), batch_size=GLOBAL_BATCH // dp, shuffle=True,
                        drop_last=True)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(resume) if resume else None)
    return recorder, final_state(module)


def largest_difference(state: dict, reference: dict, same_layout: bool = False) -> float:
    """The largest difference of this rank's tensors from the reference's (one process's: this
    rank's experts sliced out of it; ``same_layout``: another run on this rank)."""
    worst = 0.0
    for name, (start, tensor) in state.items():
        expected = reference[name][1]
        if not same_layout and tensor.dim():
            expected = expected[start:start + tensor.shape[0]]
        worst = max(worst, (tensor - expected).abs().max().item())
    return worst


def _max_over_ranks(value: float) -> float:
    box = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return box.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--reference", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="with --devices 4: these cases only, "
                        "no checkpoint or dropout runs (for trying a change quickly)")
    args = parser.parse_args()
    results = {}
    if args.devices == 1:
        pl.seed_everything(7, verbose=False)
        recorder, state = fit_case(1, 1, 1, False, 1, 0.0, "mhc_block")
        torch.save({k: v for k, v in state.items()}, args.out.with_suffix(".pt"))
        results["single"] = dict(losses=recorder.losses, aux=recorder.aux, tokens=recorder.tokens,
                                 norms=recorder.norms)
    else:
        reference = torch.load(args.reference.with_suffix(".pt"))
        checkpoint = args.out.parent / "ep2_step2.ckpt"
        states = {}
        for name in args.cases:
            tp, pp, ep, zero = CASES[name]
            pl.seed_everything(7, verbose=False)
            recorder, states[name] = fit_case(tp, pp, ep, zero, args.devices, 0.0, "mhc_block",
                                              save=checkpoint if name == "ep2" else None)
            results[name] = dict(losses=recorder.losses, aux=recorder.aux, tokens=recorder.tokens, norms=recorder.norms,
                                 weights=_max_over_ranks(largest_difference(states[name], reference)))
            print(name, json.dumps({k: v for k, v in results[name].items() if k != "tokens"}), flush=True)
        if args.cases == list(CASES):
            results.update(continued_and_dropout(args.devices, checkpoint, reference))
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))


def continued_and_dropout(devices: int, checkpoint: pathlib.Path, reference: dict) -> dict:
    """EP 2's checkpoint continued on EP 1, and with dropout ``mhc_block`` against no recompute."""
    pl.seed_everything(7, verbose=False)
    recorder, state = fit_case(1, 1, 1, False, devices, 0.0, "mhc_block", resume=checkpoint)
    results = {"ep2_to_ep1": dict(losses=recorder.losses, aux=recorder.aux,
                                  weights=_max_over_ranks(largest_difference(state, reference)))}
    runs = {}
    for policy in ("none", "mhc_block"):  # dropout: recompute against none on EP 2 x PP 2
        pl.seed_everything(7, verbose=False)
        runs[policy] = fit_case(1, 2, 2, False, devices, 0.1, policy)
    (plain, plain_state), (block, block_state) = runs["none"], runs["mhc_block"]
    results["dropout"] = dict(losses=block.losses, reference_losses=plain.losses, aux=block.aux,
                              reference_aux=plain.aux,
                              weights=_max_over_ranks(largest_difference(block_state, plain_state, same_layout=True)))
    return results


if __name__ == "__main__":
    main()
