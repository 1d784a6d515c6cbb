"""The parallel layout: one value for the TP x CP x PP x DP (and EP) degrees, checked when it is
made, that carries this rank's place and process groups once built (torchtitan's ``ParallelDims``).

Every entry point makes one (the CLI from its config, each strategy from its arguments,
``parallelize`` outside a strategy from the user's), and passes it down. :meth:`ParallelLayout.build`
has megatron-core's ``parallel_state`` make the groups over the initialised default process group
(gloo on CPU, NCCL on GPU) and returns the built layout, which the runtime (point-to-point, the
schedules, gradient reduction, RNG seeding, checkpoints) receives explicitly. Megatron's rank
order: TP fastest, then CP, then DP, then PP. DP is ``world_size / (TP * CP * PP)``.

Context parallelism (CP) splits each sequence over ``CP`` ranks that see the same samples: what
TP does not split is replicated over DP x CP, so its gradients are reduced (and the distributed
optimizer shards) over that group, while the data is split over DP only. Expert parallelism (EP)
splits the experts of an MoE layer over ``EP`` ranks carved out of the DP x CP ranks (megatron's
rule): expert parameters are replicated over the remaining expert-data-parallel ranks only.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from lightning_mhc.distributed.context_parallel import sequence_divisor
from lightning_mhc.errors import ConfigError, Field, key, term
from lightning_mhc.recompute.rng import set_parallel_randomizer

DEGREES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
           "sequence_parallel", "context_parallel_size", "expert_model_parallel_size")
"""The fields of :class:`ParallelLayout` that a user chooses (megatron's names); the world size and
this rank's place come from the processes."""

SUMMARY_FIELDS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                  "virtual_pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size",
                  "expert_model_parallel_size")
"""What :meth:`ParallelLayout.summary` writes out, in this order."""

