"""The chat page in a real headless Chromium against live servers on 127.0.0.1.

Most tests use the real app over a scripted fake engine (deterministic replies: plain, CJK + emoji,
an HTML injection); the Stop test runs a real engine over a tiny random Llama so that ``/health``
reports real KV blocks. Every test ends by reading the browser console: no errors, except the
failed-request lines a test provokes on purpose (401, 429, 400, a cut connection).
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.fakes import FakeEngine, make_hf_tokenizer
from api.fakes import make_tiny_model as _make_tiny_model

from proxy.api.app import create_app
from proxy.settings import Settings

from .conftest import CJK, HELLO, INJECTION, LONG, MODEL, BurstEngine, WireApp, fake_app, live_app

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "img" / "chat-ui.png"
UPDATE_SCREENSHOT_ENV = "STREAMPROXY_UPDATE_SCREENSHOT"
WAIT_S = 30.0

OBSERVE_REPLIES = """
window.__snapshots = [];
const log = document.getElementById("log");
new MutationObserver(() => {
  const all = log.querySelectorAll(".message.assistant");
  const last = all[all.length - 1];
  if (last) window.__snapshots.push([last.dataset.state || "", last.querySelector(".text").textContent]);
}).observe(log, {subtree: true, childList: true, characterData: true, attributes: true});
"""


# ----------------------------------------------------------------------------- helpers


def wait_for(driver: Any, script: str, timeout: float = WAIT_S) -> Any:
    """Poll ``script`` (JS returning a value) until it is truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {script}")
        time.sleep(0.05)


def open_page(driver: Any, base: str) -> None:
    driver.get(base + "/")
    wait_for(driver, "return document.body.dataset.ready === 'true'")


def send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By

    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(text)
    driver.find_element(By.ID, "send").click()


def last(driver: Any, role: str) -> dict:
    """The last message of ``role``: its ``text``, ``state`` (streaming, done, stopped, failed) and
    ``info``."""
    return driver.execute_script(
        "const all = document.querySelectorAll('#log .message.' + arguments[0]);"
        "const m = all[all.length - 1];"
        "return m ? {text: m.querySelector('.text').textContent, state: m.dataset.state || '',"
        "            info: m.querySelector('.info').textContent} : null;", role)


def wait_reply(driver: Any, states: tuple[str, ...] = ("done",)) -> dict:
    """Wait until the last assistant message is in one of ``states`` (or an error is shown)."""
    wait_for(driver, "const all = document.querySelectorAll('#log .message.assistant, #log .message.error');"
                     "const m = all[all.length - 1];"
                     f"return m && (m.classList.contains('error') || {json.dumps(list(states))}"
                     ".includes(m.dataset.state));")
    return last(driver, "assistant")


def console_errors(driver: Any, allowed: tuple[str, ...] = ()) -> list[str]:
    """SEVERE console entries since the last call, minus those containing one of ``allowed``."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


def errors_shown(driver: Any) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#log .message.error .text')].map(e => e.textContent);")


def prompt_text(engine: FakeEngine, which: int = -1) -> str:
    return make_hf_tokenizer().decode(engine.submitted[which][1])


# ----------------------------------------------------------------------------- fixtures


class FakeServer:
    def __init__(self, base: str, engine: BurstEngine, app: WireApp) -> None:
        self.base, self.engine, self.app = base, engine, app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    engine = BurstEngine(step_s=0.03)
    app = WireApp(fake_app(engine))
    with live_app(app) as base:
        yield FakeServer(base, engine, app)


@pytest.fixture
def page(browser: Any, fake_server: FakeServer) -> Iterator[Any]:
    """The page loaded from the fake server; the engine's failure knobs reset; console drained."""
    fake_server.engine.max_waiting = 1000
    fake_server.engine.fail_after = None
    fake_server.engine.burst = False
    fake_server.engine.step_s = 0.03
    fake_server.app.reset()
    open_page(browser, fake_server.base)
    browser.get_log("browser")
    yield browser


# ----------------------------------------------------------------------------- the page


def test_page_loads_without_console_errors(browser: Any, fake_server: FakeServer) -> None:
    browser.get_log("browser")
    open_page(browser, fake_server.base)
    assert browser.title == "streamproxy chat"
    models = browser.execute_script(
        "return [...document.querySelectorAll('#model option')].map(o => o.value);"
    )
    assert models == [MODEL]
    assert browser.execute_script("return document.getElementById('stop').disabled") is True
    assert console_errors(browser) == []


