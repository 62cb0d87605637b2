"""Several models in one server (issue 48): a stream's inter-token gaps while another model loads, the
load and unload times, and the resident memory with none, one and two models loaded and after unloading.

Per mode (``--modes``, default ``process,thread``: each engine in its own child process, the default
with several models, or ``--no-engine-process``: engines on threads of the server process, the peer run)
one ``python -m proxy serve --model F=A --model F=B`` is started on a free port (the same folder ``F``
twice under two ids, or B from ``--model-b``; default: the default model's GGUF, ``--no-compile-decode``
so no start compiles). Then: ``POST /models/load A``; a greedy stream on A (``ignore_eos``) whose chunk
arrival times are recorded; once ``--warm-chunks`` chunks came, ``POST /models/load B`` runs beside it;
the stream is closed ``--after-chunks`` chunks after the load returned. Gaps are the differences of
consecutive arrival times: ``before`` (all before the load started) and ``during`` (those that end
within the load). RSS is ``VmRSS`` summed over the server and its descendants (an engine process
included), read after each step.

Printed per mode, one JSON line: the load and unload seconds, ``tpot_ms`` (median gap before the
load), ``max_gap_during_ms``, ``p99_gap_during_ms``, ``max_gap_ratio`` (max during / median before:
the issue's target is at most 2; with ``--control-s S`` the same figures over S seconds of the stream
without a load: what the machine and the engine give alone), ``max_gap_at_s`` (when the largest gap
ended: seconds after the load began, and before it returned), ``median_gap_ratio`` (median during /
median before), ``stream_outlived_load`` (False: the stream of ``--max-tokens`` ended before the
load did, and the gaps miss the load's end: a load starved by the stream reads so), the nice
value B loaded at (``load_nice``, from the engine process's ready line; None in thread mode) and
the RSS in MB; then the process / thread ratio of the max gap. With ``--same-positions`` (the
default) the same greedy stream runs again after the load, on A alone: ``tpot_same_positions_ms`` is
its median gap over the positions the load's gaps had (a stream slows as its context grows, so the
median of the first chunks understates the pace there), ``max_gap_ratio_same_positions`` the load's
largest gap over it (the issue's "keep their pace": at most 2) and ``control_max_ratio_same_positions``
the same stream's own largest gap there over it (what the machine gives without a load).

Usage: ``python bench/models_bench.py [--model F] [--modes process,thread] [--json out.json]
[--gil-watch PATH]`` (the server under ``bench/gil_watch.py``: the holds, collections and long
event-loop callbacks that ended during B's load, with their stacks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rss_bench import status_mb

from proxy.ports import REPO, LocalServer, free_port, launch, start_serve, wait_ready


def rss_mb(pid: int) -> float:
    """``VmRSS`` (MB) summed over ``pid`` and its descendants."""
    return round(status_mb(pid, "VmRSS"), 1)


def default_folder() -> str:
    """The default model's GGUF (its cached folder holds no weights, issue 46)."""
    from proxy.models import default_gguf_path

    return str(default_gguf_path())


