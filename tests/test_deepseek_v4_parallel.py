"""DeepSeek-V4 (``deepseek_v4``) through ``parallelize(model, plan="auto")`` (``any_model/deepseek_v4.py``,
its family record): its own hyper-connections kept as they are (``hc_mult`` streams, none added),
from ``save_pretrained`` files in several shards (DeepSeek's own tensor names, the experts one file
tensor each), against the model in one process (fp32).

A tiny V4 (tests/v4_utils.py: compressed sparse and heavily compressed attention, a sliding-window
layer, a hash-routed layer with ``tid2eid`` spreading tokens over the experts, every map moved off
its init): on one process bit-exact. One spawned 4-rank group runs every distributed case
(``_all_layouts``): step-0 logits on PP 2, TP 2, TP 2 x PP 2, PP 2 x EP 2, TP 2 x EP 2, under
context parallelism (``any_model/deepseek_v4_context.py``: CP 2, TP 2 x CP 2, PP 2 x CP 2, a
left-padded batch) and with sequence parallelism (TP 2, TP 2 x PP 2, TP 2 x CP 2) within 1e-5;
``Trainer.fit`` on TP 2 x EP 2, TP 2 x CP 2, CP 2 x EP 2, TP 2 with sequence parallelism, on TP 2 x
DP 2 with ZeRO-1 and on TP 2 x PP 2 (its step-2 checkpoint continued on PP 2 x EP 2, then read in
one process, exported and read back by ``from_pretrained``, greedy ``generate``), losses and
weights within 1e-5 of one process; ``mhc_block`` on its own hyper-connections on TP 2 x PP 2, CP 2
and EP 2 (after ``use_our_ops``) against the same layout without it (1e-6, fewer bytes); PP 2 x EP 2
with the router's own loss and the auxiliary-free bias update against transformers' model trained
by hand; the TP attention's registration gone with the run. Refused in one line before anything is
built or launched: layouts that do not divide its heads, groups or experts,
``hyper_connections=n``, a transformers without the model.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

from lightning_mhc import ConfigError  # noqa: E402
from lightning_mhc.any_model import check_parallelize, parallelize, record_module_init  # noqa: E402
from lightning_mhc.distributed.context_parallel import shard_sequence  # noqa: E402
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402
from v4_utils import V4_EXPERTS, V4_VOCAB, moved_from_init, tiny_v4_config  # noqa: E402

SEQ, ROWS, MICRO = 16, 4, 1
"""``ROWS`` sequences of ``SEQ`` tokens (two CSA windows of the indexer's top 2, two HCA windows,
twice the sliding window), in microbatches of ``MICRO`` rows."""


def batch() -> torch.Tensor:
    return torch.randint(0, V4_VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def meta_model(directory: pathlib.Path):
    with record_module_init():
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    return save_moved(tmp_path_factory.mktemp("deepseek_v4"), tiny_v4_config())


def save_moved(directory: pathlib.Path, config) -> pathlib.Path:
    """A model of ``config``, its maps moved off their init, saved in ``directory`` in several
    shards (shared by HY-V4's test)."""
    torch.manual_seed(0)
    model = moved_from_init(transformers.AutoModelForCausalLM.from_config(config))
    model.save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) > 2
    return directory


def padding() -> torch.Tensor:
    """A left-padding mask of the batch: row ``i`` starts after ``PADS[i]`` pad tokens (crossing
    the first CP chunk border for the last rows)."""
    return (torch.arange(SEQ)[None, :] >= torch.tensor(PADS)[:, None]).long()


PADS = (0, 3, 5, 7)