def test_reply_streams_in_incrementally(page: Any, fake_server: FakeServer) -> None:
    fake_server.engine.step_s = 0.1  # 100 ms per token: distinct frames even on a loaded machine
    page.execute_script(OBSERVE_REPLIES)
    send(page, "hello there")
    reply = wait_reply(page)
    assert reply["text"] == HELLO
    assert re.fullmatch(r"\d+ tokens · \d+ prompt · stop", reply["info"]), reply["info"]
    snapshots = page.execute_script("return window.__snapshots;")
    partial = []
    for state, text in snapshots:
        if state == "streaming" and text and text not in partial:
            partial.append(text)
    assert len(partial) >= 3, snapshots  # several DOM updates before [DONE]
    assert all(HELLO.startswith(p) for p in partial) and partial[0] != HELLO
    stats = page.find_element("id", "stats").text
    assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tok/s", stats), stats
    assert page.execute_script("return document.getElementById('send').disabled") is False
    assert console_errors(page) == []


def test_thinking_is_shown_collapsed_above_the_answer(browser: Any) -> None:
    from ui.conftest import ANSWER, THINKING

    with live_app(fake_app(BurstEngine(step_s=0.03), reasoning_parser="qwen3")) as base:
        open_page(browser, base)
        send(browser, "think first")
        reply = wait_reply(browser)
        details = browser.execute_script(
            "const m = [...document.querySelectorAll('#log .message.assistant')].pop();"
            "const d = m.querySelector('details.thinking');"
            "return d && [d.open, d.querySelector('.thinking-text').textContent, m.children[1] === d,"
            "             d.querySelector('b') === null];")
    assert reply["text"] == ANSWER
    assert details == [False, THINKING, True, True]  # collapsed, before the answer, shown as text
    assert console_errors(browser) == []


def test_cjk_and_emoji_arrive_intact_when_characters_are_split_on_the_wire(
    page: Any, fake_server: FakeServer
) -> None:
    fake_server.app.split_characters()
    send(page, "cjk please")
    assert wait_reply(page)["text"] == CJK
    assert console_errors(page) == []


def test_html_injection_in_a_reply_is_shown_as_text_and_never_runs(
    page: Any, fake_server: FakeServer
) -> None:
    fake_server.engine.burst = True  # the whole reply in one delta: whole tags, were they parsed as HTML
    send(page, "inject something")
    assert wait_reply(page)["text"] == INJECTION
    time.sleep(0.3)  # an onerror handler would have run by now
    assert page.execute_script("return typeof window.__pwned") == "undefined"
    found = page.execute_script("return document.querySelectorAll('#log img, #log script, #injected').length")
    assert found == 0
    assert console_errors(page) == []


def test_history_system_prompt_settings_and_clear(page: Any, fake_server: FakeServer) -> None:
    engine = fake_server.engine
    page.find_element("id", "settings-toggle").click()
    page.find_element("id", "system").send_keys("You are terse.")
    for field, value in (("temperature", "0.2"), ("max-tokens", "40")):
        el = page.find_element("id", field)
        el.clear()
        el.send_keys(value)
    send(page, "hello one")
    wait_reply(page)
    send(page, "cjk two")
    wait_reply(page)
    prompt = prompt_text(engine)
    assert prompt.startswith(
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhello one<|im_end|>\n"
        f"<|im_start|>assistant\n{HELLO}<|im_end|>\n<|im_start|>user\ncjk two<|im_end|>\n"
    )
    params = engine.submitted[-1][2]
    assert (params.temperature, params.max_tokens) == (0.2, 40)
    assert page.execute_script("return document.querySelectorAll('#log .message').length") == 4

    send(page, "long reply")  # Clear while it streams: the request is aborted, its turn forgotten
    wait_for(
        page,
        "const m = [...document.querySelectorAll('#log .message.assistant')].pop();"
        "return m.dataset.state === 'streaming' && m.querySelector('.text').textContent.length > 20",
    )
    long_id = engine.submitted[-1][0]
    page.find_element("id", "clear").click()
    assert page.execute_script("return document.querySelectorAll('#log .message').length") == 0
    send(page, "hello three")
    wait_reply(page)
    prompt = prompt_text(engine)
    assert "hello one" not in prompt and "long reply" not in prompt and "hello three" in prompt
    assert long_id in engine.aborted
    assert console_errors(page) == []


