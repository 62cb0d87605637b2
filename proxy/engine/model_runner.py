"""The torch side of a step: ``SchedulerOutput`` -> flat ragged batch -> one forward -> logits.

One forward pass per step over all scheduled tokens, as ``input_ids [1, T]`` with explicit
``position_ids [1, T]`` (without them every sequence after the first gets wrong RoPE positions),
``use_cache=False`` (the paged cache is ours), and ``logits_to_keep`` = the flat index of the last
token of each sequence that samples this step (logits ``[1, S, V]``; computing logits for every
prefill token would cost ~25% on a long prefill). The step's :class:`PagedAttentionMetadata` is
built once here and passed to every layer. Facts behind this:
``docs/transformers-paged-attention.md``.

Per-layer cache shapes, windows, chunk sizes, soft-caps and sinks come from a 3-token probe pass at
construction (``attention.probe_layers`` -> ``architectures.layer_specs``), which also refuses
layers that never reach the attention function (Mamba / linear attention). The cache is sized from
the shapes the layers really produce (multi-head latent attention has K and V of other widths).

Pure-decode steps on CUDA replay captured graphs (``proxy.engine.decode_graphs``; off with
``settings.enforce_eager``); on the CPU they run one graph compiled ahead of time
(``proxy.engine.compiled_step``; ``settings.compile_decode``). The pools keep one scratch slot past
the blocks for padded rows. Prefill and mixed steps run eager.

KV pool size: :func:`proxy.engine.attention.cache.choose_num_blocks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from proxy.engine.architectures import layer_specs, unexpected_kwargs
from proxy.engine.attention import (
    ATTN_IMPLEMENTATION,
    METADATA_KWARG,
    LayerSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    activation_dtype,
    active_metadata,
    choose_num_blocks,
    probe_layers,
)
from proxy.engine.compiled_step import ARTIFACT_DIR as COMPILED_DIR
from proxy.engine.compiled_step import compile_decode_wanted, compiled_decode_step
from proxy.engine.decode_graphs import DecodeGraphRunner
from proxy.engine.graph_kinds import DecodeGraph
from proxy.engine.scheduler import SchedulerOutput
from proxy.engine.step_inputs import StepInputs, StepRows, build_step_inputs
from proxy.models.source import cache_root
from proxy.quant.dense_prefill import active_row_plan, dense_dtype_of, plan_rows
from proxy.settings import Settings

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs a transformers causal LM over the paged KV cache.

    Args:
        model: a causal LM already using ``attn_implementation=ATTN_IMPLEMENTATION`` (switched here
            if not), in eval mode, on its device.
        settings: block size and KV pool size knobs.
        max_model_len: longest sequence; bounds the default CPU pool.

    Attributes:
        kv_cache: the pools; ``kv_cache.num_blocks`` is what the block manager hands out.
        layers: one :class:`LayerSpec` per layer (shapes, window, chunk, soft-cap, sinks).
        decode_graphs: the captured-graph runner of pure-decode steps, or None (eager).

    Raises:
        UnsupportedArchitectureError: the probe pass found layers the paged cache cannot serve.
        device, dtype: of the model's parameters.
    """

    def __init__(self, model: torch.nn.Module, settings: Settings, max_model_len: int) -> None:
        self.model = model
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            from proxy.engine.attention import register

            register()
            model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
        self.device = next(model.parameters()).device
        self.dtype = activation_dtype(model)
        probe = probe_layers(model)
        self.layers: list[LayerSpec] = layer_specs(model.config, probe)
        odd = unexpected_kwargs(probe)
        if odd:
            logger.warning("attention layers pass keyword arguments the paged attention ignores: %s", odd)
        self.num_groups = self.layers[0].num_heads // self.layers[0].num_kv_heads
        self.block_size = settings.block_size
        bytes_per_token = PagedKVCache.bytes_per_token(self.layers, self.dtype)
        pool = choose_num_blocks(settings, bytes_per_token, max_model_len, self.device)
        num_blocks = pool.num_blocks
        self.kv_cache = PagedKVCache(
            self.layers, num_blocks, self.block_size, self.dtype, self.device, num_scratch_slots=1
        )
        self.kv_bytes_per_token = bytes_per_token
        logger.info(
            "KV cache: %d blocks x %d tokens (%d tokens), %.1f MiB (%d bytes/token) on %s: %s",
            num_blocks, self.block_size, num_blocks * self.block_size, self.kv_cache.num_bytes / 2**20,
            bytes_per_token, self.device, pool.reason,
        )
        self.max_num_seqs = settings.max_num_seqs
        self.max_model_len = max_model_len
        #: prompt tokens take the packed linears' dense copies (``proxy.quant.dense_prefill``); fp32
        #: copies' rows do not depend on their place in the call (``plan_rows``' ``by_position``)
        self.dense_prefill = (dense_dtype := dense_dtype_of(model)) is not None
        self.dense_rows_by_position = dense_dtype != torch.float32
        self.decode_graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and not settings.enforce_eager:
            from proxy.engine.graph_kinds import cuda_graph_factory

            self.use_decode_graphs(cuda_graph_factory(self.device))
        #: pure-decode steps on the CPU through one compiled graph (``proxy.engine.compiled_step``)
        self.compiled_step = None
        if self.device.type == "cpu" and compile_decode_wanted(settings, model, self.layers):
            self.compiled_step = compiled_decode_step(
                model, self.kv_cache, self.num_groups, cache_root(settings) / COMPILED_DIR
            )

    def use_decode_graphs(self, make_graph: Callable[[], DecodeGraph]) -> DecodeGraphRunner:
        """Run pure-decode steps through graphs made by ``make_graph`` (a new :class:`DecodeGraph`
        per padded batch size and key bucket, captured lazily). Called at construction on CUDA;
        tests pass a stand-in."""
        self.decode_graphs = DecodeGraphRunner(
            self._forward, self.kv_cache, make_graph, self.max_num_seqs, self.max_model_len,
            self.num_groups, self.device,
        )
        return self.decode_graphs

    # ------------------------------------------------------------------------------------------

    def build_inputs(self, rows: StepRows) -> StepInputs:
        """The CPU inputs of a forward pass over ``rows`` (:func:`build_step_inputs`), with the dense
        prefill row plan where prompt tokens take the packed linears' dense copies."""
        inputs = build_step_inputs(rows, self.kv_cache, self.block_size, self.num_groups)
        if self.dense_prefill and inputs.prompt_tokens is not None:
            inputs.meta.row_plan = plan_rows(inputs.position_ids[0], inputs.prompt_tokens,
                                             self.dense_rows_by_position)
        return inputs

    def _to_device(self, meta: PagedAttentionMetadata) -> None:
        """Move the metadata's tensors to the model's device (in place)."""
        for name in (
            "slot_mapping", "decode_gather", "decode_context_lens", "decode_mask", "prefill_query_index",
            "prefill_gather", "prefill_positions", "prefill_mask", "prefill_valid", "prefill_token_index",
        ):
            value = getattr(meta, name)
            if value is not None:
                setattr(meta, name, value.to(self.device, non_blocking=True))

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: PagedAttentionMetadata,
        keep: torch.Tensor | int = 0,
    ) -> torch.Tensor:
        """One forward pass -> logits ``[n, V]`` (model dtype) of the ``keep`` rows (0: all), under
        ``torch.inference_mode``."""
        with torch.inference_mode(), active_metadata(meta), active_row_plan(meta.row_plan):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
            logits: torch.Tensor = out.logits[0]
            return logits

    def execute(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Run one forward pass over the scheduled tokens.

        With :attr:`compiled_step` (the CPU), every request past its prompt computes its tokens
        through it (:meth:`_execute_compiled`): decodes, and the output tokens a preempted request
        recomputes, so every generated token's K/V and logits come from the same kernels whatever
        the load (the scheduler never mixes prompt and output tokens in one chunk:
        ``SchedulerConfig.outputs_on_decode_path``); prompt rows run eager beside them. Else the
        whole step runs eager (:meth:`_execute_eager`: a captured CUDA graph for a pure-decode step
        where :attr:`decode_graphs` has its shape).

        Returns:
            logits ``[S, V]`` float32 on the model's device, one row per entry of
            ``scheduler_output.sample_indices`` (S may be 0 on a prefill-only chunk step).
        """
        rows = StepRows.of(scheduler_output)
        on_step = [i for i, r in enumerate(rows.requests) if not r.is_in_prompt]
        if self.compiled_step is None or not on_step:
            return self._execute_eager(rows)
        every = len(on_step) == len(rows.requests)
        compiled = self._execute_compiled(rows if every else rows.select(on_step))
        if compiled is None:  # the call failed (logged): this and every later step eager
            self.compiled_step = None
            return self._execute_eager(rows)
        if every:
            return compiled
        taken = set(on_step)
        eager = self._execute_eager(rows.select([i for i in range(len(rows.requests)) if i not in taken]))
        is_compiled = torch.tensor([i in taken for i in rows.sample_indices], dtype=torch.bool)
        logits = torch.empty((len(rows.sample_indices), compiled.shape[1]), dtype=compiled.dtype,
                             device=compiled.device)
        logits[is_compiled] = compiled
        logits[~is_compiled] = eager
        return logits

    def _execute_compiled(self, rows: StepRows) -> torch.Tensor | None:
        """Logits ``[S, V]`` float32 of ``rows`` (all past their prompts) through
        :attr:`compiled_step`, one token a row; None when the call failed."""
        assert self.compiled_step is not None
        split, sampled = rows.one_token_rows()
        inputs = self.build_inputs(split)
        logits = self.compiled_step(self.kv_cache, self.num_groups, inputs.input_ids, inputs.position_ids,
                                    inputs.meta)
        if logits is None:
            return None
        if len(sampled) != len(split.counts):  # some rows feed a token without sampling
            logits = logits.index_select(0, torch.tensor(sampled, dtype=torch.long))
        return logits.float()

    def _execute_eager(self, rows: StepRows) -> torch.Tensor:
        """Logits ``[S, V]`` float32 of ``rows`` through the eager forward, or a captured CUDA graph
        for a pure-decode step."""
        inputs = self.build_inputs(rows)
        input_ids, position_ids, logits_index, meta = (inputs.input_ids, inputs.position_ids,
                                                       inputs.logits_index, inputs.meta)
        dev = self.device
        pure_decode = meta.num_decodes == len(rows.requests) and meta.row_plan is None
        if self.decode_graphs is not None and pure_decode:
            graph_logits = self.decode_graphs.run(input_ids, position_ids, meta)
            if graph_logits is not None:  # sampling rows selected outside the graph (a copy)
                return graph_logits.index_select(0, logits_index.to(dev)).float()
        if dev.type != "cpu":
            input_ids = input_ids.to(dev, non_blocking=True)
            position_ids = position_ids.to(dev, non_blocking=True)
            logits_index = logits_index.to(dev, non_blocking=True)
            self._to_device(meta)
        if logits_index.numel() == 0:
            keep = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
            return self._forward(input_ids, position_ids, meta, keep)[:0].float()
        return self._forward(input_ids, position_ids, meta, logits_index).float()
