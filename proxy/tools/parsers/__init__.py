"""Incremental tool-call parsers for the ``tool_choice: "auto"`` path.

A parser sees the detokenized output of one choice, piece by piece, and splits it into *content*
(text for ``delta.content`` / ``message.content``) and *tool calls* (OpenAI ``tool_calls``). The
formats and names follow vLLM's ``--tool-call-parser`` options:

- ``hermes`` (Hermes 2/3, Qwen2/2.5/3 templates):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated for parallel calls; text may
  come before and between calls.
- ``llama3_json`` (Llama 3.1/3.2/3.3 templates): the whole output is one or more
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (optionally after
  ``<|python_tag|>``); output that does not start with ``{`` is plain content.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects, or the
  v11+ form ``[TOOL_CALLS]name[ARGS]{...}`` (repeated). The markers are special tokens in Mistral
  tokenizers, so the API detokenizes with them kept (``marker_texts``).

The package, one concept a module: :mod:`~proxy.tools.parsers.calls` (the call and delta values),
:mod:`~proxy.tools.parsers.payloads` (whole call sections, per format),
:mod:`~proxy.tools.parsers.call_stream` (calls read while they are generated),
:mod:`~proxy.tools.parsers.formats` (the format table: markers, writing, detection) and
:mod:`~proxy.tools.parsers.parser` (the per-choice ``auto`` parser).

Rules shared by all formats, and why:

- **No partial marker leaks into content**: text that could be the start of a marker is held back
  until it is known not to be one (the stop-string hold-back rule of ``proxy.hotpath.StopChecker``).
- **Whitespace around calls is not content**: trailing whitespace is held; it is emitted when more
  text follows, dropped when a call follows; whitespace right after a call is dropped. Output with a
  call and only whitespace besides has ``content`` null, as vLLM's parsers answer.
- **Invalid calls are content**: a marker whose payload is not a call (not JSON of the expected
  shape) is returned as content text, marker included, never an error (vLLM does the same), as long
  as no call of it was streamed yet (next rule).
- **Arguments stream as they are generated** (:class:`CallStream`): a call is sent as soon as its
  name is known and its arguments object has started (``{"name": "f", "arguments": {``): a header
  delta (``index``, ``id``, ``type``, ``function.name``), then, for each piece of output, one delta
  with the arguments text that piece brought, the model's text unchanged, so the fragments
  concatenate to ``function.arguments`` (OpenAI's streaming shape). A sent call is never taken back:
  if the model then breaks the JSON or ``max_tokens`` cuts it, ``arguments`` is the text up to there
  and may not parse (as with OpenAI when ``max_tokens`` cuts a call). Mistral's ``name[ARGS]{...}``
  streams the same way. Other shapes (arguments before the name, arguments as a JSON string) are
  sent whole when complete, their arguments re-serialized with ``json.dumps``.
- **Streaming == non-streaming**: :meth:`ToolCallParser.parse` is ``feed`` + ``flush``, so the
  concatenated stream always equals the one-shot result, whatever the chunking.
"""

from proxy.tools.parsers.call_stream import CallStream
from proxy.tools.parsers.calls import (
    PendingCall,
    ToolCall,
    ToolCallDelta,
    ToolParseResult,
    call_deltas,
    new_call_id,
)
from proxy.tools.parsers.formats import CALL_SHAPES, PARSERS, detect_parser, format_calls
from proxy.tools.parsers.parser import ToolCallParser, get_parser

__all__ = [
    "CALL_SHAPES",
    "PARSERS",
    "CallStream",
    "PendingCall",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolParseResult",
    "call_deltas",
    "detect_parser",
    "format_calls",
    "get_parser",
    "new_call_id",
]
