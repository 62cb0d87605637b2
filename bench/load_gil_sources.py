"""The longest hold of the interpreter lock by each part of an engine-process load that runs in the API
process (issue 48: a stream's one long gap while another model loads).

Each part runs on a thread of its own, as a load does, while a ticker thread sleeps 1 ms at a time;
the ticker's longest oversleep during the part is the longest stretch the part kept the lock (or the
machine kept the core: run it on a quiet machine, several times). Parts, in a load's order, for
``--model`` (an HF folder; default: the default model's converted folder): the first import of
transformers' config and tokenizer classes, ``AutoTokenizer.from_pretrained``, ``tokenizers``'
``Tokenizer.from_file`` of the same ``tokenizer.json`` (does the Rust parse let the lock go?), our
``Tokenizer`` (decode table built and verified), its first and second chat template render (what a
model's first request does), ``AutoConfig.from_pretrained``,
``VisionProcessor.load``, starting a spawned process as the engine's is started (the same
``multiprocessing`` context; the child only exits), a full collection and ``freeze_heap()``, and
``MODEL_FILES.get`` of the folder the first time (a read) and the second (kept: what a load does now).

Prints one JSON line per part: ``ms`` (its wall time) and ``max_hold_ms`` (the ticker's longest
oversleep less its 1 ms); and the resident memory one model's kept files take (``kept_files_rss_mb``,
the RSS before and after the first ``MODEL_FILES.get``: the tokenizer read again).

Usage: ``python bench/load_gil_sources.py [--model FOLDER]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class Ticker:
    """A thread sleeping 1 ms at a time; :meth:`worst` is its longest oversleep since :meth:`reset`."""

    def __init__(self) -> None:
        self._worst = 0.0
        threading.Thread(target=self._run, name="ticker", daemon=True).start()

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            time.sleep(0.001)
            self._worst = max(self._worst, time.perf_counter() - start - 0.001)

    def reset(self) -> None:
        time.sleep(0.005)
        self._worst = 0.0

    def worst(self) -> float:
        return self._worst


def _exit_now() -> None:
    pass


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(ticker: Ticker, name: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread, waited for; print its wall time and the ticker's worst gap."""
    out: list[Any] = []
    ticker.reset()
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: out.append(fn()), name="streamproxy-load")
    thread.start()
    thread.join()
    ms = (time.perf_counter() - start) * 1000
    time.sleep(0.003)  # the ticker's last sleep ends
    print(json.dumps({"part": name, "ms": round(ms, 1), "max_hold_ms": round(ticker.worst() * 1000, 1)}))
    return out[0] if out else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an HF folder (default: the default model's)")
    args = parser.parse_args(argv)
    from proxy.settings import Settings

    settings = Settings(model=args.model, device="cpu")
    from proxy.models.source import resolve_model_source

    folder = str(resolve_model_source(settings)[0])
    from proxy.models.device import keep_triton_out

    keep_triton_out(settings)
    ticker = Ticker()

    def imports() -> None:
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401

        AutoConfig.from_pretrained(folder)  # the model type's config module is imported at first use

    measure(ticker, "import transformers + first AutoConfig", imports)
    from transformers import AutoConfig, AutoTokenizer

    hf = measure(ticker, "AutoTokenizer.from_pretrained", lambda: AutoTokenizer.from_pretrained(folder))
    from tokenizers import Tokenizer as RustTokenizer

    path = f"{folder}/tokenizer.json"
    measure(ticker, "tokenizers.Tokenizer.from_file", lambda: RustTokenizer.from_file(path))
    from proxy.tokenizer import Tokenizer

    tokenizer = measure(ticker, "proxy.tokenizer.Tokenizer(hf)", lambda: Tokenizer(hf))
    chat = [{"role": "user", "content": "Hello"}]
    for which in ("first", "second"):  # a model's first request compiles its template
        measure(ticker, f"{which} chat template render", lambda: tokenizer.render_chat_template(chat))
    measure(ticker, "len(hf_tokenizer)", lambda: len(hf))
    config = measure(ticker, "AutoConfig.from_pretrained", lambda: AutoConfig.from_pretrained(folder))
    from proxy.media.processor import VisionProcessor

    measure(ticker, "VisionProcessor.load", lambda: VisionProcessor.load(folder, config))
    from proxy.engine.core_proc.lifecycle import _MP

    def spawn() -> None:
        proc = _MP.Process(target=_exit_now, daemon=True)
        proc.start()
        proc.join()

    measure(ticker, "spawn a process (start + join)", spawn)
    import gc

    from proxy.heap import freeze_heap

    measure(ticker, "gc.collect()", gc.collect)
    measure(ticker, "freeze_heap()", freeze_heap)
    from proxy.engine.model_files import ModelFilesCache

    cache = ModelFilesCache()
    rss = _rss_mb()
    measure(ticker, "ModelFilesCache.get (read)", lambda: cache.get(folder))
    print(json.dumps({"kept_files_rss_mb": round(_rss_mb() - rss, 1)}))
    measure(ticker, "ModelFilesCache.get (kept)", lambda: cache.get(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
