"""``--engine-process``: the engine core in a child process of a real server (``proxy.engine.core_proc``).

Killing the child with SIGKILL mid-stream ends the open stream with an error event and ``[DONE]``
within one second, ``/health`` answers 503 (``dead``) while a new child loads, then the server serves
again and ``streamproxy:engine_restarts_total`` is 1. SIGTERM still drains and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .helpers import TINY, TINY_ARGS, chunks_and_done, make_tiny_model, start_server, stream_text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-engine-proc") / "tiny")


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(child) for child in f.read().split()]
    return out


def engine_child_pid(server_pid: int) -> int:
    """The pid of the server's engine process: the one child of its ``multiprocessing`` fork server
    (``proxy.engine.core_proc.lifecycle``; not the resource tracker)."""
    found = []
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as c:
            if b"forkserver" in c.read():
                found += _children(pid)
    assert len(found) == 1, found
    return found[0]


def test_sigkill_of_the_engine_process_ends_streams_and_restarts(model_dir: Path, tmp_path: Path):
    proc = start_server(tmp_path, ["--model", str(model_dir), *TINY_ARGS, "--engine-process"])
    try:
        url = f"{proc.base_url}/v1/completions"
        fresh = httpx.get(f"{proc.base_url}/health", timeout=10).json()  # before any step
        assert fresh["num_total_blocks"] > 0 and fresh["num_free_blocks"] == fresh["num_total_blocks"]
        body = {"model": TINY, "prompt": "Hello", "temperature": 0, "ignore_eos": True}
        reference = httpx.post(url, json={**body, "max_tokens": 20}, timeout=60).json()["choices"][0]["text"]
        child = engine_child_pid(proc.process.pid)
        out: dict = {}
        first = threading.Event()

        def run() -> None:
            raw = b""
            long_body = {**body, "max_tokens": 16000, "stream": True}
            with httpx.stream("POST", url, json=long_body, timeout=60) as r:
                for piece in r.iter_raw():
                    raw += piece
                    if b'"text"' in raw:
                        first.set()
            out["raw"], out["t_end"] = raw, time.monotonic()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert first.wait(30)
        t_kill = time.monotonic()
        os.kill(child, signal.SIGKILL)
        thread.join(30)
        health = httpx.get(f"{proc.base_url}/health", timeout=10)

        chunks = chunks_and_done(out["raw"])
        assert out["t_end"] - t_kill < 1.0
        err = chunks[-1]["error"]
        assert err["type"] == "server_error" and "engine process died (killed by signal 9)" in err["message"]
        assert len(stream_text(chunks[:-1], chat=False)) > 0  # it was mid-stream
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert health.json()["num_running"] == 0 and health.json()["num_waiting"] == 0  # it ended them
        refused = httpx.post(url, json={**body, "max_tokens": 5}, timeout=60)
        assert refused.status_code == 503

        deadline = time.monotonic() + 300
        while httpx.get(f"{proc.base_url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.1)
        assert engine_child_pid(proc.process.pid) != child
        restarted = httpx.get(f"{proc.base_url}/health", timeout=10).json()
        assert restarted["num_free_blocks"] == restarted["num_total_blocks"] == fresh["num_total_blocks"]
        again = httpx.post(url, json={**body, "max_tokens": 20}, timeout=60).json()["choices"][0]["text"]
        assert again == reference  # the new engine serves the same greedy text
        metrics = httpx.get(f"{proc.base_url}/metrics", timeout=10).text
        assert f'streamproxy:engine_restarts_total{{model_name="{TINY}"}} 1.0' in metrics
        log = proc.log()
        assert "engine process died (killed by signal 9)" in log and "engine process restarted" in log
    finally:
        code = proc.stop()
    assert code == 0, proc.log()[-3000:]


def test_load_failure_in_the_engine_process_is_reported(tmp_path: Path):
    from proxy.engine.core_proc.proc_client import EngineProcClient
    from proxy.models import ModelLoadError
    from proxy.settings import Settings

    with pytest.raises(ModelLoadError, match="failed to load the model"):
        EngineProcClient(Settings(model=str(tmp_path / "missing"), device="cpu", engine_process=True))


def test_engine_process_reports_the_openmp_wait_policy_of_its_environment(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The child runs torch with the environment's ``OMP_WAIT_POLICY`` and sets none itself ("":
    libgomp's default spin, which made batch-1 decode 2x faster than PASSIVE on an idle machine)."""
    from proxy.engine.core_proc.proc_client import EngineProcClient

    from .helpers import tiny_settings

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    client = EngineProcClient(tiny_settings(model_dir, engine_process=True, self_check=False))
    try:
        assert client.info.omp_wait_policy == ""
    finally:
        client.shutdown()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    client = EngineProcClient(tiny_settings(model_dir, engine_process=True, self_check=False))
    try:
        assert client.info.omp_wait_policy == "PASSIVE"
    finally:
        client.shutdown()


