"""The thinking-model fixtures load as the server loads models, and their templates render what the
parsers expect (so end-to-end tests can rely on them)."""

from __future__ import annotations

import pytest

from proxy.reasoning import detect_reasoning_parser, starts_in_reasoning
from proxy.tools import detect_parser

from .fixtures import (
    HARMONY_STYLE_TEMPLATE,
    QWEN3_STYLE_TEMPLATE,
    make_harmony_tokenizer,
    make_qwen3_style_tokenizer,
    write_harmony_style_model,
    write_qwen3_style_model,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nold thoughts</think>\n\nHello"},
        {"role": "user", "content": "Again"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object"}}}]


def test_qwen3_style_template_honours_enable_thinking() -> None:
    hf = make_qwen3_style_tokenizer()
    on = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    off = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    history = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello<|im_end|>\n"  # the past thinking is dropped
               "<|im_start|>user\nAgain<|im_end|>\n")
    assert on == history + "<|im_start|>assistant\n<think>\n"
    assert off == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert starts_in_reasoning("qwen3", on) and not starts_in_reasoning("qwen3", off)
    assert detect_reasoning_parser(QWEN3_STYLE_TEMPLATE) == "qwen3"
    assert detect_parser(QWEN3_STYLE_TEMPLATE) == "hermes"
    with_tools = hf.apply_chat_template(CHAT[1:2], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in with_tools


def test_harmony_style_template() -> None:
    hf = make_harmony_tokenizer()
    calls = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
              "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "name": "get_weather", "content": "sunny"}]
    text = hf.apply_chat_template(calls, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                  reasoning_effort="low")
    assert "Reasoning: low" in text
    assert text.endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"  # kept before tool calls
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant")
    assert "Reasoning: medium" in hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert detect_reasoning_parser(HARMONY_STYLE_TEMPLATE) == "gpt_oss"
    assert not starts_in_reasoning("gpt_oss", text)


@pytest.mark.parametrize("write", [write_qwen3_style_model, write_harmony_style_model])
def test_model_folders_load_as_the_server_loads_them(tmp_path, write) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from proxy.engine.loading import load_engine_model as load_model
    from proxy.settings import Settings
    from proxy.tokenizer import Tokenizer

    folder = write(tmp_path / "m")
    loaded = load_model(Settings(model=str(folder), device="cpu", dtype="float32", self_check=False))
    tok = Tokenizer(loaded.hf_tokenizer, generation_eos_ids=loaded.eos_token_ids)
    hf = tok.hf_tokenizer
    assert tok.decode_path.startswith("table:"), tok.decode_path
    eos = {"<|im_end|>"} if write is write_qwen3_style_model else {"<|return|>", "<|call|>"}
    assert {hf.convert_tokens_to_ids(t) for t in eos} <= loaded.eos_token_ids <= tok.eos_token_ids
    if write is write_harmony_style_model:  # <|end|> ends the analysis message, not the turn
        assert hf.convert_tokens_to_ids("<|end|>") not in tok.eos_token_ids
    assert loaded.model.config.model_type == "qwen3"
    prompt = tok.apply_chat_template(CHAT)
    model = AutoModelForCausalLM.from_pretrained(str(folder))  # a plain forward of the saved weights
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), len(hf))
