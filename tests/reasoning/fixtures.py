"""Thinking-model fixtures for tests: tokenizers, chat templates and tiny random model folders.

Built in-process and seeded, no hub download; the templates are our own, modelled on the public
ones (Qwen3's ChatML with ``<think>``, GPT-OSS's harmony), so that end-to-end tests can drive the
real request path with a thinking model:

- :func:`make_qwen3_style_tokenizer`: byte-level BPE with ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` as special tokens, ``<think>`` / ``</think>`` as special tokens (``"special"``), as
  plain added tokens like Qwen3's vocabulary (``"added"``: one id each, kept by the decoder), or not in
  the vocabulary at all (``"plain"``: split into several tokens), ``<tool_call>`` / ``</tool_call>`` as
  added tokens, and :data:`QWEN3_STYLE_TEMPLATE`.
- :func:`write_qwen3_style_model`: that tokenizer beside a random 2-layer ``Qwen3ForCausalLM``.
- :func:`make_harmony_tokenizer` / :func:`write_harmony_style_model`: the harmony markers as special
  tokens, :data:`HARMONY_STYLE_TEMPLATE`, EOS ``<|return|>`` and ``<|call|>``. (openai-harmony 0.0.8
  ships no vocabulary: it downloads ``o200k_base`` at run time, so it cannot be used here.)
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Literal

ThinkTokens = Literal["special", "added", "plain"]

QWEN3_STYLE_TEMPLATE = (  # transformers renders with trim_blocks: a newline after a block tag is {{ '\n' }}
    "{% if tools %}<|im_start|>system{{ '\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "{% set content = message.content or '' %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ content }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}"
    "{% else %}<think>{{ '\\n' }}{% endif %}"
    "{% endif %}"
)
"""ChatML with thinking, after Qwen3's (2507-thinking style): the generation prompt opens the thinking
(``<|im_start|>assistant\\n<think>\\n``), or with ``enable_thinking=False`` closes an empty one
(``<think>\\n\\n</think>\\n\\n``); past assistant turns lose their thinking (the text up to
``</think>``); ``reasoning_content`` fields are not rendered; tools are listed in the system message
and calls written as ``<tool_call>`` JSON (the ``hermes`` parser's format)."""

HARMONY_STYLE_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\nKnowledge cutoff: 2024-06\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}"
    "<|end|>"
    "{% set system = messages | selectattr('role', 'in', ['system', 'developer']) | list %}"
    "{% if system or tools %}<|start|>developer<|message|>"
    "{% if system %}# Instructions{{ '\\n\\n' }}{{ system[0].content }}{% endif %}"
    "{% if tools %}{% if system %}{{ '\\n\\n' }}{% endif %}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "{{ '\\n' }}// {{ fn.description }}\ntype {{ fn.name }} = (_: {{ fn.parameters | tojson }}) => any;\n"
    "{% endfor %}{{ '\\n' }}} // namespace functions{% endif %}<|end|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}"
    "{% set thinking = message.reasoning_content or message.reasoning or message.thinking %}"
    "{% if message.tool_calls %}"
    "{% if thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>{% endif %}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "<|start|>assistant to=functions.{{ fn.name }}<|channel|>commentary json<|message|>"
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}<|call|>"
    "{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<|start|>functions.{{ message.name or 'tool' }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
"""Harmony, after GPT-OSS's template: system message with ``Reasoning: <reasoning_effort>`` (default
medium), a developer message with the instructions and the tools as a TypeScript namespace, the
generation prompt ``<|start|>assistant``; a past assistant turn's thinking (``reasoning_content``,
``reasoning`` or ``thinking``) is kept only before its tool calls, as GPT-OSS's template does."""

HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|constrain|>", "<|return|>", "<|call|>")

_CORPUS = [
    "Hello! How can I help you today? The weather in Paris is sunny and warm.",
    "Let me think about this step by step. First, the user wants to know the answer.",
    "Okay, so the question is simple: 2 + 2 = 4. I should answer briefly.",
    'The function get_weather takes {"city": "Oslo", "unit": "celsius"} as arguments.',
    "analysis commentary final assistant user system developer functions json",
    "Hmm, wait. Actually, I think the answer is 42. Let me double-check that.",
    "def f(x):\n    return x * 2\n\nprint(f(21))",
    "naïve café, 你好，世界 🤗 — emoji and accents too.",
]


@functools.cache
def _bpe(specials: tuple[str, ...], vocab_size: int = 600) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def make_qwen3_style_tokenizer(think_tokens: ThinkTokens = "special") -> Any:
    """A ``PreTrainedTokenizerFast`` with :data:`QWEN3_STYLE_TEMPLATE` (see the module docstring for
    ``think_tokens``); EOS ``<|im_end|>``, pad ``<|endoftext|>``. A fresh object each call."""
    from transformers import PreTrainedTokenizerFast

    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    if think_tokens == "special":
        specials += ("<think>", "</think>")
    hf = PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(_bpe(specials)), eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    added = ["<tool_call>", "</tool_call>"] + (["<think>", "</think>"] if think_tokens == "added" else [])
    hf.add_tokens(added)
    hf.chat_template = QWEN3_STYLE_TEMPLATE
    return hf


def make_harmony_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with the harmony markers (:data:`HARMONY_SPECIALS`) as special
    tokens and :data:`HARMONY_STYLE_TEMPLATE`; EOS ``<|return|>`` (``<|call|>`` is an EOS of the
    model folder's generation config too). A fresh object each call."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(_bpe(HARMONY_SPECIALS)),
                                 bos_token="<|startoftext|>", eos_token="<|return|>",
                                 pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    hf.chat_template = HARMONY_STYLE_TEMPLATE
    return hf


def _write_model(folder: Path, hf: Any, eos_tokens: tuple[str, ...], seed: int,
                 positions: int = 1024) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos_ids = [hf.convert_tokens_to_ids(t) for t in eos_tokens]
    config = Qwen3Config(vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=positions, eos_token_id=eos_ids[0],
                         pad_token_id=hf.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=hf.pad_token_id).save_pretrained(folder)
    hf.save_pretrained(folder)
    return folder


def write_qwen3_style_model(folder: Path | str, *, think_tokens: ThinkTokens = "special",
                            seed: int = 0, positions: int = 1024) -> Path:
    """A tiny random Qwen3-style thinking model folder (``Qwen3ForCausalLM``, 2 layers, hidden 64,
    fp32, ``positions`` positions) with :func:`make_qwen3_style_tokenizer`; EOS ``<|im_end|>``. Returns the
    folder (created if needed). Serve it with ``--model FOLDER``; ``</think>`` is one token unless
    ``think_tokens="plain"`` (so ``logit_bias`` can place it)."""
    return _write_model(Path(folder), make_qwen3_style_tokenizer(think_tokens), ("<|im_end|>",), seed,
                        positions)


def write_harmony_style_model(folder: Path | str, *, seed: int = 0) -> Path:
    """A tiny random model folder with :func:`make_harmony_tokenizer` (a ``Qwen3ForCausalLM`` body: the
    reasoning path only sees the tokenizer and template); EOS ``<|return|>`` and ``<|call|>``."""
    return _write_model(Path(folder), make_harmony_tokenizer(), ("<|return|>", "<|call|>"), seed)
