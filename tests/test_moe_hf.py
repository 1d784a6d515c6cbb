"""Hugging Face mixture-of-experts models under expert parallelism (``any_model/experts.py``), with
4 hyper-connection streams, from ``save_pretrained`` files, against the unmodified model in one
process (fp32, within 1e-5).

One spawned 4-rank group runs every case: tiny Mixtral and Qwen3-MoE on EP 2 x PP 2 (DP 2: each
EP rank holds 2 of the 4 experts and routes its own rows), step-0 logits and 3 SGD steps through
the 1F1B schedule, then a checkpoint exported by ``export_pretrained`` and read back by
``from_pretrained``; Qwen2-MoE (shared expert with its sigmoid gate) and OLMoE on EP 2 (DP 4),
step-0 logits (Qwen2-MoE also drawn from the seed, not read); Mixtral on TP 2 x EP 2 (DP 2),
step-0 logits. The one-process references run here, in the test's process.
"""
from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from lightning_mhc import ConfigError  # noqa: E402
from lightning_mhc.any_model import (  # noqa: E402
    add_hyper_connections, build_recorded_module, check_parallelize, export_pretrained, load_pretrained, parallelize,
    record_module_init)
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402

VOCAB, SEQ, ROWS, MICRO, STEPS, LR, STREAMS = 64, 8, 8, 2, 3, 0.2, 4
"""Global batch of ``ROWS`` sequences of ``SEQ`` tokens (+1 for the labels), microbatches of
``MICRO`` rows, ``STEPS`` SGD steps at ``LR``, ``STREAMS`` hyper-connection streams."""
TRAINED = ("mixtral", "qwen3_moe")
"""Trained on EP 2 x PP 2."""
LOGITS_ONLY = ("qwen2_moe", "olmoe")
"""Step-0 logits on EP 2."""
SEEDED = "qwen2_moe"
"""Also built from seed 0 (no files) on EP 2."""
FUSED = "olmoe"
"""Also read from one file of the model's own state dict (fused expert tensors) on EP 2."""
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=1, pad_token_id=None)


