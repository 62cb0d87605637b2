"""proxy/ports.py: the one start-and-wait of the servers the tests and benchmarks start.

Each rule is checked against a small stand-in server (``python -c``), so no model is loaded: ready at
200, failed at once when the process exits or ``/health`` says ``failed`` (and then stopped), stopped
after the timeout, and a whole process group stopped when the server leads its own session.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from proxy.ports import ServerFailed, free_port, launch, started, stop, wait_ready

STAND_IN = """
import http.server, json, sys, time
status, body, delay = int(sys.argv[2]), sys.argv[3].encode(), float(sys.argv[4])
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(status); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        print("GET", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def stand_in(port: int, status: int, body: str, delay_s: float = 0.0) -> list[str]:
    return [sys.executable, "-c", STAND_IN, str(port), str(status), body, str(delay_s)]


def test_ready_at_200_after_the_port_opens(tmp_path: Path):
    port = free_port()
    process = launch(stand_in(port, 200, '{"status": "ready"}', 0.5), tmp_path / "s.log")
    try:
        wait_ready(process, f"http://127.0.0.1:{port}/health", tmp_path / "s.log", 30)
        assert process.poll() is None
        assert "GET" in (tmp_path / "s.log").read_text()
    finally:
        assert stop(process) is not None


def test_a_failed_load_fails_at_once_and_stops_the_server(tmp_path: Path):
    port = free_port()
    process = launch(stand_in(port, 503, '{"status": "failed", "error": "no such model: m"}'),
                     tmp_path / "s.log")
    start = time.monotonic()
    with pytest.raises(ServerFailed, match="could not load the model: no such model: m"):
        wait_ready(process, f"http://127.0.0.1:{port}/health", tmp_path / "s.log", 60)
    assert time.monotonic() - start < 30  # not the timeout
    assert process.poll() is not None


def test_an_exited_server_fails_with_its_log(tmp_path: Path):
    process = launch([sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
                     tmp_path / "s.log")
    with pytest.raises(ServerFailed, match=r"exited with 3:\nboom: bad flag"):
        wait_ready(process, f"http://127.0.0.1:{free_port()}/health", tmp_path / "s.log", 60)


def test_loading_until_the_timeout_then_stopped(tmp_path: Path):
    port = free_port()
    process = launch(stand_in(port, 503, '{"status": "loading"}'), tmp_path / "s.log")
    with pytest.raises(ServerFailed, match="not ready after 2 s"):
        wait_ready(process, f"http://127.0.0.1:{port}/health", tmp_path / "s.log", 2)
    assert process.poll() is not None


def test_started_stops_the_whole_process_group(tmp_path: Path):
    port = free_port()
    child_pid = tmp_path / "child.pid"
    script = (f"import subprocess, sys; p = subprocess.Popen({stand_in(port, 200, 'ok')!r}); "
              f"open({str(child_pid)!r}, 'w').write(str(p.pid)); p.wait()")
    with started([sys.executable, "-c", script], f"http://127.0.0.1:{port}/", tmp_path / "s.log", 30) as p:
        assert p.poll() is None
        pid = int(child_pid.read_text())
    assert p.poll() is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail("the server's child outlived the group stop")
