"""Structured outputs on the engine: the per-step cost of grammar masks, and compile stalls.

On the default model (SmolLM2-135M-Instruct, CPU), with the engine stepped on its own thread as the
server does:

1. **Mask cost.** 16 requests constrained by a ``json_schema`` (an array of at least 40 small
   objects, so no output completes early) against the same 16 prompts unconstrained, greedy,
   ``--max-new-tokens`` each (EOS ignored, so both runs have identical lengths). Reported: ms per
   engine step of each, their ratio (target <= 1.10), and the time the sampler spent filling and
   applying the masks.
2. **Compile stall.** 15 unconstrained streams decode; in one run a worker thread compiles a new
   large schema (60 nested objects with patterns, never cached) meanwhile, as the API does for a new
   request. Reported: inter-token latency (one engine step) p50/p99 of both runs and the p99 ratio
   (target <= 1.20), and the compile time.

Runs alternate (``--repeat``, best of each kept), and every number is from this one process: on a
shared, noisy machine the ratios are the result, not the absolute times.

Usage: ``python bench/structured_bench.py [--max-new-tokens 64] [--repeat 2] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from proxy.engine.core import EngineCore
from proxy.engine.loading import load_engine_model
from proxy.engine.structured import GrammarCompiler, logits_width
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.settings import Settings
from proxy.threads import run_in_own_thread

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 0,
                                                                           "maximum": 999}},
        "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def big_schema(tag: str) -> str:
    """A large schema (60 nested objects with patterns and enums) whose text is new for each ``tag``."""
    props = {f"{tag}_field_{i}": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{3,6}"},
        "count": {"type": "integer", "minimum": 0}, "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "when": {"type": "string", "format": "date"}}, "required": ["code", "count", "kind", "when"],
        "additionalProperties": False} for i in range(60)}
    return json.dumps(
        {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    )


def prompts_for(tokenizer, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        msg = f"List {40 + i} items of a shop inventory as JSON, with names and quantities."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def new_core(loaded, compiler: GrammarCompiler, prompts, max_new: int) -> EngineCore:  # type: ignore[no-untyped-def]
    blocks = sum(-(-(len(p) + max_new) // 16) for p in prompts) + 8
    settings = Settings(num_kv_blocks=blocks, block_size=16, max_num_batched_tokens=2048, max_num_seqs=64)
    return EngineCore(
        loaded.model, settings, loaded.eos_token_ids, loaded.max_model_len, grammar_compiler=compiler
    )


def run_steps(core: EngineCore, prompts, params: SamplingParams, on_step=None) -> list[float]:  # type: ignore[no-untyped-def]
    """Submit all prompts, step to the end; return the duration of each decode-only step (s)."""
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    times = []
    step = 0
    while core.has_unfinished():
        decode_only = core.num_waiting == 0 and all(
            r.num_computed_tokens + 1 == r.num_tokens for r in core.scheduler.running)
        t0 = time.perf_counter()
        core.step()
        if decode_only:
            times.append(time.perf_counter() - t0)
        step += 1
        if on_step is not None:
            on_step(step)
    return times


def mask_cost(loaded, compiler, prompts, max_new: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    so = StructuredOutputParams("json", json.dumps(SCHEMA))
    compiler.compile(so)
    out: dict[str, float] = {}
    for name, structured in (("plain", None), ("json", so)):
        core = new_core(loaded, compiler, prompts, max_new)
        spent = [0.0]
        original = core.sampler._apply_grammars

        def timed(logits, requests, _orig=original, _spent=spent):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            rows = _orig(logits, requests)
            _spent[0] += time.perf_counter() - t0
            return rows

        core.sampler._apply_grammars = timed  # type: ignore[method-assign]
        params = SamplingParams(
            max_tokens=max_new, temperature=0.0, ignore_eos=True, structured_outputs=structured
        )
        times = run_steps(core, prompts, params)
        out[f"{name}_ms_step"] = 1000 * statistics.mean(times)
        out[f"{name}_mask_ms_step"] = 1000 * spent[0] / max(1, len(times))
    return out


def compile_stall(loaded, compiler, prompts, max_new: int, tag: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    out: dict[str, float] = {}
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for name in ("quiet", "compile"):
        core = new_core(loaded, compiler, prompts, max_new)
        worker: list[threading.Thread] = []
        compile_s = [0.0]

        def start_compile(step: int, _w=worker, _c=compile_s, _name=name) -> None:
            if _name == "compile" and step == 3 and not _w:
                def job() -> None:  # on the compiler's executor, as the API's compile_async
                    t0 = time.perf_counter()
                    so = StructuredOutputParams("json", big_schema(tag))
                    compiler.executor.submit(compiler.compile, so).result()
                    _c[0] = time.perf_counter() - t0
                _w.append(threading.Thread(target=job))
                _w[0].start()

        times = run_steps(core, prompts, params, start_compile)
        for w in worker:
            w.join()
        times.sort()
        out[f"{name}_p50_ms"] = 1000 * times[len(times) // 2]
        out[f"{name}_p99_ms"] = 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]
        if name == "compile":
            out["compile_s"] = compile_s[0]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    loaded = run_in_own_thread(load_engine_model, Settings(num_threads=args.threads))
    vocab = logits_width(loaded.model)
    compiler = GrammarCompiler(loaded.hf_tokenizer, vocab, loaded.eos_token_ids)
    prompts = prompts_for(loaded.hf_tokenizer, 16)
    run_in_own_thread(mask_cost, loaded, compiler, prompts[:2], 4)  # warm-up
    best: dict[str, float] = {}
    for r in range(args.repeat):
        res = run_in_own_thread(mask_cost, loaded, compiler, prompts, args.max_new_tokens)
        res.update(run_in_own_thread(compile_stall, loaded, compiler, prompts[:15], args.max_new_tokens,
                                     f"r{r}"))
        for k, v in res.items():
            best[k] = min(best.get(k, v), v)
    print(f"model {loaded.served_model_name}, {args.threads} threads, {args.max_new_tokens} new tokens, "
          f"best of {args.repeat} alternating runs")
    print(f"mask cost, 16 streams: plain {best['plain_ms_step']:.1f} ms/step, json_schema "
          f"{best['json_ms_step']:.1f} ms/step (masks {best['json_mask_ms_step']:.2f} ms/step), "
          f"ratio {best['json_ms_step'] / best['plain_ms_step']:.3f} (target <= 1.10)")
    print(
        f"compile stall, 15 streams: ITL p50/p99 quiet "
        f"{best['quiet_p50_ms']:.1f}/{best['quiet_p99_ms']:.1f} ms, "
        f"while compiling a large schema ({best['compile_s']:.2f} s) {best['compile_p50_ms']:.1f}/"
        f"{best['compile_p99_ms']:.1f} ms, p99 ratio {best['compile_p99_ms'] / best['quiet_p99_ms']:.3f} "
        "(target <= 1.20)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