def test_an_on_demand_load_runs_at_nice_19_and_the_serving_thread_keeps_its_priority(model_dir: Path):
    """A several-model server's load yields the cores (``ON_DEMAND_LOAD_NICE``) on a thread of the child
    that ends with it; the child's main thread, which steps the engine, keeps the priority it started
    with (this thread's, which spawned it). ``test_multi_model`` serves from such loads."""
    from proxy.engine.core_proc.proc_client import EngineProcClient
    from proxy.engine.factory import ON_DEMAND_LOAD_NICE
    from proxy.threads import thread_nice

    from .helpers import tiny_settings

    start = thread_nice()
    if start >= ON_DEMAND_LOAD_NICE:
        pytest.skip("the tests already run at the lowest priority")
    settings = tiny_settings(model_dir, engine_process=True, self_check=False)
    client = EngineProcClient(settings, ON_DEMAND_LOAD_NICE)
    try:
        assert (client.info.load_nice, client.info.serve_nice) == (19, start)
        assert client.pid is not None
        assert os.getpriority(os.PRIO_PROCESS, client.pid) == start  # the child's main thread

        async def reserve() -> None:
            client.start(lambda outputs: None)  # the step messages are read (the acknowledgement)
            assert client.cores_reserved()
            client.reserve_cores(1)  # a later load beside it (proxy.api.multi)
            deadline = time.monotonic() + 20
            while not client.cores_reserved():  # the idle child applies it at once and says so
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

        asyncio.run(reserve())
    finally:
        client.shutdown()


def test_engine_process_flag_and_default():
    from proxy.cli import build_parser, settings_from
    from proxy.engine.factory import use_engine_process

    parser = build_parser()
    on = settings_from(parser.parse_args(["serve", "--engine-process"]), {})
    off = settings_from(parser.parse_args(["serve", "--no-engine-process"]), {})
    default = settings_from(parser.parse_args(["serve"]), {})
    env = settings_from(parser.parse_args(["serve"]), {"STREAMPROXY_ENGINE_PROCESS": "1"})
    modes = (on.engine_process, off.engine_process, default.engine_process, env.engine_process)
    assert modes == (True, False, None, True)
    assert use_engine_process(on) and not use_engine_process(off)
    assert not use_engine_process(default.__class__(device="cpu"))
    assert use_engine_process(default.__class__(device="cuda"))


