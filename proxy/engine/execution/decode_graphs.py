"""Captured graphs for pure-decode steps: CUDA graphs, as vLLM's ``CUDAGraphRunner`` does it.

A decode step of a small model on a GPU is bound by kernel launches, not by arithmetic: every
layer launches a few dozen kernels for one token a row. A CUDA graph records them once and replays
them with one launch (``torch.cuda.CUDAGraph``). A graph replays fixed shapes and fixed memory, so:

- **Shapes.** One graph per (padded batch size, key-length bucket), captured lazily the first time
  a step needs it. Batch sizes are vLLM's capture sizes (``cudagraph_capture_sizes``):
  1, 2, 4, then multiples of 8, up to ``max_num_seqs`` (:func:`capture_batch_sizes`; vLLM goes on
  in steps of 16 past 256 and up to twice ``max_num_seqs`` for speculative decoding, which a
  decode batch of ours never needs). Our decode
  attention gathers each row's context to ``[B, H_kv, L, D]``, so the key length ``L`` is a shape
  too: it is bucketed to the next power of two, at least :data:`KEY_PAD` (:func:`key_length_bucket`).
  Powers of two keep the graph count at ``log2(max_model_len / 64) + 1`` buckets a batch size
  (8 for 8192 tokens) while the padded keys cost at most 2x the attention of the longest row,
  1.33x on average over a uniform context length (a decode step's attention is a small share of
  the step until contexts grow long); buckets are multiples of ``KEY_PAD``, so the batch invariance
  of the padded attention holds (``proxy.engine.execution.attention.metadata``). Longer batches or contexts
  run eager.
- **Static buffers.** Each graph owns its inputs (token ids, positions, slot mapping, the gather
  slots, context lengths, the key mask) and its output (logits ``[B_pad, V]``); a step copies its
  rows into them and replays. Padded rows read and write only the KV cache's scratch slot
  (``PagedKVCache.scratch_slot``, outside every block), attend over that one key, and their logits
  are dropped: a padded row never touches a real sequence's blocks.
- **Outside the graph.** Sampling, grammar masks, penalties and logprobs run eager on the graph's
  logits (the model runner selects the sampling rows); prefill and mixed steps run eager.

Capture runs on the padded buffers only (every row a padded row), then the real step replays, so
capture never writes a real sequence's KV. A capture that fails (a model with data-dependent control
flow, e.g. routed MoE layers) logs once and turns graphs off: every later step runs eager.

The graph itself sits behind :class:`~proxy.engine.execution.graph_kinds.DecodeGraph` (``capture(fn) ->
output``, ``replay()``, in ``proxy.engine.execution.graph_kinds``): ``CudaDecodeGraph`` on CUDA (the only
code that touches ``torch.cuda``, called only on a CUDA device; ``--enforce-eager`` turns graphs
off); the CPU tests also run the plumbing with a stand-in that re-runs ``fn`` at replay. The CUDA
path was written without a GPU to run it on: see the README.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from proxy.engine.execution.attention import KEY_PAD, PagedAttentionMetadata, PagedKVCache
from proxy.engine.execution.graph_kinds import DecodeGraph

logger = logging.getLogger(__name__)

DecodeForward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]
"""``forward(input_ids [1, B], position_ids [1, B], meta) -> logits [B, V]`` (model dtype)."""


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes up to ``max_num_seqs``: 1, 2, 4, 8, 16, 24, ..., and ``max_num_seqs``
    itself when it is not one of them (a step of ``B`` rows runs the smallest size ``>= B``)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def key_length_bucket(length: int) -> int:
    """The key length (tokens) a graph is captured for: the next power of two ``>= length``, at
    least :data:`KEY_PAD` (then a multiple of it; ``KEY_PAD`` is a power of two)."""
    bucket = KEY_PAD
    while bucket < length:
        bucket *= 2
    return bucket


def padded_step_inputs(
    scratch_slot: int, batch: int, key_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU inputs of a decode step of ``batch`` padded rows over ``key_len`` keys: token 0 at position
    0, written to and reading only ``scratch_slot``, context length 1 (one visible key, so the
    softmax has a real term). Returns ``input_ids [1, B]``, ``position_ids [1, B]``, ``slot_mapping
    [B]``, ``decode_gather [B, L]``, ``context_lens [B]`` (int64) and ``decode_mask [B, 1, 1, L]``."""
    input_ids = torch.zeros((1, batch), dtype=torch.long)
    position_ids = torch.zeros((1, batch), dtype=torch.long)
    slots = torch.full((batch,), scratch_slot, dtype=torch.long)
    gather = torch.full((batch, key_len), scratch_slot, dtype=torch.long)
    context_lens = torch.ones(batch, dtype=torch.long)
    mask = (torch.arange(key_len)[None, :] < context_lens[:, None]).view(batch, 1, 1, key_len)
    return input_ids, position_ids, slots, gather, context_lens, mask


@dataclass
class _Captured:
    """One graph and its static buffers (``B`` = padded batch size, ``L`` = key bucket), all on
    the model's device: ``input_ids``/``position_ids`` ``[1, B]`` int64, ``meta`` (its
    ``slot_mapping [B]``, ``decode_gather [B, L]``, ``decode_context_lens [B]`` int64 and
    ``decode_mask [B, 1, 1, L]`` bool are the static inputs), ``output`` logits ``[B, V]``."""

    graph: DecodeGraph
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    meta: PagedAttentionMetadata
    output: torch.Tensor


