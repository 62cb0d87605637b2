"""The engine factory: ``Settings`` -> loaded model -> ``EngineCore`` -> ``AsyncEngine`` -> ``EngineClient``;
and the embedding model's worker (``build_embedding_client``).

A served engine is assembled by ``proxy.engine.loading.build_core``, here or in the engine process.
Runs in a worker thread at startup (``proxy.api.app.create_app``); imports torch through the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.engine.client import AsyncEngineClient, EmbeddingClient, ModelInfo
from proxy.errors import ServiceUnavailableError
from proxy.heap import freeze_heap
from proxy.settings import Settings
from proxy.threads import call_at_nice

if TYPE_CHECKING:
    from proxy.engine.loading import BuiltEngine
    from proxy.models.embedding import EmbeddingModel

ON_DEMAND_LOAD_NICE = 19
"""The nice value a several-model server's load runs at while another model serves
(``build_engine_client``'s ``load_nice``, ``proxy.api.multi.build_registry``): it yields the cores to
the engines serving (the lowest priority, as the grammar compiles run at). A load with nothing of the
server to yield to (the first, or the one model) runs at the server's own priority."""


def use_engine_process(settings: Settings) -> bool:
    """``settings.engine_process``, or when it is None: True on CUDA, False on CPU.

    CPU: ``bench/engine_modes.py`` (default model, 2 shared cores, three runs) found neither mode
    consistently faster (process/thread served tok/s 0.66-1.49 over 18 points, geometric mean 0.99;
    at 16 streams 0.72-1.30, mean 0.91), so the thread stays the CPU default. CUDA: the process, as
    vLLM v1 does."""
    if settings.engine_process is not None:
        return settings.engine_process
    if settings.device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return settings.device == "cuda"


def build_engine_client(settings: Settings, load_nice: int = 0) -> AsyncEngineClient:
    """Load ``settings.model`` (HF folder, GGUF file or the default model) behind an engine client.

    ``load_nice`` above 0: the model's load (conversion, compile, self-check) runs on a thread of its
    own at that nice value, which the threads and processes it starts inherit, so that engines
    already serving keep the cores (:data:`ON_DEMAND_LOAD_NICE`); the engine then serves at the
    priority of its process (``proxy.threads.call_at_nice``, ``proxy.engine.core_proc.child``).

    With :func:`use_engine_process` the engine core is loaded and run in a child process
    (:class:`proxy.engine.core_proc.proc_client.EngineProcClient`, which blocks here until the child
    is ready) and this process reads only the model's tokenizer, config and image processor, once
    per model (``proxy.engine.model_files``); otherwise in this process on a thread (``AsyncEngine``).

    The end-of-sequence ids are :func:`proxy.tokenizer.find_eos_token_ids` of the tokenizer and the
    model's generation config; ``max_model_len`` is the engine's (lowered to the KV pool's capacity
    when that is smaller). The client is not started: ``start()`` must run on the event loop.

    Unless ``settings.self_check`` is False, the engine's greedy output is first compared with
    ``generate()`` on the same weights (``proxy.engine.selfcheck``), or a recorded pass for the same
    inputs is found (``proxy.engine.selfcheck_record``).

    Raises:
        proxy.models.ModelLoadError: the model cannot be resolved or loaded, or its architecture is
            refused (``proxy.engine.execution.architectures``).
        proxy.engine.selfcheck.SelfCheckError: the self-check found a difference.
    """
    from proxy.models.device import keep_triton_out

    keep_triton_out(settings)  # before the loaders import transformers and xgrammar
    if use_engine_process(settings):
        return _build_process_client(settings, load_nice)
    from proxy.engine.async_engine import AsyncEngine
    from proxy.engine.loading import build_core
    from proxy.media.processor import images_refusal

    def build(settings: Settings) -> tuple[BuiltEngine, AsyncEngine]:
        built = build_core(settings)  # the engine's driver reads the torch thread count of this thread
        return built, AsyncEngine(built.core, settings.max_waiting)

    built, engine = call_at_nice(load_nice, build, settings, name="streamproxy-load")
    loaded, core = built.loaded, built.core
    model = ModelInfo(loaded.served_model_name, core.max_model_len, vocab_size=len(loaded.hf_tokenizer),
                      dtype=str(loaded.dtype).removeprefix("torch."), quantization=loaded.quantization,
                      execution=core.execution.as_dict(),
                      images_refused=images_refusal(getattr(loaded.model, "config", None)))
    return AsyncEngineClient(engine, built.tokenizer, model,
                             grammar_compiler=built.grammar_compiler, vision=loaded.vision)


def _build_process_client(settings: Settings, load_nice: int) -> AsyncEngineClient:
    from proxy.engine.core_proc.grammar import ChildGrammarCompiler
    from proxy.engine.core_proc.proc_client import EngineProcClient
    from proxy.engine.model_files import MODEL_FILES

    core = EngineProcClient(settings, load_nice)
    info = core.info
    try:  # read once per model and kept (images are processed here, encoded in the child)
        files = MODEL_FILES.get(info.model_path)
    except BaseException:
        core.shutdown()
        raise
    tokenizer = files.tokenizer.with_generation_eos(info.eos_token_ids)
    model = ModelInfo(info.served_model_name, info.max_model_len, vocab_size=files.vocab_size,
                      dtype=info.dtype, quantization=info.quantization, execution=info.execution,
                      images_refused=files.images_refused)
    # grammars are compiled once, in the child, where the masks are applied (a bad one is still a 400
    # before the request is sent): see proxy.engine.core_proc.grammar
    compiler = ChildGrammarCompiler(core.compile_grammar)
    freeze_heap()  # this process's start-up objects out of the collector's full passes (proxy.heap)
    return AsyncEngineClient(core, tokenizer, model, grammar_compiler=compiler, vision=files.vision)


def read_model_files_ahead(models: Sequence[Settings]) -> None:
    """Read now the files this process keeps of each model in ``models`` whose engine will run in a
    child process (``proxy.engine.model_files.MODEL_FILES``: at most ``KEPT_MODELS``, those whose
    folder exists; a GGUF not converted yet is read at its first load), then freeze the heap. A
    several-model server runs it before any model serves (``proxy.api.multi.start_read_ahead``), so
    that a later load of these models reads nothing here while other models stream."""
    from proxy.engine.model_files import MODEL_FILES
    from proxy.models.device import keep_triton_out
    from proxy.models.source import ready_model_folder

    forked = [s for s in models if use_engine_process(s)]
    if forked:
        from proxy.engine.core_proc.lifecycle import start_fork_server

        start_fork_server()  # its interpreter's start now, beside the first load, not beside a stream
        keep_triton_out(forked[0])  # before transformers is imported, as a load does
        MODEL_FILES.preread(ready_model_folder(s) for s in forked)
        freeze_heap()


def embedding_model_name(settings: Settings, chat_model_name: str) -> str:
    """The id ``/v1/embeddings`` serves: ``--served-embedding-model-name``, else the
    ``--embedding-model`` folder's name (a ``.gguf`` file's stem), else the chat model's own name
    (it embeds itself)."""
    if settings.served_embedding_model_name:
        return settings.served_embedding_model_name
    if settings.embedding_model:
        path = Path(settings.embedding_model).expanduser()
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return chat_model_name


def build_embedding_client(settings: Settings, chat: ModelInfo) -> EmbeddingClient:
    """The embedding worker (``proxy.engine.embedding_worker``), started.

    With ``--embedding-model`` that folder is loaded now (its errors are startup errors); without
    one, the chat model's folder is loaded again as a base model with ``--embedding-pooling`` at
    the first embeddings request (a second copy of the chat weights, dense, outside the KV cache
    pool: a convenience, not a retrieval model). ``--device`` / ``--dtype`` as for the chat model.

    Raises:
        proxy.models.ModelLoadError: the embedding model's name is the chat model's, or (eager) it
            cannot be loaded.
    """
    from proxy.engine.embedding_worker import EmbeddingWorker
    from proxy.models import ModelLoadError, resolve_device_dtype, resolve_model_source
    from proxy.models.embedding import load_embedding_model

    name = embedding_model_name(settings, chat.served_model_name)
    own = settings.embedding_model is not None
    if own and name == chat.served_model_name:
        raise ModelLoadError(f"the embedding model's name {name!r} is the chat model's; set "
                             "--served-embedding-model-name")

    def load() -> EmbeddingModel:
        dense = replace(settings, quantization="none", mmproj=None)  # the text model embeds
        device, dtype = resolve_device_dtype(dense)
        source = replace(dense, model=settings.embedding_model) if own else dense
        folder, _, gguf = resolve_model_source(source)
        return load_embedding_model(folder, device, dtype, default_pooling=settings.embedding_pooling,
                                    max_len=None if own else chat.max_model_len, gguf=gguf)

    threads = settings.embedding_num_threads
    if threads is None and settings.device != "cuda":
        threads = 1
    worker = EmbeddingWorker(load, name, max_num_batched_tokens=settings.embedding_max_num_batched_tokens,
                             num_threads=threads, lazy=not own)
    try:
        worker.start()
    except ServiceUnavailableError as exc:
        raise ModelLoadError(exc.message) from exc
    return worker
