"""The grammar compile cache of one tokenizer: compiled off the engine thread, at the lowest priority.

See :mod:`proxy.engine.structured` for the library choice and the rules a compiled grammar keeps
(refused schema keywords, bounded whitespace, no raw control characters in JSON).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from proxy.engine.structured.masks import has_control_char, token_mask
from proxy.engine.structured.request_grammar import RequestGrammar
from proxy.errors import InvalidRequestError
from proxy.sampling import StructuredOutputParams
from proxy.threads import lower_thread_priority
from proxy.tools.regex_features import check_regex
from proxy.tools.schema import check_json_schema

__all__ = ["GrammarCompiler"]

logger = logging.getLogger(__name__)


def _lowest_priority() -> None:
    """Lower the calling thread's CPU priority to nice 19 (``proxy.threads.lower_thread_priority``:
    this thread only). Elsewhere, or where refused, nothing changes."""
    lower_thread_priority(19)


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
"""xgrammar's C++ log prefix on its error messages (``[20:05:45] /project/cpp/file.cc:5088: ``)."""


def compile_error_reason(exc: Exception) -> str:
    """What a client reads of a grammar compiler's error: its last line, without xgrammar's C++ log
    prefix (time, source file and line of its build), or the exception's type when it says
    nothing."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", text.splitlines()[-1])

class GrammarCompiler:
    """Compiles grammars for one tokenizer and caches them by ``(kind, spec)`` (thread-safe).

    The API calls :meth:`compile_async`: a cache hit returns at once; a miss compiles on one of
    :attr:`executor`'s threads, which run at the lowest CPU priority (nice 19), so a compile that
    takes from milliseconds to seconds for large schemas uses only the CPU time the engine's forward
    passes leave (on 2 cores, a compile at normal priority raised the running streams' inter-token
    p99 by 27%: ``bench/structured_bench.py``). The engine thread then only looks the grammar up.

    Args:
        hf_tokenizer: the transformers tokenizer of the served model.
        vocab_size: the model's logits width (``config.vocab_size``; may exceed the tokenizer's size;
            the masks cover every column, padding columns disallowed).
        eos_token_ids: the engine's EOS ids; a complete grammar allows exactly these.
        cache_size: compiled grammars kept (least recently used dropped first).
        max_threads: xgrammar's compile threads; default a quarter of the CPUs (1 on a 2-core
            machine), so a large compile leaves the cores to the engine's forward passes.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = 256,
        max_threads: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(eos_token_ids))
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        if max_threads is None:
            max_threads = min(8, max(1, (os.cpu_count() or 1) // 4))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.json_token_mask = token_mask(
            vocab_size,
            [i for i, raw in enumerate(info.decoded_vocab[:vocab_size]) if not has_control_char(raw)],
        )
        self.stop_token_mask = token_mask(vocab_size, self.stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiled = 0
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile",
                                           initializer=_lowest_priority)

    def cached(self, so: StructuredOutputParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``so`` if the cache holds it (marked recently used), else None."""
        key = (so.kind, so.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    async def compile_async(
        self, so: StructuredOutputParams, param: str = "response_format"
    ) -> xgr.CompiledGrammar:
        """:meth:`compile` off the event loop: a cache hit at once, a miss on :attr:`executor`.

        Raises:
            InvalidRequestError: as :meth:`compile`.
        """
        hit = self.cached(so)
        if hit is not None:
            return hit
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.compile, so, param)

    def compile(self, so: StructuredOutputParams, param: str = "response_format") -> xgr.CompiledGrammar:
        """The compiled grammar of ``so``, from the cache or compiled now (blocking; off the engine thread).

        Raises:
            InvalidRequestError: the spec is not valid (bad JSON, a refused schema keyword, an invalid
                regex or grammar, a regex feature the grammar cannot enforce); the message names
                ``param`` and the reason.
        """
        hit = self.cached(so)
        if hit is not None:
            return hit
        key = (so.kind, so.spec)
        compiled = self._compile(so, param)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _compile(self, so: StructuredOutputParams, param: str) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if so.kind == "json":
                try:
                    schema = json.loads(so.spec)
                except ValueError as exc:
                    raise InvalidRequestError(
                        f"{param}: the schema is not valid JSON: {exc}", param=param
                    ) from None
                check_json_schema(schema, param)
                return c.compile_json_schema(so.spec, any_whitespace=False, strict_mode=True)
            if so.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if so.kind == "regex":
                check_regex(so.spec, param)
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                choices = json.loads(so.spec)
                if (
                    not isinstance(choices, list)
                    or not choices
                    or not all(isinstance(x, str) and x for x in choices)
                ):
                    raise InvalidRequestError(
                        f"{param}: must be a non-empty list of non-empty strings", param=param
                    )
                alts = " | ".join(json.dumps(x, ensure_ascii=False) for x in choices)
                return c.compile_grammar(f"root ::= {alts}")
            if so.kind == "grammar":
                return c.compile_grammar(so.spec)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = compile_error_reason(exc)
            raise InvalidRequestError(
                f"{param}: cannot be compiled to a grammar: {reason}", param=param
            ) from None
        raise InvalidRequestError(f"{param}: unknown structured output kind {so.kind!r}", param=param)

    def new_request_grammar(self, so: StructuredOutputParams, offset: int = 0) -> RequestGrammar:
        """A fresh per-request grammar (engine thread) whose first token is output token ``offset``.
        Compiles now if ``so`` is not cached, which only happens when the caller skipped
        :meth:`compile` (tests) or the entry was evicted."""
        with self._lock:
            compiled = self._cache.get((so.kind, so.spec))
        if compiled is None:
            logger.warning("grammar compiled on the engine thread (not cached): kind %s", so.kind)
            compiled = self.compile(so)
        extra = self.json_token_mask if so.kind in ("json", "json_object") else None
        return RequestGrammar(compiled, self.stop_token_ids, extra, self.stop_token_mask, offset)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` bitmask (CPU)."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)
