"""Tensor parallelism on CPU/gloo: TP = 2 and 4 equal TP = 1 (one spawned group of 4 ranks).

Each rank first computes the TP = 1 reference, then rebuilds the model-parallel
state with TP = 2 and TP = 4 and repeats the same steps on the same data, so
one process group covers every layout. Under TP = 2 it also runs every
recompute policy with dropout against ``none``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mhc import GPTModel
from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
from lightning_mhc.recompute import RecomputePolicy, attach_recompute
from lightning_mhc.testing.launch import spawn_ranks
from lightning_mhc.testing.tensor_parallel import gather_tensor_parallel
from model_utils import tiny_config, train_steps

STEPS = 3
CASES = {
    "mha_gelu": dict(),
    "gqa_swiglu_untied_learned_pos": dict(
        num_attention_heads=8,
        num_query_groups=4,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    ),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (4, 16), generator=g)
    return tokens, tokens.roll(-1, dims=1)


def _train(case: dict, layout) -> dict:
    """3 SGD steps (linear in the gradients, so layout round-off is not amplified the way
    Adam amplifies near-zero gradients); returns per-step losses, full gradients of every
    step, final full weights, and whether every replicated tensor is bit-identical across TP."""
    model = GPTModel(tiny_config(**case), layout=layout)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, replicas_identical = [], {}, True
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    for step in range(STEPS):
        tokens, labels = _batch(step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
        for name, p in model.named_parameters():
            grads[(step, name)] = gather_tensor_parallel(p.grad, p).clone()
            if not getattr(p, "tensor_model_parallel", False) and tp > 1:
                for t in (p.detach(), p.grad):
                    copies = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(copies, t.contiguous(), group=tp_group)
                    replicas_identical &= all(torch.equal(c, copies[0]) for c in copies)
        opt.step()
        opt.zero_grad()
    weights = {n: gather_tensor_parallel(p.detach(), p).clone() for n, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, weights=weights, replicas_identical=replicas_identical)


def _policy_histories(layout) -> dict:
    """3 AdamW steps with dropout under each recompute policy (same layout, same seeds)."""
    histories = {}
    for policy in ("none", "selective", "mhc_block", "full"):
        cfg = tiny_config(hidden_dropout=0.1, attention_dropout=0.1, mhc_recompute_layer_num=2)
        model = GPTModel(RecomputePolicy(policy).apply(cfg), layout=layout)
        attach_recompute(model)
        histories[policy] = train_steps(model)
    return histories


def _tp_layouts(rank: int, world_size: int) -> dict:
    results = {}
    for tp in (1, 2, 4):
        layout = ParallelLayout(tensor_model_parallel_size=tp).build()
        for name, case in CASES.items():
            torch.manual_seed(0)
            results[(name, tp)] = _train(case, layout)
        if tp == 2:
            policies = _policy_histories(layout)
        destroy_parallel()
    if rank != 0:
        return {k: v["replicas_identical"] for k, v in results.items()}
    results["policies_tp2"] = policies
    return results


def test_tensor_parallel_matches_single_rank():
    per_rank = spawn_ranks(_tp_layouts, 4, timeout_s=240)
    results = per_rank[0]
    for name in CASES:
        ref = results[(name, 1)]
        for tp in (2, 4):
            got = results[(name, tp)]
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5,
                msg=lambda m: f"{name} TP={tp} losses: {m}",
            )
            assert got["grads"].keys() == ref["grads"].keys()
            for (step, param), grad in ref["grads"].items():
                torch.testing.assert_close(
                    got["grads"][(step, param)], grad, rtol=0, atol=1e-5,
                    msg=lambda m: f"{name} TP={tp} step {step} grad of {param}: {m}",
                )
            for param, weight in ref["weights"].items():
                torch.testing.assert_close(
                    got["weights"][param], weight, rtol=0, atol=1e-5,
                    msg=lambda m: f"{name} TP={tp} weight {param} after {STEPS} steps: {m}",
                )
    # every recompute policy equals `none` under TP = 2 (with dropout), within 1e-5
    policies = results.pop("policies_tp2")
    for policy, history in policies.items():
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, policies["none"])):
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
            for param, grad in ref_grads.items():
                torch.testing.assert_close(
                    grads[param], grad, rtol=0, atol=1e-5,
                    msg=lambda m: f"TP=2 policy {policy} step {step} grad of {param}: {m}",
                )
    # replicated parameters (hyper-connections, norms, row-parallel biases) stay
    # bit-identical across the ranks of every TP group, on every rank
    for rank, rank_results in enumerate(per_rank):
        flags = {k: (v if isinstance(v, bool) else v["replicas_identical"]) for k, v in rank_results.items()
                 if k != "policies_tp2"}
        assert all(flags.values()), f"rank {rank}: replicated tensors diverged across TP: {flags}"
