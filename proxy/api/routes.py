"""The endpoints, framework-free: each takes an :class:`ApiRequest` and returns a reply object.

``app.py`` (the only Starlette importer) turns :class:`JsonReply`/:class:`StreamReply` into
responses, maps :class:`~proxy.errors.StreamproxyError` to OpenAI error objects, reads the body
under the size limit and watches for client disconnects.

Flow of a completion (``../shared/DESIGN.md``): parse + validate -> tokenize (chat template) ->
context check -> ``AsyncEngine.submit`` once per choice (request id ``f"{id}-{i}"``, seed + i) ->
the :class:`~proxy.engine.output.OutputProcessor` fills the request's mailbox -> SSE body or one
JSON body. A streaming request first waits for its first output, up to ``keepalive_interval_s``,
so that an early engine failure is still a plain 500 JSON error; if nothing came by then (the
request waits in the queue or in a long prefill) the headers and a keep-alive comment go out, and
from then on errors travel in-band (SSE error event + ``[DONE]``).

Shutdown (``ServerState.begin_drain``, called when uvicorn starts its graceful shutdown): new
requests get 503, running ones may finish within ``shutdown_grace_s``; then every open response is
ended with an error (``code: "server_shutdown"``) and its engine requests are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proxy import protocol
from proxy.engine.output import LogprobEntry, Mailbox, OutputProcessor, chat_logprobs, completion_logprobs
from proxy.errors import (
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    StreamproxyError,
)
from proxy.settings import Settings

from .streaming import SseStream, wait_pending

log = logging.getLogger("proxy.api")

LARGE_PROMPT_CHARS = 4096
"""Prompts longer than this are tokenized in a worker thread, off the event loop."""


@dataclass
class ServingModel:
    """What the engine factory returns: a loaded model behind a (not yet started) ``AsyncEngine``.

    Attributes:
        engine: ``AsyncEngine`` (``start``, ``shutdown``, ``submit``, ``abort``, ``is_healthy``,
            ``num_running``, ``num_waiting``, ``kv_cache_usage``).
        tokenizer: ``proxy.tokenizer.Tokenizer``.
        served_model_name: the id clients send as ``model``.
        max_model_len: context window in tokens.
        vocab_size: token ids accepted in prompts and ``logit_bias``; None: unchecked.
        core: the ``EngineCore`` when available, for ``/health`` counters (``num_free_blocks``...).
    """

    engine: Any
    tokenizer: Any
    served_model_name: str
    max_model_len: int
    vocab_size: int | None = None
    core: Any | None = None
    created: int = field(default_factory=lambda: int(time.time()))


SHUTDOWN_MESSAGE = "The server is shutting down; the response was cut short. Retry the request."


class ServerState:
    """Lifecycle of the server: ``loading`` -> ``ready`` (or ``failed``) -> ``draining`` -> ``stopped``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.status = "loading"
        self.model: ServingModel | None = None
        self.processor: OutputProcessor | None = None
        self.load_error: str | None = None
        self.metrics: Any | None = None  # proxy.metrics.Metrics once loaded
        self.is_draining = False
        self.fault_injector: Any | None = None  # proxy.api.faults.FaultInjector when test faults are on
        self._grace_timer: asyncio.TimerHandle | None = None

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Start the graceful shutdown (idempotent; call on the event loop).

        From now on new completions get 503 and ``/health`` says ``draining`` (503), so a load
        balancer takes this replica out. Responses already running may finish for ``grace_s``
        seconds (default ``settings.shutdown_grace_s``); then :meth:`end_streams` cuts the rest.
        """
        if self.is_draining:
            return
        self.is_draining = True
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: no new requests; open responses get %.1f s to finish", grace)
        self._grace_timer = asyncio.get_running_loop().call_later(max(0.0, grace), self.end_streams)

    def end_streams(self) -> int:
        """End every open response now: SSE error event (``server_shutdown``) + ``[DONE]``, or a
        503 JSON error for a non-stream request; their engine requests are aborted. Returns how
        many engine requests were ended."""
        if self.processor is None:
            return 0
        n = self.processor.fail_all(SHUTDOWN_MESSAGE, "server_shutdown")
        if n:
            log.warning("shutdown grace period over: ended %d running request(s)", n)
        return n

    def cancel_drain_timer(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    def set_ready(self, model: ServingModel, processor: OutputProcessor) -> None:
        self.model, self.processor, self.status = model, processor, "ready"

    def set_failed(self, message: str) -> None:
        self.status, self.load_error = "failed", message

    @property
    def is_healthy(self) -> bool:
        return (self.status == "ready" and not self.is_draining and self.model is not None
                and bool(self.model.engine.is_healthy))

    def require_ready(self) -> tuple[ServingModel, OutputProcessor]:
        """The model and processor, or 503 while loading / draining / after a failure or engine death."""
        if self.is_draining:
            raise ServiceUnavailableError("The server is shutting down; send the request to another replica.",
                                          code="server_shutdown")
        if self.status == "loading":
            raise ServiceUnavailableError("The model is still loading; retry shortly.")
        if self.model is None or self.processor is None or self.status != "ready":
            raise ServiceUnavailableError("The model failed to load; see the server log.")
        return self.model, self.processor

    @property
    def max_n(self) -> int:
        return max(1, min(self.settings.max_num_seqs, 128))


@dataclass
class ApiRequest:
    """One HTTP request, as the endpoints see it.

    Attributes:
        body: the whole body (already size-checked).
        path_params: e.g. ``{"model_id": ...}``.
        is_disconnected: True once the client went away.
        disconnect_callbacks: run (on the event loop) when the client goes away.
    """

    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    path_params: Mapping[str, str] = field(default_factory=dict)
    is_disconnected: bool = False
    disconnect_callbacks: list[Callable[[], None]] = field(default_factory=list)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        if self.is_disconnected:
            callback()
        else:
            self.disconnect_callbacks.append(callback)

    def mark_disconnected(self) -> None:
        if self.is_disconnected:
            return
        self.is_disconnected = True
        for callback in self.disconnect_callbacks:
            callback()


@dataclass
class JsonReply:
    payload: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


@dataclass
class StreamReply:
    body: AsyncIterator[bytes]
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: dict(SSE_HEADERS))
    media_type: str = SSE_MEDIA_TYPE


@dataclass
class BytesReply:
    body: bytes
    media_type: str
    status: int = 200


@dataclass
class EmptyReply:
    """The client is gone; nothing to send."""


Reply = JsonReply | StreamReply | BytesReply | EmptyReply


# ----------------------------------------------------------------------------- info endpoints


async def health(state: ServerState, req: ApiRequest) -> JsonReply:
    """``GET /health``: 200 when the model is loaded and the engine runs, else 503.

    The body also gives engine counters (``num_running``, ``num_waiting``, ``num_free_blocks``,
    ``num_total_blocks``) used by the disconnect tests.
    """
    payload: dict[str, Any] = {"status": "draining" if state.is_draining else state.status}
    model = state.model
    if model is not None:
        engine, core = model.engine, model.core
        if not engine.is_healthy and not state.is_draining:
            payload["status"] = "dead"
        payload["num_running"] = engine.num_running
        payload["num_waiting"] = engine.num_waiting
        for name in ("num_free_blocks", "num_total_blocks"):
            value = getattr(core, name, None) if core is not None else None
            if value is not None:
                payload[name] = value
        if state.processor is not None:
            payload["num_tracked_outputs"] = state.processor.num_tracked
    if state.load_error:
        payload["error"] = state.load_error
    return JsonReply(payload, status=200 if state.is_healthy else 503)


async def metrics(state: ServerState, req: ApiRequest) -> BytesReply:
    """``GET /metrics``: Prometheus text exposition (``proxy.metrics``, vLLM's metric names); 503 while loading."""
    if state.metrics is None:
        raise ServiceUnavailableError("The model is still loading; no metrics yet.")
    from proxy.metrics import CONTENT_TYPE

    return BytesReply(state.metrics.render(), CONTENT_TYPE)


async def list_models(state: ServerState, req: ApiRequest) -> JsonReply:
    """``GET /v1/models`` (OpenAI "List models")."""
    model, _ = state.require_ready()
    card = protocol.model_card(model.served_model_name, model.created, model.max_model_len)
    return JsonReply({"object": "list", "data": [card]})


async def get_model(state: ServerState, req: ApiRequest) -> JsonReply:
    """``GET /v1/models/{model_id}`` (OpenAI "Retrieve model"); 404 for another id."""
    model, _ = state.require_ready()
    model_id = req.path_params.get("model_id", "")
    if model_id != model.served_model_name:
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return JsonReply(protocol.model_card(model.served_model_name, model.created, model.max_model_len))


# ----------------------------------------------------------------------------- completions


def _check_model(model: ServingModel, requested: str) -> None:
    if requested != model.served_model_name:
        raise ModelNotFoundError(
            f"The model '{requested}' does not exist; this server serves '{model.served_model_name}'.",
            param="model",
        )


async def _run_blocking(func: Callable[[], list[int]], size: int) -> list[int]:
    return await asyncio.to_thread(func) if size > LARGE_PROMPT_CHARS else func()


async def _chat_prompt(model: ServingModel, messages: tuple[dict[str, str], ...]) -> list[int]:
    size = sum(len(m["content"]) for m in messages)
    try:
        return list(await _run_blocking(lambda: model.tokenizer.apply_chat_template(list(messages)), size))
    except StreamproxyError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja TemplateError etc.: the request's fault
        raise InvalidRequestError(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from None


async def _completion_prompt(model: ServingModel, prompt: str | tuple[int, ...]) -> list[int]:
    if isinstance(prompt, tuple):
        return list(prompt)
    return list(await _run_blocking(lambda: model.tokenizer.encode(prompt), len(prompt)))


class _Generation:
    """The engine requests behind one HTTP request: submit them, and abort them exactly once."""

    def __init__(self, model: ServingModel, processor: OutputProcessor, response_id: str, n: int) -> None:
        self.model = model
        self.processor = processor
        self.mailbox = Mailbox(n)
        self.request_ids = [f"{response_id}-{i}" for i in range(n)]
        self._submitted: list[str] = []
        self.wants_logprobs = False

    def submit(self, prompt_ids: list[int], params: Any) -> None:
        engine = self.model.engine
        self.wants_logprobs = bool(params.logprobs)
        try:
            for i, rid in enumerate(self.request_ids):
                p = protocol.choice_params(params, i)
                self.processor.add(rid, self.mailbox, i, p)
                self._submitted.append(rid)
                engine.submit(rid, prompt_ids, p, self.processor.process)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop tracking; abort what the engine may still run (idempotent)."""
        submitted, self._submitted = self._submitted, []
        for rid in submitted:
            self.processor.abort(rid)
            try:
                self.model.engine.abort(rid)
            except Exception:  # pragma: no cover - abort is documented idempotent
                log.exception("abort of %s failed", rid)


async def _completion(state: ServerState, req: ApiRequest, *, is_chat: bool) -> Reply:
    body = protocol.parse_json_body(req.body)
    model, processor = state.require_ready()
    created = int(time.time())
    if is_chat:
        chat = protocol.parse_chat_request(body, max_n=state.max_n, vocab_size=model.vocab_size)
        _check_model(model, chat.model)
        prompt_ids = await _chat_prompt(model, chat.messages)
        max_tokens = protocol.resolve_max_tokens(chat.max_tokens, len(prompt_ids), model.max_model_len)
        n, stream, params = chat.n, chat.stream, chat.params
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
    else:
        cmpl = protocol.parse_completion_request(body, max_n=state.max_n, vocab_size=model.vocab_size)
        _check_model(model, cmpl.model)
        prompt_ids = await _completion_prompt(model, cmpl.prompt)
        max_tokens = protocol.resolve_max_tokens(cmpl.max_tokens, len(prompt_ids), model.max_model_len,
                                                 prompt_name="prompt")
        n, stream, params = cmpl.n, cmpl.stream, cmpl.params
        response_id = f"cmpl-{uuid.uuid4().hex}"
    if req.is_disconnected:
        return EmptyReply()
    params = replace(params, max_tokens=max_tokens)
    gen = _Generation(model, processor, response_id, n)
    try:
        gen.submit(prompt_ids, params)
    except RateLimitError:
        if state.metrics is not None:
            state.metrics.observe_rejected("queue_full")
        raise
    req.on_disconnect(gen.close)  # aborts in the engine at once, even while a write is blocked
    req.on_disconnect(gen.mailbox.interrupt)
    try:
        if stream.stream:
            return await _stream_reply(state, req, gen, is_chat, response_id, created, len(prompt_ids), stream)
        return await _json_reply(req, gen, is_chat, response_id, created, len(prompt_ids))
    except BaseException:
        gen.close()
        raise


async def _stream_reply(state: ServerState, req: ApiRequest, gen: _Generation, is_chat: bool,
                        response_id: str, created: int, num_prompt_tokens: int,
                        stream: protocol.StreamOptions) -> Reply:
    from proxy.hotpath import ChunkFramer, dumps

    mailbox = gen.mailbox
    keepalive_s = state.settings.keepalive_interval_s or None
    # the first output, an error, the client left -- or keepalive_s passed (queue wait, long prefill)
    got_output = await wait_pending(mailbox, keepalive_s)
    if req.is_disconnected:
        gen.close()
        return EmptyReply()
    if got_output and mailbox.error is not None:
        gen.close()
        raise _mailbox_error(mailbox)
    framer = ChunkFramer("chat.completion.chunk" if is_chat else "text_completion", response_id, created,
                         gen.model.served_model_name, stream.include_usage)
    sse = SseStream(mailbox, framer, is_chat=is_chat, num_prompt_tokens=num_prompt_tokens,
                    include_usage=stream.include_usage, is_interrupted=lambda: req.is_disconnected,
                    on_close=gen.close, dumps=dumps,
                    keepalive_interval_s=keepalive_s, started_idle=not got_output)
    return StreamReply(sse.body())


def _mailbox_error(mailbox: Mailbox) -> StreamproxyError:
    if mailbox.error_code == "server_shutdown":
        return ServiceUnavailableError(mailbox.error or SHUTDOWN_MESSAGE, code="server_shutdown")
    return EngineError(mailbox.error or "The engine failed.")


async def _json_reply(req: ApiRequest, gen: _Generation, is_chat: bool, response_id: str, created: int,
                      num_prompt_tokens: int) -> Reply:
    mailbox = gen.mailbox
    n = mailbox.num_choices
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[LogprobEntry]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    while True:
        for d in mailbox.take():
            texts[d.index].append(d.text)
            logprobs[d.index].extend(d.logprobs)
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
        if req.is_disconnected:
            gen.close()
            return EmptyReply()
        if mailbox.error is not None:
            gen.close()
            raise _mailbox_error(mailbox)
        if mailbox.is_finished:
            break
        await wait_pending(mailbox, None)
    gen.close()
    want_logprobs = gen.wants_logprobs
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        if is_chat:
            lp = chat_logprobs(logprobs[i]) if want_logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": finish[i]})
        else:
            lp = completion_logprobs(logprobs[i], 0) if want_logprobs else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
    payload = {
        "id": response_id,
        "object": "chat.completion" if is_chat else "text_completion",
        "created": created,
        "model": gen.model.served_model_name,
        "choices": choices,
        "usage": protocol.usage_dict(num_prompt_tokens, mailbox.num_output_tokens),
    }
    return JsonReply(payload)


async def chat_completions(state: ServerState, req: ApiRequest) -> Reply:
    """``POST /v1/chat/completions`` (OpenAI "Create chat completion"), stream and non-stream."""
    return await _completion(state, req, is_chat=True)


async def completions(state: ServerState, req: ApiRequest) -> Reply:
    """``POST /v1/completions`` (OpenAI legacy "Create completion"), stream and non-stream."""
    return await _completion(state, req, is_chat=False)
