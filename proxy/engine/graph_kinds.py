"""The graphs a :class:`~proxy.engine.decode_graphs.DecodeGraphRunner` records decode steps into.

:class:`DecodeGraph` is the protocol (``capture(fn) -> output``, ``replay()``);
:class:`CudaDecodeGraph` records a CUDA graph (the only code here that touches ``torch.cuda``, run
only on a CUDA device); :class:`CompiledDecodeGraph` compiles the step with ``torch.compile`` for
the CPU (``Settings.compile_decode``; ``docs/compile.md``).
"""

from __future__ import annotations

import logging
import time
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


class CompiledDecodeGraph:
    """:class:`DecodeGraph` over ``torch.compile`` (inductor, static shapes), for the CPU.

    Capture compiles ``fn`` and runs it once; a replay runs the compiled code again and copies its
    logits into the captured output, as a CUDA graph's replay overwrites its own. ``fn`` must not
    enter ``torch.inference_mode`` (dynamo refuses it: "Cannot set version_counter for inference
    tensor"); the model runner passes a forward under ``torch.no_grad`` instead. Every graph
    compiles the same function, so dynamo keeps one entry per shape under one code object:
    :func:`raise_recompile_limit` raises its recompile limit to the runner's shape count, past
    which dynamo would silently run the function eager.
    """

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Compile ``fn`` (on its first call, here) and return its output ``[B, V]``.

        Raises:
            Exception: whatever dynamo or inductor raise; the runner then turns graphs off.
        """
        compiled = torch.compile(fn, dynamic=False)
        start = time.monotonic()
        with torch.no_grad():
            self.output = compiled().clone()
        self.fn = compiled
        logger.info("compiled a decode step in %.1f s", time.monotonic() - start)
        return self.output

    def replay(self) -> None:
        """Run the compiled step; its logits go into the captured output."""
        assert self.fn is not None and self.output is not None
        with torch.no_grad():
            self.output.copy_(self.fn())


def raise_recompile_limit(num_shapes: int) -> None:
    """Raise dynamo's per-function recompile limit (default 8) to at least ``num_shapes`` (a
    runner's :attr:`DecodeGraphRunner.num_shapes`), for :class:`CompiledDecodeGraph`."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, num_shapes)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, num_shapes)
