"""The parallel layout: degrees, ranks and process groups in one object.

megatron-core's ``parallel_state`` builds the groups over the initialised default
process group (gloo on CPU, NCCL on GPU); :func:`initialize_parallel` then reads
them once into a :class:`ParallelLayout`, which the runtime (point-to-point, the
schedules, gradient reduction, RNG seeding, checkpoints) receives explicitly, in
the spirit of torchtitan's ``ParallelDims``. Megatron's rank order: TP fastest,
then DP, then PP. DP is ``world_size / (TP * PP)``.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mhc.errors import ConfigError, KeyNames


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one rank (megatron's) and its pipeline's global ranks."""

    tensor: Any
    pipeline: Any
    data: Any
    model_parallel: Any
    embedding: Any | None
    """First and last stage of this pipeline (tied embedding); None off those stages or without PP."""
    pipeline_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, stage 0 first."""


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x PP x DP layout, with its groups.

    ``virtual_pipeline_model_parallel_size`` is ``v``: each rank holds ``v`` model
    chunks (interleaved 1F1B). ``sequence_parallel``: the residual stream, norms,
    hyper-connections and dropout run on ``s / TP`` tokens per TP rank.
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_rank: int
    pipeline_model_parallel_rank: int
    data_parallel_rank: int
    virtual_pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    groups: ParallelGroups | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Degrees and ranks travel (e.g. ``all_gather_object``); process groups do not."""
        return {**self.__dict__, "groups": None}

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == self.pipeline_model_parallel_size - 1

    def _groups(self) -> ParallelGroups:
        if self.groups is None:
            raise RuntimeError("this ParallelLayout describes degrees only; initialize_parallel() gives one with groups")
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
    def embedding_group(self):
        return self._groups().embedding


RUNTIME_NAMES = KeyNames({
    "world_size": "the world size {}",
    "padded_vocab_size": "padded vocabulary (vocab_size rounded up to make_vocab_size_divisible_by)",
})
"""How layout errors name values by default (a strategy's and the model's arguments)."""

