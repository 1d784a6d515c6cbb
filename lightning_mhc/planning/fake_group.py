"""One process standing in for one rank of a layout, with no other process: torch's fake process
group (backend ``"fake"``: every collective returns at once and leaves its tensors as they are, so
shapes come out as a real group's), with megatron-core's groups for the layout made over it, as
torchtitan's dry runs and memory estimation use it. The planner traces a Hugging Face stage's
forward and backward on the meta device in it (``hf_activations``): TP's, CP's and EP's collectives
then have groups to run on, and the collective counter (``distributed.collectives``) reads what each
hands in.

Nothing of it outlives :func:`pretend_rank`: the fake default group and megatron's groups are
destroyed and what the build changes in the process (the parallel randomizer, transformers' registry
of CP attention, torch's generators, the checkpoint functions) is put back by the runtime's own
:class:`~lightning_mhc.distributed.process_state.ProcessState`. The plan runs before launch, in the
launching process, which later makes the real group. A process that holds a default group already
(a test worker's one-rank group) has it set aside while the fake one stands in, and given back; one
holding megatron's groups (a layout in use) is refused: they are the one process-wide state of a
layout, and the fake one would replace them.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.errors import ConfigError


@contextlib.contextmanager
def pretend_rank(layout: ParallelLayout, rank: int) -> Iterator[ParallelLayout]:
    """``layout`` built for global ``rank`` of its world over a fake default group, torn down on exit."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    from lightning_mhc.distributed.layout import destroy_parallel
    from lightning_mhc.distributed.process_state import ProcessState

    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            raise ConfigError("the planner traces a layout's collectives over megatron-core's groups of a fake "
                              "process group, and this process holds a layout's groups already: plan before "
                              "building one (the planner's command, the pre-launch check).")
    own = c10d._world.default_pg  # (torch's documented point to set the default group aside)
    state = ProcessState()
    state.enter()
    try:
        c10d._world.default_pg = None
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            yield layout.build(gloo_groups=False)
        finally:
            destroy_parallel()
            if own is None:
                dist.destroy_process_group()
            else:  # the fake one alone (with the process's own back as the default, it is another group)
                fake, c10d._world.default_pg = c10d._world.default_pg, own
                dist.destroy_process_group(fake)
    finally:
        c10d._world.default_pg = own
        state.release()


def stage_rank(layout: ParallelLayout, stage: int) -> int:
    """The global rank of ``stage``'s first rank (TP, CP, DP and EP rank 0: megatron's order puts
    TP fastest, then CP, then DP, then PP)."""
    return stage * layout.world_size // layout.pipeline_model_parallel_size
