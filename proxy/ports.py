"""A free local TCP port, and a local server started on one and waited for: the servers the
benchmarks and tests start (vLLM's ``get_open_port``; the wait is what its benchmarks' ``wait_for_server``
does).

The wait reads ``/health`` with the standard library (``urllib``) so that serving needs no HTTP
client; every caller gets the same rules: ready at status 200, failed early when the process exits or
``/health`` reports ``failed`` (the load failed; ``proxy.api.state``), stopped and failed
with the log's tail after the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 3000
FAILED_STATES = ("failed",)
"""``/health`` statuses that will not turn into 200 by waiting (a failed load)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that was free a moment ago: bind port 0, read what the OS chose, close.

    Another process may take it before the caller binds it (the usual race of this idiom); the
    callers start one server on it right away.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class ServerFailed(RuntimeError):
    """A started server exited, reported a failed load, or was not ready in time; the message ends
    with the tail of its log."""


def log_tail(log_path: Path) -> str:
    """The last :data:`LOG_TAIL_CHARS` characters of a server log (undecodable bytes replaced)."""
    return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def _get(url: str) -> tuple[int, bytes] | None:
    """``(status, body)`` of a GET, or None when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return None


def wait_ready(process: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float,
               poll_s: float = 0.2) -> None:
    """Poll ``url`` (a server's ``/health``, or any page answering 200 when ready) until it answers 200.

    Raises:
        ServerFailed: the process exited, the page's JSON ``status`` is ``failed`` (then the process
            is stopped), or no 200 came within ``timeout_s`` seconds (the process is stopped).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"{process.args!r} exited with {process.returncode}:\n{log_tail(log_path)}")
        answer = _get(url)
        if answer is not None and answer[0] == 200:
            return
        health = _json_object(answer[1]) if answer is not None else {}
        if health.get("status") in FAILED_STATES:
            stop(process)
            raise ServerFailed(f"the server could not load the model: {health.get('error')}\n"
                               f"{log_tail(log_path)}")
        time.sleep(poll_s)
    stop(process)
    raise ServerFailed(f"{url} not ready after {timeout_s:.0f} s:\n{log_tail(log_path)}")


def _json_object(body: bytes) -> dict[str, object]:
    """``body`` as a JSON object, or ``{}`` when it is not one."""
    with contextlib.suppress(ValueError):
        value = json.loads(body)
        if isinstance(value, dict):
            return value
    return {}


def stop(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int | None:
    """SIGTERM (to the whole process group when the process leads its own session), wait
    ``timeout_s`` seconds, then SIGKILL; returns the exit status."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait_s)
    return process.returncode


@dataclass
class LocalServer:
    """A ``python -m proxy serve`` started by :func:`start_serve`."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return stop(self.process, timeout_s)


def launch(cmd: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
           new_session: bool = False, cwd: Path | None = REPO) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout and stderr into ``log_path``, offline (``HF_HUB_OFFLINE=1``) and with
    the tokenizers' thread pool off, ``env`` on top of this process's environment."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "wb") as log:  # the child writes through its own copy
        return subprocess.Popen(list(cmd), cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=new_session)


def start_serve(args: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                timeout_s: float = 600.0, new_session: bool = False) -> LocalServer:
    """``python -m proxy serve ARGS --port <free>`` from this checkout, waited for until ``/health``
    is 200.

    ``new_session``: the server leads its own session and process group (pgid = its pid), so a
    caller can signal the whole group (``os.killpg``) as a terminal's Ctrl-C or a supervisor does.

    Raises:
        ServerFailed: as :func:`wait_ready`.
    """
    port = free_port()
    process = launch([sys.executable, "-m", "proxy", "serve", "--port", str(port), *args], log_path,
                     env, new_session)
    server = LocalServer(process, port, log_path)
    wait_ready(process, f"{server.base_url}/health", log_path, timeout_s)
    return server


@contextlib.contextmanager
def started(cmd: Sequence[str], ready_url: str, log_path: Path, timeout_s: float = 900.0,
            cwd: Path | None = REPO) -> Iterator[subprocess.Popen[bytes]]:
    """Any server command (a peer, a router, nginx) in its own session, ready when ``ready_url``
    answers 200, stopped with its whole process group on exit.

    Raises:
        ServerFailed: as :func:`wait_ready`.
    """
    process = launch(cmd, log_path, new_session=True, cwd=cwd)
    try:
        wait_ready(process, ready_url, log_path, timeout_s)
        yield process
    finally:
        stop(process, 30.0)
