"""The torch side of a step: ``SchedulerOutput`` -> flat ragged batch -> one forward -> logits.

One forward pass per step over all scheduled tokens, as ``input_ids [1, T]`` with explicit
``position_ids [1, T]`` (without them every sequence after the first gets wrong RoPE positions;
an M-RoPE model's are its rotary positions, ``proxy.engine.execution.mrope``),
``use_cache=False`` (the paged cache is ours), and ``logits_to_keep`` = the flat index of the last
token of each sequence that samples this step (logits ``[1, S, V]``; computing logits for every
prefill token would cost ~25% on a long prefill). The step's :class:`PagedAttentionMetadata` is
built once here and passed to every layer. Facts behind this:
``docs/transformers-paged-attention.md``.

Per-layer cache shapes, windows, chunk sizes, soft-caps and sinks come from a 3-token probe pass at
construction (``attention.probe_layers`` -> ``architectures.layer_specs``), which also refuses
layers that never reach the attention function (Mamba / linear attention). The cache is sized from
the shapes the layers really produce (multi-head latent attention has K and V of other widths).

How a step runs is one :class:`~proxy.engine.execution.decode_runner.DecodeRunner` object chosen at
construction: eager; captured graphs for pure-decode steps on CUDA (``proxy.engine.execution.decode_graphs``;
off with ``settings.enforce_eager``); or, on the CPU, every token past a prompt through one graph
compiled ahead of time (``proxy.engine.execution.compiled_step``; ``settings.compile_decode``). The pools keep
one scratch slot past the blocks for padded rows. Prompt tokens always run eager.

KV pool size: :func:`proxy.engine.execution.attention.cache.choose_num_blocks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack

import torch

from proxy.engine.execution.architectures import layer_specs, unexpected_kwargs
from proxy.engine.execution.attention import (
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
from proxy.engine.execution.choice import ExecutionChoice, PrefillPlan, choose_execution, prefill_plan_of
from proxy.engine.execution.compiled_step import ARTIFACT_DIR as COMPILED_DIR
from proxy.engine.execution.compiled_step import (
    CompiledDecodeStep,
    compile_decode_wanted,
    compiled_decode_step,
)
from proxy.engine.execution.decode_graphs import DecodeGraphRunner
from proxy.engine.execution.decode_runner import CompiledDecode, CudaGraphDecode, DecodeRunner, EagerDecode
from proxy.engine.execution.deepstack import deepstack_added
from proxy.engine.execution.graph_kinds import DecodeGraph
from proxy.engine.execution.image_blocks import add_prefill_image_blocks
from proxy.engine.execution.image_embeds import ImageEncoder
from proxy.engine.execution.mrope import MRope
from proxy.engine.execution.step_inputs import ImageSlots, StepInputs, StepRows, build_step_inputs
from proxy.engine.scheduler import SchedulerOutput
from proxy.models.source import cache_root
from proxy.models.vision import (
    bidirectional_images,
    decoder_attention,
    deepstack_layers,
    is_served_vision,
    uses_mrope,
)
from proxy.quant.dense_prefill import active_row_plan, plan_rows
from proxy.settings import Settings

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs a transformers causal LM over the paged KV cache.

    Args:
        model: a causal LM already using ``attn_implementation=ATTN_IMPLEMENTATION`` (switched here
            if not), in eval mode, on its device.
        settings: block size and KV pool size knobs.
        max_model_len: longest sequence; bounds the default CPU pool.
        choice: what runs (``proxy.engine.execution.choice``; the step's :class:`DecodeRunner`), chosen before
            the model loaded; None: chosen here for the model's device.

    Attributes:
        device, dtype: of the model's parameters.
        kv_cache: the pools; ``kv_cache.num_blocks`` is what the block manager hands out.
        choice: the :class:`ExecutionChoice` in force.
        prefill_plan: prompt tokens through dense copies of the packed linears, or None (what the
            model holds: a model built without copies has none whatever the choice).
        layers: one :class:`LayerSpec` per layer (shapes, window, chunk, soft-cap, sinks).
        decode: how steps run, :class:`EagerDecode`, :class:`CudaGraphDecode` or
            :class:`CompiledDecode` (``proxy.engine.execution.decode_runner``).

    Raises:
        UnsupportedArchitectureError: the probe pass found layers the paged cache cannot serve.
    """

    def __init__(self, model: torch.nn.Module, settings: Settings, max_model_len: int,
                 choice: ExecutionChoice | None = None) -> None:
        self.model = model
        text_config = model.config.get_text_config()  # type: ignore[union-attr, operator]
        if getattr(text_config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            from proxy.engine.execution.attention import register

            register()
            model.set_attn_implementation(decoder_attention(model.config, ATTN_IMPLEMENTATION))  # type: ignore[operator]
        self.device = next(model.parameters()).device
        self.dtype = activation_dtype(model)
        #: what runs, chosen before the model loaded (the loader's), else here for its device
        self.choice = choice if choice is not None else choose_execution(settings, self.device)
        probe = probe_layers(model)
        self.layers: list[LayerSpec] = layer_specs(model.config, probe)
        odd = unexpected_kwargs(probe)
        if odd:
            logger.warning("attention layers pass keyword arguments the paged attention ignores: %s", odd)
        self.num_groups = self.layers[0].num_heads // self.layers[0].num_kv_heads
        self.block_size = settings.block_size
        #: a vision-language model's image encoder (``proxy.engine.execution.image_embeds``); None: text only
        self.images = ImageEncoder(model, self.device, self.dtype) if is_served_vision(model.config) else None
        #: an M-RoPE model's rotary positions (``proxy.engine.execution.mrope``); None: the cache positions
        self.mrope = MRope(model) if uses_mrope(model.config) else None
        #: the decoder layers that take a DeepStack model's image rows (``proxy.models.vision``); else []
        self.deepstack_layers = deepstack_layers(model)
        #: image tokens attend within their image both ways during prefill (``image_blocks``)
        self.image_blocks = self.images is not None and bidirectional_images(model.config)
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
        #: prompt tokens through the packed linears' dense copies, or None (``proxy.quant.dense_prefill``)
        self.prefill_plan: PrefillPlan | None = prefill_plan_of(model)
        #: how steps run (``proxy.engine.execution.decode_runner``): chosen here, replaced when it fails
        self.decode: DecodeRunner = EagerDecode()
        if self.choice.step == "cuda_graphs":
            from proxy.engine.execution.graph_kinds import cuda_graph_factory

            self.use_decode_graphs(cuda_graph_factory(self.device))
        elif self.choice.step == "compiled":
            self.decode = self._compiled_or_eager(settings)

    def _compiled_or_eager(self, settings: Settings) -> DecodeRunner:
        """:class:`CompiledDecode` where the model's layers allow it and compiling or loading the
        step succeeds (``proxy.engine.execution.compiled_step``; a failure is logged), else
        :class:`EagerDecode`."""
        if not compile_decode_wanted(settings, self.model, self.layers):
            return EagerDecode()
        step = compiled_decode_step(self.model, self.kv_cache, self.num_groups,
                                    cache_root(settings) / COMPILED_DIR, self.choice.key())
        return EagerDecode() if step is None else CompiledDecode(step)

    @property
    def compiled_step(self) -> CompiledDecodeStep | None:
        """The compiled decode step serving tokens past their prompts, or None."""
        return self.decode.step if isinstance(self.decode, CompiledDecode) else None

    @property
    def decode_graphs(self) -> DecodeGraphRunner | None:
        """The captured-graph runner of pure-decode steps, or None."""
        return self.decode.graphs if isinstance(self.decode, CudaGraphDecode) else None

    def use_decode_graphs(self, make_graph: Callable[[], DecodeGraph]) -> DecodeGraphRunner:
        """Run pure-decode steps through graphs made by ``make_graph`` (a new :class:`DecodeGraph`
        per padded batch size and key bucket, captured lazily). Called at construction on CUDA;
        tests pass a stand-in."""
        graphs = DecodeGraphRunner(
            self._forward, self.kv_cache, make_graph, self.max_num_seqs, self.max_model_len,
            self.num_groups, self.device,
        )
        self.decode = CudaGraphDecode(graphs)
        return graphs

    # ------------------------------------------------------------------------------------------

    def build_inputs(self, rows: StepRows) -> StepInputs:
        """The CPU inputs of a forward pass over ``rows`` (:func:`build_step_inputs`), with the dense
        prefill row plan where prompt tokens take the packed linears' dense copies."""
        inputs = build_step_inputs(rows, self.kv_cache, self.block_size, self.num_groups)
        if self.images is not None:
            inputs.image_slots = self.images.slots(rows)
        if self.mrope is not None:
            inputs.rope_position_ids = self.mrope.positions(rows, inputs.position_ids[0])
        if self.image_blocks:
            add_prefill_image_blocks(inputs.meta, rows)
        prefill = self.prefill_plan
        if prefill is not None and inputs.prompt_tokens is not None:
            inputs.meta.row_plan = plan_rows(inputs.position_ids[0], inputs.prompt_tokens,
                                             prefill.rows_by_position)
        return inputs

    def _to_device(self, meta: PagedAttentionMetadata) -> None:
        """Move the metadata's tensors to the model's device (in place)."""
        for name in (
            "slot_mapping", "decode_gather", "decode_context_lens", "decode_mask", "prefill_query_index",
            "prefill_gather", "prefill_positions", "prefill_mask", "prefill_valid", "prefill_token_index",
            "prefill_query_blocks", "prefill_key_blocks",
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
        image_slots: ImageSlots | None = None,
    ) -> torch.Tensor:
        """One forward pass -> logits ``[n, V]`` (model dtype) of the ``keep`` rows (0: all), under
        ``torch.inference_mode``; with ``image_slots``, as ``inputs_embeds`` whose image positions take
        the images' embeddings (``proxy.engine.execution.image_embeds``), and a DeepStack model's first
        layers add theirs (``proxy.engine.execution.deepstack``)."""
        with (torch.inference_mode(), active_metadata(meta), active_row_plan(meta.row_plan),
              ExitStack() as stack):
            tokens: dict[str, torch.Tensor] = {"input_ids": input_ids}
            if image_slots is not None and self.images is not None:
                tokens = {"inputs_embeds": self.images.embed(input_ids, image_slots)}
                deepstack = image_slots.deepstack_embeds
                if deepstack is not None:
                    stack.enter_context(deepstack_added(self.deepstack_layers, image_slots.flat_index,
                                                        deepstack))
            out = self.model(
                **tokens,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
            logits: torch.Tensor = out.logits[0]
            return logits

    def execute(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Run one forward pass over the scheduled tokens through :attr:`decode`
        (``proxy.engine.execution.decode_runner``); a compiled step whose call fails (logged by it) is
        replaced by :class:`EagerDecode` for this and every later step.

        Returns:
            logits ``[S, V]`` float32 on the model's device, one row per entry of
            ``scheduler_output.sample_indices`` (S may be 0 on a prefill-only chunk step).
        """
        rows = StepRows.of(scheduler_output)
        logits = self.decode.execute(self, rows)
        if logits is None:
            self.decode = EagerDecode()
            logits = self.decode.execute(self, rows)
            assert logits is not None
        return logits

    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """Logits ``[S, V]`` float32 of a step's inputs through the eager forward (moved to the
        model's device here)."""
        input_ids, position_ids, logits_index, meta = (inputs.input_ids, inputs.model_position_ids,
                                                       inputs.logits_index, inputs.meta)
        dev = self.device
        if dev.type != "cpu":
            input_ids = input_ids.to(dev, non_blocking=True)
            position_ids = position_ids.to(dev, non_blocking=True)
            logits_index = logits_index.to(dev, non_blocking=True)
            self._to_device(meta)
        if logits_index.numel() == 0:
            keep = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
            return self._forward(input_ids, position_ids, meta, keep, inputs.image_slots)[:0].float()
        return self._forward(input_ids, position_ids, meta, logits_index, inputs.image_slots).float()