MODEL_SPLIT_BY_TP = ("num_attention_heads", "hidden_size", "num_query_groups", "ffn_hidden_size", "padded_vocab_size")
"""The model sizes tensor parallelism divides, in the order they are checked."""


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a TP x PP x DP layout and the model sizes it splits, checked when built: the
    one place the layout rules live (torchtitan's ``ParallelDims.__post_init__``). The config
    schema, both strategies, :func:`initialize_parallel` and the model's tensor-parallel layers
    build one; each passes ``errors.KeyNames`` to have errors name its own keys.

    ``world_size=None``: not known yet (a strategy before launch), so its divisibility is not
    checked. ``model``: the sizes of ``MODEL_SPLIT_BY_TP`` and ``num_layers`` that are known
    (each checked when given); ``seq_length``: checked under sequence parallelism when given.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    model: Mapping[str, int | None] = field(default_factory=dict)
    seq_length: int | None = None
    names: KeyNames = field(default=RUNTIME_NAMES, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_degrees()
        self._check_world()
        self._check_layers()
        self._check_sequence_parallel()
        self._check_tensor_split()

    @property
    def data_parallel_size(self) -> int:
        if self.world_size is None:
            raise RuntimeError("the data-parallel size is known once the world size is")
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def virtual_size(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def _fail(self, message: str) -> None:
        raise ConfigError(message)

    def _check_degrees(self) -> None:
        t = self.names.term
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self._fail(f"{t(name, value)}: must be a positive integer.")
        vp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if vp is not None and (isinstance(vp, bool) or not isinstance(vp, int) or vp < 1):
            self._fail(f"{t('virtual_pipeline_model_parallel_size', vp)}: must be a positive integer "
                       f"(or {self.names.show(None)}).")
        if vp is not None and vp > 1 and pp < 2:
            self._fail(
                f"{t('virtual_pipeline_model_parallel_size', vp)} needs a positive size and "
                f"{self.names.key('pipeline_model_parallel_size')} >= 2 (it is {pp}): the interleaved schedule "
                f"splits each stage into chunks. Set it to {self.names.show(None)}, or use pipeline parallelism."
            )

    def _check_world(self) -> None:
        tp, pp, world, t = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.world_size,
                            self.names.term)
        if world is not None and (world < 1 or world % (tp * pp)):
            self._fail(
                f"{t('tensor_model_parallel_size', tp)} * {t('pipeline_model_parallel_size', pp)} = {tp * pp} "
                f"does not divide {t('world_size', world)}. Use a number of devices that is a multiple of "
                f"{tp * pp}, or change the TP/PP sizes."
            )

    def _check_layers(self) -> None:
        layers, pp, v, t = self.model.get("num_layers"), self.pipeline_model_parallel_size, self.virtual_size, \
            self.names.term
        if layers is None:
            return
        if layers % pp:
            self._fail(f"{t('num_layers', layers)} cannot be split evenly over {t('pipeline_model_parallel_size', pp)} "
                       f"stages. Use a number of layers divisible by {pp}.")
        if layers % (pp * v):
            self._fail(
                f"{t('num_layers', layers)} cannot be split into {t('pipeline_model_parallel_size', pp)} x "
                f"{t('virtual_pipeline_model_parallel_size', v)} = {pp * v} equal chunks. Use a number of layers "
                f"divisible by {pp * v}, or another virtual pipeline size."
            )

    def _check_sequence_parallel(self) -> None:
        tp, seq, t, key = self.tensor_model_parallel_size, self.seq_length, self.names.term, self.names.key
        if not self.sequence_parallel:
            return
        if tp < 2:
            self._fail(
                f"{t('sequence_parallel', True)} needs {key('tensor_model_parallel_size')} >= 2 (it is {tp}): the "
                f"sequence is split across the tensor-parallel ranks. Set {t('sequence_parallel', False)}, or raise "
                "the TP size."
            )
        if seq is not None and seq % tp:
            self._fail(f"{t('sequence_parallel', True)} splits {t('seq_length', seq)} over "
                       f"{t('tensor_model_parallel_size', tp)} ranks: use a sequence length divisible by {tp}.")

    def _check_tensor_split(self) -> None:
        tp, t = self.tensor_model_parallel_size, self.names.term
        for name in MODEL_SPLIT_BY_TP:
            value = self.model.get(name)
            if value is not None and value % tp:
                self._fail(
                    f"{t(name, value)} is not divisible by {t('tensor_model_parallel_size', tp)}. Choose a "
                    f"tensor-parallel size that divides {value}, or change {self.names.key(name)}."
                )


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int, group: int | None = None,
                                   names: KeyNames = RUNTIME_NAMES) -> int:
    """Megatron's rule for the interleaved schedule (virtual pipeline): microbatches run in groups
    of ``group`` (default: the PP size) per model chunk, ``p <= group <= m``, and a last group
    shorter than ``p`` would stall the pipeline. Returns the group size."""
    m, p, t = num_microbatches, pipeline_size, names.term
    group = group or p
    multiple = t("pipeline_model_parallel_size", p) if group == p else f"the group size {group}"
    needs = f"the interleaved schedule needs a number of microbatches ({t('num_microbatches', m)}) that is a " \
            f"multiple of {multiple} (megatron's rule)"
    fix = f"Change {names.key('num_microbatches')}, or drop the virtual pipeline."
    if not p <= group <= m:
        raise ConfigError(f"the interleaved pipeline schedule runs microbatches in groups of {group} per model chunk, "
                          f"which must lie in [{t('pipeline_model_parallel_size', p)}, {t('num_microbatches', m)}]: "
                          f"{needs}, at least {max(p, group)}. {fix}")
    if 0 < m % group < p:
        raise ConfigError(f"{t('num_microbatches', m)} leaves a last group of {m % group} microbatches for the "
                          f"interleaved schedule (groups of {group}): it must be 0 or at least "
                          f"{t('pipeline_model_parallel_size', p)}, else the pipeline stalls; {needs}. {fix}")
    return group


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    timeout: datetime.timedelta | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    sequence_parallel: bool = False,
) -> ParallelLayout:
    """Build megatron-core's TP, PP, DP (and embedding) groups; returns this rank's layout.

    A layout of these degrees built earlier and still alive is returned as it is: a model built
    on its groups (megatron's layers keep them) goes on working, as after ``Trainer.fit`` for
    ``trainer.save_checkpoint``, ``validate``, ``test``, ``predict`` or a second ``fit``. Other
    degrees replace it (its groups destroyed)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(or run under MHCParallelStrategy / torchrun) first."
        )
    ParallelDims(tensor_model_parallel_size, pipeline_model_parallel_size, dist.get_world_size(),
                 virtual_pipeline_model_parallel_size, sequence_parallel)
    global _ACTIVE
    live = _ACTIVE
    if live is not None and parallel_state.model_parallel_is_initialized() and (
            live.tensor_model_parallel_size, live.pipeline_model_parallel_size,
            live.virtual_pipeline_model_parallel_size, live.sequence_parallel, live.world_size) == (
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1,
            sequence_parallel, dist.get_world_size()):
        return live
    destroy_parallel()
    kwargs = {"distributed_timeout_minutes": max(1, int(timeout.total_seconds() // 60))} if timeout else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **kwargs,
    )
    _ACTIVE = current_layout(virtual_pipeline_model_parallel_size, sequence_parallel)
    return _ACTIVE


_ACTIVE: ParallelLayout | None = None


def active_layout() -> ParallelLayout:
    """The layout :func:`initialize_parallel` built last (virtual pipeline and sequence
    parallelism included), while its groups live; else megatron's current groups'; else, in a
    process without a layout, the one-process one (:func:`single_process_layout`)."""
    if _ACTIVE is not None and parallel_state.model_parallel_is_initialized():
        return _ACTIVE
    if parallel_state.model_parallel_is_initialized():
        return current_layout()
    return single_process_layout()


def current_layout(virtual_pipeline_model_parallel_size: int | None = None,
                   sequence_parallel: bool = False) -> ParallelLayout:
    """The layout of the groups megatron's ``parallel_state`` holds now."""
    ps = parallel_state
    pipeline_ranks = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    # megatron's default embedding ranks: the first and last stage (its is_rank_in_embedding_group
    # can answer from a previous initialisation after destroy_model_parallel)
    in_embedding = dist.get_rank() in (pipeline_ranks[0], pipeline_ranks[-1])
    groups = ParallelGroups(
        tensor=ps.get_tensor_model_parallel_group(),
        pipeline=ps.get_pipeline_model_parallel_group(),
        data=ps.get_data_parallel_group(),
        model_parallel=ps.get_model_parallel_group(),
        embedding=ps.get_embedding_group() if in_embedding else None,
        pipeline_ranks=pipeline_ranks,
    )
    return ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        tensor_model_parallel_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_model_parallel_rank=ps.get_pipeline_model_parallel_rank(),
        data_parallel_rank=ps.get_data_parallel_rank(),
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size or 1,
        sequence_parallel=sequence_parallel,
        groups=groups,
    )