def _configs() -> dict:
    t = transformers
    return {
        "mixtral": t.MixtralConfig(**_COMMON, num_key_value_heads=2, intermediate_size=16, num_local_experts=4,
                                   num_experts_per_tok=2),
        "qwen3_moe": t.Qwen3MoeConfig(**_COMMON, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": t.Qwen2MoeConfig(**_COMMON, num_key_value_heads=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2),
        "olmoe": t.OlmoeConfig(**_COMMON, num_key_value_heads=4, intermediate_size=16, num_experts=4,
                               num_experts_per_tok=2),
    }


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _parallel(directory: pathlib.Path, layout: ParallelLayout, weights: pathlib.Path | None | bool = True):
    """The model of ``directory`` on ``layout`` (the logits gathered over TP), its weights read from
    its files (``True``), from other files, or drawn from seed 0 (``None``)."""
    model = _meta(transformers.AutoConfig.from_pretrained(directory))
    return parallelize(model, "auto", layout=layout, weights=directory if weights is True else weights,
                       hyper_connections=STREAMS, loss_parallel=False)


def _train_on_ep2_pp2(directory: pathlib.Path, checkpoint: pathlib.Path) -> dict:
    """Step-0 logits (forward-only schedule), ``STEPS`` SGD steps, then a checkpoint."""
    import torch.distributed as dist

    from lightning_mhc.checkpoint.format import MODEL, model_state, save
    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining

    layout = ParallelLayout(pipeline_model_parallel_size=2, expert_model_parallel_size=2).build()
    model = _parallel(directory, layout)
    experts = [m for m in model.modules() if type(m).__name__ == "ExpertParallelExperts"]
    per_rank, dp_rank = ROWS // layout.data_parallel_size, layout.data_parallel_rank
    logits = []

    def loss_func(output, microbatch):
        logits.append(output.detach())
        return model.loss(output, microbatch["labels"])

    def run(step: int, forward_only: bool = False):
        rows = batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        microbatches = [dict(input_ids=c[:, :-1], labels=c[:, 1:]) for c in rows.split(MICRO)]
        return forward_backward_pipelining(
            [model], microbatches, lambda m, mb: m.forward_step({"input_ids": mb["input_ids"]}), loss_func,
            ScheduleConfig(layout, model.pipeline_tensor_shape(microbatches[0]), forward_only=forward_only))

    run(0, forward_only=True)
    step0 = torch.cat(logits) if logits else None
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        losses.append(run(step).loss.item())
        finalize_model_grads([model], layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {f"model.{name}": tensor for name, tensor in model_state(model, layout).items()}
    save({MODEL: state}, checkpoint, layout, dist.get_rank())
    return dict(step0=step0, dp_rank=dp_rank, losses=losses, ep_rank=layout.expert_model_parallel_rank,
                local_experts=[(e.local_expert_start, tuple(e.gate_up_proj.shape)) for e in experts])


ROUTER_LOSS = {"mixtral": (2, 1, 1), "qwen2_moe": (1, 2, 1), "mixtral4": (2, 1, 2)}
"""The models trained with their own router loss (``output_router_logits``, coef ``AUX_COEF``), a
padded row in each microbatch, on (PP, TP, virtual stages) x EP 2: Mixtral on EP 2 x PP 2, Qwen2-MoE
on TP 2 x EP 2, a 4-layer Mixtral on EP 2 x PP 2 with 2 virtual stages (the interleaved schedule)."""
AUX_COEF = 0.5
"""Large, so that a run that drops the term or its gradient is far off (Mixtral's default is 0.001)."""


def padding_mask(rows: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` ones, the first 3 positions of every other row padded (0)."""
    mask = torch.ones(rows.shape[0], SEQ, dtype=torch.long)
    mask[::2, :3] = 0
    return mask


def shifted_labels(rows: torch.Tensor) -> torch.Tensor:
    """The next tokens, the last position ignored: Hugging Face's loss with ``labels=input_ids``."""
    labels = rows[:, 1:].clone()
    labels[:, -1] = -100
    return labels


class _Chunks:
    """The pipeline contract over a split model's chunks (the interleaved schedule's form)."""

    def __init__(self, model) -> None:
        self.model = model

    def model_chunks(self) -> list:
        return list(self.model.chunks)

    def set_input_tensor(self, tensor, chunk: int = 0) -> None:
        self.model.set_input_tensor(tensor, chunk)

    def forward_step(self, microbatch: dict, chunk: int = 0):
        inputs = {"input_ids": microbatch["input_ids"], "attention_mask": microbatch["attention_mask"]}
        return self.model.forward_step(inputs, chunk)

    def parameters(self):
        return self.model.parameters()


def _train_router_loss(directory: pathlib.Path, pp: int, tp: int, virtual: int) -> dict:
    """A forward-only schedule on step 0's batch, then ``STEPS`` SGD steps of ``ParallelModel.loss``
    (CE + coef x the router loss) on PP x TP x EP 2; the losses and this rank's parameters by their
    whole-model names (experts: ``(start, block)``)."""
    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining

    layout = ParallelLayout(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                            virtual_pipeline_model_parallel_size=virtual,
                            expert_model_parallel_size=2).build()
    model = _parallel(directory, layout)
    per_rank, dp_rank = ROWS // layout.data_parallel_size, layout.data_parallel_rank
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def run(step: int, forward_only: bool = False) -> float:
        rows = batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        microbatches = [dict(input_ids=c[:, :-1], labels=shifted_labels(c), attention_mask=padding_mask(c))
                        for c in rows.split(MICRO)]
        return forward_backward_pipelining(
            _Chunks(model), microbatches, lambda m, mb: m.forward_step(mb),
            lambda output, mb: model.loss(output, mb["labels"]),
            ScheduleConfig(layout, model.pipeline_tensor_shape(microbatches[0]), forward_only=forward_only)).loss.item()

    evaluated = run(0, forward_only=True)  # an evaluation's loss holds the term too, and leaves nothing pending
    losses = []
    for step in range(STEPS):
        losses.append(run(step))
        finalize_model_grads([model], layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {}
    for name, param in model.named_parameters():
        owner = param
        experts = next((m for m in model.modules() if type(m).__name__ == "ExpertParallelExperts"
                        and any(p is param for p in m.parameters())), None)
        full = model.global_parameter_name(name)
        if tp > 1 and experts is None and "mlp" not in full and "norm" not in full:
            continue  # split over TP: the replicated router, norms and experts are the subject here
        params[full] = (experts.local_expert_start if experts is not None else None, owner.detach().clone())
    return dict(losses=losses, params=params, evaluated=evaluated)


def _all_cases(rank: int, world: int, root: str) -> dict:
    root = pathlib.Path(root)
    results = {f"{name}+aux": _train_router_loss(root / f"{name}+aux", *ROUTER_LOSS[name]) for name in ROUTER_LOSS}
    results.update({name: _train_on_ep2_pp2(root / name, root / f"{name}.ckpt") for name in TRAINED})
    layout = ParallelLayout(expert_model_parallel_size=2).build()
    rows = batch(0)[rank:rank + 1, :-1]
    with torch.no_grad():
        for name in LOGITS_ONLY:
            results[name] = _parallel(root / name, layout)(input_ids=rows)
        # drawn, not read: each rank cuts its experts out of the whole tensors the seed draws
        results["seeded"] = _parallel(root / SEEDED, layout, weights=None)(input_ids=rows)
        # the fused [E, ...] tensors in the file (as the model names them): each rank reads its block
        results["fused"] = _parallel(root / FUSED, layout, weights=root / f"{FUSED}.safetensors")(input_ids=rows)
        # TP 2 x EP 2 (DP 2): the attention split over TP, the experts whole on both TP ranks
        layout = ParallelLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2).build()
        dp_rank = layout.data_parallel_rank
        results["tp2ep2"] = dp_rank, _parallel(root / TRAINED[0], layout)(input_ids=batch(0)[dp_rank:dp_rank + 1, :-1])
    return results


def _reference(directory: pathlib.Path) -> torch.nn.Module:
    """The unmodified model from the files, with the same hyper-connections (exact at step 0)."""
    return add_hyper_connections(transformers.AutoModelForCausalLM.from_pretrained(directory), STREAMS)


def _logits(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=rows[:, :-1]).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """Each family's tiny model with weights off any init (routers off zero), written by
    ``save_pretrained`` in several files: ``<root>/<model_type>``."""
    root = tmp_path_factory.mktemp("moe_hf")
    for seed, (name, config) in enumerate(_configs().items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / name, max_shard_size="40KB")
        if name in ROUTER_LOSS:  # the same model asking for its router loss
            model.config.output_router_logits, model.config.router_aux_loss_coef = True, AUX_COEF
            model.save_pretrained(root / f"{name}+aux", max_shard_size="40KB")
        if name == FUSED:
            save_file(model.state_dict(), root / f"{name}.safetensors")
    config = _configs()["mixtral"]  # 4 layers: 2 virtual stages of one layer on each of 2 ranks
    config.num_hidden_layers, config.output_router_logits, config.router_aux_loss_coef = 4, True, AUX_COEF
    torch.manual_seed(len(_configs()))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "mixtral4+aux", max_shard_size="40KB")
    return root


def test_moe_models_on_expert_parallel_layouts_equal_one_process(saved):
    results = spawn_ranks(_all_cases, 4, str(saved), timeout_s=240)
    for name in TRAINED:
        reference = _reference(saved / name)
        expected = _logits(reference, batch(0))
        per_rank = ROWS // 2
        on_last_stage = [r[name] for r in results if r[name]["step0"] is not None]
        assert sorted(r["dp_rank"] for r in on_last_stage) == [0, 1]
        for r in on_last_stage:  # each DP (= EP) rank's rows
            rows = slice(r["dp_rank"] * per_rank, (r["dp_rank"] + 1) * per_rank)
            torch.testing.assert_close(r["step0"], expected[rows], rtol=0, atol=1e-5)
        # each EP rank holds its half of each layer's 4 experts
        assert {r[name]["ep_rank"]: r[name]["local_experts"][0] for r in results} == \
            {0: (0, (2, 32, 32)), 1: (2, (2, 32, 32))}

        optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
        ref_losses = []
        for step in range(STEPS):
            data = batch(step)
            logits = reference(input_ids=data[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, -2), data[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
        for r in results:
            torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)

        # the EP x PP checkpoint, exported for from_pretrained, is the one-process trained model
        exported = saved / f"{name}.export"
        export_pretrained(saved / f"{name}.ckpt", _reference(saved / name), exported)
        back = load_pretrained(exported)
        trained = reference.state_dict()
        assert back.state_dict().keys() == trained.keys()
        worst = max((back.state_dict()[k] - v).abs().max().item() for k, v in trained.items())
        moved = max((_reference(saved / name).state_dict()[k] - v).abs().max().item() for k, v in trained.items())
        print(f"{name} EP 2 x PP 2: losses {results[0][name]['losses']} (one process {ref_losses}); "
              f"exported weights within {worst:.2g} of one process (training moved them by up to {moved:.2g})")
        assert worst <= 1e-5 < moved

    for name, layout in ROUTER_LOSS.items():
        _check_router_loss(saved / f"{name}+aux", [r[f"{name}+aux"] for r in results], *layout)

    expected = _logits(_reference(saved / TRAINED[0]), batch(0))
    for dp_rank, logits in (r["tp2ep2"] for r in results):
        torch.testing.assert_close(logits, expected[dp_rank:dp_rank + 1], rtol=0, atol=1e-5)
    seeded = add_hyper_connections(_meta(transformers.AutoConfig.from_pretrained(saved / SEEDED)), STREAMS)
    for name, reference in [(name, _reference(saved / name)) for name in LOGITS_ONLY] + \
            [("seeded", build_recorded_module(seeded)), ("fused", _reference(saved / FUSED))]:
        expected = _logits(reference, batch(0))
        for rank, r in enumerate(results):
            torch.testing.assert_close(r[name], expected[rank:rank + 1], rtol=0, atol=1e-5)


def _check_router_loss(directory: pathlib.Path, results: list[dict], pp: int, tp: int, virtual: int) -> None:
    """The split run against one process: per step, the mean over the DP ranks and microbatches of
    the model's own ``model(..., labels=...).loss`` (CE + coef x its load-balancing loss, each DP
    rank's microbatch on its own, as Hugging Face under DDP), SGD on that mean; losses and weights
    within 1e-5, and the router loss's part of the loss far above that."""
    reference = _reference(directory)
    assert reference.config.output_router_logits and reference.config.router_aux_loss_coef == AUX_COEF
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses, aux_parts = [], []
    for step in range(STEPS):
        losses = []
        for chunk in batch(step).split(MICRO):  # DP ranks' rows in order, then their microbatches
            labels = chunk[:, :-1].clone()  # HF shifts them: position t's target is labels[t + 1]
            out = reference(input_ids=chunk[:, :-1], attention_mask=padding_mask(chunk), labels=labels)
            losses.append(out.loss)
            aux_parts.append(AUX_COEF * out.aux_loss.item())
        loss = torch.stack(losses).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        assert abs(r["evaluated"] - ref_losses[0]) <= 1e-5  # the forward-only schedule before step 0
    trained = dict(reference.named_parameters())
    compared = 0
    for r in results:
        for name, (start, param) in r["params"].items():
            expected = trained[name].detach()
            if start is not None:
                expected = expected[start:start + param.shape[0]]
            torch.testing.assert_close(param, expected, rtol=0, atol=1e-5, msg=name)
            compared += 1
    assert compared and min(aux_parts) > 0.5  # the term (coef x ~2) is far above the tolerance
    print(f"{directory.name} PP {pp} (v {virtual}) x TP {tp} x EP 2: losses {results[0]['losses']} (one process {ref_losses}; "
          f"router loss's part {min(aux_parts):.3f}..{max(aux_parts):.3f}); {compared} tensors within 1e-5")


def _meta(config):
    with record_module_init():
        return transformers.AutoModelForCausalLM.from_config(config)


def test_expert_parallel_sizes_that_do_not_fit_are_refused():
    config = _configs()["mixtral"]
    with pytest.raises(ConfigError, match=r"has 4 experts, which do not split evenly over 3 ranks"):
        check_parallelize(_meta(config), "auto", layout=ParallelLayout(expert_model_parallel_size=3))
    dense = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=4)
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM has no fused experts"):
        check_parallelize(_meta(dense), "auto", layout=ParallelLayout(expert_model_parallel_size=2))
