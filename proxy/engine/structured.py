"""Constrained decoding: grammars compiled off the engine thread, one matcher per request.

Library: **xgrammar** (0.2.x). Why, measured on this project's CPU machine with the default model's
tokenizer (49152 tokens; 2 shared cores, so read ratios, not absolutes):

- *Engine-thread cost.* xgrammar compiles the whole grammar (with its adaptive token-mask cache) up
  front, so filling a mask during decode is small and flat: walking a 60-field nested schema (1421
  tokens) cost median 0.001 ms, p99 0.012 ms, max 0.5 ms per mask. llguidance 1.9.1 builds its lexer
  lazily while decoding: median 0.025 ms but p99 4.6 ms and max 16-30 ms per mask, on the engine
  thread, for every new matcher. Compilation happens in a worker thread (it releases the GIL), so
  xgrammar's larger compile time (~6 ms for a small schema, ~1.8 s for the 60-field one) never
  stalls running streams.
- *Coverage.* llguidance names unimplemented keywords; xgrammar silently ignores some (checked:
  ``uniqueItems``, ``not``, ``if``/``then``, ``dependentRequired``, ``allOf`` past its first branch,
  ``oneOf`` exclusivity, ``minProperties``/``maxProperties``/``patternProperties`` misbehave). So
  :func:`check_json_schema` keeps an allow-list of keywords xgrammar was checked to enforce
  (:data:`ENFORCED_KEYWORDS`) and answers 400 naming any other keyword: a schema is enforced or
  refused, never silently relaxed.
- *Maintenance.* Both are maintained and used by vLLM, SGLang and TensorRT-LLM; xgrammar is vLLM's
  default backend, and its ``apply_token_bitmask_inplace`` has CPU and CUDA kernels.

Raw control characters are refused: xgrammar 0.2.9's JSON strings admit unescaped U+0000-U+001F
(seen with a random model: ``"name": ",\x06&("``), which RFC 8259 forbids and ``json.loads`` and
pydantic reject. For JSON kinds, every token whose bytes hold such a character is masked out (a
precomputed bitmask ANDed into the grammar's): a valid JSON document never needs one when the
grammar allows no whitespace besides single spaces.

Whitespace is bounded: JSON grammars are compiled with ``any_whitespace=False`` (xgrammar then
allows exactly the separators ``", "`` and ``": "`` and no other whitespace between tokens), so a
constrained output cannot loop on spaces or newlines until ``max_tokens``. Free strings are not
bounded unless the schema says ``maxLength``; ``max_tokens`` is the backstop (``finish_reason``
``"length"``). As in xgrammar's (and vLLM's) default strict mode, an object schema without
``additionalProperties`` allows only its listed properties (a subset of what the schema allows, so
the output still validates).

A request's :class:`RequestGrammar` advances lazily: before each mask it consumes the request's
output tokens it has not seen yet. The output tokens survive preemption by recompute, so the grammar
state stays right across preemption and prefill chunks without extra bookkeeping; the sampler drops
it with the request (``Sampler.forget``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from proxy.errors import InvalidRequestError
from proxy.sampling import StructuredOutputParams
from proxy.tools.schema import ANNOTATION_KEYWORDS, ENFORCED_KEYWORDS, JSON_FORMATS, check_json_schema

__all__ = [
    "ANNOTATION_KEYWORDS",
    "ENFORCED_KEYWORDS",
    "JSON_FORMATS",
    "GrammarCompiler",
    "RequestGrammar",
    "apply_bitmask",
    "check_json_schema",
    "logits_width",
]

logger = logging.getLogger(__name__)

class RequestGrammar:
    """One request's grammar state.

    Args:
        compiled: the compiled grammar (shared, read-only).
        stop_token_ids: tokens that end the output once the grammar is complete (the engine's EOS ids).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        stop_token_ids: Sequence[int],
        extra_mask: torch.Tensor | None = None,
        stop_mask: torch.Tensor | None = None,
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.stop_mask = stop_mask
        self.num_accepted = 0
        self.is_failed = False
        self.extra_mask = extra_mask

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consume the output tokens not seen yet (the tokens sampled since the last call)."""
        while self.num_accepted < len(output_token_ids) and not self.is_failed:
            token = output_token_ids[self.num_accepted]
            self.num_accepted += 1
            if self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                # Cannot happen for tokens sampled under the mask; keep serving, and say so.
                logger.warning("grammar rejected token %d; the request is no longer constrained", token)
                self.is_failed = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed). A finished grammar allows only its stop tokens."""
        if self.is_failed:
            bitmask[row].fill_(-1)
            return
        if self.matcher.is_terminated():
            # The grammar ended and a stop token was taken, yet the request goes on (``ignore_eos``):
            # only stop tokens stay allowed.
            if self.stop_mask is not None:
                bitmask[row] = self.stop_mask
            else:
                bitmask[row].fill_(-1)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask


def _lowest_priority() -> None:
    """Lower the calling thread's CPU priority to nice 19 (Linux keeps a nice value per thread; a
    thread may always lower its own). Elsewhere, or where refused, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


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
        self.json_token_mask = _token_mask(
            vocab_size,
            [i for i, raw in enumerate(info.decoded_vocab[:vocab_size]) if not _has_control_char(raw)],
        )
        self.stop_token_mask = _token_mask(vocab_size, self.stop_token_ids)
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
                regex or grammar); the message names ``param`` and the library's reason.
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
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(
                f"{param}: cannot be compiled to a grammar: {reason}", param=param
            ) from None
        raise InvalidRequestError(f"{param}: unknown structured output kind {so.kind!r}", param=param)

    def new_request_grammar(self, so: StructuredOutputParams) -> RequestGrammar:
        """A fresh per-request grammar (engine thread). Compiles now if ``so`` is not cached, which
        only happens when the caller skipped :meth:`compile` (tests) or the entry was evicted."""
        with self._lock:
            compiled = self._cache.get((so.kind, so.spec))
        if compiled is None:
            logger.warning("grammar compiled on the engine thread (not cached): kind %s", so.kind)
            compiled = self.compile(so)
        extra = self.json_token_mask if so.kind in ("json", "json_object") else None
        return RequestGrammar(compiled, self.stop_token_ids, extra, self.stop_token_mask)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` bitmask (CPU)."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


_CONTROL_BYTES = frozenset(range(32))


def _has_control_char(raw: bytes) -> bool:
    return not _CONTROL_BYTES.isdisjoint(raw)


def _token_mask(vocab_size: int, allowed_ids: Iterable[int]) -> torch.Tensor:
    """int32 ``[ceil(vocab_size / 32)]`` bitmask (xgrammar's layout) allowing exactly ``allowed_ids``."""
    allowed = torch.zeros(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    ids = [i for i in allowed_ids if 0 <= i < vocab_size]
    if ids:
        allowed[torch.tensor(ids, dtype=torch.long)] = True
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return words.to(torch.int32)


def logits_width(model: torch.nn.Module) -> int:
    """Columns of the model's logits (what the masks must cover): the output head's ``out_features``
    (``nn.Linear`` and the quantized ``PackedLinear`` both have it; a packed head has no ``weight``),
    else its weight's rows, else the text config's ``vocab_size``."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    width = getattr(head, "out_features", None)
    if width is None and head is not None and getattr(head, "weight", None) is not None:
        width = head.weight.shape[0]
    if width is None:
        config: Any = model.config
        width = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
    return int(width)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed logits of ``rows`` to ``-inf`` in place.

    Args:
        logits: ``[S, V]`` float logits (CPU or CUDA).
        bitmask: int32 ``[len(rows), ceil(V / 32)]`` on the CPU; row ``k`` is the mask of ``rows[k]``.
        rows: the constrained rows of ``logits``; the others are untouched.

    On the CPU this is xgrammar's CPU kernel; on CUDA the mask is copied to the device and applied
    there by xgrammar's CUDA kernel (``backend="auto"``).
    """
    vocab = logits.shape[-1]
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab
        )
        return
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[torch.tensor(list(rows), dtype=torch.long)] = bitmask
    xgr.apply_token_bitmask_inplace(
        logits, full.to(logits.device, non_blocking=True), vocab_size=vocab, indices=list(rows)
    )
