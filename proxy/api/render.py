"""vLLM's render endpoints: a request's prompt token ids without generating anything.

``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` answer what vLLM answers
(``vllm/entrypoints/serve/render``: ``ServingRender.render_chat_request`` /
``render_completion_request``): its ``GenerateRequest`` as JSON, ``{"request_id", "token_ids",
"features", "sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
"kv_transfer_params"}``; the completion render is a list of them (one per prompt; here always one).
``POST /v1/responses/render`` (vLLM 0.30, PR #50195) renders a self-contained Responses request to
one ``GenerateRequest``; it is stateless, so ``previous_response_id`` is refused (400).
vllm-router's ``cache_aware`` policy calls them on each worker to route by token prefix; without them
it falls back to least load (``render_unavailable``).

The ids come from :func:`proxy.pipeline.prepare_chat` / :func:`~proxy.pipeline.prepare_completion`,
the same path as generation (template, tools, reasoning), so they are exactly the ids a later
generation of the same body prefills; only the grammar compile is skipped (nothing is generated).
Bad bodies are the same 400s as the generating endpoints'.
"""

from __future__ import annotations

import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.errors import InvalidRequestError
from proxy.media.prompt import PromptImages
from proxy.pipeline import PreparedRequest, prepare_chat, prepare_completion
from proxy.protocol.responses_request import parse_responses_request

from .body import read_json_body
from .responses import json_response
from .state import ServedModel, ServerState


def _request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def vllm_sampling_params(prepared: PreparedRequest) -> dict[str, Any]:
    """The prepared request's sampling parameters under vLLM's ``SamplingParams`` field names.

    ``logprobs`` is vLLM's count of top alternatives (None: off); ``max_tokens`` is resolved against
    the context as generation resolves it.
    """
    p = prepared.params
    return {
        "n": prepared.n, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed, "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos, "max_tokens": p.max_tokens,
        "min_tokens": p.min_tokens, "logprobs": p.top_logprobs if p.logprobs else None,
        "logit_bias": {str(k): v for k, v in p.logit_bias.items()} or None,
        "skip_special_tokens": True,
    }


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("'cache_salt' must be a string.", param="cache_salt")
    return salt


def _priority(body: dict[str, Any]) -> int:
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("'priority' must be an integer.", param="priority")
    return priority


def _features(images: PromptImages | None) -> dict[str, Any] | None:
    """vLLM's ``MultiModalFeatures`` of a prompt's images (``vllm/entrypoints/serve/disagg/protocol.py``):
    ``{"mm_hashes": {"image": [hash, ...]}, "mm_placeholders": {"image": [{"offset", "length"}, ...]},
    "kwargs_data": None}`` (the pixel values are not rendered); None for a text prompt."""
    if images is None:
        return None
    spans = [{"offset": first, "length": last - first + 1} for first, last in images.spans()]
    return {"mm_hashes": {"image": list(images.hashes)}, "mm_placeholders": {"image": spans},
            "kwargs_data": None}


def generate_request(prepared: PreparedRequest, model: str, body: dict[str, Any],
                     prefix: str) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` of one prepared prompt (``features``: its images' hashes and
    placeholder ranges, :func:`_features`; None: text only).

    Raises:
        InvalidRequestError: ``cache_salt`` not a string, ``priority`` not an integer (400).
    """
    stream = prepared.stream
    return {
        "request_id": _request_id(prefix), "token_ids": list(prepared.prompt_ids),
        "features": _features(prepared.images),
        "sampling_params": vllm_sampling_params(prepared), "model": model, "stream": stream.stream,
        "stream_options": {"include_usage": stream.include_usage} if stream.stream else None,
        "cache_salt": _cache_salt(body), "priority": _priority(body), "kv_transfer_params": None,
    }


async def _read(request: Request) -> tuple[ServerState, ServedModel, dict[str, Any]]:
    """The server state, the model the body names (``ServerState.model_of``) and the body, as every
    render endpoint starts.

    Raises:
        ModelNotFoundError: another ``model`` (404).
        ServiceUnavailableError: loading or draining (503).
    """
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.settings.max_body_bytes)
    return state, state.model_of(request), body


async def render_chat_completion(request: Request) -> Response:
    """``POST /v1/chat/completions/render`` (vLLM): a chat body -> its ``GenerateRequest`` (200); a
    body that is not a valid chat request is its 400 (``param`` named), and as :func:`_read`."""
    state, served, body = await _read(request)
    chat = protocol.parse_chat_request(body, max_n=state.max_n, vocab_size=served.client.model.vocab_size)
    prepared = await prepare_chat(chat, served.client, served.features, compile_grammar=False)
    return json_response(generate_request(prepared, chat.model, body, "chatcmpl"))


async def render_completion(request: Request) -> Response:
    """``POST /v1/completions/render`` (vLLM): a completion body -> ``[GenerateRequest]`` (200); a
    body that is not a valid completion request is its 400, and as :func:`_read`."""
    state, served, body = await _read(request)
    vocab_size = served.client.model.vocab_size
    cmpl = protocol.parse_completion_request(body, max_n=state.max_n, vocab_size=vocab_size)
    prepared = await prepare_completion(cmpl, served.client)
    return json_response([generate_request(prepared, cmpl.model, body, "cmpl")])


async def render_response(request: Request) -> Response:
    """``POST /v1/responses/render`` (vLLM): a Responses body -> its ``GenerateRequest`` (200), the
    prompt built as ``POST /v1/responses`` builds it (``parse_responses_request``, ``prepare_chat``);
    ``previous_response_id`` is a 400 (the render is stateless), an invalid body its 400, and as
    :func:`_read`."""
    _, served, body = await _read(request)
    if body.get("previous_response_id") is not None:
        raise InvalidRequestError("The render endpoint is stateless: send the whole conversation as 'input' "
                                  "instead of 'previous_response_id'.", param="previous_response_id")
    parsed = parse_responses_request(body, [], vocab_size=served.client.model.vocab_size)
    prepared = await prepare_chat(parsed.chat, served.client, served.features, compile_grammar=False)
    return json_response(generate_request(prepared, parsed.chat.model, body, "resp"))
