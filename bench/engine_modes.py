"""Both engine modes side by side: ``--no-engine-process`` (engine thread) vs ``--engine-process``
(engine core in a child process), served, with ``bench/serve_bench.py``, in one run.

For each shape (``--shapes``, default decode-heavy 32 in / 128 out and prompt-heavy 128 in / 64 out)
it starts ``python -m proxy serve`` in each mode (default model unless ``--model``), runs
serve_bench's random dataset at each ``--concurrency`` (default 1, 8, 16; ``--num-prompts`` requests
per point, default one wave: max(4, streams)), stops the server, and finally runs static batched
``generate()`` (``bench/engine_bench.run_static``, HF, left padding, greedy) on the same model with
the top concurrency and the same shape (the weights as served, quantized, with SDPA attention).
Printed: output tok/s, mean TTFT and ITL per mode and point,
the ratio process / thread, and served tok/s at the top concurrency / static ``generate()`` tok/s.
All numbers come from this one run; on a shared machine compare the ratios, not the absolutes.

It fails loudly (exit status 1, the server log's tail on stderr, no table) when a mode cannot load
the model (``/health`` reports ``failed`` or the server exits), does not become healthy within
``--load-timeout`` seconds, or a measured point has a failed request: a half-measured comparison is
worse than none.

Usage: ``python bench/engine_modes.py [--shapes 32x128,128x64] [--concurrency 1,8,16]
[--threads 2] [--num-prompts N] [--model PATH] [--extra-args "..."]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from proxy.ports import LocalServer, ServerFailed, start_serve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # generate() as `proxy serve` runs torch (proxy/cli.py)

MODES = {"thread": "--no-engine-process", "process": "--engine-process"}



class BenchError(RuntimeError):
    """A mode failed to load or to serve; the message carries the server log's tail."""


def start_server(mode: str, args: argparse.Namespace, log_dir: Path) -> LocalServer:
    """``python -m proxy serve`` in ``mode``, waited for until ``/health`` is 200.

    Raises:
        BenchError: the server exited, its load failed (``/health`` status ``failed``), or it was not
            healthy after ``args.load_timeout`` seconds (the server is stopped first).
    """
    serve_args = ["--num-threads", str(args.threads), MODES[mode],
                  *(["--model", args.model] if args.model else []), *shlex.split(args.extra_args)]
    try:
        return start_serve(serve_args, log_dir / f"{mode}.log", timeout_s=args.load_timeout)
    except ServerFailed as exc:
        raise BenchError(f"{mode} server: {exc}") from exc


def serve_points(base: str, label: str, shape: tuple[int, int], args: argparse.Namespace,
                 out_dir: Path) -> dict[int, dict[str, Any]]:
    """serve_bench at every concurrency; returns {streams: vLLM-style metrics}."""
    import serve_bench

    results = {}
    for conc in args.concurrency:
        n = args.num_prompts or max(4, conc)
        argv = ["--base-url", base, "--label", f"{label}-{shape[0]}x{shape[1]}",
                "--endpoint", "/v1/completions",
                "--random-input-len", str(shape[0]), "--random-output-len", str(shape[1]),
                "--max-concurrency", str(conc), "--num-prompts", str(n), "--num-warmups", "2",
                "--result-dir", str(out_dir), "--no-plot", "--no-progress"]
        summary = asyncio.run(serve_bench.run_benchmark(serve_bench.build_parser().parse_args(argv)))
        run = summary["runs"][0]
        if run["failed"] or run["completed"] != n:
            raise BenchError(f"{label}: {run['failed']} of {n} requests failed at {conc} streams "
                             f"(shape {shape[0]}x{shape[1]})")
        results[conc] = run
    return results


def static_generate(shape: tuple[int, int], streams: int, args: argparse.Namespace) -> float:
    """tok/s of HF static batched ``generate()`` over ``streams`` prompts of ``shape[0]`` tokens."""
    import engine_bench
    import torch

    from proxy.engine.loading import load_engine_model
    from proxy.settings import Settings
    from proxy.threads import run_in_own_thread

    torch.set_num_threads(args.threads)
    loaded = run_in_own_thread(load_engine_model,
                               Settings(model=args.model, device="cpu", num_threads=args.threads))
    vocab = len(loaded.hf_tokenizer)
    prompts = [[(17 * i + 31 * j) % (vocab - 200) + 100 for j in range(shape[0])] for i in range(streams)]
    model, tok = loaded.model, loaded.hf_tokenizer
    model.set_attn_implementation("sdpa")  # the served weights (quantized as served); generate() needs sdpa
    run_in_own_thread(engine_bench.run_static, model, tok, prompts[:2], 4)  # warm-up
    run = run_in_own_thread(engine_bench.run_static, model, tok, prompts, shape[1])
    return float(run["tok_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="32x128,128x64", help="INPUTxOUTPUT token lengths, comma-separated")
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per point (0: max(4, streams))")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--extra-args", default="", help="more `proxy serve` options for both modes")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds a server may take to load")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    out_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="engine-modes-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    top = max(args.concurrency)
    table: dict[tuple[int, int], dict[str, dict[int, dict[str, Any]]]] = {}
    for k, shape in enumerate(shapes):
        table[shape] = {}
        order = list(MODES) if k % 2 == 0 else list(MODES)[::-1]  # alternate who goes first
        for mode in order:
            try:
                server = start_server(mode, args, out_dir)
                try:
                    table[shape][mode] = serve_points(server.base_url, mode, shape, args, out_dir)
                finally:
                    server.stop()
            except BenchError as exc:
                print(f"engine_modes: FAILED in mode {mode}: {exc}", file=sys.stderr)
                return 1
    statics = {shape: static_generate(shape, top, args) for shape in shapes}

    print(f"\nengine modes, {args.threads} threads, results in {out_dir}")
    print(f"{'shape':>8} {'streams':>7} | {'thread tok/s':>12} {'TTFT ms':>8} {'ITL ms':>7} | "
          f"{'process tok/s':>13} {'TTFT ms':>8} {'ITL ms':>7} | {'proc/thread':>11}")
    for shape, modes in table.items():
        for conc in args.concurrency:
            t, q = modes["thread"][conc], modes["process"][conc]
            print(f"{shape[0]:>3}x{shape[1]:<4} {conc:>7} | {t['output_throughput']:>12.1f} "
                  f"{t['mean_ttft_ms']:>8.0f} "
                  f"{t['mean_itl_ms']:>7.1f} | {q['output_throughput']:>13.1f} {q['mean_ttft_ms']:>8.0f} "
                  f"{q['mean_itl_ms']:>7.1f} | {q['output_throughput'] / t['output_throughput']:>11.2f}")
        st = statics[shape]
        print(f"{shape[0]:>3}x{shape[1]:<4} static generate() x{top}: {st:.1f} tok/s; "
              f"served/static at {top}: "
              f"thread {modes['thread'][top]['output_throughput'] / st:.2f}, "
              f"process {modes['process'][top]['output_throughput'] / st:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
