"""One real ``python -m proxy serve`` (default model) per test process, started on first use.

Tests get it through the ``server`` fixture (tests/e2e/conftest.py, tests/test_cases.py). It listens
on a free port of 127.0.0.1; the process is stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxy.ports import start_serve

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600.0  # the first run converts the GGUF once; later starts take seconds


@dataclass
class Server:
    base_url: str
    port: int
    model: str
    max_model_len: int
    process: subprocess.Popen
    log_path: Path

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


_SERVERS: dict[bool, Server] = {}



def get_server(tmp_dir: Path, engine_process: bool = False) -> Server:
    """Start the server once per engine mode (or return the running one); waits for /health 200."""
    running = _SERVERS.get(engine_process)
    if running is not None and running.process.poll() is None:
        return running
    started = start_serve(["--num-threads", "2", "--max-num-seqs", "16", "--kv-cache-bytes", str(256 << 20),
                           "--engine-process" if engine_process else "--no-engine-process"],
                          tmp_dir / "server.log", timeout_s=STARTUP_TIMEOUT_S)
    atexit.register(started.stop, 15.0)
    card = httpx.get(f"{started.base_url}/v1/models", timeout=10).json()["data"][0]
    _SERVERS[engine_process] = server = Server(
        started.base_url, started.port, card["id"], card["max_model_len"], started.process, started.log_path
    )
    return server


def sse_payloads(raw: bytes) -> list[bytes]:
    """Event payloads of an SSE body; asserts the exact ``data: <one line>\\n\\n`` framing."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    out = []
    for event in raw[:-2].split(b"\n\n"):
        if event.startswith(b":"):
            continue
        assert event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event, event[:200]
        out.append(event[6:])
    return out


def sse_chunks(raw: bytes) -> list[dict]:
    """JSON chunks of a complete stream; asserts one final ``[DONE]`` and strict UTF-8 JSON."""
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1
    chunks = []
    for p in payloads[:-1]:
        text = p.decode("utf-8")  # strict
        obj = json.loads(text)
        assert "\\ud8" not in text.lower() and "\\udc" not in text.lower()  # no lone surrogate escapes
        chunks.append(obj)
    return chunks
