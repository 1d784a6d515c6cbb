"""``StrategyProcesses``: what Lightning asks of any parallel strategy, the same for the Trainer's
and Fabric's ``MHCParallelStrategy``."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.strategies.runtime import ParallelRuntime, broadcast_object
from lightning_mhc.strategies.settings import ParallelSettings


class StrategyProcesses:
    """Mixed in before the Lightning base class (which provides the devices and the cluster
    environment): the constructor (the :class:`ParallelSettings` its subclass's ``__init__`` made,
    building ``self.runtime``), devices and ranks, the launcher, the registry name, barrier and broadcast.
    Everything else of the parallel run is ``self.runtime``
    (:class:`~lightning_mhc.strategies.runtime.ParallelRuntime`)."""

    strategy_name = "mhc_parallel"
    launcher_class: type
    """The subprocess launcher (Fabric's or the Trainer's, with ``launcher.JobLauncherMixin``)."""

    def __init__(self, settings: ParallelSettings, **lightning_arguments: Any) -> None:
        """``settings`` (made by the subclass's ``__init__``, which lists every keyword); the
        ``lightning_arguments`` go to Lightning's strategy."""
        super().__init__(**lightning_arguments)
        self.runtime = ParallelRuntime(settings)
        self._num_nodes = 1
        self.last_grad_norm: float | None = None
        """The global gradient norm of the last step (before clipping)."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Tensor/pipeline/data parallelism for mHC transformers"
            )

    # --------------------------------------------- the settings, read through
    @property
    def settings(self) -> ParallelSettings:
        return self.runtime.settings

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.settings.layout.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.settings.layout.pipeline_model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.settings.microbatches

    @property
    def layout(self) -> ParallelLayout | None:
        """The parallel layout (degrees, ranks, process groups), once the processes have started."""
        return self.runtime.layout

    @property
    def activation_bytes(self) -> int | None:
        return self.runtime.activation_bytes

    # ------------------------------------------------------ devices and ranks
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.runtime.distributed_sampler_kwargs

    @property
    def process_group_backend(self) -> str | None:
        return self.runtime.backend or self.settings.process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _set_world_ranks(self) -> None:  # the name Fabric's connector calls
        self.set_world_ranks()

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.runtime.check_world(self.num_nodes * self.num_processes)  # before any process starts
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def _start_processes(self, module: Any = None) -> None:
        """In every process, from ``setup_environment``: the process taken (put back at teardown), ranks,
        seeds, then the runtime's groups."""
        self.runtime.process_state.enter()
        reset_seed()
        self.set_world_ranks()
        self.runtime.start(self.cluster_environment, self.root_device, module)

    # ------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            with self.runtime.fail_fast.waiting():
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self.runtime.fail_fast.waiting():
            return broadcast_object(obj, src)
