"""Two streamproxy replicas behind each published cache-aware router (``sglang-router``, ``vllm-router``;
the ``router`` extra), real processes on 127.0.0.1 over a tiny random model folder.

- a stream through the router is byte-identical to a direct one (ids and ``created`` aside);
- a multi-turn conversation stays on one replica, with cached prompt tokens on every later turn;
- a replica killed mid-stream ends the client's stream (error event + ``[DONE]`` or the router's
  error), and the next requests are served by the survivor;
- a draining replica (SIGTERM) finishes its open stream;
- a session key (``X-SMG-Routing-Key`` with ``sglang-router --policy manual``, ``x-session-id`` with
  ``vllm-router --policy consistent_hash``) pins differing requests to one replica;
- the README's router commands run as written (ports, the key and the model substituted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.ports import launch, wait_ready

from .helpers import (
    TINY,
    TINY_ARGS,
    Proc,
    chunks_and_done,
    data_payloads,
    free_port,
    make_tiny_model,
    start_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROUTERS = ("sglang-router", "vllm-router")
SYSTEM = ("{n}: you are the archivist of this conversation. Keep every answer short, exact and friendly, "
          "and always remember what the user told you before in this conversation, word for word.")
"""The unique ``{n}`` comes first, inside the prompt's first KV block: no other test's prompt shares it."""


def _router_command(kind: str, port: int, urls: list[str], log_level: str, policy: str) -> list[str]:
    exe = shutil.which(kind, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{kind} is not installed (pip install -e '.[router]'; make setup installs it)")
    args = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--log-level", log_level]
    return [exe, "launch", *args] if kind == "sglang-router" else [exe, *args]


@contextlib.contextmanager
def router(tmp: Path, kind: str, replicas: list[Proc], log_level: str = "info",
           policy: str = "cache_aware") -> Iterator[str]:
    """``kind`` in front of ``replicas`` (``--policy``); yields its base URL once it routes a request.
    Its log is ``tmp / f"{kind}.log"``."""
    port = free_port()
    log_path = tmp / f"{kind}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(_router_command(kind, port, [r.base_url for r in replicas], log_level,
                                                   policy),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _replicas(tmp: Path, model: Path, n: int = 2) -> list[Proc]:
    """``n`` replicas of ``model``, started side by side."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: start_server(tmp, ["--model", str(model), *TINY_ARGS],
                                                    name=f"replica{i}", new_session=True), range(n)))


def _stop_all(procs: list[Proc]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.process.pid, signal.SIGKILL)
        p.process.wait(10)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[list[Proc]]:
    procs = _replicas(tmp_path_factory.mktemp("pair"), tiny_model)
    yield procs
    _stop_all(procs)


def _chat(messages: list[dict], **kw) -> dict:
    return {"model": TINY, "messages": messages, "temperature": 0, "max_tokens": 24, **kw}


def _stream(url: str, body: dict) -> bytes:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


