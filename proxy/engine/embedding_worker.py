"""``EmbeddingWorker``: the embedding model on its own thread, requests batched under a token budget.

One daemon thread (``streamproxy-embed``) owns the model. Each turn it takes every request queued
so far, tokenizes and checks them, sorts their inputs by length and runs them in as few forward
passes as the budget allows: a batch holds inputs while ``rows * longest <= max_num_batched_tokens``
padded tokens (an input alone may exceed it up to the model's length), so one pass's memory and
time are bounded whatever a request sends. Results go back through ``concurrent.futures`` futures
awaited on the event loop; a request whose client left is skipped.

On a CPU the thread runs torch with ``num_threads`` intra-op threads of its own (``torch.set_num_threads``
sets the calling thread's OpenMP team size, so the chat engine's threads are untouched): the chat
engine keeps its cores and a running stream slows by what the embedding thread takes of them
(``docs/embeddings.md``, measured with ``bench/embedding_bench.py``).

The model is loaded on that thread: at :meth:`EmbeddingWorker.start` (``lazy=False``; a load error
is raised there) or at the first request (``lazy=True``; a load error is a 503 for that request and
every later one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from proxy.engine.client.embedding import EmbeddingOutput
from proxy.errors import EngineError, InvalidRequestError, ServiceUnavailableError, StreamproxyError
from proxy.models.embedding import EmbeddingModel
from proxy.models.pooling import normalized

log = logging.getLogger(__name__)


@dataclass
class _Job:
    texts: Sequence[str] | None
    token_ids: Sequence[Sequence[int]] | None
    truncate: int | None
    dimensions: int | None
    future: concurrent.futures.Future[EmbeddingOutput] = field(default_factory=concurrent.futures.Future)
    ids: list[list[int]] = field(default_factory=list)
    rows: list[torch.Tensor | None] = field(default_factory=list)
    error: StreamproxyError | None = None

    def param(self, index: int) -> str:
        count = len(self.texts if self.texts is not None else self.token_ids or ())
        return "input" if count == 1 else f"input[{index}]"


def _settle(job: _Job, result: EmbeddingOutput | None, error: BaseException | None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # the awaiting task was cancelled
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)  # type: ignore[arg-type]


def batches(lengths: Sequence[int], max_num_batched_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into forward passes: sorted by length, each group's padded size
    ``len(group) * max(its lengths) <= max_num_batched_tokens``, or a single index when that one alone
    is longer."""
    out: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if out and (len(out[-1]) + 1) * lengths[index] <= max_num_batched_tokens:
            out[-1].append(index)
        else:
            out.append([index])
    return out


