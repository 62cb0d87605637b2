"""A JSON Schema ``pattern`` the grammar cannot enforce is a 400 through the API, before any engine work."""

from __future__ import annotations

from .conftest import chat_body, run
from .test_tools import _serve_reply


def test_a_lookahead_pattern_is_a_400_naming_pattern() -> None:
    code = {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}
    schema = {"type": "object", "properties": {"code": code}, "required": ["code"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}

    async def main():
        async with _serve_reply("x", with_grammar=True, max_model_len=2048) as s:
            out = []
            for body in (
                chat_body(response_format=json_schema),
                chat_body(guided_regex="(a|b)\\1"),
            ):
                r = await s.client.post("/v1/chat/completions", json=body)
                out.append((r.status_code, r.json()["error"]))
            return out, s.engine

    ((s1, e1), (s2, e2)), engine = run(main())
    assert s1 == 400 and e1["param"] == "response_format.json_schema.schema"
    assert e1["type"] == "invalid_request_error"
    assert "the JSON Schema 'pattern' (at #/properties/code) uses a lookahead at position 1" in e1["message"]
    assert s2 == 400 and e2["param"] == "guided_regex" and "the regex uses a backreference" in e2["message"]
    assert engine.submitted == []