class DecodeGraphRunner:
    """Runs pure-decode steps through captured graphs (see the module docstring).

    Args:
        forward: the model's forward pass (:data:`DecodeForward`), called at capture (and, by a
            stand-in graph, at every replay).
        kv_cache: the pools; its ``scratch_slot`` must exist (``num_scratch_slots >= 1``).
        make_graph: a new :class:`DecodeGraph` per (batch size, key bucket).
        max_num_seqs: largest batch size captured.
        max_model_len: contexts longer than its key bucket run eager.
        num_groups: the model's GQA group (passed through to the metadata).
        device: where the static buffers live (the model's device).

    Raises:
        ValueError: the cache has no scratch slot.
    """

    def __init__(
        self,
        forward: DecodeForward,
        kv_cache: PagedKVCache,
        make_graph: Callable[[], DecodeGraph],
        max_num_seqs: int,
        max_model_len: int,
        num_groups: int,
        device: torch.device,
    ) -> None:
        if kv_cache.num_scratch_slots < 1:
            raise ValueError("decode graphs need a KV cache with a scratch slot for padded rows")
        self.forward = forward
        self.kv_cache = kv_cache
        self.make_graph = make_graph
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_key_len = key_length_bucket(max_model_len)
        self.num_groups = num_groups
        self.device = device
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.enabled = True
        self.num_replays = 0

    @property
    def num_shapes(self) -> int:
        """Shapes this runner may capture: its batch sizes times its key buckets."""
        return len(self.batch_sizes) * (self.max_key_len // KEY_PAD).bit_length()

    def warm_up(self, num_rows: int) -> None:
        """Capture the shape of a ``num_rows``-row step over :data:`KEY_PAD` keys now (at load)
        rather than at its first step; a failure turns graphs off as :meth:`run` does."""
        shape = self.shape_for(num_rows, KEY_PAD)
        if shape is not None:
            self._graph_for(shape)

    def _graph_for(self, shape: tuple[int, int]) -> _Captured | None:
        """The graph of ``shape``, captured now if new; None (and graphs off) when capture fails."""
        captured = self.graphs.get(shape)
        if captured is None:
            try:
                captured = self._capture(*shape)
            except Exception:
                logger.warning("decode graph capture failed at batch %d, %d keys: running eager from now on",
                               *shape, exc_info=True)
                self.enabled = False
                return None
            self.graphs[shape] = captured
        return captured

    def shape_for(self, num_rows: int, key_len: int) -> tuple[int, int] | None:
        """``(padded batch size, key bucket)`` of a decode step, or None when it runs eager."""
        if not self.enabled or num_rows > self.batch_sizes[-1] or key_len > self.max_key_len:
            return None
        batch = next(s for s in self.batch_sizes if s >= num_rows)
        return batch, key_length_bucket(key_len)

    def run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor | None:
        """Run a pure-decode step built on the CPU by the model runner; None: run it eager.

        Args:
            input_ids, position_ids: ``[1, B]`` int64 (CPU).
            meta: the step's CPU metadata with ``num_decodes == B`` and no prefill rows.

        Returns:
            logits ``[B, V]`` (model dtype, on the device): a view of the graph's output, valid
            until the next replay.
        """
        assert meta.decode_gather is not None and meta.decode_context_lens is not None
        rows, key_len = meta.decode_gather.shape
        shape = self.shape_for(rows, key_len)
        if shape is None:
            return None
        captured = self._graph_for(shape)
        if captured is None:
            return None
        self._fill(captured, input_ids, position_ids, meta)
        captured.graph.replay()
        self.num_replays += 1
        return captured.output[:rows]

    def _padded_inputs(
        self, batch: int, key_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return padded_step_inputs(self.kv_cache.scratch_slot, batch, key_len)

    def _capture(self, batch: int, key_len: int) -> _Captured:
        """Static buffers of one shape, filled with padded rows, and the graph captured over them."""
        dev = self.device
        ids, pos, slots, gather, ctx, mask = (t.to(dev) for t in self._padded_inputs(batch, key_len))
        meta = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            num_decodes=batch,
            decode_gather=gather,
            decode_context_lens=ctx,
            decode_mask=mask,
            num_groups=self.num_groups,
        )

        def step() -> torch.Tensor:
            meta.masks.clear()  # window / chunk masks are rebuilt from the static context lengths
            return self.forward(ids, pos, meta)

        graph = self.make_graph()
        output = graph.capture(step)
        logger.info(
            "captured a decode graph: batch %d, %d keys (%d graphs)", batch, key_len, len(self.graphs) + 1
        )
        return _Captured(graph, ids, pos, meta, output)

    def _fill(
        self,
        captured: _Captured,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> None:
        """Copy the step's rows into the static buffers; the rest become padded rows again."""
        assert meta.decode_gather is not None and meta.decode_context_lens is not None
        static = captured.meta
        assert static.decode_gather is not None and static.decode_context_lens is not None
        assert static.decode_mask is not None
        batch, key_len = static.decode_gather.shape
        rows, step_len = meta.decode_gather.shape
        ids, pos, slots, gather, ctx, _ = self._padded_inputs(batch, key_len)
        ids[:, :rows] = input_ids
        pos[:, :rows] = position_ids
        slots[:rows] = meta.slot_mapping
        gather[:rows, :step_len] = meta.decode_gather  # keys past step_len stay on the scratch slot
        ctx[:rows] = meta.decode_context_lens
        mask = (torch.arange(key_len)[None, :] < ctx[:, None]).view(batch, 1, 1, key_len)
        for dst, src in (
            (captured.input_ids, ids), (captured.position_ids, pos), (static.slot_mapping, slots),
            (static.decode_gather, gather), (static.decode_context_lens, ctx), (static.decode_mask, mask),
        ):
            dst.copy_(src, non_blocking=True)
