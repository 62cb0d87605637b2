"""Test doubles for the API layer: a tiny real tokenizer and a scripted engine core.

``FakeEngine`` implements :class:`proxy.engine.client.EngineCoreClient` (``start``, ``shutdown``,
``add_request``, ``abort_requests``, ``is_healthy``, ``stats``, ``fault_injector``) and emits one
scripted token per step on the event loop, so the API can be tested without torch.
:func:`fake_client` puts the real :class:`~proxy.engine.client.AsyncEngineClient` (output
processing, mailboxes, metrics) over it: the API tests drive the same ``EngineClient`` the server
uses, with only the engine core replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.client import AsyncEngineClient, EngineStats, ModelInfo, OutputsHandler
from proxy.engine.request import RequestOutput, TokenLogprob
from proxy.errors import EngineDeadError, RateLimitError
from proxy.sampling import SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world! This is a test of the streaming server. alpha beta gamma delta",
    "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5.",
    "你好，世界。我很感动。🤗 emoji and café, naïve façade",
    "STOP here END and then more text follows\nnew line",
]


@functools.lru_cache(maxsize=1)
def make_hf_tokenizer() -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) trained in-process on :data:`CORPUS`, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHATML
    return hf


def make_tiny_model(folder: Any, max_positions: int = 256, eos_token: str = "<|im_end|>",
                    seed: int = 0) -> Any:
    """A randomly initialised 2-layer Llama (hidden 32) over :func:`make_hf_tokenizer` with
    ``max_positions`` positions, saved as a Hugging Face folder; returns ``folder``. ``eos_token``
    is the EOS of the config and of the saved tokenizer; ``seed`` seeds the weights."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_hf_tokenizer()
    if eos_token != tok.eos_token:
        tok = copy.deepcopy(tok)
        tok.eos_token = eos_token
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=tok.convert_tokens_to_ids(eos_token),
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_tokenizer() -> Any:
    """``proxy.tokenizer.Tokenizer`` over :func:`make_hf_tokenizer`."""
    from proxy.tokenizer import Tokenizer

    return Tokenizer(make_hf_tokenizer())


def fake_logprob(position: int, token_id: int, k: int) -> TokenLogprob:
    """Deterministic logprobs: chosen ``-0.5 * (position + 1)``, alternatives ``token_id + j``."""
    lp = -0.5 * (position + 1)
    return TokenLogprob(token_id, lp, [(token_id + j, lp - j) for j in range(k)])


@dataclass
class _Running:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    script: list[int]
    task: asyncio.Task[None] | None = None
    num_out: int = 0