MODEL_SPLIT_BY_TP = ("num_attention_heads", "hidden_size", "num_query_groups", "ffn_hidden_size", "padded_vocab_size")
"""The model sizes tensor parallelism divides, in the order they are checked."""


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank (megatron's) and its pipeline's global ranks."""

    tensor: Any
    pipeline: Any
    data: Any
    """The ranks that read different samples (DP, without CP)."""
    model_parallel: Any
    context: Any
    """The ranks that split one sequence (CP; size 1 without it)."""
    data_context: Any
    """DP x CP: the ranks over which what TP does not split is replicated (gradients, ZeRO-1)."""
    expert: Any
    """The ranks that split the experts (EP; size 1 without it)."""
    expert_data: Any
    """The ranks over which an expert's parameters are replicated (DP x CP / EP)."""
    embedding: Any | None
    """First and last stage of this pipeline (tied embedding); None off those stages or without PP."""
    pipeline_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, stage 0 first."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelLayout:
    """A TP x CP x PP x DP (x EP) layout: its degrees, checked when made (the one place the layout rules
    live); once :meth:`build` has run, also this rank's ranks and process groups.

    ``virtual_pipeline_model_parallel_size`` is ``v``: each rank holds ``v`` model chunks
    (interleaved 1F1B; 1 is the plain pipeline). ``sequence_parallel``: the residual stream,
    norms, hyper-connections and dropout run on ``s / TP`` tokens per TP rank.
    ``context_parallel_size``: each sequence split over ``CP`` ranks (load-balanced chunks, see
    ``distributed.context_parallel``). ``expert_model_parallel_size``: the experts of MoE layers
    split over ``EP`` ranks of DP x CP. ``world_size=None``:
    not known yet (a strategy before launch); :meth:`build` checks it. Its errors name the
    values by these fields (a door such as the CLI relabels them: ``ConfigError.relabel``).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    world_size: int | None = None
    tensor_model_parallel_rank: int | None = None
    """This rank's place, once built (None before)."""
    pipeline_model_parallel_rank: int | None = None
    data_parallel_rank: int | None = None
    context_parallel_rank: int | None = None
    expert_model_parallel_rank: int | None = None
    groups: ProcessGroups | None = field(default=None, compare=False, repr=False)
    """This rank's process groups, once built (None before, and in a copy sent to another process)."""

    def __post_init__(self) -> None:
        self._check_degrees()
        if self.world_size is not None:
            self._check_world(self.world_size)

    def __getstate__(self) -> dict:
        """Degrees and ranks travel (e.g. ``all_gather_object``); process groups do not."""
        return {**self.__dict__, "groups": None}

    # ------------------------------------------------------------------ rules: errors name the layout's own fields
    def _check_degrees(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(term(name, getattr(self, name)), ": must be a positive integer.")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(term("sequence_parallel", self.sequence_parallel), ": must be true or false.")
        vp, pp, tp = (self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size,
                      self.tensor_model_parallel_size)
        if vp > 1 and pp < 2:
            raise ConfigError(
                term("virtual_pipeline_model_parallel_size", vp), " needs ", key("pipeline_model_parallel_size"),
                f" >= 2 (it is {pp}): the interleaved schedule splits each stage into chunks. Set it to 1, or use "
                "pipeline parallelism.")
        if self.sequence_parallel and tp < 2:
            raise ConfigError(
                term("sequence_parallel", True), " needs ", key("tensor_model_parallel_size"), f" >= 2 (it is {tp}): "
                "the sequence is split across the tensor-parallel ranks. Set ", term("sequence_parallel", False),
                ", or raise the TP size.")

    def _check_world(self, world: int) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp, ep = self.context_parallel_size, self.expert_model_parallel_size
        if not _positive_int(world) or world % (tp * cp * pp):
            product = (term("tensor_model_parallel_size", tp), " * ", term("pipeline_model_parallel_size", pp))
            product += (" * ", term("context_parallel_size", cp)) if cp > 1 else ()
            raise ConfigError(
                *product, f" = {tp * cp * pp} does not divide ", term("world_size", world),
                f". Use a number of devices that is a multiple of {tp * cp * pp}, or change the "
                f"{'TP/CP/PP' if cp > 1 else 'TP/PP'} sizes.")
        replicas = world // (tp * pp)  # DP x CP: the ranks experts are split over (megatron's rule)
        if replicas % ep:
            raise ConfigError(
                term("expert_model_parallel_size", ep), f" does not divide the {replicas} data- and context-parallel "
                "ranks of ", term("world_size", world), " (world / (TP * PP)): experts are split over ranks that hold "
                f"the same stage and TP shard. Use an EP size that divides {replicas}, or more devices.")

    def with_world(self, world_size: int) -> ParallelLayout:
        """This layout in a world of ``world_size`` processes (checked)."""
        return dataclasses.replace(self, world_size=world_size)

    def check_model(self, sizes: Mapping[str, int | None], seq_length: int | None = None) -> None:
        """A model on this layout: ``num_layers`` split evenly over the (virtual) stages, the sizes of
        ``MODEL_SPLIT_BY_TP`` divisible by TP, and under sequence parallelism ``seq_length`` too
        (each checked when given)."""
        tp, pp, v = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, \
            self.virtual_pipeline_model_parallel_size
        layers = sizes.get("num_layers")
        if layers is not None and layers % pp:
            raise ConfigError(term("num_layers", layers), " cannot be split evenly over ",
                              term("pipeline_model_parallel_size", pp),
                              f" stages. Use a number of layers divisible by {pp}.")
        if layers is not None and layers % (pp * v):
            raise ConfigError(
                term("num_layers", layers), " cannot be split into ", term("pipeline_model_parallel_size", pp),
                " x ", term("virtual_pipeline_model_parallel_size", v), f" = {pp * v} equal chunks. Use a number "
                f"of layers divisible by {pp * v}, or another virtual pipeline size.")
        for name in MODEL_SPLIT_BY_TP:
            value = sizes.get(name)
            if value is not None and value % tp:
                raise ConfigError(term(name, value), " is not divisible by ", term("tensor_model_parallel_size", tp),
                                  f". Choose a tensor-parallel size that divides {value}, or change ", key(name), ".")
        if seq_length is not None and seq_length % self.sequence_split:
            raise ConfigError(*self._sequence_split_reason(seq_length),
                              f": use a sequence length divisible by {self.sequence_split}.")

    @property
    def sequence_split(self) -> int:
        """What the sequence length must divide by: ``2 * CP`` load-balanced chunks, each split again
        over TP under sequence parallelism."""
        return sequence_divisor(self.context_parallel_size,
                                self.tensor_model_parallel_size if self.sequence_parallel else 1)

    def _sequence_split_reason(self, seq_length: int) -> tuple[str | Field, ...]:
        """Why ``seq_length`` must divide by ``sequence_split`` (the parts of an error)."""
        length = term("seq_length", seq_length)

        def sp(what: str | Field) -> tuple[str | Field, ...]:
            return (term("sequence_parallel", True), " splits ", what, " over ",
                    term("tensor_model_parallel_size", self.tensor_model_parallel_size), " ranks")

        if self.context_parallel_size == 1:
            return sp(length)
        chunks = (term("context_parallel_size", self.context_parallel_size), " cuts ", length,
                  f" into 2 * {self.context_parallel_size} chunks")
        return (*chunks, " and ", *sp("each")) if self.sequence_parallel else chunks

    def check_microbatches(self, num_microbatches: int, group: int | None = None) -> int:
        """The microbatches of one step on this layout: at least one; with a virtual pipeline,
        megatron's rule for the interleaved schedule: microbatches run in groups of ``group``
        (default: the PP size) per model chunk, ``p <= group <= m``, and a last group shorter than
        ``p`` would stall the pipeline. Returns the group size (``m`` without a virtual pipeline)."""
        m, p = num_microbatches, self.pipeline_model_parallel_size
        if not _positive_int(m):
            raise ConfigError(term("num_microbatches", m), ": must be a positive integer.")
        if self.virtual_pipeline_model_parallel_size == 1:
            return m
        group = group or p
        microbatches, stages = term("num_microbatches", m), term("pipeline_model_parallel_size", p)
        needs = ("the interleaved schedule needs a number of microbatches (", microbatches, ") that is a multiple of ",
                 stages if group == p else f"the group size {group}", " (megatron's rule)")
        fix = (". Change ", key("num_microbatches"), ", or drop the virtual pipeline.")
        if not p <= group <= m:
            raise ConfigError(f"the interleaved pipeline schedule runs microbatches in groups of {group} per model "
                              "chunk, which must lie in [", stages, ", ", microbatches, "]: ", *needs,
                              f", at least {max(p, group)}", *fix)
        if 0 < m % group < p:
            raise ConfigError(microbatches, f" leaves a last group of {m % group} microbatches for the interleaved "
                              f"schedule (groups of {group}): it must be 0 or at least ", stages,
                              ", else the pipeline stalls; ", *needs, *fix)
        return group

    # ------------------------------------------------------- degrees and stages
    @property
    def data_parallel_size(self) -> int:
        if self.world_size is None:
            raise RuntimeError("the data-parallel size is known once the world size is")
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)

    def summary(self) -> dict[str, int | bool]:
        """The layout as runs write it out (checkpoint metadata, a run's summary): the world, every
        degree and the DP size derived from them (``SUMMARY_FIELDS``)."""
        return {name: getattr(self, name) for name in SUMMARY_FIELDS}

    @property
    def expert_data_parallel_size(self) -> int:
        """The ranks one expert's parameters are replicated over: DP x CP / EP."""
        return self.data_parallel_size * self.context_parallel_size // self.expert_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def num_virtual_stages(self) -> int:
        """Stages the model is cut into: ``PP * v``."""
        return self.pipeline_model_parallel_size * self.virtual_pipeline_model_parallel_size

    def local_virtual_stages(self) -> list[int]:
        """This rank's (virtual) stages, chunk by chunk: chunk ``c`` of stage ``r`` is virtual stage
        ``c * PP + r`` (megatron's layer assignment); one stage without a virtual pipeline."""
        pp, rank = self.pipeline_model_parallel_size, self._place("pipeline_model_parallel_rank")
        return [chunk * pp + rank for chunk in range(self.virtual_pipeline_model_parallel_size)]

    def place(self) -> str:
        """This rank's place as messages name it: "TP rank 0, PP rank 1, DP rank 0", with its CP and
        EP ranks where the layout splits over them."""
        ranks = [("TP", "tensor_model_parallel_rank"), ("PP", "pipeline_model_parallel_rank")]
        if self.context_parallel_size > 1:
            ranks.append(("CP", "context_parallel_rank"))
        ranks.append(("DP", "data_parallel_rank"))
        if self.expert_model_parallel_size > 1:
            ranks.append(("EP", "expert_model_parallel_rank"))
        return ", ".join(f"{short} rank {self._place(name)}" for short, name in ranks)

    @property
    def is_first_stage(self) -> bool:
        return self._place("pipeline_model_parallel_rank") == 0

    @property
    def is_last_stage(self) -> bool:
        return self._place("pipeline_model_parallel_rank") == self.pipeline_model_parallel_size - 1

    # ------------------------------------------------------------- groups
    @property
    def is_built(self) -> bool:
        return self.groups is not None

    def _place(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"this ParallelLayout describes degrees only ({name} is not known): "
                               "layout.build() gives one with this rank's place and groups")
        return value

    def _groups(self) -> ProcessGroups:
        if self.groups is None:
            raise RuntimeError("this ParallelLayout describes degrees only; layout.build() gives one with groups")
        return self.groups

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage (the last stage's next is the first: the virtual
        pipeline's chunk boundary)."""
        ranks = self._groups().pipeline_ranks
        return ranks[(self.pipeline_model_parallel_rank + 1) % len(ranks)]

    @property
    def prev_rank(self) -> int:
        ranks = self._groups().pipeline_ranks
        return ranks[(self.pipeline_model_parallel_rank - 1) % len(ranks)]

    @property
    def last_stage_rank(self) -> int:
        return self._groups().pipeline_ranks[-1]

    @property
    def tp_group(self):
        return self._groups().tensor

    @property
    def pp_group(self):
        return self._groups().pipeline

    @property
    def dp_group(self):
        return self._groups().data

    @property
    def model_parallel_group(self):
        return self._groups().model_parallel

    @property
    def cp_group(self):
        return self._groups().context

    @property
    def dp_cp_group(self):
        """DP x CP: where the gradients of what TP does not split are reduced (the DP group without CP)."""
        return self._groups().data_context

    @property
    def ep_group(self):
        return self._groups().expert

    @property
    def expert_dp_group(self):
        return self._groups().expert_data

    @property
    def embedding_group(self):
        return self._groups().embedding

    def build(self, timeout: datetime.timedelta | None = None, gloo_groups: bool = True) -> ParallelLayout:
        """This layout with this rank's place and megatron-core's TP, CP, PP, DP, EP (and embedding) groups,
        made over the initialised default process group (whose size is checked first).

        The groups megatron's ``parallel_state`` holds are kept, when they are the ones this layout
        needs (the same TP, CP, PP and EP sizes in the same world; the virtual pipeline and sequence
        parallelism need no groups of their own): a model built on them (megatron's layers keep
        them) goes on working, as after ``Trainer.fit`` for ``trainer.save_checkpoint``,
        ``validate``, ``test`` or a second ``fit``. Other sizes replace them (destroyed).
        ``gloo_groups=False``: without megatron's gloo twins of its groups (the planner's fake
        default group, ``planning.fake_group``, has no store for gloo to meet over)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(or run under MHCParallelStrategy / torchrun) first."
            )
        from megatron.core import parallel_state  # (here: planning a layout imports no megatron-core)

        world = self.with_world(dist.get_world_size())
        if _megatron_groups_serve(world):
            return world._adopt_megatron_groups()
        destroy_parallel()
        kwargs = {"distributed_timeout_minutes": max(1, int(timeout.total_seconds() // 60))} if timeout else {}
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            create_gloo_process_groups=gloo_groups,
            **kwargs,
        )
        return world._adopt_megatron_groups()

    def same_layout(self, other: ParallelLayout) -> bool:
        """The same degrees in the same world (whatever the rank or the groups)."""
        return all(getattr(self, name) == getattr(other, name) for name in (*DEGREES, "world_size"))

    def _adopt_megatron_groups(self) -> ParallelLayout:
        """This layout with the place and groups megatron's ``parallel_state`` holds now (whose
        TP, CP, PP and EP sizes it must have)."""
        from megatron.core import parallel_state as ps

        pipeline_ranks = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
        # megatron's default embedding ranks: the first and last stage (its is_rank_in_embedding_group
        # can answer from a previous initialisation after destroy_model_parallel)
        in_embedding = dist.get_rank() in (pipeline_ranks[0], pipeline_ranks[-1])
        groups = ProcessGroups(
            tensor=ps.get_tensor_model_parallel_group(),
            pipeline=ps.get_pipeline_model_parallel_group(),
            data=ps.get_data_parallel_group(),
            model_parallel=ps.get_model_parallel_group(),
            context=ps.get_context_parallel_group(),
            data_context=ps.get_data_parallel_group(with_context_parallel=True),
            expert=ps.get_expert_model_parallel_group(),
            expert_data=ps.get_expert_data_parallel_group(),
            embedding=ps.get_embedding_group() if in_embedding else None,
            pipeline_ranks=pipeline_ranks,
        )
        return dataclasses.replace(
            self, world_size=dist.get_world_size(),
            tensor_model_parallel_rank=ps.get_tensor_model_parallel_rank(),
            pipeline_model_parallel_rank=ps.get_pipeline_model_parallel_rank(),
            data_parallel_rank=ps.get_data_parallel_rank(), context_parallel_rank=ps.get_context_parallel_rank(),
            expert_model_parallel_rank=ps.get_expert_model_parallel_rank(), groups=groups)


def stage_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges of ``sizes`` items each: the layers (or blocks) of each
    (virtual) pipeline stage."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _megatron_groups_serve(layout: ParallelLayout) -> bool:
    """megatron's ``parallel_state`` holds groups that would serve ``layout`` (a world-checked
    one): the same TP, CP, PP and EP sizes in the same world. megatron's layers read its groups
    from there, so they are the one process-wide state; no layout is kept beside them."""
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized() and _alive(ps.get_model_parallel_group()) \
        and dist.get_world_size() == layout.world_size and (
            ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size()) == (
            layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.context_parallel_size,
            layout.expert_model_parallel_size)


def _alive(group: Any) -> bool:
    """``group`` is still registered with torch.distributed: megatron keeps its groups after the
    default group they were made in is destroyed (a failed job of a multirun ends that way; the
    next job makes a new default group), and those must be made again."""
    try:
        dist.get_process_group_ranks(group)
    except KeyError:
        return False
    return True


def destroy_parallel() -> None:
    """Tear the model-parallel groups down (the default group stays), and the parallel randomizer
    seeded for their ranks (``distributed.random``): its streams belong to this layout, and left
    installed they would keep feeding dropout after ``torch.manual_seed`` (which does not reach
    them), so two runs meant to start alike would not.

    megatron's ``destroy_model_parallel`` only forgets its groups; with gloo each group
    keeps its own threads and sockets, so a process that builds layouts again and again
    (tests, sweeps in one process) would pile them up. The groups are destroyed here."""
    from megatron.core import parallel_state

    set_parallel_randomizer(None)
    groups = {id(g): g for g in vars(parallel_state).values()
              if isinstance(g, dist.ProcessGroup) and g is not dist.GroupMember.WORLD}
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in groups.values():
        try:
            dist.destroy_process_group(group)
        except ValueError:  # not registered with c10d (already gone): nothing to free
            pass


def ensure_default_group() -> None:
    """A one-rank gloo default group when there is none: megatron-core's layers and dataset
    builders call ``torch.distributed`` even in one process."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def single_process_layout() -> ParallelLayout:
    """TP = PP = DP = 1 in this process, for using a whole model outside a parallel run (loading
    a checkpoint, generating, a model built without a layout handed to it): megatron's layers need
    an initialised default group and TP group, so a one-rank gloo group is made when there is none.
    In a process of a larger world, only where megatron's groups there are TP = PP = CP = 1 (a
    data-parallel run: the whole model on every rank); else the run's layout must be handed over."""
    ensure_default_group()
    world = dist.get_world_size()
    if world == 1 or _megatron_groups_serve(ParallelLayout(world_size=world)):
        return ParallelLayout().build()
    raise ConfigError(
        f"torch.distributed has {world} ranks and no data-parallel-only layout: hand the model the run's layout "
        "(layout=strategy.layout, or a LightningModule's self.layout), or build the whole model in a process of "
        "its own (a checkpoint resumes on any layout through Trainer.fit(ckpt_path=...)).")
