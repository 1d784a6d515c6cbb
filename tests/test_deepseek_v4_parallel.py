"""DeepSeek-V4 (``deepseek_v4``) through ``parallelize(model, plan="auto")`` (``any_model/deepseek_v4.py``,
its family record): its own hyper-connections kept as they are (``hc_mult`` streams, none added),
from ``save_pretrained`` files in several shards (DeepSeek's own tensor names, the experts one file
tensor each), against the model in one process (fp32).

A tiny V4 (tests/v4_utils.py: compressed sparse and heavily compressed attention, a sliding-window
layer, a hash-routed layer with ``tid2eid`` spreading tokens over the experts, every map moved off
its init): on one process bit-exact. One spawned 4-rank group runs every distributed case
(``_all_layouts``): step-0 logits on PP 2, TP 2, TP 2 x PP 2, PP 2 x EP 2 and TP 2 x EP 2 within
1e-5; ``Trainer.fit`` on TP 2 x EP 2, on TP 2 x DP 2 with ZeRO-1 and on TP 2 x PP 2 (its step-2
checkpoint continued on PP 2 x EP 2, then read in one process, exported and read back by
``from_pretrained``, greedy ``generate``), losses and weights within 1e-5 of one process; the TP
attention's registration gone with the run. Refused in one line before anything is built or
launched: what is not built for V4, layouts that do not divide its heads, groups or experts,
``hyper_connections=n``, a transformers without the model.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

from lightning_mhc import ConfigError  # noqa: E402
from lightning_mhc.any_model import check_parallelize, parallelize, record_module_init  # noqa: E402
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402
from v4_utils import V4_VOCAB, moved_from_init, tiny_v4_config  # noqa: E402

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
    directory = tmp_path_factory.mktemp("deepseek_v4")
    torch.manual_seed(0)
    model = moved_from_init(transformers.AutoModelForCausalLM.from_config(tiny_v4_config()))
    model.save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) > 2
    return directory


def reference_logits(directory: pathlib.Path) -> torch.Tensor:
    """The model as transformers reads its files, in one process."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(input_ids=batch()).logits


def _pipeline_logits(directory: pathlib.Path, layout: ParallelLayout) -> tuple[int, torch.Tensor | None]:
    """Step-0 logits of this DP rank's rows through the forward-only pipeline schedule (None
    before the last stage)."""
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining

    model = parallelize(meta_model(directory), "auto", layout=layout, weights=directory, loss_parallel=False)
    per_rank, dp_rank = ROWS // layout.data_parallel_size, layout.data_parallel_rank
    rows = batch()[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    microbatches = [dict(input_ids=c) for c in rows.split(MICRO)]
    logits = []

    def loss_func(output, microbatch):
        logits.append(output.detach())
        return output.sum() * 0

    forward_backward_pipelining([model], microbatches, lambda m, mb: m.forward_step(mb), loss_func,
                                ScheduleConfig(layout, model.pipeline_tensor_shape(microbatches[0]), forward_only=True))
    experts = {(m.local_expert_start, m.gate_up_proj.shape[0]) for m in model.modules()
               if type(m).__name__ == "ExpertParallelExperts"}
    return dp_rank, torch.cat(logits) if logits else None, experts, layout.expert_model_parallel_rank


LAYOUTS = {"pp2": dict(pipeline_model_parallel_size=2), "tp2": dict(tensor_model_parallel_size=2),
           "tp2pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
           "pp2ep2": dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
           "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)}
"""The layouts of the 4 ranks (DP fills the rest)."""


FIT = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)
"""The layout trained through ``Trainer.fit`` (DP 2): the shared K/V head's gradient summed over
TP, the experts' over their ranks."""
ZERO = dict(tensor_model_parallel_size=2, use_distributed_optimizer=True)
"""ZeRO-1 (DP 2): each DP rank steps its shard of the momentum and weights (the experts' too,
whole on every rank here) and gathers the rest."""
SAVED_ON, RESUMED_ON = (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2))
"""Save and go on: TP 2 x PP 2 saves its step ``SAVE_AT`` (``ModelCheckpoint``, which calls
``trainer.save_checkpoint``), continued from it on PP 2 x EP 2 (DP 2) and saved again by
``trainer.save_checkpoint``, then read in one process."""
FIT_STEPS, FIT_ROWS, FIT_LR, SAVE_AT = 3, 4, 0.05, 2


