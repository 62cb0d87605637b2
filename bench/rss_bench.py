"""Peak resident memory of a real server with the default model: load, then one generation.

Per configuration (``--configs``, default ``none,auto``: dense, and the default, the shipped Q4_1
GGUF at its own precision) one ``python -m proxy serve`` is started on a free port of 127.0.0.1;
once ``/health`` says ready its peak RSS is read (``VmHWM`` of ``/proc/<pid>/status``, summed over
the server and its child processes, e.g. an engine process), then one completion
(``--max-tokens`` tokens) is generated and the peak is read again; the server is then stopped.

Printed per configuration: ``load_mb`` (peak after loading), ``peak_mb`` (peak after the
generation), its ratio against the issue's baseline (``--baseline-mb``, 2000: issue 14's "today",
target at most 0.5) and against the first configuration of the same run. Peak RSS does not depend
on how busy the machine is, unlike the timings of the other benchmarks.

Usage: ``python bench/rss_bench.py [--configs none,auto] [--max-tokens 32] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

from proxy.ports import start_serve

STARTUP_TIMEOUT_S = 600.0



def descendants(pid: int) -> list[int]:
    """``pid`` and all its descendants (from ``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def status_mb(pid: int, key: str = "VmHWM") -> float:
    """``key`` of ``/proc/<pid>/status`` (``VmHWM``: the peak resident set; ``VmRSS``: the resident set
    now), in MB, summed over ``pid`` and its descendants."""
    total_kb = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(f"{key}:"):
                    total_kb += int(line.split()[1])
        except OSError:
            pass
    return total_kb / 1024


def peak_rss_mb(pid: int) -> float:
    """Sum of ``VmHWM`` (peak resident set, MB) over ``pid`` and its descendants."""
    return status_mb(pid, "VmHWM")


def run_one(quantization: str, max_tokens: int, log_dir: Path, extra: list[str]) -> dict[str, float | str]:
    """Start a server with ``--quantization quantization``, measure, stop it."""
    server = start_serve(["--quantization", quantization, *extra], log_dir / f"rss_{quantization}.log",
                         timeout_s=STARTUP_TIMEOUT_S, new_session=True)
    proc, base = server.process, server.base_url
    try:
        load_mb = peak_rss_mb(proc.pid)
        models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
        body = {"model": models["id"], "prompt": "The capital of France is", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        resp.raise_for_status()
        peak_mb = peak_rss_mb(proc.pid)
        served = str(models.get("quantization", quantization))
    finally:
        server.stop()
    return {"config": quantization, "served": served, "load_mb": load_mb, "peak_mb": peak_mb,
            "tokens": resp.json()["usage"]["completion_tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="none,auto", help="comma-separated --quantization values")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--baseline-mb", type=float, default=2000.0, help="issue 14's peak RSS today")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--json", default=None)
    parser.add_argument("--server-args", default="", help="more serve flags: '--kv-cache-bytes 67108864'")
    args = parser.parse_args(argv)
    extra = args.server_args.split()
    rows = [run_one(q, args.max_tokens, Path(args.log_dir), extra) for q in args.configs.split(",")]
    first = float(rows[0]["peak_mb"])
    ref = "/" + str(rows[0]["config"])
    print(f"{'config':8s} {'load_mb':>8s} {'peak_mb':>8s} {'/baseline':>9s} {ref:>9s}  tokens  served")
    for r in rows:
        peak = float(r["peak_mb"])
        print(f"{r['config']!s:8s} {float(r['load_mb']):8.0f} {peak:8.0f} "
              f"{peak / args.baseline_mb:9.2f} {peak / first:9.2f}  {r['tokens']!s:>6s}  {r['served']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