def reference_logits(directory: pathlib.Path, padded: bool = False) -> torch.Tensor:
    """The model as transformers reads its files, in one process."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(input_ids=batch(), attention_mask=padding() if padded else None).logits


def _pipeline_logits(directory: pathlib.Path, layout: ParallelLayout, padded: bool = False) -> tuple:
    """Step-0 logits of this DP rank's rows (of its CP chunks) through the forward-only pipeline
    schedule (None before the last stage)."""
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining

    model = parallelize(meta_model(directory), "auto", layout=layout, weights=directory, loss_parallel=False)
    per_rank, dp_rank = ROWS // layout.data_parallel_size, layout.data_parallel_rank
    rows = batch()[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    masks = padding()[dp_rank * per_rank:(dp_rank + 1) * per_rank].split(MICRO)
    microbatches = [dict(input_ids=c, attention_mask=m if padded else None) for c, m in zip(rows.split(MICRO), masks)]
    logits = []

    def loss_func(output, microbatch):
        logits.append(output.detach())
        return output.sum() * 0

    forward_backward_pipelining([model], microbatches, lambda m, mb: m.forward_step(mb), loss_func,
                                ScheduleConfig(layout, model.pipeline_tensor_shape(microbatches[0]), forward_only=True))
    experts = {(m.local_expert_start, m.gate_up_proj.shape[0]) for m in model.modules()
               if type(m).__name__ == "ExpertParallelExperts"}
    cp_rank = layout.context_parallel_rank if layout.context_parallel_size > 1 else None
    return dp_rank, torch.cat(logits) if logits else None, experts, layout.expert_model_parallel_rank, cp_rank


SP = dict(sequence_parallel=True)
"""Sequence parallelism: between the TP regions each TP rank holds its half of the sequence."""
LAYOUTS = {"pp2": dict(pipeline_model_parallel_size=2), "tp2": dict(tensor_model_parallel_size=2),
           "tp2pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
           "tp2 sp": dict(tensor_model_parallel_size=2, **SP),
           "tp2pp2 sp": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, **SP),
           "tp2cp2 sp": dict(tensor_model_parallel_size=2, context_parallel_size=2, **SP),
           "pp2ep2": dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
           "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
           "cp2": dict(context_parallel_size=2), "tp2cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
           "pp2cp2": dict(pipeline_model_parallel_size=2, context_parallel_size=2),
           "cp2 padded": dict(context_parallel_size=2)}
"""The layouts of the 4 ranks (DP fills the rest); "padded": the batch left-padded (``PADS``);
"sp": with sequence parallelism (each TP rank's 8 of the 16 tokens between the TP regions; the
attention's compressor and indexer read the gathered sequence; under CP 2 each TP rank holds one
chunk of its CP rank's two). Under CP 2 each sequence of ``SEQ`` tokens is cut into 4 chunks of 4: the sliding window (8), the
HCA windows (8) and CSA's overlapping pairs of windows (2 x 4) cross the chunk borders."""


BLOCK_RECOMPUTE = dict(name="mhc_block", layer_num=2)
"""``mhc_block`` on V4's own hyper-connections, one recompute group per pipeline stage of 2 layers
(the second layer's input streams are the first's checkpointed, freed output)."""
MEASURED = dict(measure_activation_memory=True)
FITS = {"tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        "tp2cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
        "cp2ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),
        "tp2 sp": dict(tensor_model_parallel_size=2, **SP),
        "tp2pp2 mhc_block": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 recompute=BLOCK_RECOMPUTE, **MEASURED),
        "cp2": dict(context_parallel_size=2, **MEASURED),
        "cp2 mhc_block": dict(context_parallel_size=2, recompute=BLOCK_RECOMPUTE, **MEASURED),
        "ep2 our ops": dict(expert_model_parallel_size=2, our_ops=True, **MEASURED),
        "ep2 our ops mhc_block": dict(expert_model_parallel_size=2, our_ops=True, recompute=BLOCK_RECOMPUTE,
                                      **MEASURED)}
"""The layouts trained through ``Trainer.fit``: the shared K/V head's gradient summed over TP, the
experts' over their ranks; under CP the gathered K/V's and compressor inputs' gradients
reduce-scattered back to their ranks, the loss each rank's part of the mean; under sequence
parallelism ("sp") the replicated attention branches' gradients summed once, by the gathered
sequence's reduce-scatter, and the replicated parameters' over TP; the block recompute of its
hyper-connections (:data:`BLOCK_RECOMPUTE`) on TP 2 x PP 2, CP 2 and EP 2 (DP 4), the last with
its hyper-connections on our kernels (``use_our_ops``: "our ops"), each beside the same layout
without it (:data:`RECOMPUTED`; TP 2 x PP 2's is ``SAVED_ON``'s run), their retained activation
bytes measured."""
RECOMPUTED = {"TP 2 x PP 2": ("fit tp2pp2 mhc_block", "saved"), "CP 2": ("fit cp2 mhc_block", "fit cp2"),
              "EP 2 on our ops": ("fit ep2 our ops mhc_block", "fit ep2 our ops")}
"""``mhc_block`` on its own hyper-connections beside the same layout without it: ``(with, without)``
of ``_all_layouts``' results."""
ZERO = dict(tensor_model_parallel_size=2, use_distributed_optimizer=True)
"""ZeRO-1 (DP 2): each DP rank steps its shard of the momentum and weights (the experts' too,
whole on every rank here) and gathers the rest."""
SAVED_ON, RESUMED_ON = (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2))
"""Save and go on: TP 2 x PP 2 saves its step ``SAVE_AT`` (``ModelCheckpoint``, which calls
``trainer.save_checkpoint``), continued from it on PP 2 x EP 2 (DP 2) and saved again by
``trainer.save_checkpoint``, then read in one process."""
FIT_STEPS, FIT_ROWS, FIT_LR, SAVE_AT = 3, 4, 0.05, 2
BALANCED = dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
"""The layout the router's own loss and the auxiliary-free bias update train on (DP 2): the
routers' statistics cross the stages, the counts the DP ranks."""
AUX_COEF, BIAS_RATE = 0.5, 0.02


