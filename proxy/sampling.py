"""Per-request sampling parameters, shared by the API layer and the engine.

Field meanings follow the OpenAI API reference (``temperature``, ``top_p``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``seed``, ``stop``, ``logprobs``/``top_logprobs``) and vLLM's
extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutputParams:
    """What a constrained request's output must match (vLLM's ``StructuredOutputsParams``, one kind).

    Attributes:
        kind: ``"json"`` (``spec`` is a JSON Schema as JSON text), ``"json_object"`` (any JSON object;
            ``spec`` is ignored), ``"regex"`` (``spec`` is a regular expression), ``"choice"``
            (``spec`` is a JSON list of strings; the output is exactly one of them), ``"grammar"``
            (``spec`` is an EBNF grammar in GBNF syntax with a ``root`` rule).
        spec: the grammar source text; with ``kind`` it is the compile-cache key.
        reasoning_end_ids: the end-of-thinking marker as token ids (one special token such as
            ``</think>``, or several plain tokens), or None: the grammar applies from the first output
            token. With a marker the grammar applies from the token after the marker's first
            occurrence in the output (vLLM's ``reasoning_ended`` / ``is_reasoning_end``); until then
            the output is free text, sampled exactly as without ``structured_outputs``, bounded only
            by ``max_tokens``. See :class:`proxy.engine.structured.ReasoningEnd`.
        starts_in_reasoning: with a marker: True (default) when the prompt opened the thinking (the
            generation prompt ends with ``<think>``), so the output starts inside the reasoning; False
            when the model may think or not, which its first output token decides (see
            ``reasoning_start_ids``). Ignored without a marker.
        reasoning_start_ids: the start-of-thinking marker as token ids; used only when
            ``starts_in_reasoning`` is False: the output thinks iff its first token is
            ``reasoning_start_ids[0]`` (that token is allowed beside the grammar's first tokens);
            any other first token starts the grammar at once. Empty: the grammar applies at once.
    """

    kind: StructuredOutputKind
    spec: str = ""
    reasoning_end_ids: tuple[int, ...] | None = None
    starts_in_reasoning: bool = True
    reasoning_start_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.reasoning_end_ids is not None and not self.reasoning_end_ids:
            raise ValueError("reasoning_end_ids must be None or a non-empty tuple of token ids")


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on the thinking of one request (vLLM's ``thinking_token_budget``; Anthropic's
    ``thinking.budget_tokens``): once ``max_tokens`` thinking tokens are out without the end marker,
    the marker's tokens are forced as the next sampled tokens, one a step, and generation goes on
    normally after them. Enforced by :class:`proxy.engine.thinking_budget.ThinkingBudgetState`.

    Attributes:
        max_tokens: the most thinking tokens (>= 0; 0 closes the thinking at once). Counted from
            output token 0 when ``starts_in_reasoning``, else from the token after ``start_ids``.
        end_ids: the reasoning parser's end marker as token ids (``</think>``: one special token, or
            several plain ones); its first whole occurrence in the output ends the thinking.
        starts_in_reasoning: the prompt opened the thinking (the generation prompt ends with
            ``<think>``): the output starts inside it.
        start_ids: without ``starts_in_reasoning``: the output thinks only when it begins with these
            token ids (the open marker as the first output tokens, where the reasoning parser reads it);
            empty or not matched: there is no thinking to cap.
    """

    max_tokens: int
    end_ids: tuple[int, ...]
    starts_in_reasoning: bool = True
    start_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or not self.end_ids:
            raise ValueError("a thinking budget needs max_tokens >= 0 and a non-empty end marker")


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops.

    Attributes:
        max_tokens: most tokens to generate (>= 1); ``finish_reason="length"`` when reached.
        temperature: 0 means greedy (argmax); > 0 divides the logits.
        top_p: nucleus mass in [0, 1]; 1 disables; 0 keeps only the most likely token (OpenAI accepts the
            closed range), which is greedy decoding: the same tokens as ``temperature=0``.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p * p_max``; 0 disables.
        seed: seeds this request's own ``torch.Generator``; the same seed gives the same tokens
            whatever else runs in the batch, and every distinct 64-bit value (taken modulo 2**64) its
            own stream (the API accepts the signed 64-bit range). None: non-deterministic.
        presence_penalty, frequency_penalty: OpenAI additive penalties over the generated tokens, in [-2, 2].
        repetition_penalty: multiplicative penalty (CTRL paper, Keskar et al. 2019) over prompt and
            generated tokens; 1 disables.
        logit_bias: token id -> bias added to its logit, in [-100, 100].
        stop: stop strings; the output ends before the first match, which is not included.
        stop_token_ids: token ids that end the sequence (not included in the text).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: return the chosen token's log-probability for every generated token.
        top_logprobs: also return this many most likely alternatives per position (0..20).
        min_tokens: generate at least this many tokens before an EOS / ``stop_token_ids`` token
            may end the sequence (vLLM's ``min_tokens``; not applied to a constrained request: its
            grammar decides when the output may end; nor, so, to its reasoning before the grammar
            starts); see :meth:`is_stop_allowed`.
        structured_outputs: constrain the output to a grammar (``response_format``, tool calls);
            None: unconstrained.
        keep_special_ids: special tokens whose text stays in the output text (the detokenizer
            drops special tokens otherwise): the markers a tool-call parser reads, such as
            Mistral's ``[TOOL_CALLS]`` (vLLM sets ``skip_special_tokens=False`` for such parsers;
            this keeps only the markers, so EOS and other specials still never show).
        reasoning_parser: the ``--reasoning-parser`` name whose thinking this request's output
            starts with (``proxy.reasoning``); output processing counts the tokens generated while
            inside it (``usage.completion_tokens_details.reasoning_tokens``). None: no parser.
        starts_in_reasoning: the prompt opened the thinking (its generation prompt ends with
            ``<think>``), so the output starts inside it.
        thinking_budget: close the thinking at a number of tokens (forced end marker); None: the
            thinking ends when the model ends it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    structured_outputs: StructuredOutputParams | None = None
    keep_special_ids: frozenset[int] = frozenset()
    reasoning_parser: str | None = None
    starts_in_reasoning: bool = False
    thinking_budget: ThinkingBudget | None = None

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0, or top_p 0 (only the most likely token)."""
        return self.temperature <= 0.0 or self.top_p <= 0.0

    def is_stop_allowed(self, num_tokens_before: int) -> bool:
        """Whether an EOS or ``stop_token_ids`` token may be generated (and end the sequence) after
        ``num_tokens_before`` output tokens: the one ``min_tokens`` rule. The sampler masks those
        tokens while it is False; the scheduler and the test engine finish only when it is True.
        Like vLLM's ``MinTokensLogitsProcessor``: ``min_tokens=2`` means two ordinary tokens, then
        the stop token may come as the third. A constrained request (``structured_outputs``) may
        always stop: its grammar decides when the output may end (banning EOS could leave no token).
        """
        return self.structured_outputs is not None or num_tokens_before >= self.min_tokens