def _fit(directory: pathlib.Path, devices: int, resume: str | None = None, save_at: str | None = None,
         save: str | None = None, keep_model: bool = False, **sizes) -> dict:
    """``FIT_STEPS`` SGD steps (momentum 0.9) of ``HFCausalLMModule`` (the CLI's ``model=hf``)
    through ``Trainer.fit`` on ``MHCParallelStrategy(**sizes)`` (from the checkpoint ``resume``;
    saving ``save_at/step=2.ckpt`` at step ``SAVE_AT`` as a run checkpointing as it goes, and
    ``trainer.save_checkpoint(save)`` at the end): each step's loss, and this rank's parameters by their
    whole-model names (gathered over TP; experts: ``(start, block)``); ``keep_model``: the trained
    model and the module's hyperparameters too (one process)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.testing.tensor_parallel import gather_tensor_parallel

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"].detach()))

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(str(directory), pretrained=True, optimizer="sgd", lr=FIT_LR, weight_decay=0.0,
                              min_lr_ratio=1.0)
    callbacks = [Losses()] + ([ModelCheckpoint(dirpath=save_at, filename="{step}", save_top_k=-1,
                                               every_n_train_steps=SAVE_AT)] if save_at else [])
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=MHCParallelStrategy(**sizes),
                         max_steps=FIT_STEPS, logger=False, enable_checkpointing=save_at is not None,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    dp = devices // sizes.get("tensor_model_parallel_size", 1) // sizes.get("pipeline_model_parallel_size", 1)
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
    kept = dict(model=module.model.chunks[0].eval(), hparams=dict(module.hparams)) if keep_model else {}
    return dict(losses=callbacks[0].losses, params=params, **kept)


def _all_layouts(rank: int, world: int, directory: str, checkpoints: str) -> dict:
    from transformers import AttentionInterface

    directory, checkpoints = pathlib.Path(directory), pathlib.Path(checkpoints)
    registered = set(AttentionInterface._global_mapping)
    results = {"fit": _fit(directory, world, **FIT)}
    # what the run registered in transformers' attention registry went with its teardown
    results["fit_left_registered"] = sorted(set(AttentionInterface._global_mapping) - registered)
    results["zero"] = _fit(directory, world, **ZERO)
    results["saved"] = _fit(directory, world, save_at=str(checkpoints / "tp2pp2"), **SAVED_ON)
    results["resumed"] = _fit(directory, world, resume=str(checkpoints / "tp2pp2" / f"step={SAVE_AT}.ckpt"),
                              save=str(checkpoints / "pp2ep2.ckpt"), **RESUMED_ON)
    results.update({name: _pipeline_logits(directory, ParallelLayout(**sizes).build())
                    for name, sizes in LAYOUTS.items()})
    return results


@pytest.fixture(scope="module")
def group(saved, tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    """One spawned group of 4 ranks running every case of this file (``_all_layouts``), and where
    its checkpoints are."""
    checkpoints = tmp_path_factory.mktemp("v4_checkpoints")
    return spawn_ranks(_all_layouts, 4, str(saved), str(checkpoints), timeout_s=300, init_group=False), checkpoints


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


def test_layouts_equal_one_process(saved, group, one_process):
    results, _ = group
    expected = reference_logits(saved)
    for name, sizes in LAYOUTS.items():
        dp = 4 // (sizes.get("tensor_model_parallel_size", 1) * sizes.get("pipeline_model_parallel_size", 1))
        per_rank = ROWS // dp
        found = [r[name][:2] for r in results if r[name][1] is not None]  # the last stage's ranks
        assert sorted({d for d, _ in found}) == list(range(dp)), name
        # under EP each rank holds its 2 of every layer's 4 experts
        ep = sizes.get("expert_model_parallel_size", 1)
        assert all(r[name][2] == ({(2 * r[name][3], 2)} if ep > 1 else set()) for r in results), (name, [r[name][2:] for r in results])
        for dp_rank, logits in found:
            torch.testing.assert_close(logits, expected[dp_rank * per_rank:(dp_rank + 1) * per_rank], rtol=0,
                                       atol=1e-5, msg=name)

    print(f"Trainer.fit TP 2 x EP 2 losses {[r['fit']['losses'] for r in results]}; one process "
          f"{one_process['losses']}")
    _check_fit("TP 2 x EP 2", [r["fit"] for r in results], one_process)
    start = {n: p for n, p in transformers.AutoModelForCausalLM.from_pretrained(saved).named_parameters()}
    moved = max((one_process["params"][n][1] - p.detach()).abs().max().item() for n, p in start.items()
                if n in one_process["params"])
    assert moved > 1e-3  # training moved the weights far beyond the tolerance
    # the TP attention's registration in transformers went with the run's teardown (ProcessState)
    assert all(r["fit_left_registered"] == [] for r in results), [r["fit_left_registered"] for r in results]


def test_the_distributed_optimizer_trains_it_as_one_process(group, one_process):
    """ZeRO-1 (``use_distributed_optimizer``) on TP 2 x DP 2 through ``Trainer.fit``: the losses and
    every weight of one process (1e-5)."""
    results, _ = group
    print(f"Trainer.fit TP 2 x DP 2 with ZeRO-1 losses {[r['zero']['losses'] for r in results]}")
    _check_fit("TP 2 x DP 2, ZeRO-1", [r["zero"] for r in results], one_process)


def test_a_checkpoint_goes_on_on_another_layout_and_exports_for_from_pretrained(saved, group, one_process, tmp_path):
    """Save and go on: ``trainer.save_checkpoint`` at step 2 on TP 2 x PP 2, continued on PP 2 x EP 2
    (another TP, PP and EP: resharded) to step 3 and saved again: its losses are the uninterrupted
    run's; that checkpoint read into the whole model in one process (``load_checkpoint``) holds the
    one-process run's weights and buffers (``tid2eid``, the score-correction biases); exported by
    ``lightning-mhc-export`` and read back by ``DeepseekV4ForCausalLM.from_pretrained``: its logits
    (1e-5), its tensors in the trained dtypes (the hyper-connections fp32, and kept so by
    transformers when the rest is read in bf16), and greedy ``generate`` on it the one-process
    trained model's tokens."""
    from safetensors import safe_open

    from lightning_mhc.any_model import load_checkpoint
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from script_runs import run_module_on_a_rank

    results, checkpoints = group
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
    assert state.keys() == expected.keys() and any(n.endswith("tid2eid") for n in state)
    state_diff = max((t.double() - expected[n].double()).abs().max().item() for n, t in state.items())
    export = tmp_path / "export"
    run_module_on_a_rank("lightning_mhc.cli.export", str(checkpoints / "pp2ep2.ckpt"), str(export))
    exported = transformers.DeepseekV4ForCausalLM.from_pretrained(export).eval()
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

    written = dtypes(export)  # the names and dtypes of the pretrained files (fp32; the int64 tid2eid)
    assert written == dtypes(saved) and written["model.hc_head.hc_fn"] == "F32", written
    half = transformers.DeepseekV4ForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
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
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True))
    assert "(model_type 'deepseek_v4'): sequence_parallel=True is not built" in message, message
    model.config.output_router_logits = True
    message = _refusal(model=model, layout=ParallelLayout())
    assert "(model_type 'deepseek_v4'): output_router_logits=True asks for its router's auxiliary loss" in message
    model.config.output_router_logits = False
    message = _refusal(model=model, layout=ParallelLayout(expert_model_parallel_size=3))  # 4 experts
    assert "4 experts, which do not split evenly over 3 ranks" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=4))  # 4 heads, 2 groups
    assert "o_groups=2 cannot be divided by tensor_model_parallel_size=4" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=8))
    assert "num_heads=4 cannot be divided by tensor_model_parallel_size=8" in message, message
    message = _refusal(model=model, layout=ParallelLayout(context_parallel_size=2))
    # (the config's sliding window is named first; without one, the record's reason)
    assert message.startswith("context parallelism: DeepseekV4ForCausalLM (model_type 'deepseek_v4')"), message
    message = _refusal(model=model, layout=ParallelLayout(), recompute="mhc_block")
    assert message.startswith("recompute='mhc_block' on the model's own hyper-connections (4 streams"), message
    check_parallelize(model, "auto", layout=ParallelLayout(pipeline_model_parallel_size=2))  # PP runs


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