def _fit(directory: pathlib.Path, devices: int, router_bias_update_rate: float = 0.0, resume: str | None = None,
         save_at: str | None = None, save: str | None = None, keep_model: bool = False, recompute=None,
         our_ops: bool = False, **sizes) -> dict:
    """``FIT_STEPS`` SGD steps (momentum 0.9) of ``HFCausalLMModule`` (the CLI's ``model=hf``)
    through ``Trainer.fit`` on ``MHCParallelStrategy(**sizes)`` (from the checkpoint ``resume``;
    saving ``save_at/step=2.ckpt`` at step ``SAVE_AT`` as a run checkpointing as it goes, and
    ``trainer.save_checkpoint(save)`` at the end; ``recompute``: the policy an
    ``MHCRecomputeCallback`` selects; ``our_ops``: the model's hyper-connections run on our
    kernels, ``use_our_ops`` on the recorded model before ``parallelize``): each step's loss, this rank's parameters by their
    whole-model names (gathered over TP; experts: ``(start, block)``), its routers'
    score-correction biases, the batches it trained on (with its DP rank) and the strategy's
    ``activation_bytes`` (None unless ``measure_activation_memory``); ``keep_model``: the trained
    model and the module's hyperparameters too (one process)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy, MHCRecomputeCallback
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.testing.tensor_parallel import gather_tensor_parallel

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses, self.batches = [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.batches.append((trainer.strategy.layout.data_parallel_rank, batch["tokens"], batch["labels"]))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"].detach()))

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(str(directory), pretrained=True, optimizer="sgd", lr=FIT_LR, weight_decay=0.0,
                              min_lr_ratio=1.0, router_bias_update_rate=router_bias_update_rate)
    if our_ops:
        from lightning_mhc.ops.deepseek_v4 import use_our_ops

        parallelize_recorded = module.parallelize
        module.parallelize = lambda recorded, *args, **kwargs: parallelize_recorded(use_our_ops(recorded), *args,
                                                                                   **kwargs)
    losses = Losses()
    callbacks = [losses] + ([ModelCheckpoint(dirpath=save_at, filename="{step}", save_top_k=-1,
                                             every_n_train_steps=SAVE_AT)] if save_at else [])
    callbacks += [MHCRecomputeCallback(recompute)] if recompute is not None else []
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=MHCParallelStrategy(**sizes),
                         max_steps=FIT_STEPS, logger=False, enable_checkpointing=save_at is not None,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    dp = (devices // sizes.get("tensor_model_parallel_size", 1) // sizes.get("pipeline_model_parallel_size", 1)
          // sizes.get("context_parallel_size", 1))
    data = SyntheticTokens(FIT_ROWS * FIT_STEPS, SEQ, vocab_size=V4_VOCAB, seed=3)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=FIT_ROWS // dp), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    params = {}
    for name, param in module.model.named_parameters():
        experts = next((m for m in module.model.modules() if type(m).__name__ == "ExpertParallelExperts"
                        and any(p is param for p in m.parameters())), None)
        value = param.detach() if experts is not None else gather_tensor_parallel(param.detach(), param)
        params[module.model.global_parameter_name(name)] = (experts.local_expert_start if experts else None, value)
    biases = {module.model.global_parameter_name(name): buffer.clone()
              for name, buffer in module.model.named_buffers() if name.endswith("e_score_correction_bias")}
    kept = dict(model=module.model.chunks[0].eval(), hparams=dict(module.hparams)) if keep_model else {}
    return dict(losses=losses.losses, params=params, biases=biases, batches=losses.batches,
                activation_bytes=trainer.strategy.activation_bytes, **kept)


def _all_layouts(rank: int, world: int, directory: str, fits: dict, layouts: dict, balanced: str | None = None,
                 checkpoints: str | None = None) -> dict:
    """On each of the group's ranks: ``_fit`` on each of ``fits``, the router-balanced fit on
    ``balanced``'s files where given, ZeRO-1 and save-and-go-on into ``checkpoints`` where given,
    then each of ``layouts``' step-0 logits (shared by HY-V4's test)."""
    from transformers import AttentionInterface

    directory = pathlib.Path(directory)
    registered = set(AttentionInterface._global_mapping)
    results = {f"fit {name}": _fit(directory, world, **sizes) for name, sizes in fits.items()}
    # what the runs registered in transformers' attention registry went with their teardown
    results["fit_left_registered"] = sorted(set(AttentionInterface._global_mapping) - registered)
    if balanced is not None:
        results["balanced"] = _fit(pathlib.Path(balanced), world, BIAS_RATE, **BALANCED)
    if checkpoints is not None:
        checkpoints = pathlib.Path(checkpoints)
        results["zero"] = _fit(directory, world, **ZERO)
        results["saved"] = _fit(directory, world, save_at=str(checkpoints / "tp2pp2"), measure_activation_memory=True,
                                **SAVED_ON)
        results["resumed"] = _fit(directory, world, resume=str(checkpoints / "tp2pp2" / f"step={SAVE_AT}.ckpt"),
                                  save=str(checkpoints / "pp2ep2.ckpt"), **RESUMED_ON)
    results.update({name: _pipeline_logits(directory, ParallelLayout(**sizes).build(), name.endswith("padded"))
                    for name, sizes in layouts.items()})
    return results


def test_one_process_is_the_model_bit_for_bit(saved):
    check_one_process_bit_for_bit(saved)


def check_one_process_bit_for_bit(saved: pathlib.Path) -> None:
    """``parallelize`` on one process, from the files, gives transformers' logits to the bit, with
    none of our hyper-connections added (shared by HY-V4's test)."""
    model = parallelize(meta_model(saved), "auto", weights=saved)
    assert not hasattr(model.chunks[0].model.layers[0], "hyper_connection_wiring")  # none of ours added
    with torch.no_grad():
        logits = model(input_ids=batch())
    torch.testing.assert_close(logits, reference_logits(saved), rtol=0, atol=0)


def test_block_recompute_of_its_hyper_connections_in_one_process(saved, monkeypatch):
    check_block_recompute_in_one_process(saved, at_most=0.6, monkeypatch=monkeypatch)


def test_block_recompute_of_its_hyper_connections_on_our_ops_in_one_process(saved, monkeypatch):
    """The same after ``use_our_ops`` (its hyper-connections, mixes and head on our kernels): the
    recomputed layer mixes on our kernels too, so its logits are the swapped model's bit for bit. It
    saves less than on transformers' modules: our fused kernels keep fewer bytes to begin with
    (measured 0.76x of 904,912 B, against 0.56x of 1,262,288 B)."""
    check_block_recompute_in_one_process(saved, at_most=0.8, monkeypatch=monkeypatch, our_ops=True)


def check_block_recompute_in_one_process(saved: pathlib.Path, at_most: float, monkeypatch,
                                         our_ops: bool = False) -> None:
    """``parallelize(..., recompute="mhc_block")`` in one process, with the paper's groups (one
    layer each of the 4 here) and with 2 layers a group: one recompute hook per group (the last
    group's first), each layer's hyper-connections with their norms and its mixes the checkpoints
    (the group's last mix kept); the logits bit for bit, every parameter's gradient within 1e-5
    of its largest (the same operations; only the order in which the streams' gradient
    contributions are summed differs: inside a checkpoint first); the bytes the forward keeps for
    backward (``ActivationMemoryMeter``, deterministic) at most ``at_most`` of the run without; an
    evaluation forward the model's own (shared by HY-V4's test). ``our_ops``: both runs after
    ``use_our_ops``."""
    from lightning_mhc.ops.deepseek_v4 import use_our_ops
    from lightning_mhc.recompute import ActivationMemoryMeter, MHCBlockRecomputeManager, RecomputePolicy

    recomputes = []
    original = MHCBlockRecomputeManager._unified_recompute_hook

    def counted(self, grad):
        recomputes.append(self)
        return original(self, grad)

    monkeypatch.setattr(MHCBlockRecomputeManager, "_unified_recompute_hook", counted)
    tokens = batch()[:2]

    def run(policy):
        recorded = use_our_ops(meta_model(saved)) if our_ops else meta_model(saved)
        model = parallelize(recorded, "auto", weights=saved, recompute=policy).train()
        with ActivationMemoryMeter(model) as meter:
            logits = model(input_ids=tokens)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            evaluated = model.eval()(input_ids=tokens)
        return logits.detach(), grads, meter.result.retained_bytes, evaluated

    plain = run("none")
    assert not recomputes
    largest = max(g.abs().max().item() for g in plain[1].values())
    groups = {None: [(3, 3), (2, 2), (1, 1), (0, 0)], 2: [(2, 3), (0, 1)]}
    for policy in (RecomputePolicy("mhc_block"), RecomputePolicy("mhc_block", layer_num=2)):
        recomputes.clear()
        logits, grads, retained, evaluated = run(policy)
        assert [m.name for m in recomputes] == [f"model.layers.{i}..model.layers.{j}"
                                                for i, j in groups[policy.layer_num]], policy
        first, last = groups[policy.layer_num][-1]
        assert [e.name for e in recomputes[-1].last_plan] == [
            f"model.layers.{i}.{name}" for i in range(first, last + 1)
            for name in ("attn_hc+norm", "attn_hc mix", "ffn_hc+norm", "ffn_hc mix")][:-1], policy
        assert torch.equal(logits, plain[0]) and torch.equal(evaluated, plain[3]), policy
        assert grads.keys() == plain[1].keys(), policy
        worst = max((grads[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * largest)
                    for n, g in plain[1].items())
        print(f"{type(meta_model(saved)).__name__} mhc_block (layer_num {policy.layer_num}) in one process: retained "
              f"{retained:,d} B against {plain[2]:,d} B without ({retained / plain[2]:.2f}x); gradients within "
              f"{worst:.2g} of their largest")
        assert worst < 1e-5, (policy, worst)
        assert retained <= at_most * plain[2], (policy, retained, plain[2])
        assert run(policy)[2] == retained  # deterministic


@pytest.fixture(scope="module")
def balanced(saved, tmp_path_factory) -> pathlib.Path:
    """The saved model with its own auxiliary loss asked for (``output_router_logits``), at a
    coefficient that makes its part of the loss far larger than the tolerance."""
    directory = tmp_path_factory.mktemp("deepseek_v4_aux")
    shutil.copytree(saved, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def group(saved, balanced, tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    """One spawned group of 4 ranks running every distributed case of this file (``_all_layouts``),
    and where its checkpoints are."""
    checkpoints = tmp_path_factory.mktemp("v4_checkpoints")
    return spawn_ranks(_all_layouts, 4, str(saved), FITS, LAYOUTS, str(balanced), str(checkpoints), timeout_s=420,
                       init_group=False), checkpoints


@pytest.fixture(scope="module")
def one_process(saved) -> dict:
    """The same ``FIT_STEPS`` steps in one process, through the same ``Trainer.fit``."""
    return _fit(saved, 1, keep_model=True)


def _check_fit(case: str, ranks: list[dict], reference: dict, steps: slice = slice(None)) -> None:
    """Each rank's losses (``steps`` of the reference's) and every parameter it holds equal one
    process (1e-5); every parameter of the model is held by some rank."""
    compared = set()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"][steps]), rtol=0,
                                   atol=1e-5, msg=case)
        for name, (start, value) in r["params"].items():
            expected_value = reference["params"][name][1]
            if start is not None:
                expected_value = expected_value[start:start + value.shape[0]]
            torch.testing.assert_close(value, expected_value, rtol=0, atol=1e-5, msg=f"{case}: {name}")
            compared.add(name)
    assert compared == set(reference["params"]), (case, set(reference["params"]) - compared)


def test_layouts_equal_one_process(saved, balanced, group, one_process):
    results, _ = group
    _check_balanced(balanced, [r["balanced"] for r in results])
    check_against_one_process(saved, results, LAYOUTS, FITS, one_process)
    # the TP attention's registration in transformers went with the runs' teardown (ProcessState)
    assert all(r["fit_left_registered"] == [] for r in results), [r["fit_left_registered"] for r in results]


def check_against_one_process(saved: pathlib.Path, results: list[dict], layouts: dict, fits: dict,
                              reference: dict | None = None) -> None:
    """The 4 ranks' ``_all_layouts`` results against the model in one process: each layout's
    step-0 logits (1e-5; under EP each rank holding its 2 of every MoE layer's 4 experts; under CP
    its chunks of the sequence), and each fit's losses and weights against the same ``Trainer.fit``
    in one process (1e-5), after the weights moved far beyond that (shared by HY-V4's test)."""
    expected = {padded: reference_logits(saved, padded) for padded in {name.endswith("padded") for name in layouts}}
    for name, sizes in layouts.items():
        cp = sizes.get("context_parallel_size", 1)
        dp = 4 // (sizes.get("tensor_model_parallel_size", 1) * sizes.get("pipeline_model_parallel_size", 1) * cp)
        per_rank = ROWS // dp
        found = [r[name][:2] for r in results if r[name][1] is not None]  # the last stage's ranks
        assert sorted({d for d, _ in found}) == list(range(dp)), name
        # under EP each rank holds its 2 of every layer's 4 experts
        ep = sizes.get("expert_model_parallel_size", 1)
        assert all(r[name][2] == ({(2 * r[name][3], 2)} if ep > 1 else set()) for r in results), (name, [r[name][2:] for r in results])
        for r in results:
            dp_rank, logits, cp_rank = r[name][0], r[name][1], r[name][4]
            if logits is None:
                continue
            rows = expected[name.endswith("padded")][dp_rank * per_rank:(dp_rank + 1) * per_rank]
            if cp_rank is not None:  # this rank's chunks r and 2cp-1-r of the sequence
                rows = shard_sequence(rows, cp_rank, cp, dim=1)
            torch.testing.assert_close(logits, rows, rtol=0, atol=1e-5, msg=name)

    # the same 3 steps in one process, through the same Trainer.fit
    reference = reference or _fit(saved, 1)
    for fit in fits:
        print(f"Trainer.fit {fit} losses {[r['fit ' + fit]['losses'] for r in results]}; one process "
              f"{reference['losses']}")
        _check_fit(fit, [r[f"fit {fit}"] for r in results], reference)
    start = {n: p for n, p in transformers.AutoModelForCausalLM.from_pretrained(saved).named_parameters()}
    moved = max((reference["params"][n][1] - p.detach()).abs().max().item() for n, p in start.items()
                if n in reference["params"])
    assert moved > 1e-3  # training moved the weights far beyond the tolerance


def _check_balanced(directory: pathlib.Path, results: list[dict]) -> None:
    """PP 2 x EP 2 (DP 2) through ``Trainer.fit`` with the config's own router loss and the
    auxiliary-free bias update, against transformers' model in one process, by hand: per step, each
    DP rank's microbatches (a row each: PP 2's two) through the model's forward, each loss CE + coef x
    the ``aux_loss`` the model returns (as Hugging Face under DDP takes it, per rank and microbatch),
    their mean backward, SGD with momentum 0.9; then every top-k router's bias moved by rate x sign(mean - count), the
    counts of the step's tokens on both DP ranks. Losses and weights within 1e-5, biases equal."""
    import torch.nn.functional as F

    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert reference.config.output_router_logits and reference.config.router_aux_loss_coef == AUX_COEF
    chosen: list = []
    for module in reference.modules():
        if type(module).__name__ == "DeepseekV4TopKRouter":
            module.register_forward_hook(lambda router, args, out: chosen.append((router, out[2])))
    optimizer = torch.optim.SGD(reference.parameters(), lr=FIT_LR, momentum=0.9)  # HFCausalLMModule's "sgd"
    micro = FIT_ROWS // 2 // BALANCED["pipeline_model_parallel_size"]
    ref_losses, aux_parts = [], []
    for step in range(FIT_STEPS):
        by_dp = {dp: (tokens, labels) for r in results for dp, tokens, labels in [r["batches"][step]]}
        assert sorted(by_dp) == [0, 1]
        chosen.clear()
        losses = []
        for dp in sorted(by_dp):
            for tokens, labels in zip(*(t.split(micro) for t in by_dp[dp])):
                out = reference(input_ids=tokens)
                losses.append(F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + AUX_COEF * out.aux_loss)
                aux_parts.append(AUX_COEF * out.aux_loss.item())
        loss = torch.stack(losses).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
        with torch.no_grad():
            counts: dict = {}
            for router, experts in chosen:
                counts[router] = counts.get(router, 0) + torch.bincount(experts.flatten(), minlength=V4_EXPERTS)
            assert len(counts) == 3  # the three top-k routers (the hash router's layer has none)
            for router, count in counts.items():
                count = count.double()
                router.e_score_correction_bias.add_((torch.sign(count.mean() - count) * BIAS_RATE).float())

    print(f"Trainer.fit PP 2 x EP 2 with the router's loss and the bias update: losses {results[0]['losses']}; "
          f"one process by hand {ref_losses} (the router loss's part {min(aux_parts):.3f}..{max(aux_parts):.3f})")
    assert min(aux_parts) > 1e-2  # far above the tolerance
    trained = dict(reference.named_parameters())
    biases = {n: b for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias")}
    start = {n: b for n, b in transformers.AutoModelForCausalLM.from_pretrained(directory).named_buffers()
             if n.endswith("e_score_correction_bias")}
    assert max((biases[n] - start[n]).abs().max().item() for n in biases) >= BIAS_RATE * 0.99  # they moved
    compared = 0
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        for name, (start_row, value) in r["params"].items():
            expected = trained[name].detach()
            if start_row is not None:
                expected = expected[start_row:start_row + value.shape[0]]
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-5, msg=name)
            compared += 1
        for name, bias in r["biases"].items():
            torch.testing.assert_close(bias, biases[name], rtol=0, atol=0, msg=name)
            compared += 1
    assert compared and all(r["biases"] for r in results)


def test_the_distributed_optimizer_trains_it_as_one_process(group, one_process):
    check_zero_one(group[0], one_process)


def check_zero_one(results: list[dict], one_process: dict) -> None:
    """ZeRO-1 (``use_distributed_optimizer``) on TP 2 x DP 2 through ``Trainer.fit`` (``_all_layouts``'
    ``"zero"``): the losses and every weight of one process (1e-5; shared by HY-V4's test)."""
    print(f"Trainer.fit TP 2 x DP 2 with ZeRO-1 losses {[r['zero']['losses'] for r in results]}")
    _check_fit("TP 2 x DP 2, ZeRO-1", [r["zero"] for r in results], one_process)


def test_block_recompute_trains_as_the_same_layout_without_it_keeping_fewer_bytes(group):
    check_block_recompute_against_without(group[0], RECOMPUTED, BLOCK_RECOMPUTE_BYTES)


def check_block_recompute_against_without(results: list[dict], pairs: dict, at_most: dict) -> None:
    """``mhc_block`` on the family's own hyper-connections through ``Trainer.fit`` (its ``attn_hc``
    / ``ffn_hc`` with their norms and their mixes recomputed from one hook per recompute group), on
    each layout of ``pairs``: the losses and every weight of the same layout trained without it
    (1e-6; both within 1e-5 of one process: ``test_layouts_equal_one_process``), and the bytes the
    first step's forward keeps for backward (the strategy's ``activation_bytes``, max over ranks:
    deterministic) at most ``at_most[layout]`` of that run's (shared by HY-V4's test)."""
    for layout, (with_name, without_name) in pairs.items():
        recomputed, plain = [r[with_name] for r in results], [r[without_name] for r in results]
        loss_diff = max(abs(a - b) for r, p in zip(recomputed, plain) for a, b in zip(r["losses"], p["losses"]))
        weight_diff = max((r["params"][n][1] - value).abs().max().item() for r, p in zip(recomputed, plain)
                          for n, (_, value) in p["params"].items())
        kept, without = recomputed[0]["activation_bytes"], plain[0]["activation_bytes"]
        print(f"Trainer.fit {layout} with mhc_block on its own hyper-connections: activation_bytes {kept:,d} B "
              f"against {without:,d} B without ({kept / without:.2f}x); max |loss diff| {loss_diff:.3g}, max |weight "
              f"diff| {weight_diff:.3g} from the run without")
        assert all(r["params"].keys() == p["params"].keys() for r, p in zip(recomputed, plain)), layout
        assert loss_diff <= 1e-6 and weight_diff <= 1e-6, layout  # the same operations, gradients summed otherwise
        # max over the ranks: one figure each
        assert {r["activation_bytes"] for r in recomputed + plain} == {kept, without}, layout
        assert kept <= at_most[layout] * without, (layout, kept, without)


BLOCK_RECOMPUTE_BYTES = {"TP 2 x PP 2": 0.5, "CP 2": 0.65, "EP 2 on our ops": 0.8}
"""Measured (the tiny V4, 4 streams, 5 Sinkhorn iterations): TP 2 x PP 2 0.46x (495,400 B against
1,083,176 B), CP 2 0.59x (429,468 B against 723,356 B), EP 2 on our ops 0.74x (352,516 B against
476,420 B: a rank's 4 layers, 1 x 16 tokens)."""


def test_a_checkpoint_goes_on_on_another_layout_and_exports_for_from_pretrained(saved, group, one_process, tmp_path):
    """Save and go on: ``trainer.save_checkpoint`` at step 2 on TP 2 x PP 2, continued on PP 2 x EP 2
    (another TP, PP and EP: resharded) to step 3 and saved again: its losses are the uninterrupted
    run's; that checkpoint read into the whole model in one process (``load_checkpoint``) holds the
    one-process run's weights and buffers (``tid2eid``, the score-correction biases); exported by
    ``lightning-mhc-export`` and read back by ``DeepseekV4ForCausalLM.from_pretrained``: its logits
    (1e-5), its tensors in the trained dtypes (the hyper-connections fp32, and kept so by
    transformers when the rest is read in bf16), and greedy ``generate`` on it the one-process
    trained model's tokens."""
    results, checkpoints = group
    check_checkpoint_and_export(saved, results, checkpoints, one_process, tmp_path, transformers.DeepseekV4ForCausalLM,
                                "tid2eid", "model.hc_head.hc_fn")


def check_checkpoint_and_export(saved: pathlib.Path, results: list[dict], checkpoints: pathlib.Path,
                                one_process: dict, tmp_path: pathlib.Path, model_class, buffer: str,
                                head_in_files: str) -> None:
    """The save-and-go-on fits of ``_all_layouts`` (``checkpoints`` given) against ``one_process``,
    the last checkpoint read in one process, exported and read back by ``model_class.from_pretrained``,
    greedy ``generate`` on it (the test above; shared by HY-V4's test). ``buffer``: the name ending
    of a buffer the checkpoint must carry (the model's own state beside its parameters);
    ``head_in_files``: the file name of ``hc_head``'s projection, written fp32."""
    from safetensors import safe_open

    from lightning_mhc.any_model import load_checkpoint
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from script_runs import run_module_on_a_rank

    # TP 2 x PP 2 as one process, its checkpoint of step 2 continued on PP 2 x EP 2
    _check_fit("TP 2 x PP 2", [r["saved"] for r in results], one_process)
    print(f"TP 2 x PP 2 losses {results[0]['saved']['losses']}; PP 2 x EP 2 from its step {SAVE_AT}: "
          f"{[r['resumed']['losses'] for r in results]}; one process {one_process['losses']}")
    _check_fit("PP 2 x EP 2 from TP 2 x PP 2's checkpoint", [r["resumed"] for r in results], one_process,
               steps=slice(SAVE_AT, None))

    trained = one_process["model"]
    expected = {name: t.detach() for name, t in trained.state_dict().items()}
    whole = load_checkpoint(HFCausalLMModule.whole_model(one_process["hparams"]), checkpoints / "pp2ep2.ckpt").eval()
    state = whole.state_dict()
    assert state.keys() == expected.keys() and any(n.endswith(buffer) for n in state)
    state_diff = max((t.double() - expected[n].double()).abs().max().item() for n, t in state.items())
    export = tmp_path / "export"
    run_module_on_a_rank("lightning_mhc.cli.export", str(checkpoints / "pp2ep2.ckpt"), str(export))
    exported = model_class.from_pretrained(export).eval()
    tokens = batch()
    with torch.no_grad():
        logits = exported(input_ids=tokens).logits
        checkpoint_diff = (logits - whole(input_ids=tokens).logits).abs().max().item()
        trained_diff = (logits - trained(input_ids=tokens).logits).abs().max().item()
    print(f"PP 2 x EP 2's checkpoint in one process: max |state diff| from the one-process run {state_diff:.3g}; "
          f"exported and read by from_pretrained: max |logit diff| {checkpoint_diff:.3g} from the checkpoint's "
          f"model, {trained_diff:.3g} from the one-process trained model")
    assert state_diff <= 1e-5 and checkpoint_diff <= 1e-5 and trained_diff <= 1e-5

    # the exported tensors in the trained model's dtypes; transformers keeps the hyper-connections
    # fp32 (_keep_in_fp32_modules_strict) when the model is read in bf16
    def dtypes(directory: pathlib.Path) -> dict[str, str]:
        found = {}
        for file in directory.glob("*.safetensors"):
            with safe_open(file, "pt") as handle:
                found.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})
        return found

    written = dtypes(export)  # the names and dtypes of the pretrained files (fp32; V4's int64 tid2eid)
    assert written == dtypes(saved) and written[head_in_files] == "F32", written
    half = model_class.from_pretrained(export, dtype=torch.bfloat16)
    kept = {n: p.dtype for n, p in half.named_parameters() if "hc_" in n or "_hc." in n}
    assert kept and set(kept.values()) == {torch.float32}, kept
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16

    # greedy generation (transformers' cache) on the export: the one-process trained model's tokens
    prompt = tokens[:2, :6]
    mask = torch.ones_like(prompt)
    generated = exported.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=10, do_sample=False)
    reference = trained.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=10, do_sample=False)
    print(f"greedy generate on the export {generated[:, 6:].tolist()}, on the one-process trained model "
          f"{reference[:, 6:].tolist()}")
    assert generated.shape == (2, 16) and torch.equal(generated, reference)