class EmbeddingWorker:
    """The :class:`~proxy.engine.client.embedding.EmbeddingClient` of ``proxy.engine.client``.

    Args:
        load: builds the model (called once, on the worker thread).
        served_model_name: the id clients send.
        max_num_batched_tokens: padded tokens of one forward pass (module docstring).
        num_threads: torch intra-op threads of the worker thread; None: torch's default.
        lazy: load at the first request instead of at :meth:`start`.
    """

    def __init__(self, load: Callable[[], EmbeddingModel], served_model_name: str, *,
                 max_num_batched_tokens: int = 2048, num_threads: int | None = None,
                 lazy: bool = False) -> None:
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self._load, self._budget = load, max_num_batched_tokens
        self._num_threads, self._lazy = num_threads, lazy
        self._model: EmbeddingModel | None = None
        self._load_error: StreamproxyError | None = None
        self._loaded = threading.Event()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="streamproxy-embed", daemon=True)
        self._stopped = False

    @property
    def max_model_len(self) -> int | None:
        return self._model.max_model_len if self._model is not None else None

    @property
    def model(self) -> EmbeddingModel | None:
        """The loaded model (None before a lazy load)."""
        return self._model

    def start(self) -> None:
        """Start the thread; unless lazy, wait until the model is loaded.

        Raises:
            ServiceUnavailableError: the eager load failed (its message says why).
        """
        self._thread.start()
        if not self._lazy:
            self._loaded.wait()
            if self._load_error is not None:
                raise self._load_error

    def shutdown(self) -> None:
        self._stopped = True
        self._queue.put(None)

    async def embed(self, texts: Sequence[str] | None, token_ids: Sequence[Sequence[int]] | None, *,
                    truncate_prompt_tokens: int | None = None,
                    dimensions: int | None = None) -> EmbeddingOutput:
        """See :meth:`proxy.engine.client.embedding.EmbeddingClient.embed`."""
        if self._stopped:
            raise ServiceUnavailableError("The embedding worker has stopped.")
        job = _Job(texts, token_ids, truncate_prompt_tokens, dimensions)
        self._queue.put(job)
        return await asyncio.wrap_future(job.future)

    # ---- the worker thread ------------------------------------------------------------------------

    def _ensure_loaded(self) -> EmbeddingModel | None:
        if self._model is None and self._load_error is None:
            try:
                self._model = self._load()
            except Exception as exc:
                log.exception("loading the embedding model failed")
                self._load_error = ServiceUnavailableError(
                    f"The embedding model failed to load: {type(exc).__name__}: {exc}")
            self._loaded.set()
        return self._model

    def _run(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        if not self._lazy:
            self._ensure_loaded()
        while True:
            job = self._queue.get()
            jobs = [job]
            with contextlib.suppress(queue.Empty):
                while True:
                    jobs.append(self._queue.get_nowait())
            live = [j for j in jobs if j is not None and not j.future.cancelled()]
            model = self._ensure_loaded() if live else self._model
            if model is None:
                for j in live:
                    _settle(j, None, self._load_error)
            elif live:
                self._serve(model, live)
            if any(j is None for j in jobs):
                for j in self._drain():
                    _settle(j, None, ServiceUnavailableError("The embedding worker has stopped."))
                return

    def _drain(self) -> list[_Job]:
        rest: list[_Job] = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    rest.append(item)
        return rest

    def _serve(self, model: EmbeddingModel, jobs: list[_Job]) -> None:
        ready: list[_Job] = []
        for job in jobs:
            try:
                job.ids = self._prepare(model, job)
            except StreamproxyError as exc:
                _settle(job, None, exc)
                continue
            job.rows = [None] * len(job.ids)
            ready.append(job)
        items = [(job, i) for job in ready for i in range(len(job.ids))]
        for group in batches([len(job.ids[i]) for job, i in items], self._budget):
            members = [items[k] for k in group if items[k][0].error is None]
            if not members:
                continue
            try:
                vectors = model.embed([job.ids[i] for job, i in members])
            except Exception as exc:
                log.exception("embedding forward pass failed")
                for job, _ in members:
                    job.error = EngineError(f"The embedding forward pass failed: {type(exc).__name__}.")
                continue
            for row, (job, i) in enumerate(members):
                job.rows[i] = vectors[row]
        for job in ready:
            if job.error is not None:
                _settle(job, None, job.error)
            else:
                _settle(job, self._finish(model, job), None)

    @staticmethod
    def _finish(model: EmbeddingModel, job: _Job) -> EmbeddingOutput:
        rows = [r for r in job.rows if r is not None]
        vectors = torch.stack(rows)
        if job.dimensions is not None and job.dimensions < vectors.shape[1]:
            vectors = vectors[:, : job.dimensions]
            if model.pooling.normalize:
                vectors = normalized(vectors)
        return EmbeddingOutput(np.ascontiguousarray(vectors.numpy(), dtype=np.float32),
                               sum(len(ids) for ids in job.ids))

    @staticmethod
    def _prepare(model: EmbeddingModel, job: _Job) -> list[list[int]]:
        """Token ids of each input, truncated or checked (``EmbeddingClient.embed``'s 400s)."""
        limit = model.max_model_len
        if job.dimensions is not None and job.dimensions > model.dimensions:
            raise InvalidRequestError(f"'dimensions' is {job.dimensions}; this model's vectors have "
                                      f"{model.dimensions}.", param="dimensions")
        keep = limit if job.truncate == -1 else job.truncate
        if keep is not None and keep > limit:
            raise InvalidRequestError(f"'truncate_prompt_tokens' is {keep}; this embedding model takes at "
                                      f"most {limit} tokens.", param="truncate_prompt_tokens")
        if job.texts is not None:
            ids = model.tokenize(job.texts, keep)
        else:
            ids = [list(t)[-keep:] if keep is not None else list(t) for t in job.token_ids or ()]
            for i, seq in enumerate(ids):
                bad = next((t for t in seq if t >= model.vocab_size), None)
                if bad is not None:
                    raise InvalidRequestError(f"'{job.param(i)}' holds {bad}, not a token id of this "
                                              f"embedding model's vocabulary ({model.vocab_size}).",
                                              param=job.param(i))
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidRequestError(f"'{job.param(i)}' has no tokens.", param=job.param(i))
            if len(seq) > limit:
                raise InvalidRequestError(
                    f"'{job.param(i)}' has {len(seq)} tokens; this embedding model takes at most {limit}. "
                    "Shorten it, or set 'truncate_prompt_tokens'.", param=job.param(i),
                    code="context_length_exceeded")
        return ids