def destroy_parallel() -> None:
    """Tear the model-parallel groups down (the default group stays).

    megatron's ``destroy_model_parallel`` only forgets its groups; with gloo each group
    keeps its own threads and sockets, so a process that builds layouts again and again
    (tests, sweeps in one process) would pile them up. The groups are destroyed here."""
    global _ACTIVE
    _ACTIVE = None
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
    a checkpoint, generating): megatron's layers need an initialised default group and TP group,
    so a one-rank gloo group is made when there is none. In a process of a larger world, the
    current layout must already be TP = PP = 1."""
    ensure_default_group()
    if parallel_state.model_parallel_is_initialized():
        layout = current_layout()
        if layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size != 1:
            raise RuntimeError(
                f"this process holds a TP={layout.tensor_model_parallel_size}, PP={layout.pipeline_model_parallel_size} "
                "layout: a whole model is built outside a model-parallel run (a checkpoint resumes on any layout "
                "through Trainer.fit(ckpt_path=...))."
            )
        return layout
    if dist.get_world_size() != 1:
        raise RuntimeError(
            f"torch.distributed has {dist.get_world_size()} ranks and no model-parallel layout: build the whole "
            "model in a process of its own, or call initialize_parallel(1, 1) first."
        )
    return initialize_parallel(1, 1)
