"""Decode step time with and without the captured decode graphs (``proxy/engine/execution/decode_graphs.py``).

For each batch size (``--batch-sizes``, default 1,3,8,16) ``B`` chat prompts arrive at once and
generate ``--max-new-tokens`` tokens greedily with EOS ignored, once eager (``enforce_eager``) and
once through the graphs, on the same loaded model in the same run, alternating ``--repeat`` times
(the best of each kept: steadier on a shared machine). Printed per batch size: mean wall time of a
pure-decode step (ms) of each, the ratio graph / eager (lower is better), the graphs
captured, and whether the greedy tokens of the two runs are equal.

On CUDA the graphs are ``torch.cuda.CUDAGraph`` (the speed-up the feature exists for; the first
step of each shape includes its capture and is left out of the mean). On a CPU there are no CUDA
graphs: the graph run goes through the tests' stand-in (it re-runs the forward at replay), so the
ratio measures only what the plumbing costs (static-buffer copies, padded rows: 3 -> 4), never a
speed-up.

Usage: ``python bench/decode_graph_bench.py [--batch-sizes 1,3,8,16] [--max-new-tokens 32]
[--repeat 3] [--threads 1] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from proxy.engine.core import EngineCore
from proxy.engine.loading import load_engine_model
from proxy.sampling import SamplingParams
from proxy.settings import Settings
from proxy.threads import run_in_own_thread

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
    "Why is the sky blue?", "How do volcanoes form?", "Explain what a compiler does.",
    "Describe a trip to the mountains.", "What is a KV cache?",
]


class StandInGraph:
    """CPU stand-in for ``CudaDecodeGraph`` (as in tests/engine/execution/test_decode_graphs.py): replay
    re-runs the recorded forward on the static buffers."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        assert self.fn is not None and self.output is not None
        with torch.inference_mode():
            self.output.copy_(self.fn())


def prompts_of(loaded, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + f" (variant {i})"
        messages = [{"role": "user", "content": q}]
        ids = loaded.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def run(loaded, prompts: list[list[int]], max_new: int, graphs: bool) -> dict:  # type: ignore[no-untyped-def]
    """One engine run; the mean wall time of its pure-decode steps (first step of a new graph shape
    left out: it includes the capture)."""
    cuda = loaded.device.type == "cuda"
    settings = Settings(max_num_seqs=max(32, len(prompts)), enforce_eager=not graphs)
    core = EngineCore(loaded.model, settings, loaded.eos_token_ids, loaded.max_model_len)
    if graphs and not cuda:
        core.runner.use_decode_graphs(StandInGraph)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    times: list[float] = []
    while core.has_unfinished():
        pure = core.num_waiting == 0 and all(r.num_computed_tokens + 1 == r.num_tokens
                                             for r in core.scheduler.running)
        shapes = len(core.runner.decode_graphs.graphs) if core.runner.decode_graphs else 0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = core.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        new_shape = core.runner.decode_graphs is not None and len(core.runner.decode_graphs.graphs) != shapes
        if pure and not new_shape:
            times.append(dt)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    graph_runner = core.runner.decode_graphs
    return {
        "step_ms": 1000 * sum(times) / max(1, len(times)),
        "steps": len(times),
        "graphs": sorted(graph_runner.graphs) if graph_runner else [],
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,3,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    loaded = run_in_own_thread(load_engine_model, Settings(num_threads=args.threads, self_check=False))
    kind = "torch.cuda.CUDAGraph" if loaded.device.type == "cuda" else "CPU stand-in (plumbing cost only)"
    print(f"model on {loaded.device} ({loaded.dtype}); graphs: {kind}")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'graph/eager':>11} {'same tokens':>11}  graphs")
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = prompts_of(loaded, b)
        eager = graph = None
        for _ in range(args.repeat):
            e = run(loaded, prompts, args.max_new_tokens, graphs=False)
            g = run(loaded, prompts, args.max_new_tokens, graphs=True)
            eager = e if eager is None or e["step_ms"] < eager["step_ms"] else eager
            graph = g if graph is None or g["step_ms"] < graph["step_ms"] else graph
        assert eager is not None and graph is not None
        ratio = graph["step_ms"] / eager["step_ms"]
        same = graph["tokens"] == eager["tokens"]
        print(f"{b:>5} {eager['step_ms']:>9.2f} {graph['step_ms']:>9.2f} {ratio:>11.3f} {same!s:>11}  "
              f"{graph['graphs']}")
        rows.append({"batch": b, "eager_ms": eager["step_ms"], "graph_ms": graph["step_ms"], "ratio": ratio,
                     "same_tokens": same, "graphs": graph["graphs"]})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