def _normalised(raw: bytes) -> tuple[list[bytes], str]:
    """``(events, text)`` of a stream's bytes with ids and ``created`` blanked and the content deltas'
    text taken out (``text``), runs of equal content events collapsed to one: how many tokens one
    event carries depends on timing (the first event may carry two), everything else is fixed."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    raw = re.sub(rb'"created":\d+', b'"created":0', raw)
    events: list[bytes] = []
    text = ""
    for payload in data_payloads(raw):
        content = payload != b"[DONE]" and json.loads(payload)["choices"]
        if content and content[0]["delta"].get("content"):
            text += content[0]["delta"]["content"]
            payload = re.sub(rb'"content":"(?:[^"\\]|\\.)*"', b'"content":""', payload)
            if events and events[-1] == payload:
                continue
        events.append(payload)
    return events, text


def _chat_requests(proc: Proc) -> float:
    text = httpx.get(f"{proc.base_url}/metrics", timeout=10).text
    pattern = r'^streamproxy:api_requests_total\{endpoint="/v1/chat/completions"[^}]*\} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _serving(procs: list[Proc]) -> Proc:
    """The replica running a request now (``/health``'s ``num_running``)."""
    for _ in range(200):
        busy = [p for p in procs if p.health().get("num_running", 0) > 0]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no single replica is running the request")


@pytest.mark.parametrize("kind", ROUTERS)
def test_stream_through_the_router_is_byte_identical(kind: str, pair: list[Proc], tmp_path: Path):
    # one multibyte token far ahead of the rest: greedy picks it whatever the float noise of the path
    # (several near-equal biased tokens would make the pick differ between a prefix-cache hit and a miss)
    tokenized = httpx.post(f"{pair[0].base_url}/tokenize",
                           json={"prompt": "你好", "add_special_tokens": False}, timeout=10)
    (nihao,) = tokenized.json()["tokens"]
    body = _chat([{"role": "user", "content": "Say 你好 🤗"}], max_tokens=40, seed=3,
                 logit_bias={str(nihao): 30}, stream_options={"include_usage": True})
    for replica in pair:  # both hold the prompt's first block now, so usage.cached_tokens is the same
        _stream(replica.base_url, body)
    direct = _stream(pair[0].base_url, body)
    with router(tmp_path, kind, pair) as url:
        routed = _stream(url, body)
    chunks = chunks_and_done(direct)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "你好" * 40 and chunks[-1]["usage"]["completion_tokens"] == 40
    assert routed.endswith(b"data: [DONE]\n\n")
    assert _normalised(routed) == _normalised(direct)
    assert len(_normalised(direct)[0]) == 5  # role, content, finish, usage, [DONE]


@pytest.mark.parametrize("kind", ROUTERS)
def test_a_conversation_stays_on_its_replica_with_cached_tokens(kind: str, pair: list[Proc], tmp_path: Path):
    with router(tmp_path, kind, pair, log_level="debug") as url:
        before = [_chat_requests(p) for p in pair]
        messages = [{"role": "system", "content": SYSTEM.format(n=f"{kind}-{time.time_ns()}")},
                    {"role": "user", "content": "My name is Ada and I like 你好 and 🤗. Remember it."}]
        cached = []
        for turn in range(4):
            r = httpx.post(f"{url}/v1/chat/completions", json=_chat(messages), timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            question = {"role": "user", "content": f"Turn {turn}: what's my name?"}
            messages += [out["choices"][0]["message"], question]
        served = [_chat_requests(p) - b for p, b in zip(pair, before)]
    # vllm-router asks each worker for /v1/chat/completions/render; when that fails it logs this (at
    # debug level, with the reason, e.g. "render_unavailable" for a 404) and falls back to least load
    log = (tmp_path / f"{kind}.log").read_text(errors="replace")
    assert "Prefix input preparation unavailable" not in log
    assert sorted(served) == [0, 4], served
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached


STICKY = {"sglang-router": ("manual", "X-SMG-Routing-Key"),
          "vllm-router": ("consistent_hash", "x-session-id")}
"""The README's session stickiness: each router's key-pinning policy and the header it reads."""


@pytest.mark.parametrize("kind", ROUTERS)
def test_a_session_key_pins_requests_to_one_replica(kind: str, pair: list[Proc], tmp_path: Path):
    policy, header = STICKY[kind]
    with router(tmp_path, kind, pair, policy=policy) as url:
        served = []
        for session in ("alpha", "beta", "gamma"):
            before = [_chat_requests(p) for p in pair]
            for i in range(3):  # different prompts: only the key ties them together
                hi = _chat([{"role": "user", "content": f"{session} {i} {'x' * i * 40}"}], max_tokens=2)
                r = httpx.post(f"{url}/v1/chat/completions", json=hi, headers={header: session},
                               timeout=60)
                assert r.status_code == 200, r.text
            served.append(sorted(_chat_requests(p) - b for p, b in zip(pair, before)))
    assert served == [[0, 3]] * 3, served


@pytest.mark.parametrize("kind", ROUTERS)
def test_a_killed_replica_ends_its_stream_and_the_survivor_serves_then_drains(kind: str, tiny_model: Path,
                                                                             tmp_path: Path):
    procs = _replicas(tmp_path, tiny_model)
    try:
        with router(tmp_path, kind, procs) as url:
            long = _chat([{"role": "user", "content": "Count forever."}], max_tokens=6000, ignore_eos=True)
            got = b""
            error = None
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**long, "stream": True},
                              timeout=60) as r:
                assert r.status_code == 200
                parts = r.iter_raw()
                while got.count(b"\n\ndata: ") < 5:
                    got += next(parts)
                victim = _serving(procs)
                os.killpg(victim.process.pid, signal.SIGKILL)
                try:
                    for part in parts:
                        got += part
                except httpx.HTTPError as exc:  # the router cut the connection
                    error = exc
            assert b'"finish_reason":"length"' not in got
            if error is None and got.rstrip().endswith(b"data: [DONE]"):
                assert b'"error"' in got, got[-400:]
            survivor = next(p for p in procs if p is not victim)
            hello = _chat([{"role": "user", "content": "hi"}])
            deadline = time.monotonic() + 30
            while httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60).status_code != 200:
                assert time.monotonic() < deadline, "the router kept sending to the dead replica"
                time.sleep(0.5)  # until the router's health check (every 1 s) takes the dead one out
            before = _chat_requests(survivor)
            for i in range(3):
                hi = _chat([{"role": "user", "content": f"hi {i}"}])
                r = httpx.post(f"{url}/v1/chat/completions", json=hi, timeout=60)
                assert r.status_code == 200, r.text
            assert _chat_requests(survivor) - before == 3

            drain = _chat([{"role": "user", "content": "Count to many."}], max_tokens=400, ignore_eos=True)
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**drain, "stream": True},
                              timeout=60) as r:
                parts = r.iter_raw()
                got = next(parts)
                assert _serving([survivor]) is survivor
                survivor.process.send_signal(signal.SIGTERM)
                got += b"".join(parts)
            chunks = chunks_and_done(got)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"][0]["delta"] == {}
            assert survivor.process.wait(30) == 0
    finally:
        _stop_all(procs)


