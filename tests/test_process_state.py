"""What a strategy's run changes in its process, and that it puts it back (``distributed/process_state.py``).

- Under the strategy's randomizer, a hyper-connected model with dropout under Hugging Face's
  gradient checkpointing (reentrant and not, turned on before the run or during it): every gradient is the unchecked run's, bit for bit
  (through Fabric, one process). torch's checkpoint restores only its own generators; unwrapped,
  the re-run drew other masks from the randomizer's streams. The same for a user's
  ``torch.utils.checkpoint`` of dropouts drawn from the streams, reentrant and not.
- Two runs in one process group (2 ranks): ``Trainer.fit`` with context parallelism, then another
  layout without it, then a Fabric run on TP 2: the process is left as it was before them
  (transformers' attention and mask registries, torch's and transformers' checkpoint functions,
  every module class's ``__init__``, torch's generator, the randomizer, the process state; after
  Fabric's teardown, megatron's groups too).
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")

sys.path.insert(0, str(pathlib.Path(__file__).parent / "scripts"))
from lm_models import SEQ, VOCAB, llama, opt  # noqa: E402

from lightning_mhc import add_hyper_connections  # noqa: E402
from lightning_mhc.recompute.rng import get_all_rng_states, rng_fork, set_all_rng_states  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402

STREAMS = 4
TOKENS = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _dropouts(x: torch.Tensor) -> torch.Tensor:
    """Dropout drawn from the randomizer's streams, as a split model's: a replicated region's inside
    a TP-split one's, then the TP-split one's again."""
    with rng_fork():
        x = F.dropout(x * 2, p=0.1)
        with rng_fork("tensor"):
            x = F.dropout(x.sin(), p=0.1)
        return F.dropout(x, p=0.1)


def _torch_checkpoint_cases() -> dict[str, bool]:
    """A user's ``torch.utils.checkpoint.checkpoint`` (looked up at call time) of :func:`_dropouts`,
    reentrant and not, in a Fabric run: True where the gradient is the unchecked one's bit for bit."""
    from lightning.fabric import Fabric

    from lightning_mhc.fabric import MHCParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=MHCParallelStrategy())
    fabric.launch()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    states = get_all_rng_states()
    out = {}
    try:
        for reentrant in (False, True):
            grads = []
            for checkpointed in (False, True):
                set_all_rng_states(states)
                x.grad = None
                y = x
                for _ in range(3):  # the streams move on between checkpoints, as over a model's blocks
                    y = torch.utils.checkpoint.checkpoint(_dropouts, y, use_reentrant=reentrant) if checkpointed \
                        else _dropouts(y)
                y.square().sum().backward()
                grads.append(x.grad.clone())
            assert grads[0].count_nonzero() > grads[0].numel() // 4  # about 0.9 ** 9 of them kept through 9 dropouts
            out[f"torch_checkpoint:{'reentrant' if reentrant else 'non_reentrant'}"] = torch.equal(*grads)
    finally:
        fabric.strategy.teardown()
    return out


def _grads(model: nn.Module, backward) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model.train()
    model.zero_grad(set_to_none=True)
    backward(model(input_ids=TOKENS, labels=TOKENS).loss)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _fabric_grads(make, way: str | None) -> dict[str, torch.Tensor]:
    """The gradients of one step of ``make``'s model with 4 streams and dropout 0.1 in a Fabric run
    with the strategy (its randomizer installed, seeded alike each run), checkpointed ``way``
    (None: not at all; ``hf_before``: Hugging Face's turned on before the run)."""
    from lightning.fabric import Fabric

    from lightning_mhc.fabric import MHCParallelStrategy
    from lightning_mhc.recompute.rng import get_parallel_randomizer

    torch.manual_seed(1)
    model = add_hyper_connections(make(dropout=0.1), STREAMS, init_gating_factor=0.5, implementation="reference")
    if way == "hf_before":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fabric = Fabric(accelerator="cpu", devices=1, strategy=MHCParallelStrategy())
    fabric.launch()
    module = fabric.setup_module(model)
    assert get_parallel_randomizer() is not None
    if way in ("hf_reentrant", "hf_non_reentrant"):  # during the run
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": way == "hf_reentrant"})
    try:
        return _grads(module, fabric.backward)
    finally:
        fabric.strategy.teardown()


