"""Weight-only quantization on the default model: speed, memory and perplexity per configuration.

Configurations (``--configs``, default all): quantization ``none`` (dense, today's serving),
``gguf`` (the shipped Q4_1 GGUF at its own precision: Q4_1 linears as int4 g32, the tied lm_head
from the Q8_0 embedding as int8 g32), ``gguf-densehead`` (the same with the lm_head left dense and
tied), ``int8`` and ``int4`` (re-quantized from the dense weights, groups of 32), each in fp32 and
bf16. Each configuration runs in its own process (peak RSS is per process) and reports:

- ``tpot_ms``: batch-1 time per output token (engine decode steps after the first token).
- ``tok_s_16``: 16 streams, all at once, aggregate generated tokens/s (``--max-new-tokens`` each).
- ``ppl``: perplexity of ``bench/prompts/perplexity.txt`` (one forward, SDPA), and its ratio
  against ``none``/fp32 of the same run.
- ``rss_load_mb``: peak resident memory after loading; ``rss_mb``: at the end (the perplexity
  forward's fp32 logits over the whole text take about 0.3 GB of it).

``--interleaved ROUNDS`` instead loads the listed configurations into one process and alternates
their batch-1 runs (best of ROUNDS each), the steadier ratios on a shared machine.

Every ratio is against ``none``/fp32 measured in the same run; the machine may be shared, so the
printed CPU seconds (``cpu_s``) are the steadier figure. Usage: ``python bench/quant_bench.py
[--configs none:float32,gguf:bfloat16] [--max-new-tokens 64] [--threads 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "bench" / "prompts" / "perplexity.txt"
CONFIGS = [f"{q}:{d}" for d in ("float32", "bfloat16") for q in ("none", "gguf", "int8", "int4")] + [
    "gguf-densehead:bfloat16"]


def perplexity(model, tokenizer) -> float:  # type: ignore[no-untyped-def]
    """exp(mean next-token NLL) over the fixed text, one forward pass with SDPA."""
    import torch

    from proxy.engine.execution.attention import ATTN_IMPLEMENTATION

    ids = tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return math.exp(float(nll))


def run_one(config: str, max_new: int, threads: int) -> dict[str, float | str]:
    """Load one configuration and measure it (in this process)."""
    import torch

    from bench.engine_bench import build_prompts, run_ours
    from proxy.engine.loading import load_engine_model
    from proxy.settings import Settings
    from proxy.threads import run_in_own_thread

    quant, dtype = config.split(":")
    torch.set_num_threads(threads)
    start = time.perf_counter()
    loaded = run_in_own_thread(load_engine_model, Settings(dtype=dtype,
                                        quantization="auto" if quant.startswith("gguf") else quant,
                                        num_threads=threads))
    load_s = time.perf_counter() - start
    rss_load_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if quant.startswith("gguf") and not loaded.quantization.startswith("gguf"):
        raise SystemExit(f"{config}: the default model was not served at its GGUF precision here")
    model = loaded.model
    if quant == "gguf-densehead":  # tie the lm_head to the dense embedding again
        emb = model.get_input_embeddings().weight
        head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False, dtype=emb.dtype)
        head.weight = emb
        model.lm_head = head
    tok = loaded.hf_tokenizer
    ppl = perplexity(model, tok)
    one = run_in_own_thread(run_ours, model, loaded, build_prompts(tok, 1), max_new)
    many = run_in_own_thread(run_ours, model, loaded, build_prompts(tok, 16), max_new)
    # batch-1 TPOT: wall time after the first token over the remaining tokens
    tpot_ms = 1000 * (one["wall_s"] - one["ttft_s"]) / (max_new - 1)
    return {
        "config": config, "served": loaded.quantization, "load_s": load_s, "ppl": ppl, "tpot_ms": tpot_ms,
        "tok_s_1": one["tok_s"], "tok_s_16": many["tok_s"], "cpu_s_16": many["cpu_s"],
        "ttft_16_s": many["ttft_s"],
        "rss_load_mb": rss_load_mb,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def interleaved_tpot(configs: list[str], max_new: int, threads: int, rounds: int) -> None:
    """Batch-1 TPOT of several configurations loaded in one process, runs alternated, best of
    ``rounds`` each: on a shared machine the ratios of this mode are the steadier ones."""
    import torch

    from bench.engine_bench import build_prompts, run_ours
    from proxy.engine.loading import load_engine_model
    from proxy.settings import Settings
    from proxy.threads import run_in_own_thread

    torch.set_num_threads(threads)
    models = {}
    for config in configs:
        quant, dtype = config.split(":")
        models[config] = run_in_own_thread(load_engine_model, Settings(dtype=dtype,
                                                    quantization="auto" if quant == "gguf" else quant,
                                                    num_threads=threads))
    prompt = build_prompts(models[configs[0]].hf_tokenizer, 1)
    best = {c: float("inf") for c in configs}
    for _ in range(rounds):
        for config, loaded in models.items():
            one = run_in_own_thread(run_ours, loaded.model, loaded, prompt, max_new)
            best[config] = min(best[config], 1000 * (one["wall_s"] - one["ttft_s"]) / (max_new - 1))
    base = best[configs[0]]
    for config in configs:
        print(
            f"{config:<20} TPOT {best[config]:7.1f} ms  x{base / best[config]:5.2f}  "
            f"({models[config].quantization})"
        )
    print(
        f"(best of {rounds} alternated runs, {max_new} tokens, threads={threads}; x = speed-up over "
        f"{configs[0]})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one config
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                        help="only batch-1 TPOT, all --configs in one process, alternated ROUNDS times")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.interleaved:
        interleaved_tpot(args.configs.split(","), args.max_new_tokens, args.threads, args.interleaved)
        return 0
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.max_new_tokens, args.threads)), flush=True)
        return 0
    configs = args.configs.split(",")
    if "none:float32" not in configs:
        configs.insert(0, "none:float32")  # the baseline of every ratio
    rows = []
    for config in configs:
        cmd = [sys.executable, __file__, "--one", config, "--max-new-tokens", str(args.max_new_tokens),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not lines:
            print(f"{config}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(lines[-1][7:]))
        print(f"done {config}", file=sys.stderr, flush=True)
    base = next(r for r in rows if r["config"] == "none:float32")
    head = (f"{'config':<26} {'TPOT ms':>8} {'x':>6} {'16-stream tok/s':>16} {'x':>6} {'CPU s':>7} "
            f"{'ppl':>7} {'ppl x':>6} {'RSS load':>8} {'RSS end':>7} {'load s':>7}  served")
    print(head)
    for r in rows:
        print(
            f"{r['config']:<26} {r['tpot_ms']:8.1f} {base['tpot_ms'] / r['tpot_ms']:6.2f} "
            f"{r['tok_s_16']:16.1f} "
            f"{r['tok_s_16'] / base['tok_s_16']:6.2f} {r['cpu_s_16']:7.1f} {r['ppl']:7.3f} "
            f"{r['ppl'] / base['ppl']:6.3f} {r['rss_load_mb']:8.0f} {r['rss_mb']:7.0f} {r['load_s']:7.1f}  "
            f"{r['served']}"
        )
    print(f"(max_new_tokens={args.max_new_tokens}, threads={args.threads}; x = speed-up over none:float32, "
          "ppl x = perplexity ratio to none:float32)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