def _refusal(**kwargs) -> str:
    with pytest.raises(ConfigError) as raised:
        check_parallelize(kwargs.pop("model"), "auto", **kwargs)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


def test_what_is_not_built_yet_and_added_streams_are_refused_in_one_line(saved):
    model = meta_model(saved)
    message = _refusal(model=model, layout=ParallelLayout(), hyper_connections=4)
    assert "model_type 'deepseek_v4'" in message and "carries its own (hc_mult=4 streams)" in message
    # sequence parallelism runs (with CP too): nothing refused
    check_parallelize(model, "auto", layout=ParallelLayout(tensor_model_parallel_size=2, context_parallel_size=2,
                                                           sequence_parallel=True))
    message = _refusal(model=model, layout=ParallelLayout(), router_bias_update_rate=-0.1)
    assert message == "router_bias_update_rate=-0.1: a number >= 0 (0: the bias stays as loaded).", message
    with record_module_init():
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    message = _refusal(model=llama, layout=ParallelLayout(), router_bias_update_rate=1e-3)
    assert message.startswith("router_bias_update_rate=0.001: llama has no routers with a score-correction bias"), message
    message = _refusal(model=model, layout=ParallelLayout(expert_model_parallel_size=3))  # 4 experts
    assert "4 experts, which do not split evenly over 3 ranks" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=4))  # 4 heads, 2 groups
    assert "o_groups=2 cannot be divided by tensor_model_parallel_size=4" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=8))
    assert "num_heads=4 cannot be divided by tensor_model_parallel_size=8" in message, message
    check_parallelize(model, "auto", layout=ParallelLayout(), recompute="mhc_block")  # on its own hyper-connections
    # a family with streams of its own whose record builds no block recompute of them is refused
    from lightning_mhc.any_model.recompute import check_recompute
    from lightning_mhc.recompute import RecomputePolicy

    with pytest.raises(ConfigError, match=r"^recompute='mhc_block' on the model's own hyper-connections \(4 streams "
                                          r"of its family's design\) is not built for its family yet"):
        check_recompute(RecomputePolicy("mhc_block"), False, native_streams=4, native_block_recompute=False)
    check_parallelize(model, "auto", layout=ParallelLayout(pipeline_model_parallel_size=2))  # PP runs
    check_parallelize(model, "auto", layout=ParallelLayout(context_parallel_size=2))  # CP too (its own attention)