def _checkpointing_cases() -> dict[str, bool]:
    """Each way of checkpointing, for Llama (attention dropout) and OPT (dropout after each branch,
    in the hyper-connections' bias-dropout-add): True where every gradient equals the unchecked
    run's bit for bit."""
    out = {}
    for name, make in (("llama", llama), ("opt", opt)):
        expected = _fabric_grads(make, None)
        for way in ("hf_before", "hf_reentrant", "hf_non_reentrant"):
            got = _fabric_grads(make, way)
            out[f"{name}:{way}"] = got.keys() == expected.keys() and all(
                torch.equal(got[k], g) for k, g in expected.items())
    out.update(_torch_checkpoint_cases())
    return out


def test_checkpointing_under_the_randomizer_draws_the_forwards_masks():
    """Every way of checkpointing a hyper-connected model with dropout, under the strategy's
    randomizer: the gradients of the unchecked run, bit for bit."""
    results = _checkpointing_cases()
    assert results and all(results.values()), results


def _process_state() -> dict:
    """What a run may leave changed in its process, by identity or value."""
    import torch.utils.checkpoint as torch_checkpoint
    import transformers.modeling_utils as hf_modeling
    from megatron.core import parallel_state
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from lightning_mhc.any_model.record import _all_module_classes
    from lightning_mhc.distributed.process_state import current_process_state
    from lightning_mhc.recompute.rng import get_parallel_randomizer

    return dict(attention=dict(AttentionInterface._global_mapping), masks=dict(AttentionMaskInterface._global_mapping),
                checkpoint=(torch_checkpoint.checkpoint, hf_modeling.checkpoint),
                inits={cls: cls.__dict__.get("__init__") for cls in _all_module_classes()},
                rng=torch.get_rng_state(), randomizer=get_parallel_randomizer(), owner=current_process_state(),
                groups=parallel_state.model_parallel_is_initialized())


def _differences(before: dict, after: dict) -> list[str]:
    diff = [key for key in ("attention", "masks", "checkpoint", "randomizer", "owner", "groups")
            if before[key] != after[key]]
    if not torch.equal(before["rng"], after["rng"]):
        diff.append("rng")
    diff += [f"{cls.__name__}.__init__" for cls, init in before["inits"].items() if cls.__dict__.get("__init__") is not init]
    return diff


def _two_fits(rank: int, world: int) -> dict:
    """``Trainer.fit`` of a Llama split by ``parallelize`` on CP 2, then on DP 2 (another layout, no
    CP), then a Fabric run on TP 2 torn down: what each left changed."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy, ParallelLMModule, parallelize, record_module_init
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.distributed.process_state import ProcessState
    from lightning_mhc.fabric import MHCParallelStrategy as FabricStrategy

    class LM(ParallelLMModule):
        def configure_model(self):
            if self.model is None:
                with record_module_init():
                    model = llama(dropout=0.1)
                self.model = parallelize(model, "llama", layout=self.layout, hyper_connections=STREAMS)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    before = _process_state()
    out = {}
    for name, sizes in (("cp2", dict(context_parallel_size=2)), ("dp2", {})):
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=MHCParallelStrategy(**sizes), max_steps=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        module = LM()
        trainer.fit(module, train_dataloaders=DataLoader(SyntheticTokens(8, SEQ, vocab_size=VOCAB), batch_size=2))
        assert trainer.global_step == 2
        out[name] = [d for d in _differences(before, _process_state()) if d != "groups"]  # the Trainer keeps them
        if name == "cp2":  # the split model goes on in a later run: its forward registers CP attention again
            later = ProcessState()
            later.enter()
            try:
                with torch.no_grad():
                    out["cp2_later_forward"] = list(module.model.eval()(input_ids=TOKENS).shape)
            finally:
                later.release()
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(tensor_model_parallel_size=2))
    fabric.launch()
    assert _differences(before, _process_state())  # the run holds the process
    fabric.strategy.teardown()
    out["fabric"] = _differences(before, _process_state())
    return out


def test_two_fits_leave_the_process_as_they_found_it():
    """CP 2, then DP 2, then Fabric on TP 2, in one group of 2 processes: each rank, after each run,
    finds nothing changed (see the module docstring for what is compared); the CP-split model's
    forward in a later run registers its attention again (its run's teardown took it out)."""
    for rank, found in enumerate(spawn_ranks(_two_fits, 2, timeout_s=300, init_group=False)):
        assert found == {"cp2": [], "cp2_later_forward": [2, SEQ // 2, VOCAB], "dp2": [], "fabric": []}, (rank, found)
