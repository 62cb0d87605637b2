"""The graphs a :class:`~proxy.engine.execution.decode_graphs.DecodeGraphRunner` records decode steps into.

:class:`DecodeGraph` is the protocol (``capture(fn) -> output``, ``replay()``);
:class:`CudaDecodeGraph` records a CUDA graph (the only code here that touches ``torch.cuda``, run
only on a CUDA device). The CPU's compiled decode step needs no static buffers and lives in
``proxy.engine.execution.compiled_step``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs on a side stream before a capture (lazy initialisation of cuBLAS and allocator
state must not happen inside the capture; torch's CUDA graph notes)."""


class DecodeGraph(Protocol):
    """A recorded forward pass over fixed buffers."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (which reads only the static inputs); return its output tensor, which
        every :meth:`replay` overwrites in place."""
        ...

    def replay(self) -> None:
        """Run the recorded work again on the static inputs' current values."""
        ...


class CudaDecodeGraph:
    """:class:`DecodeGraph` over ``torch.cuda.CUDAGraph``, all graphs of a runner in one memory pool.

    One pool (``torch.cuda.graph_pool_handle()``) is shared by every graph, as vLLM shares one.
    Graphs are replayed in any order, not the capture order torch's notes ask of a shared pool, so
    a later capture may place its tensors (its output too) in memory an earlier graph uses for its
    intermediates. That is safe here because replays never overlap (one engine thread, one stream)
    and a graph's output is consumed (the sampling rows copied out by ``index_select``) before the
    next replay of any graph.
    """

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = device
        self.pool = pool
        self.graph: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Warm up on a side stream, then capture ``fn`` into the shared pool (torch docs, "CUDA
        Graphs": whole-network capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            output = fn()
        return output

    def replay(self) -> None:
        """Launch the captured graph on the current stream."""
        self.graph.replay()


def cuda_graph_factory(device: torch.device) -> Callable[[], DecodeGraph]:
    """A factory of :class:`CudaDecodeGraph` sharing one new memory pool (CUDA only)."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaDecodeGraph(device, pool)
