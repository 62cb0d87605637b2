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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.fakes import make_tiny_model as _make_tiny_model
from api.fakes import thread_server  # noqa: F401  (re-exported for the production tests)

from proxy.ports import LocalServer, free_port, start_serve

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


class Proc(LocalServer):
    """A ``python -m proxy serve`` subprocess (:class:`proxy.ports.LocalServer`) with its ``/health``."""

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()


def start_server(tmp: Path, args: list[str], env: dict[str, str] | None = None,
                 timeout_s: float = 600.0, name: str = "server", new_session: bool = False) -> Proc:
    """Start ``python -m proxy serve ARGS --port <free>`` and wait for ``/health`` 200
    (:func:`proxy.ports.start_serve`; its log is ``tmp/<name>.log``)."""
    server = start_serve(args, tmp / f"{name}.log", env, timeout_s, new_session)
    return Proc(server.process, server.port, server.log_path)


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