def test_the_command_line_refuses_a_sequence_cp_does_not_split_before_launch(saved, tmp_path, monkeypatch, capsys):
    """CP 2 cuts the sequence into 4 chunks: 18 tokens are refused in one line before launch (the
    compressed windows need nothing more: the compressors run on the gathered sequence). The block
    recompute of its own hyper-connections is accepted (no ``model.hyper_connections`` needed)."""
    from train_cli import check_before_launch

    command = ["model=hf", f"model.pretrained={saved}", "data=synthetic", "parallel=cp2", "trainer.devices=2"]
    status, err = check_before_launch([*command, "data.seq_length=16", "recompute=mhc_block"], tmp_path, monkeypatch,
                                      capsys)
    assert status == 0, err
    status, err = check_before_launch([*command, "data.seq_length=18"], tmp_path, monkeypatch, capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "parallel.context_parallel_size=2 cuts data.seq_length=18 into 2 * 2 chunks" in err, err


def test_the_command_line_trains_it_on_pp2_ep2_as_one_process(saved, tmp_path):
    """``lightning-mhc-train model=hf model.pretrained=DIR`` (its entry point on forked ranks) on
    PP 2 x EP 2 (DP 2; synthetic tokens below the model's vocabulary of 64): 3 AdamW steps' losses
    equal the same command on one process (1e-5)."""
    check_command_line_against_one_process(saved, tmp_path, "PP 2 x EP 2", "parallel=pp2",
                                           "parallel.expert_model_parallel_size=2")


def check_command_line_against_one_process(saved: pathlib.Path, tmp_path: pathlib.Path, name: str,
                                           *parallel: str) -> None:
    """``lightning-mhc-train model=hf model.pretrained=saved`` with ``parallel`` on 4 ranks and on
    one process: 3 AdamW steps' losses within 1e-5 (shared by HY-V4's test; ``name``: the layout's,
    for the printed figures)."""
    from train_cli import run_train_on_ranks, train_losses

    common = ("model=hf", f"model.pretrained={saved}", "data=synthetic", f"data.seq_length={SEQ}",
              "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=3",
              "trainer.limit_val_batches=1")
    run_train_on_ranks(tmp_path, *common, *parallel, "trainer.devices=4", "hydra.run.dir=split")
    run_train_on_ranks(tmp_path, *common, "hydra.run.dir=single")
    split, single = (train_losses(tmp_path / run / "metrics.csv") for run in ("split", "single"))
    print(f"lightning-mhc-train {name} losses {split}; one process {single}")
    assert split.keys() == single.keys() and len(single) == 3
    torch.testing.assert_close(torch.tensor(list(split.values())), torch.tensor(list(single.values())), rtol=0,
                               atol=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["parallel.tensor_model_parallel_size=8", "trainer.devices=8"],
     r"num_heads=4 cannot be divided by parallel.tensor_model_parallel_size=8"),
    (["parallel.tensor_model_parallel_size=4", "trainer.devices=4"],
     r"o_groups=2 cannot be divided by parallel.tensor_model_parallel_size=4"),
    (["parallel.expert_model_parallel_size=3", "trainer.devices=3", "data.global_batch_size=6"],
     r"parallel.expert_model_parallel_size=3: model.layers.0.mlp.experts has 4 experts, which do not split evenly"),
    (["model.hyper_connections=4"], r"DeepseekV4ForCausalLM \(model_type 'deepseek_v4'\) carries its own \(hc_mult=4 "
                                    r"streams\), which run as the model's: leave hyper_connections unset"),
    (["no deepseek_v4 in transformers"], r"model_type 'deepseek_v4' is not in transformers [0-9.]+: its family runs on "
                                         r"transformers>=5.24; pip install 'transformers>=5.24'"),
])
def test_the_command_line_refuses_what_does_not_fit_it_before_launch(saved, extra, message, tmp_path, monkeypatch,
                                                                    capsys):
    """``lightning-mhc-train model=hf model.pretrained=DIR`` refuses, in one line before any process
    starts (its check before launch): a TP size that does not divide the heads or the output
    groups, an EP size that does not divide the experts, streams added to V4's own, and a
    transformers without the model (``deepseek_v4`` taken out of its registry here)."""
    import re

    from train_cli import check_before_launch

    if extra == ["no deepseek_v4 in transformers"]:
        from transformers import CONFIG_MAPPING

        monkeypatch.delitem(CONFIG_MAPPING._mapping, "deepseek_v4")
        extra = []
    argv = ["model=hf", f"model.pretrained={saved}", "data=synthetic", f"data.seq_length={SEQ}", *extra]
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "outputs").exists()
