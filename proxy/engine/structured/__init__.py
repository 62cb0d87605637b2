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

Thinking models: a request whose ``StructuredOutputParams`` names the end-of-thinking marker
(``reasoning_end_ids``) is unconstrained until the marker is out; its grammar starts fresh at the
token after it (:mod:`~proxy.engine.structured.reasoning_end` has the rule, after vLLM's
``reasoning_ended``). Until then the request has no mask row, so it samples exactly what it would
without ``structured_outputs``.

The package: :mod:`~proxy.engine.structured.compiler` (:class:`GrammarCompiler`, the compile cache),
:mod:`~proxy.engine.structured.request_grammar` (:class:`RequestGrammar`, one request's matcher),
:mod:`~proxy.engine.structured.reasoning_end` (:class:`ReasoningEnd`, where the grammar starts) and
:mod:`~proxy.engine.structured.masks` (token bitmasks: built, applied, their width). The schema
allow-list lives in :mod:`proxy.tools.schema` (the API validates with it before anything compiles).
"""

from __future__ import annotations

from proxy.engine.structured.compiler import GrammarCompiler
from proxy.engine.structured.masks import allow_token, apply_bitmask, logits_width
from proxy.engine.structured.reasoning_end import ReasoningEnd
from proxy.engine.structured.request_grammar import RequestGrammar
from proxy.tools.schema import ANNOTATION_KEYWORDS, ENFORCED_KEYWORDS, JSON_FORMATS, check_json_schema

__all__ = [
    "ANNOTATION_KEYWORDS",
    "ENFORCED_KEYWORDS",
    "JSON_FORMATS",
    "GrammarCompiler",
    "ReasoningEnd",
    "RequestGrammar",
    "allow_token",
    "apply_bitmask",
    "check_json_schema",
    "logits_width",
]
