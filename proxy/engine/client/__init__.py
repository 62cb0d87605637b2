"""EngineClient: the one typed interface between the API and the engine (vLLM's ``EngineClient``).

The API layer sees the engine only through :class:`EngineClient`: ``generate(prompt_token_ids,
params, n) -> Generation`` plus what it must read (the served model's facts, health, counters for
``/health`` and ``/metrics``). :class:`AsyncEngineClient` is the implementation; it owns output
processing (detokenizer, stop checker, mailboxes, metrics; as vLLM's ``AsyncLLM`` owns its
``OutputProcessor``) and drives the engine core through a small message-like seam,
:class:`EngineCoreClient`: add a request (id, prompt ids, params), abort requests, and receive the
outputs of each step as one list of ``RequestOutput``. ``proxy.engine.async_engine.AsyncEngine``
runs the core on a thread behind that seam; a core in a child process fits the same seam, with
output processing staying in the API process.

Modules: ``interface`` (what the API sees: ``EngineClient``, ``ModelInfo``), ``core_client`` (the
engine core seam: ``EngineCoreClient``, ``EngineStats``, ``deliver_outputs``), ``async_client``
(``AsyncEngineClient``), ``embedding`` (what ``POST /v1/embeddings`` sees: ``EmbeddingClient``,
``EmbeddingOutput``). Import the names from this package.
"""

from __future__ import annotations

from proxy.engine.client.async_client import AsyncEngineClient
from proxy.engine.client.core_client import (
    EngineCoreClient,
    EngineStats,
    FaultInjector,
    OutputsHandler,
    deliver_outputs,
)
from proxy.engine.client.embedding import EmbeddingClient, EmbeddingOutput
from proxy.engine.client.interface import EngineClient, ModelInfo, StructuredOutputCompiler
from proxy.engine.generation import Generation
from proxy.engine.mailbox import ChoiceDelta

__all__ = [
    "AsyncEngineClient",
    "ChoiceDelta",
    "EmbeddingClient",
    "EmbeddingOutput",
    "EngineClient",
    "EngineCoreClient",
    "EngineStats",
    "FaultInjector",
    "Generation",
    "ModelInfo",
    "OutputsHandler",
    "StructuredOutputCompiler",
    "deliver_outputs",
]