def _stream(base: str, arrivals: list[float], stop: threading.Event, max_tokens: int) -> None:
    body = {"model": "A", "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:  # e.g. max_tokens over --max-model-len: say so, do not wait for chunks
            reply.read()
            print(f"the stream on A was refused: {reply.status_code} {reply.text}", file=sys.stderr)
            return
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
            if stop.is_set():
                return


def _load_nice(log: Path) -> int | None:
    """The nice value B's engine process loaded at, from its ready line (None: not logged there)."""
    found = re.findall(r"loaded at nice (-?\d+)", log.read_text(errors="replace"))
    return int(found[-1]) if found else None


def _serve(serve_args: list[str], log: Path, watch: Path | None) -> LocalServer:
    """The server, under ``bench/gil_watch.py`` writing to ``watch`` when given."""
    if watch is None:
        return start_serve(serve_args, log)
    watch.unlink(missing_ok=True)
    port = free_port()
    process = launch([sys.executable, str(REPO / "bench" / "gil_watch.py"), str(watch), "serve", "--port",
                      str(port), *serve_args], log)
    server = LocalServer(process, port, log)
    wait_ready(process, f"{server.base_url}/health", log, 600.0)
    return server


def watched(watch: Path, t0: float, t1: float, top: int = 6) -> dict[str, Any]:
    """The watch's events (``bench/gil_watch.py``) that ended within the load: per kind the ``top``
    longest (holds by their lock wait, ``gil_ms``), each with the innermost frames that explain it."""
    events = [json.loads(line) for line in watch.read_text().splitlines() if line.strip()]
    during = [e for e in events if t0 <= e["t"] <= t1]
    out: dict[str, Any] = {}
    fields = ("ms", "gil_ms", "runqueue_ms", "generation", "callback")
    for kind in ("hold", "gc", "callback"):
        mine = sorted((e for e in during if e["kind"] == kind), key=lambda e: -(e.get("gil_ms") or e["ms"]))
        out[kind] = [{k: v for k, v in e.items() if k in fields}
                     | {"where": {name: frames[-4:] for name, frames in e.get("stacks", {}).items()}
                        or (e.get("stack") or [])[-4:]} for e in mine[:top]]
    return out


def pace_at_positions(arrivals: list[float], first: int, end: int, max_during: float) -> dict[str, Any]:
    """The figures of a control stream (no load): ``arrivals`` its chunk times (s), ``first:end`` the
    gap indices the load's gaps had, ``max_during`` the load's largest gap (s). Empty when the control
    has none of those gaps. ``tpot_same_positions_ms`` is the control's median gap there (ms),
    ``max_gap_ratio_same_positions`` the load's largest gap over it, ``control_max_ratio_same_positions``
    the control's own largest gap there over it."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)][first:end]
    if not gaps:
        return {}
    tpot = statistics.median(gaps)
    return {"tpot_same_positions_ms": round(tpot * 1000, 1),
            "max_gap_same_positions_ms": round(max(gaps) * 1000, 1),
            "max_gap_ratio_same_positions": round(max_during / tpot, 2),
            "control_max_ratio_same_positions": round(max(gaps) / tpot, 2)}


def same_positions(base: str, max_tokens: int, first: int, end: int, max_during: float) -> dict[str, Any]:
    """The pace the stream keeps without a load: the same greedy stream again on A alone (B loaded and
    idle), read by :func:`pace_at_positions` over the gaps ``first:end``. A stream slows as its context
    grows, so the median of the first chunks (``tpot_ms``) understates the pace at those positions."""
    arrivals: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=_stream, args=(base, arrivals, stop, max_tokens))
    streamer.start()
    while len(arrivals) < end + 1 and streamer.is_alive():
        time.sleep(0.01)
    stop.set()
    streamer.join(600)
    return pace_at_positions(arrivals, first, end, max_during)


def run_mode(mode: str, folder: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    # no memory budget: on a machine short of memory it would hold B's load until A's stream ended
    watch = Path(args.gil_watch).with_suffix(f".{mode}.jsonl") if args.gil_watch else None
    server = _serve(["--model", f"{folder}=A", "--model", f"{args.model_b or folder}=B", "--models-max", "2",
                     "--models-memory-bytes", "0", "--no-compile-decode",
                     "--max-model-len", str(args.max_model_len), *args.serve_arg,
                     "--engine-process" if mode == "process" else "--no-engine-process"],
                    log_dir / f"models-{mode}.log", watch)
    proc, base = server.process, server.base_url
    try:
        out: dict[str, Any] = {"mode": mode, "rss_none_mb": rss_mb(proc.pid)}
        start = time.monotonic()
        httpx.post(f"{base}/models/load", json={"model": "A"}, timeout=600).raise_for_status()
        out["load_a_s"] = round(time.monotonic() - start, 2)
        out["rss_one_mb"] = rss_mb(proc.pid)
        arrivals: list[float] = []
        stop = threading.Event()
        streamer = threading.Thread(target=_stream, args=(base, arrivals, stop, args.max_tokens))
        streamer.start()
        while len(arrivals) < args.warm_chunks:
            if not streamer.is_alive():
                raise SystemExit(f"the stream on A ended after {len(arrivals)} chunks, before the load")
            time.sleep(0.01)
        client = httpx.Client(timeout=600)  # made before the load: a client's own start-up is not the load's
        t0 = time.monotonic()
        if args.control_s:  # the control: the same stream, no load, as long
            time.sleep(args.control_s)
        else:
            client.post(f"{base}/models/load", json={"model": "B"}).raise_for_status()
        t1 = time.monotonic()
        outlived = streamer.is_alive()  # False: the stream ended first, "during" missed the load's end
        mark = len(arrivals)
        while len(arrivals) < mark + args.after_chunks and streamer.is_alive():
            time.sleep(0.01)
        stop.set()
        streamer.join(600)
        out["load_b_during_stream_s"] = round(t1 - t0, 2)
        out["stream_outlived_load"] = outlived
        gaps = [(b - a, b) for a, b in itertools.pairwise(arrivals)]
        before = [g for g, end in gaps if end < t0]
        during = sorted(g for g, end in gaps if t0 <= end <= t1 + 0.001)
        tpot = statistics.median(before)
        out["chunks_during_load"] = len(during)
        out["tpot_ms"] = round(tpot * 1000, 1)
        out["max_gap_before_ms"] = round(max(before) * 1000, 1)
        out["max_gap_during_ms"] = round(max(during) * 1000, 1) if during else None
        if during:  # where in the load the largest gap ended
            end = max((g, e) for g, e in gaps if t0 <= e <= t1 + 0.001)[1]
            out["max_gap_at_s"] = [round(end - t0, 2), round(t1 - end, 2)]
        out["p99_gap_during_ms"] = round(during[int(0.99 * (len(during) - 1))] * 1000, 1) if during else None
        out["max_gap_ratio"] = round(max(during) / tpot, 2) if during else None
        out["median_gap_during_ms"] = round(statistics.median(during) * 1000, 1) if during else None
        out["median_gap_ratio"] = round(statistics.median(during) / tpot, 2) if during else None
        out["load_nice"] = _load_nice(log_dir / f"models-{mode}.log")
        out["rss_two_mb"] = rss_mb(proc.pid)
        if watch is not None:
            out["watched_during_load"] = watched(watch, t0, t1)
        if args.arrivals:  # the chunks' wall-clock times, to set beside the server log's timestamps
            shift = time.time() - time.monotonic()
            Path(args.arrivals).with_suffix(f".{mode}.json").write_text(json.dumps(
                {"load": [t0 + shift, t1 + shift], "arrivals": [a + shift for a in arrivals]}))
        if during and args.same_positions and not args.control_s:
            first = next(i for i, (_, end) in enumerate(gaps) if end >= t0)
            out |= same_positions(base, args.max_tokens, first, first + len(during), max(during))
        for name in ("B", "A"):
            start = time.monotonic()
            httpx.post(f"{base}/models/unload", json={"model": name}, timeout=600).raise_for_status()
            out[f"unload_{name.lower()}_s"] = round(time.monotonic() - start, 2)
            time.sleep(1.0)  # the child's exit is reaped
            out[f"rss_after_unload_{name.lower()}_mb"] = rss_mb(proc.pid)
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="HF folder or GGUF served as A and B (default: the default)")
    parser.add_argument("--model-b", default=None,
                        help="what B serves (default: --model's; another folder, or a symlink to the same "
                             "GGUF under another name, makes B a model of its own files)")
    parser.add_argument("--modes", default="process,thread")
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--control-s", type=float, default=0.0,
                        help="no load: the gaps of the stream over this many seconds instead (the control; "
                             "B is then not loaded and the unload of B is a no-op)")
    parser.add_argument("--warm-chunks", type=int, default=30)
    parser.add_argument("--after-chunks", type=int, default=20)
    parser.add_argument("--same-positions", action=argparse.BooleanOptionalAction, default=True,
                        help="after the load, the same stream again without one: its median gap over the "
                             "positions of the load's gaps (tpot_same_positions_ms) and the ratio of the "
                             "load's largest gap to it (max_gap_ratio_same_positions)")
    parser.add_argument("--arrivals", default=None, metavar="PATH",
                        help="write the stream's chunk times (wall clock) and the load's to PATH.<mode>.json")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of the server's command line (repeat: "
                             "--serve-arg=--num-kv-blocks --serve-arg=256)")
    parser.add_argument("--gil-watch", default=None, metavar="PATH",
                        help="run the server under bench/gil_watch.py (events in PATH.<mode>.jsonl) and "
                             "print the events of B's load")
    args = parser.parse_args(argv)
    folder = args.model or default_folder()
    results = [run_mode(mode, folder, args, Path(args.log_dir)) for mode in args.modes.split(",")]
    for r in results:
        print(json.dumps(r))
    by_mode = {r["mode"]: r for r in results}
    if "process" in by_mode and "thread" in by_mode and by_mode["thread"]["max_gap_during_ms"]:
        ratio = by_mode["process"]["max_gap_during_ms"] / by_mode["thread"]["max_gap_during_ms"]
        print(json.dumps({"max_gap_during_process_over_thread": round(ratio, 2)}))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
