"""Names, detection from chat templates, where the output starts, and the ``--reasoning-parser`` setting."""

from __future__ import annotations

import pytest

from proxy.reasoning import (
    REASONING_PARSERS,
    HarmonyParser,
    ThinkTagParser,
    detect_reasoning_parser,
    get_reasoning_format,
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_reasoning_parser,
    starts_in_reasoning,
)

QWEN3 = (  # excerpts of Qwen3's template
    "{%- if '</think>' in content %}\n"
    "    {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}\n"
    "    {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "{%- endif %}\n"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n{%- endif %}"
)
DEEPSEEK_R1 = (  # excerpts of DeepSeek-R1's (U+FF5C bars, U+2581 spaces)
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<\uff5cAssistant\uff5c>' + content + '<\uff5cend\u2581of\u2581sentence\uff5c>'}}"
    "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c><think>\\n'}}{% endif %}"
)
GPT_OSS = (  # excerpts of GPT-OSS's
    '{%- if message.thinking %}{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking'
    ' + "<|end|>" }}{%- endif %}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}'
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
MAGISTRAL = (  # excerpts of Magistral's
    "{{- bos_token }}[SYSTEM_PROMPT]First draft your thinking process (inner monologue) until you arrive"
    " at a response. Your thoughts: [THINK]your thoughts here[/THINK] then the answer.[/SYSTEM_PROMPT]"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{%- endif %}{%- endfor %}"
)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN25_TOOLS = CHATML + "{% if tools %}<tools>{{ tools }}</tools> <tool_call>{...}</tool_call>{% endif %}"
MISTRAL_TOOLS = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS][INST]"


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN3, "qwen3"), (DEEPSEEK_R1, "deepseek_r1"), (GPT_OSS, "gpt_oss"), (MAGISTRAL, "mistral"),
    (CHATML, None), (QWEN25_TOOLS, None), (MISTRAL_TOOLS, None), ("", None), (None, None),
])
def test_detection_from_template_snippets(template: str | None, expected: str | None) -> None:
    assert detect_reasoning_parser(template) == expected


def test_names_and_parsers() -> None:
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3", "mistral", "gpt_oss")
    assert reasoning_parser_names() == ("deepseek_r1", "gpt_oss", "mistral", "openai_gptoss", "qwen3")
    assert isinstance(get_reasoning_parser("gpt_oss"), HarmonyParser)
    assert isinstance(get_reasoning_parser("openai_gptoss"), HarmonyParser)
    for name in ("deepseek_r1", "qwen3", "mistral"):
        assert isinstance(get_reasoning_parser(name), ThinkTagParser)
    assert get_reasoning_format("qwen3").marker_texts == ("<think>", "</think>")
    assert get_reasoning_format("mistral").marker_texts == ("[THINK]", "[/THINK]")
    assert get_reasoning_format("gpt_oss").marker_texts == (
        "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def test_an_unknown_name_lists_the_names() -> None:
    names = "deepseek_r1, gpt_oss, mistral, openai_gptoss, qwen3"
    with pytest.raises(ValueError, match=f"unknown reasoning parser 'qwen4'; choose one of {names}"):
        get_reasoning_parser("qwen4")


def test_resolve_the_setting() -> None:
    assert resolve_reasoning_parser("", QWEN3) == "qwen3"
    assert resolve_reasoning_parser("", CHATML) is None
    assert resolve_reasoning_parser("none", QWEN3) is None
    assert resolve_reasoning_parser("openai_gptoss", CHATML) == "gpt_oss"
    assert resolve_reasoning_parser("deepseek_r1", QWEN3) == "deepseek_r1"
    with pytest.raises(ValueError, match="choose one of"):
        resolve_reasoning_parser("bogus", QWEN3)


@pytest.mark.parametrize(("name", "tail", "expected"), [
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),  # thinking on, the prompt opened it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking=False
    ("qwen3", "<|im_start|>assistant\n", False),  # the model writes <think> itself
    ("deepseek_r1", "<\uff5cAssistant\uff5c><think>\n", True),
    ("deepseek_r1", "<\uff5cAssistant\uff5c>", True),  # R1 assumes reasoning from the start (vLLM)
    ("deepseek_r1", "<\uff5cAssistant\uff5c></think>", False),  # thinking turned off in the prompt
    ("mistral", "[/INST]", False),
    ("mistral", "[/INST][THINK]", True),
    ("gpt_oss", "<|start|>assistant", False),
    ("gpt_oss", "<|start|>assistant<|channel|>analysis<|message|>", True),
])
def test_starts_in_reasoning(name: str, tail: str, expected: bool) -> None:
    assert starts_in_reasoning(name, tail) is expected
    assert get_reasoning_parser(name, in_reasoning=expected).in_reasoning is expected


def test_cli_setting_and_its_usage_error(capsys) -> None:
    from proxy.cli import build_parser, main, settings_from

    def parse(argv, env=None):
        return settings_from(build_parser().parse_args(["serve", *argv]), env or {})

    assert parse([]).reasoning_parser == ""
    assert parse(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parse(["--reasoning-parser", "none"]).reasoning_parser == "none"
    assert parse([], {"STREAMPROXY_REASONING_PARSER": "gpt_oss"}).reasoning_parser == "gpt_oss"
    with pytest.raises(ValueError, match="--reasoning-parser: unknown reasoning parser 'bogus'"):
        parse([], {"STREAMPROXY_REASONING_PARSER": "bogus"})
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--reasoning-parser", "qwen4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser: unknown reasoning parser 'qwen4'" in err
    assert "deepseek_r1, gpt_oss, mistral, openai_gptoss, qwen3" in err
