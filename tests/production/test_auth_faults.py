"""A real ``python -m proxy serve`` (tiny model) with API keys and the test-only fault hook:
401 OpenAI errors, /health open, keys never logged; injected forward-pass faults end the affected
streams with an error event + [DONE] and the next request is served exactly as before."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from api.conftest import chat_body, run, serve

from .helpers import TINY, TINY_ARGS, Proc, chunks_and_done, make_tiny_model, start_server, stream_text

KEY1, KEY2 = "sk-test-Secret-Key-0001", "sk-test-Secret-Key-0002"
WRONG = "sk-test-Wrong-Key-9999"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("auth-faults")
    model = make_tiny_model(tmp / "tiny")
    proc = start_server(tmp, ["--model", str(model), *TINY_ARGS, "--api-key", KEY1, "--log-level", "debug"],
                        env={"STREAMPROXY_API_KEYS": KEY2, "STREAMPROXY_TEST_FAULTS": "1"})
    yield proc
    assert proc.stop() == 0


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


BASE = {"model": TINY, "prompt": "Hello", "temperature": 0, "ignore_eos": True}


def test_auth_and_keys_never_logged(server: Proc):
    url = f"{server.base_url}/v1/completions"
    body = {**BASE, "max_tokens": 4}
    missing = httpx.post(url, json=body, timeout=30)
    wrong = httpx.post(url, json=body, headers=auth(WRONG), timeout=30)
    basic = httpx.post(url, json=body, headers={"Authorization": f"Basic {KEY1}"}, timeout=30)
    for r in (missing, wrong, basic):
        assert r.status_code == 401
        assert r.json() == {"error": {
            "message": "Missing or invalid API key (send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>').",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    # the command line wins over the environment: only KEY1 is accepted
    assert httpx.post(url, json=body, headers=auth(KEY2), timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers=auth(KEY1), timeout=30).status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models", headers=auth(KEY1), timeout=30).status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200  # open for load balancers
    log = server.log()
    assert "streamproxy ready" in log  # the log is captured at debug level
    for secret in (KEY1, KEY2, WRONG, "Secret-Key", "Wrong-Key"):
        assert secret not in log


def test_env_keys_when_no_command_line_key(tmp_path: Path):
    from proxy.cli import build_parser, settings_from

    args = build_parser().parse_args(["serve"])
    assert settings_from(args, {"STREAMPROXY_API_KEYS": f"{KEY1}, {KEY2}"}).api_keys == (KEY1, KEY2)
    args = build_parser().parse_args(["serve", "--api-key", KEY1, "--api-key", KEY2])
    assert settings_from(args, {}).api_keys == (KEY1, KEY2)


def _collect(url: str, body: dict, out: list, started: threading.Event) -> threading.Thread:
    def go() -> None:
        raw = b""
        with httpx.stream("POST", url, json=body, headers=auth(KEY1), timeout=60) as r:
            for piece in r.iter_raw():
                raw += piece
                if b'"text"' in raw:
                    started.set()
        out.append(raw)
        started.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_injected_fault_fails_the_running_streams_and_server_recovers(server: Proc):
    url = f"{server.base_url}/v1/completions"
    ref_body = {**BASE, "max_tokens": 48}
    before = httpx.post(url, json=ref_body, headers=auth(KEY1), timeout=60).json()["choices"][0]["text"]
    assert len(before) > 10
    outs: list[bytes] = []
    events = [threading.Event(), threading.Event()]
    threads = [_collect(url, {**BASE, "max_tokens": 15000, "stream": True, "prompt": p}, outs, e)
               for p, e in zip(("Hello", "The quick brown fox"), events)]
    assert all(e.wait(30) for e in events)
    armed = httpx.post(f"{server.base_url}/_test/fault", json={"fail_steps": 1}, timeout=30)
    assert armed.json() == {"armed": True, "after_steps": 0, "fail_steps": 1}
    for t in threads:
        t.join(60)
    assert len(outs) == 2
    for raw in outs:
        chunks = chunks_and_done(raw)
        err = chunks[-1]["error"]
        assert err["code"] == "engine_error" and err["type"] == "server_error"
        assert err["message"] == "engine step failed: InjectedFault: injected fault (test hook)"
        assert len(stream_text(chunks[:-1], chat=False)) > 0
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # the server is up and serves the same request exactly as before; every KV block came back
    after = httpx.post(url, json=ref_body, headers=auth(KEY1), timeout=60).json()["choices"][0]["text"]
    streamed = httpx.post(url, json={**ref_body, "stream": True}, headers=auth(KEY1), timeout=60)
    assert after == before and stream_text(chunks_and_done(streamed.content), chat=False) == before
    health = server.health()
    assert health["status"] == "ready" and health["num_free_blocks"] == health["num_total_blocks"]
    assert health["num_tracked_outputs"] == 0
    assert server.log().count("InjectedFault") >= 1  # logged by the engine, as a step failure


def test_fault_route_is_off_by_default_and_cors_preflight():
    async def main():
        async with serve(allowed_origins=("https://app.example",)) as s:
            fault = await s.client.post("/_test/fault", json={})
            ok = await s.client.options("/v1/chat/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            bad = await s.client.options("/v1/chat/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            simple = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=2),
                                         headers={"Origin": "https://app.example"})
            other = await s.client.post("/v1/chat/completions", json=chat_body(max_tokens=2),
                                        headers={"Origin": "https://evil.example"})
            return fault, ok, bad, simple, other

    fault, ok, bad, simple, other = run(main())
    assert fault.status_code == 404
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
