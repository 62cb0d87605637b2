"""``POST /tokenize`` and ``POST /detokenize``, vLLM's shapes (``vllm/entrypoints/serve/tokenize``).

``/tokenize`` takes vLLM's ``TokenizeCompletionRequest`` (``prompt``: a string;
``add_special_tokens``, default true) or ``TokenizeChatRequest`` (``messages`` through the chat
template, with ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` (default true),
``continue_final_message`` (default false; not with ``add_generation_prompt``),
``add_special_tokens`` (default false)); both take ``model`` (optional; the served id when given)
and ``return_token_strs``. It answers ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` null unless asked). A chat is rendered by :func:`proxy.pipeline.render_chat`, the
rendering generation uses. ``/detokenize`` takes ``tokens`` (ids) and answers ``{"prompt"}``: the
ids decoded as vLLM decodes them (special tokens kept). vLLM serves no ``/v1/`` aliases of these.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.engine.client import EngineClient
from proxy.errors import InvalidRequestError
from proxy.pipeline import check_model, render_chat

from .body import read_json_body
from .responses import json_response
from .state import ServedModel, ServerState


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean.", param=name)
    return value


def _model(body: dict[str, Any], client: EngineClient) -> str:
    """The served id; ``model`` is optional here (vLLM), checked when given."""
    model = body.get("model")
    if model is None:
        return client.model.served_model_name
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must be a string.", param="model")
    check_model(client, model)
    return model


def _vocab_size(client: EngineClient) -> int:
    return client.model.vocab_size or len(client.tokenizer.hf_tokenizer)


async def _chat_ids(body: dict[str, Any], model: str, state: ServerState, served: ServedModel) -> list[int]:
    client = served.client
    generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise InvalidRequestError(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
            param="continue_final_message")
    keys = ("messages", "tools", "tool_choice", "chat_template_kwargs")
    fields: dict[str, Any] = {k: body[k] for k in keys if k in body}
    chat = protocol.parse_chat_request({**fields, "model": model}, max_n=state.max_n,
                                       vocab_size=client.model.vocab_size)
    _, ids, _ = await render_chat(chat, client, served.features, add_generation_prompt=generation_prompt,
                                  continue_final_message=continue_final,
                                  add_special_tokens=_flag(body, "add_special_tokens", False))
    return ids


async def tokenize(request: Request) -> Response:
    """``POST /tokenize`` (vLLM): a prompt or a chat -> its token ids and count.

    Raises:
        InvalidRequestError: neither or both of ``prompt`` / ``messages``, a non-string ``prompt``,
            a bad flag, messages the template rejects (400, ``param`` named).
        ModelNotFoundError: another ``model`` (404).
        ServiceUnavailableError: loading or draining (503).
    """
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.settings.max_body_bytes)
    served = state.model_of(request)
    client = served.client
    model = _model(body, client)
    want_strs = _flag(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("Give either 'prompt' (a string) or 'messages' (a chat).", param="prompt")
    if "messages" in body:
        ids = await _chat_ids(body, model, state, served)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError("'prompt' must be a string.", param="prompt")
        ids = client.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    strs = list(client.tokenizer.hf_tokenizer.convert_ids_to_tokens(ids)) if want_strs else None
    return json_response({"count": len(ids), "max_model_len": client.model.max_model_len, "tokens": ids,
                          "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """``POST /detokenize`` (vLLM): ``tokens`` -> ``{"prompt": text}``.

    Raises:
        InvalidRequestError: ``tokens`` missing, not a list of integers, or an id outside the
            vocabulary (400, ``param`` naming the index).
        ModelNotFoundError: another ``model`` (404).
        ServiceUnavailableError: loading or draining (503).
    """
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.settings.max_body_bytes)
    client = state.model_of(request).client
    _model(body, client)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequestError("'tokens' must be an array of token ids.", param="tokens")
    vocab = _vocab_size(client)
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidRequestError(f"'tokens[{i}]' must be a token id in [0, {vocab}).",
                                      param=f"tokens[{i}]")
    text: str = client.tokenizer.hf_tokenizer.decode(tokens)
    return json_response({"prompt": text})