def _readme_commands() -> list[list[str]]:
    """The commands of the README's router block (``sglang-router launch`` in it): continuation lines
    joined, the commented ``vllm-router`` alternative uncommented, ``&`` dropped."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)
    (block,) = [b for b in blocks if "sglang-router launch" in b]
    text = re.sub(r"^# or: ", "", block, flags=re.MULTILINE)
    text = re.sub(r"^#(\s+--)", r"\1", text, flags=re.MULTILINE).replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.strip()]
    return [[a for a in shlex.split(line, comments=True) if a != "&"] for line in lines]


def test_the_readme_router_commands_run_as_written(tiny_model: Path, tmp_path: Path):
    commands = _readme_commands()
    assert [c[0] for c in commands] == ["streamproxy", "streamproxy", "sglang-router", "vllm-router"]
    ports = {"8000": str(free_port()), "8001": str(free_port()), "8002": str(free_port())}
    bindir = Path(sys.executable).parent

    def substituted(cmd: list[str]) -> list[str]:
        out = []
        for arg in cmd:
            arg = arg.replace("$KEY", "k-readme").replace("0.0.0.0", "127.0.0.1")
            for old, new in ports.items():
                arg = re.sub(rf"(^|:){old}$", rf"\g<1>{new}", arg)
            out.append(arg)
        if out[0] == "streamproxy":  # the tiny model instead of the default one
            return [sys.executable, "-m", "proxy", *out[1:], "--model", str(tiny_model), *TINY_ARGS]
        return [str(bindir / out[0]), *out[1:], "--prometheus-port", str(free_port())]

    procs = []
    try:
        for i, cmd in enumerate(commands[:2]):
            procs.append(launch(substituted(cmd), tmp_path / f"readme{i}.log", new_session=True))
        for i, port in enumerate((ports["8001"], ports["8002"])):
            wait_ready(procs[i], f"http://127.0.0.1:{port}/health", tmp_path / f"readme{i}.log", 120)
        auth = {"Authorization": "Bearer k-readme"}
        for cmd in commands[2:]:
            with open(tmp_path / f"{cmd[0]}.log", "wb") as log:
                front = subprocess.Popen(substituted(cmd), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            try:
                url = f"http://127.0.0.1:{ports['8000']}"
                deadline = time.monotonic() + 60
                while True:
                    assert front.poll() is None and time.monotonic() < deadline, cmd[0]
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(f"{url}/v1/models", headers=auth, timeout=2).status_code == 200:
                            break
                    time.sleep(0.2)
                hi = _chat([{"role": "user", "content": "hi"}], max_tokens=2)
                ok = httpx.post(f"{url}/v1/chat/completions", json=hi, headers=auth, timeout=60)
                refused = httpx.post(f"{url}/v1/chat/completions", json=hi, timeout=60)
                assert ok.status_code == 200 and ok.json()["model"] == TINY, ok.text
                assert refused.status_code == 401, refused.text
            finally:
                os.killpg(front.pid, signal.SIGKILL)
                front.wait(10)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
