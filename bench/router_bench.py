"""Two replicas behind nginx round-robin, ``sglang-router`` and ``vllm-router`` (cache_aware), side by side.

One run starts ``--replicas`` streamproxy replicas of one model, then puts each front in turn before
them and drives it with serve_bench's ``multiturn`` set (unique system prompts, so every
conversation's turn 1 computes its own prefix): prefix-cache hit rate, TTFT of turn 1 and of turns
2+, output throughput, and the ratios of each router to nginx. Fresh conversations per front (other
seeds), so no front reuses another's prefixes. The routers come from the ``router`` extra; nginx
from the system (``docs/nginx.conf`` with ``least_conn`` removed and the ports rewritten).

    .venv/bin/python bench/router_bench.py --model PATH --conversations 8 --concurrency 4 --turns 4

Results: one JSON per front under ``--result-dir`` (serve_bench's format) and ``router_bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench

from proxy.ports import free_port, started

REPO = Path(__file__).resolve().parents[1]


def nginx_conf(listen: int, upstreams: list[int]) -> str:
    conf = (REPO / "docs" / "nginx.conf").read_text()
    conf = re.sub(r"^\s*least_conn;\n", "", conf, flags=re.MULTILINE)
    servers = "".join(f"        server 127.0.0.1:{p};\n" for p in upstreams)
    conf = re.sub(r"(?:^\s*server 127\.0\.0\.1:\d+;\n)+", servers, conf, flags=re.MULTILINE)
    return conf.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{listen};")


def front_command(kind: str, port: int, workers: list[str], tmp: Path) -> list[str]:
    bindir = Path(sys.executable).parent
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
              "--policy", "cache_aware", "--prometheus-port", str(free_port())]
    if kind == "sglang-router":
        return [str(bindir / "sglang-router"), "launch", *common]
    if kind == "vllm-router":
        return [str(bindir / "vllm-router"), *common]
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    for sub in ("client_body", "proxy_temp", "fastcgi_temp", "uwsgi_temp", "scgi_temp"):
        (tmp / sub).mkdir(exist_ok=True)
    (tmp / "nginx.conf").write_text(nginx_conf(port, [int(w.rsplit(":", 1)[1]) for w in workers]))
    return [nginx, "-p", f"{tmp}/", "-c", str(tmp / "nginx.conf"), "-e", "stderr"]


def bench_args(a: argparse.Namespace, base_url: str, label: str, seed: int) -> argparse.Namespace:
    return serve_bench.build_parser().parse_args([
        "--base-url", base_url, "--label", label, "--dataset", "multiturn", "--multiturn-unique-system",
        "--multiturn-turns", str(a.turns), "--multiturn-system-len", str(a.system_len),
        "--multiturn-user-len", str(a.user_len), "--random-output-len", str(a.output_len),
        "--num-prompts", str(a.conversations), "--max-concurrency", str(a.concurrency),
        "--num-warmups", "0", "--seed", str(seed), "--result-dir", a.result_dir, "--no-plot",
        "--no-progress"])


def row(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("prefix_cache_hit_rate", "mean_ttft_turn1_ms", "mean_ttft_later_turns_ms", "output_throughput",
            "completed")
    return {k: run.get(k) for k in keys}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf for every replica (default model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--fronts", default="nginx,sglang-router,vllm-router")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=300, help="words of each conversation's system prompt")
    p.add_argument("--user-len", type=int, default=30)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="--num-threads of each replica")
    p.add_argument("--result-dir", default="bench/out/router_bench")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="router_bench-"))
    ports = [free_port() for _ in range(a.replicas)]
    model = ["--model", a.model] if a.model else []
    results: dict[str, Any] = {"config": vars(a), "fronts": {}}
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "proxy", "serve", "--port", str(port),
                   "--num-threads", str(a.threads), *model]
            health = f"http://127.0.0.1:{port}/health"
            stack.enter_context(started(cmd, health, tmp / f"replica{i}.log"))
        workers = [f"http://127.0.0.1:{port}" for port in ports]
        for n, kind in enumerate(a.fronts.split(",")):
            port = free_port()
            with started(front_command(kind, port, workers, tmp), f"http://127.0.0.1:{port}/v1/models",
                         tmp / f"{kind}.log"):
                summary = asyncio.run(serve_bench.run_benchmark(
                    bench_args(a, f"http://127.0.0.1:{port}", kind, 1000 * (n + 1))))
            results["fronts"][kind] = row(summary["runs"][0])
    base = results["fronts"].get("nginx")
    for kind, r in results["fronts"].items():
        if base and kind != "nginx":
            ratios = ("prefix_cache_hit_rate", "mean_ttft_later_turns_ms", "output_throughput")
            r["vs_nginx"] = {k: (r[k] / base[k]) if r[k] is not None and base[k] else None for k in ratios}
    out = Path(a.result_dir) / "router_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["fronts"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
