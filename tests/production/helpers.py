"""Shared tools of the production tests: real server processes, in-thread servers, nginx, SSE parsing.

- :func:`tiny_model`: a random 2-layer Llama over the test tokenizer with a 16k context (fast steps,
  long streams possible), saved once per session.
- :func:`start_server`: ``python -m proxy serve`` in a subprocess on a free port, log captured.
- :func:`thread_server`: the real app over a scripted :class:`~tests.api.fakes.FakeEngine` in uvicorn
  on a thread (deterministic text, incl. multibyte).
- :func:`start_nginx`: nginx with ``docs/nginx.conf``, ports rewritten, in a temp prefix dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.fakes import make_tiny_model as _make_tiny_model
from api.fakes import thread_server  # noqa: F401  (re-exported for the production tests)

from proxy.ports import free_port

REPO = Path(__file__).resolve().parents[2]
NGINX_CONF = REPO / "docs" / "nginx.conf"
TINY = "tiny"



def make_tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama over ``make_hf_tokenizer()`` with 16384 positions; returns ``folder``."""
    return _make_tiny_model(folder, max_positions=16384)


TINY_ARGS = ["--served-model-name", TINY, "--max-model-len", "16384", "--num-kv-blocks", "4200",
             "--num-threads", "1", "--device", "cpu", "--dtype", "float32"]


def tiny_settings(model_dir: Path, **kw: Any) -> Any:
    from proxy.settings import Settings

    base = {"model": str(model_dir), "served_model_name": TINY, "max_model_len": 16384, "num_kv_blocks": 4200,
            "num_threads": 1, "device": "cpu", "dtype": "float32"}
    return Settings(**{**base, **kw})


# ----------------------------------------------------------------------------- subprocess server


@dataclass
class Proc:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_server(tmp: Path, args: list[str], env: dict[str, str] | None = None,
                 timeout_s: float = 600.0, name: str = "server", new_session: bool = False) -> Proc:
    """Start ``python -m proxy serve ARGS --port <free>`` and wait for ``/health`` 200.

    ``new_session``: the server leads its own session and process group (pgid = its pid), so a test
    can signal the whole group (``os.killpg``) as a terminal's Ctrl-C or a supervisor does."""
    port = free_port()
    log_path = tmp / f"{name}.log"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "wb") as log:  # the server writes through its own copy
        process = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--port", str(port), *args],
                                   cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=new_session)
    proc = Proc(process, port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{proc.log()[-3000:]}")
        try:
            if httpx.get(f"{proc.base_url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"server not healthy after {timeout_s} s:\n{proc.log()[-3000:]}")


# ----------------------------------------------------------------------------- in-thread server


# ----------------------------------------------------------------------------- nginx


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path is None:
        pytest.skip("nginx is not installed (make setup installs nginx-light when run as root)")
    return path


def nginx_config(listen_port: int, upstream_ports: list[int]) -> str:
    """docs/nginx.conf with its listen port and upstream servers replaced (asserts the shape it expects)."""
    conf = NGINX_CONF.read_text()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+;\s*$", conf, flags=re.MULTILINE)
    assert len(servers) == 2, "docs/nginx.conf should list two upstream replicas"
    replacement = "".join(f"        server 127.0.0.1:{p};\n" for p in upstream_ports)
    conf = re.sub(r"(^\s*server 127\.0\.0\.1:\d+;\s*\n)+", replacement, conf, count=1, flags=re.MULTILINE)
    conf, n = re.subn(r"listen 127\.0\.0\.1:\d+;", f"listen 127.0.0.1:{listen_port};", conf)
    assert n == 1
    return conf


@contextlib.contextmanager
def nginx(tmp: Path, upstream_ports: list[int]) -> Iterator[int]:
    """Run nginx (foreground, ``daemon off``) in prefix ``tmp``; yields its port."""
    binary = nginx_binary()
    port = free_port()
    prefix = tmp / "nginx"
    prefix.mkdir()
    (prefix / "nginx.conf").write_text(nginx_config(port, upstream_ports))
    for p in (tmp, prefix):
        p.chmod(0o755)  # worker processes may run as an unprivileged user
    log = open(prefix / "stderr.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [binary, "-p", str(prefix) + "/", "-c", str(prefix / "nginx.conf"), "-e", "stderr"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                raise RuntimeError("nginx exited: " + (prefix / "stderr.log").read_text())
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        process.send_signal(signal.SIGQUIT)  # graceful stop
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


# ----------------------------------------------------------------------------- SSE


def events(raw: bytes) -> list[bytes]:
    """Every SSE event of ``raw`` (comments included, as ``b": ..."``); asserts ``\\n\\n`` framing."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return raw[:-2].split(b"\n\n")


def data_payloads(raw: bytes) -> list[bytes]:
    out = []
    for e in events(raw):
        if e.startswith(b":"):
            continue
        assert e.startswith(b"data: ") and b"\n" not in e, e[:200]
        out.append(e[6:])
    return out


def chunks_and_done(raw: bytes) -> list[dict]:
    """The JSON chunks of a complete stream; asserts exactly one final ``[DONE]``."""
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1, payloads[-3:]
    return [json.loads(p.decode("utf-8")) for p in payloads[:-1]]


def stream_text(chunks: list[dict], chat: bool = True) -> str:
    if chat:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