def test_copy_puts_the_message_on_the_clipboard(page: Any, fake_server: FakeServer) -> None:
    page.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": fake_server.base, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    send(page, "cjk copy")
    wait_reply(page)
    page.execute_script("[...document.querySelectorAll('#log .message.assistant .copy')].pop().click();")
    wait_for(page, "return [...document.querySelectorAll('#log .message.assistant .copy')].pop().textContent"
                   " === 'Copied'")
    clip = page.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('!' + e));"
    )
    assert clip == CJK
    assert console_errors(page) == []


def test_sse_parser_handles_any_split_comments_and_crlf(page: Any) -> None:
    raw = ': keepalive\r\n\r\ndata: {"a":1}\r\n\r\ndata: x\ndata: y\n\n:c\n\nevent: e\ndata:[DONE]\r\r\n'
    got = page.execute_script(
        "const out = []; const p = new window.streamproxyChat.SseParser(d => out.push(d));"
        "for (const ch of arguments[0]) p.push(ch);"  # one character at a time: every split point
        "const whole = []; const q = new window.streamproxyChat.SseParser(d => whole.push(d)); "
        "q.push(arguments[0]);"
        "return [out, whole];",
        raw,
    )
    assert got == [['{"a":1}', "x\ny", "[DONE]"]] * 2


# ----------------------------------------------------------------------------- errors


def test_429_is_shown_with_its_retry_hint(page: Any, fake_server: FakeServer) -> None:
    fake_server.engine.max_waiting = 0
    send(page, "hello busy")
    wait_reply(page)
    shown = errors_shown(page)
    assert len(shown) == 1 and "(429)" in shown[0] and shown[0].endswith("Retry after 1 s."), shown
    assert page.find_element("id", "prompt").get_attribute("value") == "hello busy"  # kept for a retry
    assert console_errors(page, allowed=("status of 429",)) == []


def test_400_shows_the_servers_message(page: Any, fake_server: FakeServer) -> None:
    el = page.find_element("id", "max-tokens")
    page.find_element("id", "settings-toggle").click()
    el.clear()
    el.send_keys("0")
    send(page, "hello bad")
    wait_reply(page)
    expected = httpx.post(fake_server.base + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "stream": True,
    }).json()["error"]["message"]
    assert errors_shown(page) == [f"Error 400: {expected}"]
    assert console_errors(page, allowed=("status of 400",)) == []


def test_error_event_in_the_stream_is_shown_and_the_partial_reply_kept(
    page: Any, fake_server: FakeServer
) -> None:
    fake_server.engine.fail_after = 4
    send(page, "hello fail")
    reply = wait_reply(page, ("failed",))
    wait_for(page, "return document.querySelectorAll('#log .message.error').length === 1")
    assert errors_shown(page) == ["The server ended the reply with an error: injected failure"]
    assert reply["text"] and HELLO.startswith(reply["text"]) and reply["text"] != HELLO
    assert console_errors(page) == []


def test_dropped_connection_is_shown(page: Any, fake_server: FakeServer) -> None:
    fake_server.app.drop_after(3)
    send(page, "long text please")
    wait_for(page, "return document.querySelectorAll('#log .message.error').length === 1")
    shown = errors_shown(page)
    assert shown[0].startswith("The connection dropped during the reply"), shown
    assert page.execute_script("return document.getElementById('send').disabled") is False
    assert console_errors(page, allowed=("ERR_INCOMPLETE_CHUNKED_ENCODING",)) == []


# ----------------------------------------------------------------------------- API key


def test_api_key_is_asked_for_kept_in_session_storage_and_sent(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    engine = FakeEngine(step_s=0.01)
    with live_app(fake_app(engine, api_keys=("sekret-key",))) as base:
        browser.get(base + "/")
        wait_for(browser, "return !document.getElementById('key-form').hidden")
        assert "(401)" in browser.find_element(By.ID, "key-message").text

        browser.find_element(By.ID, "api-key").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, "return !document.getElementById('key-form').hidden && "
                          "sessionStorage.getItem('streamproxy.apiKey') === 'wrong'")
        assert "invalid API key" in browser.find_element(By.ID, "key-message").text

        browser.find_element(By.ID, "api-key").send_keys("sekret-key")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, "return document.body.dataset.ready === 'true'")
        assert browser.execute_script("return sessionStorage.getItem('streamproxy.apiKey')") == "sekret-key"
        assert browser.execute_script("return localStorage.length") == 0
        send(browser, "hello with key")
        assert wait_reply(browser)["text"] == HELLO

        browser.execute_script("sessionStorage.setItem('streamproxy.apiKey', 'revoked')")
        send(browser, "hello again")
        wait_for(browser, "return document.querySelectorAll('#log .message.error').length === 1")
        assert errors_shown(browser)[0].startswith("Not authorised (401): ")
        assert not browser.execute_script("return document.getElementById('key-form').hidden")
        assert console_errors(browser, allowed=("status of 401",)) == []
        browser.execute_script("sessionStorage.clear()")


