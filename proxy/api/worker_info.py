"""The server and model info endpoints the SGLang model gateway (``sglang-router``) reads of a worker.

When it registers a worker, the gateway (``smg``, ``core/steps/worker/local/discover_metadata.rs``)
GETs ``/server_info`` (falling back to ``/get_server_info`` on a 404) and ``/model_info`` (then
``/get_model_info``); without them it registers the worker for model ``unknown``. It reads, of
``/server_info``: ``model_path``, ``served_model_name`` (the worker's model id), ``tp_size``,
``dp_size``, ``max_total_tokens``, ``max_prefill_tokens``, ``max_running_requests``, ``version``;
of ``/model_info``: ``model_path``, ``tokenizer_path`` (the gateway loads that tokenizer for its
tokenizer-aware features, so it is given only when it is a local folder), ``is_generation``,
``model_type``, ``architectures``. SGLang's own names sit beside them (``context_length``,
``max_total_num_tokens``), and vLLM's ``max_model_len``. All four paths answer 503 while loading.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

import proxy
from proxy.engine.client import EngineClient

from .responses import json_response
from .state import ServerState


def _tokenizer_path(client: EngineClient) -> str | None:
    path = getattr(client.tokenizer.hf_tokenizer, "name_or_path", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


def _model_path(state: ServerState, client: EngineClient) -> str:
    return state.settings.model or _tokenizer_path(client) or client.model.served_model_name


def server_info_payload(state: ServerState, client: EngineClient) -> dict[str, Any]:
    """``/server_info``'s body (SGLang's field names, plus vLLM's ``max_model_len``).

    ``max_total_tokens`` / ``max_total_num_tokens``: the KV cache's capacity in tokens (blocks x
    ``block_size``; absent when the engine does not report its blocks). ``execution``: the engine's
    execution plan (``proxy.engine.execution.plan``: which kernels serve its steps and why the others do not).
    """
    settings = state.settings
    model = client.model
    payload: dict[str, Any] = {
        "model_path": _model_path(state, client), "tokenizer_path": _tokenizer_path(client),
        "served_model_name": model.served_model_name, "context_length": model.max_model_len,
        "max_model_len": model.max_model_len, "max_running_requests": settings.max_num_seqs,
        "max_prefill_tokens": settings.max_num_batched_tokens, "tp_size": 1, "dp_size": 1,
        "disaggregation_mode": "null", "is_generation": True, "version": proxy.__version__,
    }
    if model.execution is not None:
        payload["execution"] = model.execution
    blocks = client.stats().num_total_blocks
    if blocks is not None:
        payload["max_total_tokens"] = payload["max_total_num_tokens"] = blocks * settings.block_size
    return payload


def model_info_payload(state: ServerState, client: EngineClient) -> dict[str, Any]:
    """``/model_info``'s body (SGLang's ``get_model_info`` fields)."""
    return {"model_path": _model_path(state, client), "tokenizer_path": _tokenizer_path(client),
            "served_model_name": client.model.served_model_name, "is_generation": True,
            "max_model_len": client.model.max_model_len}


async def server_info(request: Request) -> Response:
    """``GET /server_info`` and ``GET /get_server_info`` (SGLang). Raises ServiceUnavailableError (503)
    while loading or draining."""
    state: ServerState = request.app.state.server
    return json_response(server_info_payload(state, state.require_ready()))


async def model_info(request: Request) -> Response:
    """``GET /model_info`` and ``GET /get_model_info`` (SGLang). Raises ServiceUnavailableError (503)
    while loading or draining."""
    state: ServerState = request.app.state.server
    return json_response(model_info_payload(state, state.require_ready()))
