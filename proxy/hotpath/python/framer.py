"""SSE framing of OpenAI stream chunks, and the canonical compact JSON they are written in."""

from __future__ import annotations

import json

__all__ = ["ChunkFramer", "EventFramer", "dumps"]

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(obj: object) -> str:
    """Canonical compact JSON, identical to ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``."""
    return _ENCODER.encode(obj)


def _escape(text: str) -> str:
    """JSON string body of ``text`` (without quotes), as ``json.dumps(ensure_ascii=False)`` writes it."""
    return _ENCODER.encode(text)[1:-1]


_DONE = b"data: [DONE]\n\n"


class ChunkFramer:
    """SSE events of one streamed response (OpenAI ``chat.completion.chunk`` or ``text_completion``).

    Every method returns one event, ``b"data: " + compact JSON + b"\\n\\n"``, byte-identical to
    ``json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()`` of the chunk dict in the
    OpenAI API reference (streaming chat completions / legacy completions), keys in that order. With
    ``include_usage`` (``stream_options.include_usage``) every chunk but the usage chunk ends with
    ``"usage":null``, as OpenAI sends. The constant JSON around the text is built once per request.

    Raises:
        ValueError: ``object`` is neither ``"chat.completion.chunk"`` nor ``"text_completion"``.
    """

    def __init__(self, object: str, response_id: str, created: int, model: str, include_usage: bool) -> None:
        if object not in ("chat.completion.chunk", "text_completion"):
            raise ValueError(f"unknown chunk object {object!r}")
        self.is_chat = object == "chat.completion.chunk"
        self._head = (
            "data: {"
            f'"id":{dumps(response_id)},"object":{dumps(object)},"created":{dumps(created)},'
            f'"model":{dumps(model)},'
        )
        self._choice_head = self._head + '"choices":[{"index":'
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"
        if self.is_chat:
            self._content_open = ',"delta":{"content":"'
            self._content_close = '"},"logprobs":'
        else:
            self._content_open = ',"text":"'
            self._content_close = '","logprobs":'

    def role(self, index: int) -> bytes:
        """First chunk of a chat choice: ``delta = {"role":"assistant","content":""}``.

        Text completions have no role chunk: returns ``b""`` (no event) for them.
        """
        if not self.is_chat:
            return b""
        s = (
            f'{self._choice_head}{int(index)},"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null{self._tail}'
        )
        return s.encode()

    def content(self, index: int, text: str, logprobs_json: str | None = None) -> bytes:
        """A text delta; ``logprobs_json`` (already serialized JSON) replaces ``null`` for ``logprobs``."""
        s = (
            f"{self._choice_head}{int(index)}{self._content_open}{_escape(text)}{self._content_close}"
            f"{'null' if logprobs_json is None else logprobs_json},\"finish_reason\":null{self._tail}"
        )
        return s.encode()

    def reasoning(self, index: int, text: str) -> bytes:
        """A chat chunk carrying thinking text: ``delta = {"reasoning_content": text, "reasoning": text}``
        (vLLM's field and its newer name, the same text in both so clients read either)."""
        escaped = _escape(text)
        s = (
            f'{self._choice_head}{int(index)},"delta":{{"reasoning_content":"{escaped}","reasoning":"{escaped}"}},'
            f'"logprobs":null,"finish_reason":null{self._tail}'
        )
        return s.encode()

    def tool_calls(self, index: int, tool_calls_json: str) -> bytes:
        """A chat chunk with ``delta = {"tool_calls": <tool_calls_json>}``: ``tool_calls_json`` is the
        serialized JSON array of OpenAI ``ChoiceDeltaToolCall`` objects (one entry per call, as OpenAI
        streams them)."""
        s = (
            f'{self._choice_head}{int(index)},"delta":{{"tool_calls":{tool_calls_json}}},'
            f'"logprobs":null,"finish_reason":null{self._tail}'
        )
        return s.encode()

    def finish(self, index: int, finish_reason: str) -> bytes:
        """Last chunk of a choice: empty delta (chat) or ``"text":""``, with ``finish_reason``."""
        body = '"delta":{}' if self.is_chat else '"text":""'
        s = (
            f'{self._choice_head}{int(index)},{body},"logprobs":null,'
            f'"finish_reason":{dumps(finish_reason)}{self._tail}'
        )
        return s.encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
              reasoning_tokens: int | None = None) -> bytes:
        """Usage chunk (``choices: []``), sent before ``[DONE]`` when ``include_usage`` was asked.

        ``usage`` is ``{"prompt_tokens","completion_tokens","total_tokens",
        "prompt_tokens_details":{"cached_tokens"}}`` as in the OpenAI API reference (chat completion
        object); ``cached_tokens`` is the number of prompt tokens served from the prefix cache, 0 when
        none (OpenAI always sends the details object); with ``reasoning_tokens``,
        ``"completion_tokens_details":{"reasoning_tokens"}`` follows.
        """
        p = int(prompt_tokens)
        c = int(completion_tokens)
        k = int(cached_tokens)
        r = ("" if reasoning_tokens is None else
             f',"completion_tokens_details":{{"reasoning_tokens":{int(reasoning_tokens)}}}')
        s = (
            f'{self._head}"choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},'
            f'"total_tokens":{p + c},"prompt_tokens_details":{{"cached_tokens":{k}}}{r}}}}}\n\n'
        )
        return s.encode()

    def error(self, message: str, type: str, code: str | None) -> bytes:
        """In-band error event ``{"error":{"message","type","param":null,"code"}}`` (the stream
        already started)."""
        error = {"message": message, "type": type, "param": None, "code": code}
        return ("data: " + dumps({"error": error}) + "\n\n").encode()

    def done(self) -> bytes:
        """The terminating ``data: [DONE]`` event."""
        return _DONE


class EventFramer:
    """SSE events of one Responses API stream: ``event: <type>`` then ``data: <json>``, the JSON
    ``{"type": <type>, "sequence_number": n, ...fields}`` with ``n`` counting from 0, one more each
    event (OpenAI "Streaming responses"). Each event is byte-identical to
    ``b"event: " + type + b"\ndata: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    + b"\n\n"`` of that object, keys in that order.
    """

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, type: str, fields_json: str) -> bytes:
        """One event; ``fields_json`` is the serialized JSON object of its other fields (``"{}"``: none)."""
        n = self.sequence_number
        self.sequence_number = n + 1
        rest = fields_json[1:-1]
        sep = "," if rest else ""
        s = f'event: {type}\ndata: {{"type":{dumps(type)},"sequence_number":{n}{sep}{rest}}}\n\n'
        return s.encode()

    def delta(self, type: str, item_id: str, output_index: int, content_index: int | None, text: str,
              logprobs_json: str | None = None) -> bytes:
        """A text delta event: ``item_id``, ``output_index``, ``content_index`` (left out when None, as
        in ``response.function_call_arguments.delta``), ``delta`` and, when given, ``logprobs``."""
        n = self.sequence_number
        self.sequence_number = n + 1
        ci = "" if content_index is None else f',"content_index":{int(content_index)}'
        lp = "" if logprobs_json is None else f',"logprobs":{logprobs_json}'
        s = (
            f'event: {type}\ndata: {{"type":{dumps(type)},"sequence_number":{n},"item_id":{dumps(item_id)},'
            f'"output_index":{int(output_index)}{ci},"delta":"{_escape(text)}"{lp}}}\n\n'
        )
        return s.encode()
