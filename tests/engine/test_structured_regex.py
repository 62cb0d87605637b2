"""Regex features: what the grammar library cannot enforce is a 400 naming it; the rest is enforced."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from proxy.errors import InvalidRequestError
from proxy.sampling import StructuredOutputParams
from proxy.tools.regex_features import check_regex
from proxy.tools.schema import check_json_schema

from .test_structured import compiler, eos

REFUSED = [
    ("^(?=.*[0-9])[a-z0-9]{4}$", "a lookahead", 1),
    ("(?!ab)[a-z]{2}", "a negative lookahead", 0),
    ("(?<=a)b", "a lookbehind", 0),
    ("[a-z](?<!a)", "a negative lookbehind", 5),
    ("(a|b)\\1", "a backreference", 5),
    ("(?<x>a|b)\\k<x>", "a named backreference", 9),
    ("(?P<x>a|b)(?P=x)", "a Python-style named group", 0),
    ("(?>a+)b", "an atomic group", 0),
    ("a++a", "a possessive quantifier", 1),
    ("a*+b", "a possessive quantifier", 1),
    ("a{1,2}+b", "a possessive quantifier", 5),
    ("a\\bb", "a word boundary", 1),
    ("a\\Bb", "a word boundary", 1),
    ("\\p{L}+", "a Unicode property escape", 0),
    ("(?i)ab", "an inline flag group", 0),
    ("(?i:a)b", "an inline flag group", 0),
    ("(a)?(?(1)b|c)", "a conditional", 4),
    ("a(?R)?b", "recursion", 1),
    ("a(?#note)b", "a comment group", 1),
    ("\\Aab", "the escape \\A", 0),
    ("ab\\Z", "the escape \\Z", 2),
    ("\\Qa.\\E", "the escape \\Q", 0),
    ("\\x{41}", "the escape \\x without its hex digits", 0),
    ("a^b", "an anchor '^' inside the pattern", 1),
    ("b(^a)", "an anchor '^' inside the pattern", 2),
    ("a$b", "an anchor '$' inside the pattern", 1),
    ("(a$|c)b", "an anchor '$' inside the pattern", 2),
]


@pytest.mark.parametrize(("pattern", "feature", "pos"), REFUSED)
def test_a_pattern_feature_the_grammar_cannot_enforce_is_a_400_naming_it(pattern: str, feature: str,
                                                                          pos: int) -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}},
              "required": ["code"]}
    param = "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as info:
        check_json_schema(schema, param)
    err = info.value
    assert err.status == 400 and err.param == param
    assert err.message.startswith(
        f"{param}: the JSON Schema 'pattern' (at #/properties/code) uses {feature}"
    ), err.message
    assert f"at position {pos} " in err.message
    with pytest.raises(InvalidRequestError, match=re.escape(f"uses {feature}")):
        compiler().compile(StructuredOutputParams("json", json.dumps(schema)), param)
    with pytest.raises(InvalidRequestError, match=re.escape(f"guided_regex: the regex uses {feature}")):
        compiler().compile(StructuredOutputParams("regex", pattern), "guided_regex")


def test_the_lookahead_of_the_report_is_refused_where_xgrammar_alone_drops_it() -> None:
    """The reported case: xgrammar 0.2.9 compiles the pattern and lets ``"aaaa"`` through."""
    pattern = "^(?=.*[0-9])[a-z0-9]{4}$"
    raw = compiler()._compiler.compile_json_schema(json.dumps({"type": "string", "pattern": pattern}),
                                                   any_whitespace=False, strict_mode=True)
    assert accepts(raw, '"aaaa"')  # what the check guards against
    with pytest.raises(InvalidRequestError, match="'pattern' .* uses a lookahead"):
        check_json_schema({"type": "string", "pattern": pattern}, "x")


@pytest.mark.parametrize(
    "escape", ["\\t", "\\n", "\\r", "[\\f]", "\\v", "\\0", "\\cA", "\\x1f", "\\u0009", "[\\b]"]
)
def test_control_character_escapes_are_refused_in_json_only(escape: str) -> None:
    """A JSON string holds a control character only escaped; xgrammar's pattern wants it raw."""
    with pytest.raises(InvalidRequestError, match="uses a control-character escape"):
        check_json_schema({"type": "string", "pattern": f"a{escape}"}, "x")
    check_regex(f"a{escape}", "guided_regex")


def test_a_pattern_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="#/pattern must be a string"):
        check_json_schema({"type": "string", "pattern": 5}, "x")


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos()])
    return bool(matcher.accept_string(text) and matcher.accept_token(eos()))


