"""Fixtures of the chat-page tests: live servers on 127.0.0.1 and one headless Chromium per module.

- :func:`live_app`: any ASGI app (ours) in uvicorn on a thread, on a free port, until it is ready.
- :func:`fake_app`: the real app over a scripted :class:`~api.fakes.FakeEngine` whose reply depends on
  the last user message (:func:`reply_for`), so each test picks its reply by what it types.
- :class:`WireApp`: wraps the app; on request it cuts the next streamed response's connection, or
  sends each of its multibyte frames in two pieces split inside a UTF-8 character.
- ``browser``: Debian's ``chromium`` driven by ``chromedriver`` through selenium, started with the
  flags below and a fresh ``--user-data-dir``; skipped with a reason where either is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api.fakes import FakeEngine, fake_client, make_hf_tokenizer, make_tokenizer

from proxy.api.app import create_app
from proxy.settings import Settings

MODEL = "test-model"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,760"]

HELLO = "Hello world! This is a test of the streaming server."
CJK = "你好，世界。我很感动。🤗 emoji and café, naïve façade 👩‍💻 end"
INJECTION = ('Look: <img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
             '<b id="injected">bold</b> &amp; done')
LONG = " ".join(["alpha beta gamma delta"] * 40)
THINKING = "Plan: greet, then answer <b>kindly</b>."
ANSWER = "The answer is 42."


def reply_for(last_user_message: str) -> str:
    """The fake engine's reply, chosen by a keyword in the last user message."""
    if "inject" in last_user_message:
        return INJECTION
    if "cjk" in last_user_message:
        return CJK
    if "long" in last_user_message:
        return LONG
    if "think" in last_user_message:  # a thinking model's output (served with --reasoning-parser qwen3)
        return f"<think>{THINKING}</think>{ANSWER}"
    return HELLO


def _last_user_message(prompt_text: str) -> str:
    return prompt_text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


class BurstEngine(FakeEngine):
    """:class:`~api.fakes.FakeEngine` that, with ``burst`` set, emits a whole reply in one engine step
    (so it reaches the page as one content delta)."""

    burst: bool = False

    async def _run(self, r: Any) -> None:
        if not self.burst:
            await super()._run(r)
            return
        await asyncio.sleep(self.step_s)
        ids = r.script[: r.params.max_tokens]
        r.num_out = len(ids)
        self.running.pop(r.request_id, None)
        eos = ids[-1] if ids and ids[-1] in self.eos_token_ids else None
        self._emit(self._out(r, ids, True, "stop" if eos is not None else "length", stop_reason=eos))


def fake_app(engine: FakeEngine, before_load: Callable[[], Any] | None = None, **settings: Any) -> Any:
    """The real app over ``engine`` (scripted by :func:`reply_for`), serving :data:`MODEL`.
    ``before_load`` runs in the loading thread first (a test holds the server in "loading" with it)."""
    hf = make_hf_tokenizer()
    tok = make_tokenizer()
    eos = hf.convert_tokens_to_ids("<|im_end|>")

    def script(prompt_ids: list[int], params: Any) -> list[int]:
        text = reply_for(_last_user_message(hf.decode(prompt_ids)))
        return list(tok.encode(text)) + [eos]

    engine.script = script
    settings.setdefault("served_model_name", MODEL)
    def factory(_: Settings) -> Any:
        if before_load is not None:
            before_load()
        return fake_client(engine, MODEL, 4096, vocab_size=len(hf))

    return create_app(Settings(**settings), factory)


class WireApp:
    """ASGI wrapper that changes how the next streamed chat completion travels on the wire.

    - :meth:`drop_after`: the connection is cut after ``n`` body messages (an exception once the
      response started: uvicorn closes the socket without the last chunk), as a crashed proxy would.
    - :meth:`split_characters`: every body message holding non-ASCII text is sent in two pieces, cut
      right after its first non-ASCII byte (inside a UTF-8 character), a few ms apart, so the
      browser reads a character in two halves.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state
        self.drop_after_messages: int | None = None
        self.split_next = False

    def reset(self) -> None:
        self.drop_after_messages, self.split_next = None, False

    def drop_after(self, n: int) -> None:
        self.drop_after_messages = n

    def split_characters(self) -> None:
        self.split_next = True

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        drop, split = self.drop_after_messages, self.split_next
        if (drop is None and not split) or scope.get("path") != "/v1/chat/completions":
            await self.app(scope, receive, send)
            return
        self.reset()
        sent = 0

        async def wire_send(message: dict) -> None:
            nonlocal sent
            if message["type"] != "http.response.body":
                await send(message)
                return
            sent += 1
            if drop is not None and sent > drop:
                raise ConnectionAbortedError("test: connection dropped on purpose")
            body: bytes = message.get("body", b"")
            cut = next((i + 1 for i, b in enumerate(body) if b >= 0x80), None)
            if split and cut is not None:
                await send({"type": "http.response.body", "body": body[:cut], "more_body": True})
                await asyncio.sleep(0.005)
                message = {**message, "body": body[cut:]}
            await send(message)

        await self.app(scope, receive, wire_send)


@contextlib.contextmanager
def live_app(app: Any, ready_timeout_s: float = 60.0, wait_ready: bool = True) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread at a free 127.0.0.1 port; yields the base URL once the
    model is loaded (``app.state.server.status == "ready"``), or once it listens (``wait_ready=False``)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if server.started and (not wait_ready or app.state.server.status != "loading"):
                break
            time.sleep(0.02)
        assert server.started
        assert not wait_ready or app.state.server.status == "ready", app.state.server.load_error
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium (selenium + chromedriver), shared by the tests of a module."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; "
                    "make setup does it when run as root)")
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
    )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