# ----------------------------------------------------------------------------- loading


def test_page_waits_while_the_model_loads(browser: Any) -> None:
    release = threading.Event()
    app = fake_app(BurstEngine(step_s=0.01), before_load=lambda: release.wait(60))
    try:
        with live_app(app, wait_ready=False) as base:
            browser.get(base + "/")
            wait_for(browser, "return !document.getElementById('notice').hidden")
            notice = browser.find_element("id", "notice").text
            assert "loading" in notice and notice.endswith("Retrying…"), notice
            release.set()
            wait_for(browser, "return document.body.dataset.ready === 'true'")
            assert browser.execute_script("return document.getElementById('notice').hidden") is True
            send(browser, "hello after loading")
            assert wait_reply(browser)["text"] == HELLO
            assert console_errors(browser, allowed=("status of 503",)) == []
    finally:
        release.set()


# ----------------------------------------------------------------------------- Stop (real engine)


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real engine over a random 2-layer Llama (4096 positions, 300 KV blocks of 16 tokens)."""
    folder = _make_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=4096)
    settings = Settings(model=str(folder), served_model_name="tiny", max_model_len=4096, num_kv_blocks=300,
                        num_threads=1, device="cpu", dtype="float32")
    with live_app(create_app(settings)) as base:
        yield base


def test_stop_ends_the_stream_and_frees_the_kv_blocks(browser: Any, engine_server: str) -> None:
    open_page(browser, engine_server)
    browser.get_log("browser")
    browser.find_element("id", "settings-toggle").click()
    for field, value in (("temperature", "0"), ("max-tokens", "3000")):
        el = browser.find_element("id", field)
        el.clear()
        el.send_keys(value)
    send(browser, "hello")
    wait_for(browser, "const m = [...document.querySelectorAll('#log .message.assistant')].pop();"
                      "return m && m.querySelector('.text').textContent.length > 40")
    busy = httpx.get(engine_server + "/health").json()
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < busy["num_total_blocks"], busy
    browser.find_element("id", "stop").click()
    reply = wait_reply(browser, ("stopped",))
    assert reply["state"] == "stopped" and reply["info"] == "stopped" and reply["text"]
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(engine_server + "/health").json()
        if health["num_running"] == 0 and health["num_free_blocks"] == health["num_total_blocks"]:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    stopped_text = reply["text"]
    time.sleep(0.3)
    assert last(browser, "assistant")["text"] == stopped_text  # nothing arrives after Stop
    assert browser.execute_script("return document.getElementById('send').disabled") is False
    assert console_errors(browser) == []


# ----------------------------------------------------------------------------- screenshot


def test_screenshot(browser: Any, fake_server: FakeServer, tmp_path: Path) -> None:
    """A screenshot of a short conversation, the second reply still streaming. Written to
    docs/img/chat-ui.png (for the README) when
    ``STREAMPROXY_UPDATE_SCREENSHOT=1``, else to a temp folder, so a test run leaves the tree clean."""
    open_page(browser, fake_server.base)
    browser.find_element("id", "settings-toggle").click()
    browser.find_element("id", "system").send_keys("You are a friendly assistant.")
    send(browser, "hello")
    wait_reply(browser)
    send(browser, "a long reply, please")
    wait_for(
        browser,
        "const m = [...document.querySelectorAll('#log .message.assistant')].pop();"
        "return m.dataset.state === 'streaming' && m.querySelector('.text').textContent.length > 150",
    )
    path = SCREENSHOT if os.environ.get(UPDATE_SCREENSHOT_ENV) == "1" else tmp_path / "chat-ui.png"
    assert browser.save_screenshot(str(path))
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == tuple(browser.execute_script("return [window.innerWidth, window.innerHeight]"))
    assert wait_reply(browser)["text"] == LONG
