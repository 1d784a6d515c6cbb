"""DeepSeek-V4 (``deepseek_v4``) through ``parallelize(model, plan="auto")`` (``any_model/deepseek_v4.py``,
its family record): its own hyper-connections kept as they are (``hc_mult`` streams, none added),
from ``save_pretrained`` files in several shards (DeepSeek's own tensor names, the experts one file
tensor each), against the model in one process (fp32).

A tiny V4 (tests/v4_utils.py: compressed sparse and heavily compressed attention, a sliding-window
layer, a hash-routed layer with ``tid2eid`` spreading tokens over the experts, every map moved off
its init): on one process bit-exact; one spawned 4-rank group runs PP 2 (DP 2), the streams
crossing the stages flat, ``hc_head`` and the final norm and head on the last stage: step-0 logits
within 1e-5. What is not built yet (TP, EP, CP on V4) and ``hyper_connections=n`` are refused in one
line before anything is built.
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
    return save_moved(tmp_path_factory.mktemp("deepseek_v4"), tiny_v4_config())


def save_moved(directory: pathlib.Path, config) -> pathlib.Path:
    """A model of ``config``, its maps moved off their init, saved in ``directory`` in several
    shards (shared by HY-V4's test)."""
    torch.manual_seed(0)
    model = moved_from_init(transformers.AutoModelForCausalLM.from_config(config))
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
FIT_STEPS, FIT_ROWS, FIT_LR = 3, 4, 0.05


def _fit(directory: pathlib.Path, devices: int, **sizes) -> dict:
    """``FIT_STEPS`` SGD steps of ``HFCausalLMModule`` (the CLI's ``model=hf``) through
    ``Trainer.fit`` on ``MHCParallelStrategy(**sizes)``: each step's loss, and this rank's
    parameters by their whole-model names (gathered over TP; experts: ``(start, block)``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.testing.tensor_parallel import gather_tensor_parallel

    class Losses(Callback):
        losses: list = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"].detach()))

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(str(directory), pretrained=True, optimizer="sgd", lr=FIT_LR, weight_decay=0.0,
                              min_lr_ratio=1.0)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=MHCParallelStrategy(**sizes),
                         max_steps=FIT_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[losses])
    dp = devices // sizes.get("tensor_model_parallel_size", 1) // sizes.get("pipeline_model_parallel_size", 1)
    data = SyntheticTokens(FIT_ROWS * FIT_STEPS, SEQ, vocab_size=V4_VOCAB, seed=3)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=FIT_ROWS // dp))
    params = {}
    for name, param in module.model.named_parameters():
        experts = next((m for m in module.model.modules() if type(m).__name__ == "ExpertParallelExperts"
                        and any(p is param for p in m.parameters())), None)
        value = param.detach() if experts is not None else gather_tensor_parallel(param.detach(), param)
        params[module.model.global_parameter_name(name)] = (experts.local_expert_start if experts else None, value)
    return dict(losses=losses.losses, params=params)


def _all_layouts(rank: int, world: int, directory: str, fit: dict | None = None, layouts: dict | None = None
                 ) -> dict:
    """On each of the group's ranks: ``_fit`` on ``fit`` (default :data:`FIT`), then each of
    ``layouts``' step-0 logits (default :data:`LAYOUTS`); shared by HY-V4's test."""
    directory = pathlib.Path(directory)
    results = {"fit": _fit(directory, world, **(fit or FIT))}
    results.update({name: _pipeline_logits(directory, ParallelLayout(**sizes).build())
                    for name, sizes in (layouts or LAYOUTS).items()})
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


def test_layouts_equal_one_process(saved):
    results = spawn_ranks(_all_layouts, 4, str(saved), timeout_s=240, init_group=False)
    check_against_one_process(saved, results, LAYOUTS)


def check_against_one_process(saved: pathlib.Path, results: list[dict], layouts: dict) -> None:
    """The 4 ranks' ``_all_layouts`` results against the model in one process: each layout's
    step-0 logits (1e-5; under EP each rank holding its 2 of every MoE layer's 4 experts), and the
    fit's losses and weights against the same ``Trainer.fit`` in one process (1e-5), after the
    weights moved far beyond that (shared by HY-V4's test)."""
    expected = reference_logits(saved)
    for name, sizes in layouts.items():
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

    # the same 3 steps in one process, through the same Trainer.fit
    reference = _fit(saved, 1)
    print(f"Trainer.fit TP 2 x EP 2 losses {[r['fit']['losses'] for r in results]}; one process "
          f"{reference['losses']}")
    compared = 0
    for r in results:
        torch.testing.assert_close(torch.tensor(r["fit"]["losses"]), torch.tensor(reference["losses"]), rtol=0,
                                   atol=1e-5)
        for name, (start, value) in r["fit"]["params"].items():
            expected_value = reference["params"][name][1]
            if start is not None:
                expected_value = expected_value[start:start + value.shape[0]]
            torch.testing.assert_close(value, expected_value, rtol=0, atol=1e-5, msg=name)
            compared += 1
    start = {n: p for n, p in transformers.AutoModelForCausalLM.from_pretrained(saved).named_parameters()}
    moved = max((reference["params"][n][1] - p.detach()).abs().max().item() for n, p in start.items()
                if n in reference["params"])
    assert compared and moved > 1e-3  # training moved the weights far beyond the tolerance


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
    assert "o_groups" in message, message
    message = _refusal(model=model, layout=ParallelLayout(context_parallel_size=2))
    # (the config's sliding window is named first; without one, the record's reason)
    assert message.startswith("context parallelism: DeepseekV4ForCausalLM (model_type 'deepseek_v4')"), message
    message = _refusal(model=model, layout=ParallelLayout(), recompute="mhc_block")
    assert message.startswith("recompute='mhc_block' on the model's own hyper-connections (4 streams"), message
    check_parallelize(model, "auto", layout=ParallelLayout(pipeline_model_parallel_size=2))  # PP runs


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
