"""Test doubles for the API layer: a tiny real tokenizer and a scripted engine.

``FakeEngine`` implements the ``AsyncEngine`` contract of docs/internals.md (``start``,
``shutdown``, ``submit``, ``abort``, ``is_healthy``, counters, ``fault_injector``) and emits one
scripted token per step on the event loop, so the API can be tested without torch.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.request import RequestOutput, TokenLogprob
from proxy.errors import EngineDeadError, RateLimitError
from proxy.sampling import SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world! This is a test of the streaming server. alpha beta gamma delta",
    "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5.",
    "你好，世界。我很感动。🤗 emoji and café, naïve façade",
    "STOP here END and then more text follows\nnew line",
]


@functools.lru_cache(maxsize=1)
def make_hf_tokenizer() -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) trained in-process on :data:`CORPUS`, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHATML
    return hf


def make_tiny_model(folder: Any) -> None:
    """A randomly initialised 2-layer Llama over :func:`make_hf_tokenizer`, saved as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_hf_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


class SimpleTokenizer:
    """Stand-in with the ``proxy.tokenizer.Tokenizer`` interface (used only if that module is absent)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.eos_token_ids = frozenset({hf.convert_tokens_to_ids("<|im_end|>")})

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def new_detokenizer(self) -> Any:
        return _ExactDetokenizer(self)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode("utf-8", "surrogatepass")

    def token_text(self, token_id: int) -> str:
        return str(self.hf.convert_ids_to_tokens(token_id))


class _ExactDetokenizer:
    def __init__(self, tok: SimpleTokenizer) -> None:
        self._tok, self._ids, self._sent = tok, [], 0

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        end = len(text)
        while end > self._sent and text[end - 1] == "\ufffd":
            end -= 1
        out, self._sent = text[self._sent:end], end
        return out

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        out, self._sent = text[self._sent:], len(text)
        return out


def make_tokenizer() -> Any:
    """``proxy.tokenizer.Tokenizer`` over :func:`make_hf_tokenizer` (or the stand-in before it exists)."""
    try:
        from proxy.tokenizer import Tokenizer
    except ImportError:
        return SimpleTokenizer(make_hf_tokenizer())
    return Tokenizer(make_hf_tokenizer())


def fake_logprob(position: int, token_id: int, k: int) -> TokenLogprob:
    """Deterministic logprobs: chosen ``-0.5 * (position + 1)``, alternatives ``token_id + j``."""
    lp = -0.5 * (position + 1)
    return TokenLogprob(token_id, lp, [(token_id + j, lp - j) for j in range(k)])


@dataclass
class _Running:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    on_output: Callable[[Any], None]
    script: list[int]
    task: asyncio.Task[None] | None = None
    num_out: int = 0


@dataclass
class FakeEngine:
    """Scripted ``AsyncEngine``: each request generates ``script(prompt_ids, params)``, one token per step.

    Attributes:
        script: token ids to generate for a request (default: :attr:`reply_ids`).
        eos_token_ids: finish ``"stop"`` on these (unless ``ignore_eos``); EOS counts as a token.
        step_s: seconds per step (0: next loop iteration).
        fail_after: when set, a request fails (``finish_reason="error"``) after this many tokens.
        max_waiting: ``submit`` raises RateLimitError past this many live requests.
    """

    reply_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    step_s: float = 0.0
    fail_after: int | None = None
    max_waiting: int = 1000
    script: Callable[[list[int], SamplingParams], list[int]] | None = None
    is_healthy: bool = True
    fault_injector: Callable[[], None] | None = None
    started: bool = False
    running: dict[str, _Running] = field(default_factory=dict)
    submitted: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def start(self) -> None:
        asyncio.get_running_loop()
        self.started = True

    def shutdown(self) -> None:
        for r in list(self.running.values()):
            if r.task is not None:
                r.task.cancel()
        self.running.clear()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def kv_cache_usage(self) -> float:
        return 0.0

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               on_output: Callable[[Any], None]) -> None:
        if not self.is_healthy:
            raise EngineDeadError("The engine is not running.")
        if len(self.running) >= self.max_waiting:
            raise RateLimitError("Too many requests are waiting; retry later.")
        self.submitted.append((request_id, list(prompt_token_ids), params))
        script = self.script(list(prompt_token_ids), params) if self.script else list(self.reply_ids)
        r = _Running(request_id, list(prompt_token_ids), params, on_output, script)
        self.running[request_id] = r
        r.task = asyncio.get_running_loop().create_task(self._run(r))

    def abort(self, request_id: str) -> None:
        r = self.running.pop(request_id, None)
        if r is not None:
            self.aborted.append(request_id)
            if r.task is not None:
                r.task.cancel()

    def _out(self, r: _Running, ids: list[int], finished: bool, reason: str | None,
             error: str | None = None, stop_reason: int | None = None) -> RequestOutput:
        lps = None
        if r.params.logprobs:
            lps = [fake_logprob(r.num_out - len(ids) + j, t, r.params.top_logprobs) for j, t in enumerate(ids)]
        return RequestOutput(r.request_id, ids, lps, finished, reason, len(r.prompt), r.num_out, error,
                             stop_reason=stop_reason)

    async def _run(self, r: _Running) -> None:
        p = r.params
        for i in range(p.max_tokens):
            await asyncio.sleep(self.step_s)
            if self.fault_injector is not None:
                try:
                    self.fault_injector()
                except Exception as exc:  # noqa: BLE001 - the step fails: this request finishes with an error
                    self.running.pop(r.request_id, None)
                    r.on_output(self._out(r, [], True, "error", f"engine step failed: {exc}"))
                    return
            if self.fail_after is not None and i >= self.fail_after:
                self.running.pop(r.request_id, None)
                r.on_output(self._out(r, [], True, "error", "injected failure"))
                return
            token = r.script[i] if i < len(r.script) else (r.script[-1] if r.script else 0)
            r.num_out += 1
            is_eos = token in self.eos_token_ids and not p.ignore_eos and r.num_out > p.min_tokens
            is_last = is_eos or r.num_out >= p.max_tokens
            reason = "stop" if is_eos else ("length" if is_last else None)
            if is_last:
                self.running.pop(r.request_id, None)
            r.on_output(self._out(r, [token], is_last, reason, stop_reason=token if is_eos else None))
            if is_last:
                return
