"""Reasoning parser cost per delta against the detokenizer's, in the same run (not a timed test).

A thinking-style output (``<think>`` + mixed CJK / emoji / English / code with ``<`` in it +
``</think>`` + an answer; and the same as harmony channels) is encoded with the zoo's qwen2 tokenizer
(``tests/testdata.py``) and streamed one token per call, as the engine hands tokens over, through the
detokenizer twins and the stop checker (one stop string) for reference, then each token's text through
the pure-Python reasoning parsers (``qwen3`` starting in the reasoning, ``gpt_oss``). Prints ns per
token and the parser / compiled-detokenizer ratio: what decides whether the parsers belong in ``ext/``
(``docs/internals.md``).

Usage: ``python bench/reasoning_bench.py [--tokens N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer

from proxy.hotpath import python as py_hotpath
from proxy.reasoning import get_reasoning_parser
from proxy.tokenizer import Tokenizer

try:
    from proxy.hotpath import compiled as c_hotpath
except ImportError:  # pragma: no cover
    c_hotpath = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from testdata import zoo_path

BODY = [
    "Let me think about this. If a < b and b < c then a < c, so </b> is not a tag here. ",
    "你是谁？请用中文详细介绍你自己。🤗😄 emoji, naïve café. ",
    "def f(x):\n    return [i for i in range(x) if i < 3]  # <tool_call> inside stays reasoning\n",
    "The quick brown fox jumps over the lazy dog. Streaming servers send deltas as events. ",
]


def trace_text(num_chars: int, harmony: bool) -> str:
    body = ""
    while len(body) < num_chars:
        body += "".join(BODY)
    half = len(body) // 2
    if harmony:
        return (f"<|channel|>analysis<|message|>{body[:half]}<|end|>"
                f"<|start|>assistant<|channel|>final<|message|>{body[half:]}")
    return f"<think>\n{body[:half]}</think>\n\n{body[half:]}"


def per_token_ns(fn: Callable[[], object], n: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def detokenize(module, table, singles: list[list[int]]) -> list[str]:
    d = module.IncrementalDetokenizer(table)
    return [d.feed(s) for s in singles]


def stop_check(module, texts: list[str]) -> list[tuple[str, int]]:
    feed = module.StopChecker(["###"]).feed
    return [feed(x) for x in texts]


def parse(name: str, texts: list[str]) -> list[tuple[str, str]]:
    feed = get_reasoning_parser(name, in_reasoning=False).feed
    return [feed(x) for x in texts]


def bench_trace(tok: Tokenizer, harmony: bool, num_tokens: int) -> dict[str, float]:
    """ns per token of each stage on one trace; prints them."""
    table = tok.decode_table
    assert table is not None
    text = trace_text(num_tokens * 3, harmony)
    ids = tok.encode(text, add_special_tokens=False)
    n = len(ids)
    singles = [[i] for i in ids]
    results: dict[str, float] = {}
    texts: list[str] = []
    for label, module in (("detok compiled", c_hotpath), ("detok python", py_hotpath)):
        if module is None:
            continue
        t = module.DecodeTable(table.token_bytes, table.special_ids, table.strip_leading_space,
                               table.byte_fallback_ids)
        results[label] = per_token_ns(lambda m=module, t=t: detokenize(m, t, singles), n)
        texts = detokenize(module, t, singles)
    for label, module in (("stop compiled", c_hotpath), ("stop python", py_hotpath)):
        if module is not None:
            results[label] = per_token_ns(lambda m=module: stop_check(m, texts), n)
    name = "gpt_oss" if harmony else "qwen3"
    deltas = parse(name, texts)
    assert "".join(r for r, _ in deltas) + "".join(c for _, c in deltas) in (
        text.replace("<think>\n", "\n", 1).replace("</think>", "", 1),
        text.replace("<|channel|>analysis<|message|>", "", 1)
        .replace("<|end|><|start|>assistant<|channel|>final<|message|>", "", 1))
    results[f"parser {name}"] = per_token_ns(lambda: parse(name, texts), n)
    print(f"\n{name} trace: {n} tokens, {len(text)} chars (qwen2 tokenizer, one token per feed)")
    for k, v in results.items():
        print(f"  {k:16s} {v:8.0f} ns/token")
    base = results.get("detok compiled", results["detok python"])
    print(f"  parser / detok compiled = {results[f'parser {name}'] / base:5.2f}x; "
          f"parser / detok python = {results[f'parser {name}'] / results['detok python']:5.2f}x")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000, help="about this many tokens per trace")
    args = ap.parse_args(argv)
    tok = Tokenizer(AutoTokenizer.from_pretrained(str(zoo_path("qwen2"))))
    for harmony in (False, True):
        bench_trace(tok, harmony, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
