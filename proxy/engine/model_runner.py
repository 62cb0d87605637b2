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
    active_metadata,
    choose_num_blocks,
    padded_key_length,
    probe_layers,
)
from proxy.engine.compiled_step import ARTIFACT_DIR as COMPILED_DIR
from proxy.engine.compiled_step import compile_decode_wanted, compiled_decode_step
from proxy.engine.decode_graphs import DecodeGraphRunner
from proxy.engine.graph_kinds import DecodeGraph
from proxy.engine.scheduler import SchedulerOutput
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
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        probe = probe_layers(model)
        self.layers: list[LayerSpec] = layer_specs(model.config, probe)
        odd = unexpected_kwargs(probe)
        if odd:
            logger.warning("attention layers pass keyword arguments the paged attention ignores: %s", odd)
        self.num_groups = self.layers[0].num_heads // self.layers[0].num_kv_heads
        self.block_size = settings.block_size
        bytes_per_token = PagedKVCache.bytes_per_token(self.layers, self.dtype)
        num_blocks = choose_num_blocks(settings, bytes_per_token, max_model_len, self.device)
        self.kv_cache = PagedKVCache(
            self.layers, num_blocks, self.block_size, self.dtype, self.device, num_scratch_slots=1
        )
        self.kv_bytes_per_token = bytes_per_token
        logger.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB (%d bytes/token) on %s",
            num_blocks, self.block_size, self.kv_cache.num_bytes / 2**20, bytes_per_token, self.device,
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

    def build_metadata(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """Flatten the step into CPU tensors (:meth:`execute` moves them to the model's device).

        Returns:
            ``input_ids [1, T]`` int64, ``position_ids [1, T]`` int64, ``logits_index [S]`` int64
            (flat index of each sampling sequence's last token), and the attention metadata.
        """
        requests = scheduler_output.requests
        nums = scheduler_output.num_new_tokens
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []  # num_computed_tokens of each row
        max_blocks = 0
        for request, n in zip(requests, nums):
            c = request.num_computed_tokens
            starts.append(c)
            if n == 1:
                token_ids.append(request.all_token_ids[c])
                positions.append(c)
            else:
                token_ids.extend(request.all_token_ids[c : c + n])
                positions.extend(range(c, c + n))
            max_blocks = max(max_blocks, len(request.block_ids))
        block_tables_list = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in requests]
        block_tables = torch.tensor(block_tables_list, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        nums_t = torch.tensor(nums, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        row_of_token = torch.repeat_interleave(torch.arange(len(requests)), nums_t)
        slot_mapping = block_tables[row_of_token, pos_t // bs] * bs + pos_t % bs
        ends_t = torch.cumsum(nums_t, 0)  # flat end index of each row
        logits_index = ends_t[scheduler_output.sample_indices] - 1

        num_decodes = scheduler_output.num_decodes
        num_tokens = len(token_ids)
        meta = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            num_groups=self.num_groups,
        )
        if num_decodes:
            ctx = starts_t[:num_decodes] + 1
            meta.decode_context_lens = ctx
            real_len = int(ctx.max())
            max_len = padded_key_length(real_len)
            ar = torch.arange(max_len)
            ar_real = ar.clamp_max(real_len - 1)  # padding keys read a real slot and are masked
            meta.decode_gather = block_tables[:num_decodes, ar_real // bs] * bs + ar_real % bs
            if int(ctx.min()) != max_len:
                meta.decode_mask = (ar[None, :] < ctx[:, None]).view(num_decodes, 1, 1, max_len)
        if num_decodes < len(requests):
            p_nums = nums_t[num_decodes:]
            p_starts = starts_t[num_decodes:]
            p_first = ends_t[num_decodes:] - p_nums  # flat index of each prefill row's first token
            num_seqs = len(requests) - num_decodes
            q_len = int(p_nums.max())
            ctx = p_starts + p_nums
            real_len = int(ctx.max())
            max_len = padded_key_length(real_len)
            qa = torch.arange(q_len)
            ka = torch.arange(max_len)
            ka_real = ka.clamp_max(real_len - 1)
            q_clamped = torch.minimum(qa[None, :], p_nums[:, None] - 1)  # [B_p, Q_p]
            meta.prefill_query_index = (p_first[:, None] + q_clamped).reshape(-1)
            meta.prefill_gather = block_tables[num_decodes:, ka_real // bs] * bs + ka_real % bs
            # bottom-right causal: query j of row i sees keys k <= start_i + j
            meta.prefill_positions = p_starts[:, None] + q_clamped  # [B_p, Q_p]
            mask = ka[None, None, :] <= meta.prefill_positions[:, :, None]  # [B_p, Q_p, L_p]
            g = self.num_groups
            meta.prefill_mask = (
                mask[:, None].expand(num_seqs, g, q_len, max_len).reshape(num_seqs, 1, g * q_len, max_len)
            )
            meta.num_prefill_seqs = num_seqs
            meta.prefill_query_len = q_len
            if int(p_nums.min()) != q_len:
                valid = (qa[None, :] < p_nums[:, None]).reshape(-1)
                meta.prefill_valid = valid.nonzero().squeeze(1)
                meta.prefill_token_index = meta.prefill_query_index[meta.prefill_valid]
        if self.dense_prefill and any(r.is_in_prompt for r in requests):
            prompt_lens = torch.tensor([r.num_prompt_tokens for r in requests], dtype=torch.long)
            meta.row_plan = plan_rows(pos_t, pos_t < prompt_lens[row_of_token], self.dense_rows_by_position)
        input_ids = torch.tensor(token_ids, dtype=torch.long).view(1, num_tokens)
        position_ids = pos_t.view(1, num_tokens)
        return input_ids, position_ids, logits_index, meta

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
        """Run one forward pass over the scheduled tokens: on the CPU with :attr:`compiled_step`,
        the rows that feed a generated token through it (a step with prompt rows too runs those
        eager, as a second forward); on CUDA a pure-decode step through a captured graph when
        :attr:`decode_graphs` is set and has its shape; else eager.

        Returns:
            logits ``[S, V]`` float32 on the model's device, one row per entry of
            ``scheduler_output.sample_indices`` (S may be 0 on a prefill-only chunk step).
        """
        num_generated = scheduler_output.num_generated_decodes if self.compiled_step is not None else 0
        if num_generated:
            return self._execute_split(scheduler_output, num_generated)
        input_ids, position_ids, logits_index, meta = self.build_metadata(scheduler_output)
        dev = self.device
        pure_decode = meta.num_decodes == len(scheduler_output.requests) and meta.row_plan is None
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

    def _execute_split(self, scheduler_output: SchedulerOutput, num_generated: int) -> torch.Tensor:
        """:meth:`execute` with the first ``num_generated`` rows through :attr:`compiled_step` and the
        rest eager. A generated token's numerics then never depend on whether prompt rows share its
        step (the batch invariance of ``proxy.engine.attention.metadata``); every such row samples."""
        so = scheduler_output
        assert self.compiled_step is not None
        decodes = SchedulerOutput(so.requests[:num_generated], so.num_new_tokens[:num_generated],
                                  list(range(num_generated)), num_generated)
        input_ids, position_ids, _, meta = self.build_metadata(decodes)
        compiled = self.compiled_step(self.kv_cache, self.num_groups, input_ids, position_ids, meta)
        if compiled is None:  # the call failed (logged): this and every later step eager
            self.compiled_step = None
            return self.execute(scheduler_output)
        logits = compiled.float()
        if num_generated == len(so.requests):
            return logits
        rest = SchedulerOutput(so.requests[num_generated:], so.num_new_tokens[num_generated:],
                               [i - num_generated for i in so.sample_indices if i >= num_generated],
                               so.num_decodes - num_generated)
        return torch.cat([logits, self.execute(rest)])
