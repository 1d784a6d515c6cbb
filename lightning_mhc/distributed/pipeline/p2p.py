"""Point-to-point between adjacent pipeline stages with ``isend``/``irecv``.

``batch_isend_irecv`` can hang on gloo, so each exchange posts its receives
and sends as separate non-blocking ops and then waits on all of them, with a
deadline. Posting everything before waiting gives the same ordering
guarantees as megatron's batched exchange, so the 1F1B schedule cannot
deadlock between neighbours. Activations and gradients use different tags.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout

_FORWARD_TAG = 1
_BACKWARD_TAG = 2


class PipelineP2P:
    """Sends and receives one stage's activations and gradients.

    ``tensor_shape`` and ``dtype`` describe what crosses stages (the
    ``[s, b, n*C]`` residual stream for the mHC GPT, ``[s/TP, b, n*C]`` under
    sequence parallelism). The last stage's next rank is the first stage (the
    virtual pipeline's chunk boundary); the named exchanges below are no-ops at
    the pipeline's ends, :meth:`exchange` is not.
    """

    def __init__(
        self,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        layout: ParallelLayout,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    ) -> None:
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self.timeout = timeout
        self.is_first = layout.is_first_stage
        self.is_last = layout.is_last_stage
        self.next_rank = layout.next_rank
        self.prev_rank = layout.prev_rank

    def _check(self, tensor: Tensor, what: str) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline {what} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; the "
                f"schedule was set up for {self.tensor_shape} {self.dtype}. Every microbatch must "
                "have the same shape, and the stage output the pipeline dtype."
            )

    def exchange(
        self,
        send_next: Tensor | None = None,
        send_prev: Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Post every receive and send, then wait for all: ``(from_prev, from_next)``."""
        works, from_prev, from_next = [], None, None
        if recv_prev:
            from_prev = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=True)
            works.append(dist.irecv(from_prev, src=self.prev_rank, tag=_FORWARD_TAG))
        if recv_next:
            from_next = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            works.append(dist.irecv(from_next, src=self.next_rank, tag=_BACKWARD_TAG))
        if send_next is not None:
            self._check(send_next, "activation")
            works.append(dist.isend(send_next.detach().contiguous(), dst=self.next_rank, tag=_FORWARD_TAG))
        if send_prev is not None:
            self._check(send_prev, "gradient")
            works.append(dist.isend(send_prev.contiguous(), dst=self.prev_rank, tag=_BACKWARD_TAG))
        for work in works:
            work.wait(self.timeout)
        return from_prev, from_next

    # Megatron's p2p_communication vocabulary; each is a no-op at the pipeline's ends.
    def recv_forward(self) -> Tensor | None:
        return None if self.is_first else self.exchange(recv_prev=True)[0]

    def send_forward(self, output: Tensor) -> None:
        if not self.is_last:
            self.exchange(send_next=output)

    def recv_backward(self) -> Tensor | None:
        return None if self.is_last else self.exchange(recv_next=True)[1]

    def send_backward(self, input_grad: Tensor | None) -> None:
        if not self.is_first:
            self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output: Tensor) -> Tensor | None:
        return None if self.is_last else self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: Tensor | None) -> Tensor | None:
        return None if self.is_first else self.exchange(send_prev=input_grad, recv_prev=True)[0]
