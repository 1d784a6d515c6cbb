"""Pipeline stage partitioning: which layers each stage (and each virtual-pipeline chunk) holds,
and building only the local ones."""
from __future__ import annotations

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.gpt import GPTModel
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.model.sizes import partition_layers


def build_gpt_chunks(
    config: MHCTransformerConfig,
    layout: ParallelLayout,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[GPTModel]:
    """This rank's model chunks, one per (virtual) pipeline stage it holds
    (``layout.local_virtual_stages()``: chunk ``c`` of stage ``r`` is virtual stage ``c * p + r``,
    megatron's layer assignment), and only they (like megatron's ``model_provider``: no module of
    another stage is constructed, not even on the meta device). The layers are split over the
    ``p * v`` virtual stages; the first embeds (and expands the streams), the last contracts the
    streams and computes the loss. ``first/last_stage_layers`` size the first and last one.
    """
    stages = layout.num_virtual_stages
    ranges = partition_layers(config.num_layers, stages, first_stage_layers, last_stage_layers)
    return [GPTModel(config, pre_process=stage == 0, post_process=stage == stages - 1, layer_range=ranges[stage],
                     layout=layout)
            for stage in layout.local_virtual_stages()]