def test_sigterm_to_the_process_group_drains_without_a_restart(model_dir: Path, tmp_path: Path):
    """SIGTERM to the whole process group (a terminal, ``kill -TERM -PGID``, a supervisor's control
    group) reaches the engine process too: it ignores it (the API process owns shutdown), the open
    stream finishes within the grace period, the server exits 0 in time, and nothing restarts."""
    grace = 15.0  # long enough for the stream on a busy machine; the exit does not wait for it
    proc = start_server(tmp_path, ["--model", str(model_dir), *TINY_ARGS, "--engine-process",
                                   "--shutdown-grace-s", str(grace)], new_session=True)
    url = f"{proc.base_url}/v1/completions"
    body = {"model": TINY, "prompt": "Hello", "temperature": 0, "ignore_eos": True}
    try:
        reference = httpx.post(url, json={**body, "max_tokens": 100}, timeout=60).json()["choices"][0]["text"]
        child = engine_child_pid(proc.process.pid)
        out: dict = {}
        first = threading.Event()

        def run() -> None:
            raw = b""
            with httpx.stream("POST", url, json={**body, "max_tokens": 100, "stream": True}, timeout=60) as r:
                for piece in r.iter_raw():
                    raw += piece
                    if b'"text"' in raw:
                        first.set()
            out["raw"] = raw

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert first.wait(30)
        t_term = time.monotonic()
        assert "raw" not in out  # still streaming
        os.killpg(proc.process.pid, signal.SIGTERM)  # the server leads its group: the child gets it too
        thread.join(30)
        code = proc.process.wait(grace + 30)
        t_exit = time.monotonic()
    finally:
        proc.stop()
    log = proc.log()
    assert code == 0, log[-3000:]
    assert t_exit - t_term < grace + 10, log[-3000:]
    chunks = chunks_and_done(out["raw"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert stream_text(chunks, chat=False) == reference  # drained: the stream finished whole
    assert "died" not in log and "restart" not in log and "Traceback" not in log, log[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the engine process is gone too


def test_engine_process_dying_while_draining_is_not_restarted(model_dir: Path, tmp_path: Path):
    """The child dies (SIGKILL) after shutdown began: the open stream ends with an error event and
    ``[DONE]``, no new child is started, and the server exits 0 at once (not after the grace period
    or a model load)."""
    grace = 60.0
    proc = start_server(tmp_path, ["--model", str(model_dir), *TINY_ARGS, "--engine-process",
                                   "--shutdown-grace-s", str(grace)])
    url = f"{proc.base_url}/v1/completions"
    body = {"model": TINY, "prompt": "Hello", "temperature": 0, "ignore_eos": True, "max_tokens": 16000,
            "stream": True}
    try:
        child = engine_child_pid(proc.process.pid)
        out: dict = {}
        first = threading.Event()

        def run() -> None:
            raw = b""
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                for piece in r.iter_raw():
                    raw += piece
                    if b'"text"' in raw:
                        first.set()
            out["raw"] = raw

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert first.wait(30)
        proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "shutting down: no new requests" not in proc.log():
            assert time.monotonic() < deadline, proc.log()[-3000:]
            time.sleep(0.05)
        t_kill = time.monotonic()
        os.kill(child, signal.SIGKILL)
        thread.join(30)
        code = proc.process.wait(30)
        t_exit = time.monotonic()
    finally:
        proc.stop()
    log = proc.log()
    assert code == 0, log[-3000:]
    assert t_exit - t_kill < 15, log[-3000:]  # not the 60 s grace period
    chunks = chunks_and_done(out["raw"])
    err = chunks[-1]["error"]
    assert "engine process died (killed by signal 9); the server is shutting down" in err["message"]
    assert log.count("engine process started") == 1 and "restart" not in log, log[-3000:]


def test_grammars_are_compiled_once_in_the_engine_process(model_dir: Path, capfd: pytest.CaptureFixture[str]):
    """In process mode the API process has no grammar compiler: ``prepare_structured_output`` has the
    child compile (a refused spec is still an InvalidRequestError naming the param, before
    ``generate``), and the request then finds the grammar in the child's cache (no compile on its
    engine loop) and follows it."""
    import asyncio

    from proxy.engine.core_proc.grammar import ChildGrammarCompiler
    from proxy.engine.factory import build_engine_client
    from proxy.errors import InvalidRequestError
    from proxy.sampling import SamplingParams, StructuredOutputParams

    from .helpers import tiny_settings

    client = build_engine_client(tiny_settings(model_dir, engine_process=True, self_check=False))

    async def main() -> str:
        client.start()
        try:
            with pytest.raises(InvalidRequestError) as refused:
                bad = StructuredOutputParams("regex", "(unclosed")
                await client.prepare_structured_output(bad, "guided_regex")
            assert refused.value.param == "guided_regex" and "guided_regex" in refused.value.message
            so = StructuredOutputParams("choice", '["yes", "no"]')
            await client.prepare_structured_output(so, "guided_choice")
            params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, structured_outputs=so)
            text = ""
            async for deltas in client.generate(client.tokenizer.encode("Hello"), params):
                text += "".join(d.text for d in deltas)
            return text
        finally:
            client.shutdown()

    assert isinstance(client.grammar_compiler, ChildGrammarCompiler)
    assert asyncio.run(main()) in ("yes", "no")
    assert "grammar compiled on the engine thread" not in capfd.readouterr().err


def test_a_dead_engine_says_whether_retrying_here_can_help():
    """Restarting: retry shortly; a restart that failed: this replica stays down (send the request
    elsewhere); shutting down: not running."""
    from proxy.engine.core_proc.proc_client import ClientState, EngineProcClient

    client = EngineProcClient.__new__(EngineProcClient)  # no child: only the state is read
    client._draining = False
    client._state = ClientState.RESTARTING
    assert client._down_message() == "the engine process is restarting; retry shortly"
    client._state = ClientState.DEAD
    assert "could not be restarted" in client._down_message() and "retry" not in client._down_message()
    client._draining = True
    assert "shutting down" in client._down_message()


def _modules_of_a_child(conn: Any) -> None:
    import sys

    names = ("torch", "transformers.modeling_utils", "proxy.engine.loading", "proxy.engine.core",
             "torch._inductor.codecache")
    found = {name: name in sys.modules for name in names}
    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    found["vec_isa_probed"] = isa is not None and isa.valid_vec_isa_list.cache_info().currsize == 1
    conn.send(found)
    conn.close()


def _wait_for_eof(conn: Any) -> None:
    with contextlib.suppress(EOFError):
        conn.recv()


def test_the_fork_server_preloads_a_loads_imports_and_is_replaced_when_their_environment_changes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """Engine processes are forked with torch, transformers' modeling code, the engine and inductor's
    loading side imported, its vector-ISA probe done (``proxy.engine.core_proc.fork_server``: a load
    beside serving models starts at once, a saved decode step loads without the probe); a change of
    a variable those imports read replaces the fork server when no engine process runs, and is only
    warned about while one does (its exit status travels through the fork server)."""
    from multiprocessing import forkserver

    from proxy.engine.core_proc import lifecycle

    server: Any = forkserver._forkserver
    lifecycle.start_fork_server()
    first = server._forkserver_pid
    ours, theirs = lifecycle._MP.Pipe()
    child = lifecycle._MP.Process(target=_modules_of_a_child, args=(theirs,))
    child.start()
    theirs.close()
    assert ours.recv() == {"torch": True, "transformers.modeling_utils": True, "proxy.engine.loading": True,
                           "proxy.engine.core": True, "torch._inductor.codecache": True,
                           "vec_isa_probed": True}
    child.join(30)
    policy = "ACTIVE" if os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" else "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    lifecycle.start_fork_server()
    second = server._forkserver_pid
    assert second not in (None, first)
    ours, theirs = lifecycle._MP.Pipe()
    holder = lifecycle._MP.Process(target=_wait_for_eof, args=(theirs,))
    holder.start()
    theirs.close()
    lifecycle._track(holder)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE" if policy == "PASSIVE" else "PASSIVE")
        with caplog.at_level("WARNING", logger="proxy.engine.core_proc.lifecycle"):
            lifecycle.start_fork_server()
        assert server._forkserver_pid == second
        assert "(OMP_WAIT_POLICY); kept while its engine processes run" in caplog.text
    finally:
        ours.close()
        holder.join(30)
        lifecycle.untrack(holder)