def test_the_command_line_trains_it_on_pp2_ep2_as_one_process(saved, tmp_path):
    """``lightning-mhc-train model=hf model.pretrained=DIR`` (its entry point on forked ranks) on
    PP 2 x EP 2 (DP 2; synthetic tokens below the model's vocabulary of 64): 3 AdamW steps' losses
    equal the same command on one process (1e-5)."""
    from train_cli import run_train_on_ranks, train_losses

    common = ("model=hf", f"model.pretrained={saved}", "data=synthetic", f"data.seq_length={SEQ}",
              "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=3",
              "trainer.limit_val_batches=1")
    run_train_on_ranks(tmp_path, *common, "parallel=pp2", "parallel.expert_model_parallel_size=2",
                       "trainer.devices=4", "hydra.run.dir=pp2ep2")
    run_train_on_ranks(tmp_path, *common, "hydra.run.dir=single")
    split, single = (train_losses(tmp_path / run / "metrics.csv") for run in ("pp2ep2", "single"))
    print(f"lightning-mhc-train PP 2 x EP 2 losses {split}; one process {single}")
    assert split.keys() == single.keys() and len(single) == 3
    torch.testing.assert_close(torch.tensor(list(split.values())), torch.tensor(list(single.values())), rtol=0,
                               atol=1e-5)