SUPPORTED = [
    ("^[a-z0-9]{4}$", ["ab12"], ["ab1", "AB12"]),
    ("(?:ab)+c", ["ababc"], ["c"]),
    ("(?<year>\\d{4})-\\d{2}", ["2024-05"], ["24-05"]),
    ("^a|^b", ["a", "b"], ["ab"]),
    ("(^a|b)c$", ["ac", "bc"], ["c"]),
    ("a$|b$", ["a", "b"], ["ab"]),
    ("[^a-z\\d]+", ["AB"], ["a1"]),
    ("\\w+\\s\\W\\D\\S", ["ab !xy"], ["ab  1y"]),
    ("a+?b{2,}?", ["aabbb"], ["ab"]),
    ("\\x41\\u00e9\\u{e8}", ["Aéè"], ["A"]),
    ("[a$]\\$\\^\\.", ["$$^."], ["a$^x"]),
    ("é+|x?", ["éé", ""], ["ex"]),
]


@pytest.mark.parametrize(("pattern", "good", "bad"), SUPPORTED)
def test_supported_patterns_pass_and_are_enforced(pattern: str, good: list[str], bad: list[str]) -> None:
    check_json_schema({"type": "string", "pattern": pattern}, "x")
    schema = json.dumps({"type": "string", "pattern": pattern})
    as_json = compiler().compile(StructuredOutputParams("json", schema))
    as_regex = compiler().compile(StructuredOutputParams("regex", pattern))
    for text in good:
        python = pattern.replace("\\u{e8}", "\\u00e8").replace("(?<", "(?P<")  # Python's syntax
        assert re.fullmatch(python, text)
        quoted = json.dumps(text, ensure_ascii=False)
        assert accepts(as_json, quoted) and accepts(as_regex, text), text
    for text in bad:
        quoted = json.dumps(text, ensure_ascii=False)
        assert not accepts(as_json, quoted) and not accepts(as_regex, text), text


#: what pydantic writes for a tool whose arguments nest models: every nested model a "$ref" into
#: "$defs", a recursive one back into itself, plus an old-style "definitions" entry.
_NESTED_TOOL = {
    "type": "object",
    "properties": {
        "loc": {"$ref": "#/$defs/Loc"},
        "tags": {"type": "array", "items": {"$ref": "#/definitions/Tag"}, "maxItems": 2},
    },
    "required": ["loc"],
    "additionalProperties": False,
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                        "near": {"anyOf": [{"$ref": "#/$defs/Loc"},
                                                                           {"type": "null"}]}},
                      "required": ["city", "near"], "additionalProperties": False}},
    "definitions": {"Tag": {"enum": ["red", "blue"]}},
}


def test_required_tool_choice_enforces_parameters_with_local_refs() -> None:
    """``tool_choice: "required"`` wraps each tool's parameters in an array schema: their "#..."
    references must still resolve there (they pointed at the parameters' own root)."""
    from proxy.tools.request import parse_chat_tools
    from proxy.tools.schema import rebase_local_refs

    plain = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                              "properties": {}}}}
    nested = {"type": "function", "function": {"name": "find", "parameters": _NESTED_TOOL}}
    tools = parse_chat_tools({"tools": [plain, nested], "tool_choice": "required"})
    assert tools is not None
    so = tools.grammar()
    assert so is not None
    compiled = compiler().compile(so, "tools")
    ok = ('[{"name": "find", "parameters": {"loc": {"city": "Oslo", "near": {"city": "Bergen", '
          '"near": null}}, "tags": ["red"]}}, {"name": "now", "parameters": {}}]')
    assert accepts(compiled, ok)
    assert tools.calls_from_output(ok)[0].arguments == json.dumps(json.loads(ok)[0]["parameters"])
    for bad_parameters in ('{"loc": {"city": "Oslo"}}',  # Loc's "near" is required
                           '{"loc": {"city": "Oslo", "near": null}, "tags": ["green"]}',
                           '{"loc": {"city": "Oslo", "near": {"city": 3, "near": null}}}',
                           '{"loc": {"city": "Oslo", "near": null}, "extra": 1}'):
        bad = f'[{{"name": "find", "parameters": {bad_parameters}}}]'
        assert not accepts(compiled, bad), bad
    # a tool without references keeps its parameters inline, as before
    spec = json.loads(so.spec)
    assert spec["items"]["anyOf"][0]["properties"]["parameters"] == plain["function"]["parameters"]
    assert spec["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/tool_1"}
    # only references move: data that looks like one, other references and anchors stay as written
    data = {"const": {"$ref": "#/x"}, "enum": [{"$ref": "#"}], "default": {"$ref": "#/a"},
            "examples": [{"$ref": "#/b"}], "anyOf": [{"$ref": "#"}, {"$ref": "https://x/s.json"},
                                                    {"$ref": "#anchor"}]}
    assert rebase_local_refs(data, "#/$defs/t") == {**data, "anyOf": [
        {"$ref": "#/$defs/t"}, {"$ref": "https://x/s.json"}, {"$ref": "#anchor"}]}