@dataclass
class FakeEngine:
    """Scripted engine core: each request generates ``script(prompt_ids, params)``, one token per step.

    Attributes:
        script: token ids to generate for a request (default: :attr:`reply_ids`).
        eos_token_ids: finish ``"stop"`` on these (unless ``ignore_eos``); EOS counts as a token.
            :func:`fake_client` sets them from the tokenizer (``Tokenizer.eos_token_ids``).
        step_s: seconds per step (0: next loop iteration).
        fail_after: when set, a request fails (``finish_reason="error"``) after this many tokens.
        max_waiting: ``add_request`` raises RateLimitError past this many live requests.
        images: the ``images`` of each ``add_request``, in order.
    """

    reply_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    step_s: float = 0.0
    fail_after: int | None = None
    max_waiting: int = 1000
    script: Callable[[list[int], SamplingParams], list[int]] | None = None
    is_healthy: bool = True
    fault_injector: Callable[[], None] | None = None
    started: bool = False
    draining: bool = False
    running: dict[str, _Running] = field(default_factory=dict)
    submitted: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # the PromptImages (or None) of each add_request
    aborted: list[str] = field(default_factory=list)
    reserved_cores: list[int] = field(default_factory=list)

    on_outputs: OutputsHandler | None = None

    def start(self, on_outputs: OutputsHandler) -> None:
        asyncio.get_running_loop()
        self.on_outputs = on_outputs
        self.started = True

    def begin_drain(self) -> None:
        self.draining = True

    def shutdown(self) -> None:
        for r in list(self.running.values()):
            if r.task is not None:
                r.task.cancel()
        self.running.clear()

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=0, kv_cache_usage=0.0)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    images: Any = None) -> None:
        self.images.append(images)
        if not self.is_healthy:
            raise EngineDeadError("The engine is not running.")
        if len(self.running) >= self.max_waiting:
            raise RateLimitError("Too many requests are waiting; retry later.")
        self.submitted.append((request_id, list(prompt_token_ids), params))
        script = self.script(list(prompt_token_ids), params) if self.script else list(self.reply_ids)
        r = _Running(request_id, list(prompt_token_ids), params, script)
        self.running[request_id] = r
        r.task = asyncio.get_running_loop().create_task(self._run(r))

    def reserve_cores(self, cores: int) -> None:
        self.reserved_cores.append(cores)

    def cores_reserved(self) -> bool:
        return True

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            r = self.running.pop(request_id, None)
            if r is not None:
                self.aborted.append(request_id)
                if r.task is not None:
                    r.task.cancel()

    def _emit(self, out: RequestOutput) -> None:
        assert self.on_outputs is not None
        self.on_outputs([out])

    def _out(self, r: _Running, ids: list[int], finished: bool, reason: str | None,
             error: str | None = None, stop_reason: int | None = None) -> RequestOutput:
        lps = None
        if r.params.logprobs:
            lps = [
                fake_logprob(r.num_out - len(ids) + j, t, r.params.top_logprobs) for j, t in enumerate(ids)
            ]
        return RequestOutput(r.request_id, ids, lps, finished, reason, len(r.prompt), r.num_out, error,
                             stop_reason=stop_reason)

    async def _run(self, r: _Running) -> None:
        p = r.params
        for i in range(p.max_tokens):
            await asyncio.sleep(self.step_s)
            if self.fault_injector is not None:
                try:
                    self.fault_injector()
                except Exception as exc:  # noqa: BLE001 - the step fails: this request finishes with an error
                    self.running.pop(r.request_id, None)
                    self._emit(self._out(r, [], True, "error", f"engine step failed: {exc}"))
                    return
            if self.fail_after is not None and i >= self.fail_after:
                self.running.pop(r.request_id, None)
                self._emit(self._out(r, [], True, "error", "injected failure"))
                return
            token = r.script[i] if i < len(r.script) else (r.script[-1] if r.script else 0)
            r.num_out += 1
            is_eos = token in self.eos_token_ids and not p.ignore_eos and p.is_stop_allowed(r.num_out - 1)
            is_last = is_eos or r.num_out >= p.max_tokens
            reason = "stop" if is_eos else ("length" if is_last else None)
            if is_last:
                self.running.pop(r.request_id, None)
            self._emit(self._out(r, [token], is_last, reason, stop_reason=token if is_eos else None))
            if is_last:
                return


def fake_client(engine: FakeEngine, model: str = "test-model", max_model_len: int = 4096,
                vocab_size: int | None = None, with_grammar: bool = False) -> AsyncEngineClient:
    """The real engine client over ``engine`` and :func:`make_tokenizer` (EOS ids from the tokenizer).

    ``with_grammar``: give it a grammar compiler (structured outputs are then accepted and compiled;
    the scripted engine does not apply the masks)."""
    tok = make_tokenizer()
    engine.eos_token_ids = tok.eos_token_ids
    compiler = grammar_compiler() if with_grammar else None
    return AsyncEngineClient(
        engine, tok, ModelInfo(model, max_model_len, vocab_size), grammar_compiler=compiler
    )


@functools.lru_cache(maxsize=1)
def grammar_compiler() -> Any:
    """A grammar compiler over :func:`make_hf_tokenizer` (built once: about a second)."""
    from proxy.engine.structured import GrammarCompiler

    return GrammarCompiler(make_hf_tokenizer(), len(make_hf_tokenizer()), make_tokenizer().eos_token_ids)


@contextlib.contextmanager
def thread_server(
    engine: FakeEngine, model: str = "test-model", client: AsyncEngineClient | None = None, **settings: Any
) -> Iterator[tuple[int, Any]]:
    """The real app over ``engine`` in uvicorn on a thread, on a free 127.0.0.1 port; yields ``(port,
    app)``. ``client``: the engine client to serve (over ``engine``; default :func:`fake_client`)."""
    import uvicorn

    from proxy.api.app import create_app
    from proxy.settings import Settings

    settings.setdefault("served_model_name", model)
    app = create_app(Settings(**settings), lambda _: client or fake_client(engine, model))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started and app.state.server.status == "ready":
                break
            time.sleep(0.01)
        assert server.started and app.state.server.status == "ready"
        yield server.servers[0].sockets[0].getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(10)


def post_stream(port: int, body: dict[str, Any], path: str = "/v1/chat/completions") -> socket.socket:
    """Send ``body`` as a raw HTTP/1.1 POST on a new socket (the response is left to read)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + body[:size], body[size + 2:]
