"""Load-time self-check: the engine's greedy ids must equal transformers' ``generate()`` before serving.

The support rules (``proxy.engine.execution.architectures``) refuse what is known not to work; this check
catches what they do not foresee (an architecture whose attention needs something the paged
cache does not carry), so that a model that would produce wrong text is refused at load instead.

What runs (:func:`run_self_check`, a few seconds on a CPU for a small model):

- three seeded random prompts: 5 tokens, 23 tokens, and one longer than every sliding window /
  attention chunk of the model (window + 8, at most ``MAX_PROMPT_TOKENS`` and the context), at
  least 40 tokens;
- through a separate small :class:`~proxy.engine.core.EngineCore` over the same loaded model (its
  own small KV pool, the served ``block_size``), all three submitted together (batched) with a
  token budget of about a third of the long prompt, so that its prefill is chunked while the
  short ones decode; ``NUM_NEW_TOKENS`` greedy tokens each, EOS ignored;
- the reference: ``generate(do_sample=False)`` of each prompt alone, with the model switched to
  transformers' ``eager`` attention and a default ``GenerationConfig`` (no repetition penalty or
  other processors from the model's own generation config), then switched back.

A difference is accepted only where the reference's top-2 logit gap is a near-tie (below
``tie_tolerance``: 1e-3 in fp32, 1.0 in 16-bit dtypes, where bf16 rounding of
logits around 10-20 is already 0.06-0.125; an fp32 model whose packed linears run bf16 activations
counts as 16-bit, :func:`compute_dtype`), and then only from that token on, as in the
engine tests. Any other difference, or an exception in either run, raises :class:`SelfCheckError`
naming the model type and the first differing step. ``Settings.self_check=False`` skips it
(large models on a CPU); a pass is remembered for the same inputs (``proxy.engine.selfcheck_record``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proxy.engine.execution.architectures import layer_specs
from proxy.engine.execution.attention import ATTN_IMPLEMENTATION, activation_dtype, probe_layers
from proxy.models.vision import decoder_attention
from proxy.sampling import SamplingParams
from proxy.settings import Settings

logger = logging.getLogger(__name__)

NUM_NEW_TOKENS = 8
"""Greedy tokens generated per prompt."""
MAX_PROMPT_TOKENS = 1024
"""Longest self-check prompt (windows beyond it are exercised by the tests, not at load)."""
SHORT_PROMPTS = (5, 23)
MIN_LONG_PROMPT = 40
SEED = 1234


class SelfCheckError(RuntimeError):
    """The engine's greedy output differs from ``generate()`` (or a run raised): do not serve."""


@dataclass(frozen=True)
class SelfCheckReport:
    """A passed self-check.

    Attributes:
        model_type: the config's ``model_type``.
        prompt_lengths: tokens of each prompt.
        num_new_tokens: greedy tokens compared per prompt.
        num_near_ties: prompts whose comparison stopped at a near-tie.
        seconds: wall time of the whole check.
    """

    model_type: str
    prompt_lengths: tuple[int, ...]
    num_new_tokens: int
    num_near_ties: int
    seconds: float


def tie_tolerance(dtype: torch.dtype) -> float:
    """Top-2 logit gap below which a differing greedy token counts as a near-tie."""
    return 1e-3 if dtype == torch.float32 else 1.0


def compute_dtype(model: Any) -> torch.dtype:
    """The narrowest dtype ``model``'s activations pass through: its activation dtype, or bf16 where
    a packed linear's kernel runs bf16 activations (``kernel_dtype`` of
    :class:`proxy.quant.linear.PackedLinear`; there the engine's prompt tokens may take dense fp32
    copies while ``generate()``'s take the kernel, ``proxy.quant.dense_prefill``)."""
    dtype = activation_dtype(model)
    for module in model.modules():
        kernel = getattr(module, "kernel_dtype", None)
        if isinstance(kernel, torch.dtype) and kernel.itemsize < dtype.itemsize:
            return kernel
    return dtype


def _model_type(model: Any) -> str:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", None) or getattr(config, "model_type", "unknown"))


def _prompts(model: Any, max_model_len: int, longest_window: int | None) -> list[list[int]]:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", None) or model.get_output_embeddings().weight.shape[0])
    room = max_model_len - NUM_NEW_TOKENS - 1
    long = max(MIN_LONG_PROMPT, (longest_window or 0) + 8)
    long = min(long, MAX_PROMPT_TOKENS, room)
    lengths = [min(n, room) for n in (long, *SHORT_PROMPTS)]
    g = torch.Generator().manual_seed(SEED)
    low = min(3, vocab - 1)
    return [torch.randint(low, vocab, (max(1, n),), generator=g).tolist() for n in lengths]


def greedy_reference(
    model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None,
    min_new_tokens: int = 0,
) -> tuple[list[int], list[float]]:
    """transformers' ``generate(do_sample=False)`` of one prompt alone (batch 1, no padding), the
    reference the engine's greedy ids are compared with (here and in the engine tests).

    Args:
        model: a causal LM; runs with its current attention implementation and generation config.
        prompt: token ids.
        max_new_tokens, min_new_tokens: as ``generate()``'s.
        eos_token_id: passed to ``generate()`` (None: the generation config's).

    Returns:
        ``(new token ids, the top-2 logit gap of each step)``: a gap below :func:`tie_tolerance` marks
        a near-tie, where a different but correct kernel may pick the other token.
    """
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids: list[int] = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for score in out.scores:
        top2 = score[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return ids, gaps


def _reference(model: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """:func:`greedy_reference` of each prompt with eager attention and a default generation config."""
    from transformers import GenerationConfig

    saved_generation_config = model.generation_config
    model.set_attn_implementation("eager")
    try:
        model.generation_config = GenerationConfig(pad_token_id=0)
        return [greedy_reference(model, p, NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS) for p in prompts]
    finally:
        model.generation_config = saved_generation_config
        model.set_attn_implementation(decoder_attention(model.config, ATTN_IMPLEMENTATION))


def _engine_run(
    model: Any, settings: Settings, prompts: list[list[int]], max_model_len: int, chunk: int
) -> list[list[int]]:
    from proxy.engine.core import EngineCore

    bs = settings.block_size
    blocks = sum(-(-(len(p) + NUM_NEW_TOKENS + 1) // bs) for p in prompts) + 2
    check_settings = dataclasses.replace(
        settings, num_kv_blocks=blocks, max_num_seqs=len(prompts), max_num_batched_tokens=chunk
    )
    core = EngineCore(model, check_settings, [], min(max_model_len, blocks * bs))
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    ids: list[list[int]] = [[] for _ in prompts]
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            if out.finish_reason == "error":
                raise SelfCheckError(f"the engine failed on prompt {out.request_id}: {out.error}")
            ids[int(out.request_id)].extend(out.new_token_ids)
        steps += 1
        if steps > 100 * (len(prompts) + NUM_NEW_TOKENS) + sum(len(p) for p in prompts):
            raise SelfCheckError("the engine did not finish the self-check prompts")
    return ids


def run_self_check(
    model: Any, settings: Settings, max_model_len: int, eos_token_ids: Iterable[int] = (), vision: Any = None,
) -> SelfCheckReport:
    """Compare the engine's greedy ids with ``generate()`` on the same loaded model (module docstring).

    Args:
        model: the loaded causal LM, using ``ATTN_IMPLEMENTATION`` (it is switched to ``eager``
            for the reference and back).
        settings: the served settings (``block_size`` is kept; pool and budget are the check's own).
        max_model_len: the served context in tokens (bounds the prompts).
        eos_token_ids: unused by the comparison (EOS is ignored on both sides); kept for callers.
        vision: a vision-language model's ``VisionProcessor``: one image prompt is checked too
            (:mod:`proxy.engine.selfcheck_images`); None: text only.

    Returns:
        a :class:`SelfCheckReport`.

    Raises:
        SelfCheckError: a token differs outside a near-tie, or either run raised; the message names
            the model type, the prompt and the first differing step.
        UnsupportedArchitectureError: from the probe pass (layers the cache cannot serve).
    """
    del eos_token_ids
    start = time.monotonic()
    model_type = _model_type(model)
    specs = layer_specs(model.config, probe_layers(model))
    spans = [s.sliding_window for s in specs if s.sliding_window] + [
        s.chunk_size for s in specs if s.chunk_size
    ]
    spans = [w for w in spans if w < max_model_len]
    prompts = _prompts(model, max_model_len, max(spans) if spans else None)
    long = max(len(p) for p in prompts)
    chunk = max(8, -(-long // 3))
    fail = f"self-check failed for model type '{model_type}'"
    advice = ("the engine would serve different text than transformers; this model is refused "
              "(--no-self-check skips the check at your own risk)")
    try:
        engine_ids = _engine_run(model, settings, prompts, max_model_len, chunk)
    except SelfCheckError as exc:
        raise SelfCheckError(f"{fail}: {exc}; {advice}") from exc
    except Exception as exc:
        raise SelfCheckError(f"{fail}: the engine raised {type(exc).__name__}: {exc}; {advice}") from exc
    try:
        reference = _reference(model, prompts)
    except Exception as exc:
        raise SelfCheckError(
            f"{fail}: transformers' generate() raised {type(exc).__name__}: {exc}; cannot verify the engine"
        ) from exc
    tolerance = tie_tolerance(compute_dtype(model))
    near_ties = 0
    for i, (prompt, got, (want, gaps)) in enumerate(zip(prompts, engine_ids, reference)):
        for step, (a, b) in enumerate(zip(got, want)):
            if a != b:
                if gaps[step] < tolerance:
                    near_ties += 1
                    break
                raise SelfCheckError(
                    f"{fail}: prompt {i} ({len(prompt)} tokens, batched with {len(prompts) - 1} others, "
                    f"prefill chunks of {chunk} tokens) first differs at generated token {step}: engine "
                    f"{a}, generate() {b} (top-2 logit gap {gaps[step]:.3g}); {advice}"
                )
        else:
            if len(got) != len(want):
                raise SelfCheckError(
                    f"{fail}: prompt {i} ({len(prompt)} tokens): the engine generated {len(got)} tokens, "
                    f"generate() {len(want)}; {advice}"
                )
    lengths = tuple(len(p) for p in prompts)
    if vision is not None:
        from proxy.engine.selfcheck_images import check_image_prompt

        try:
            image_len, tie = check_image_prompt(model, vision, settings, max_model_len, NUM_NEW_TOKENS,
                                                tolerance)
        except Exception as exc:
            raise SelfCheckError(f"{fail}: {type(exc).__name__}: {exc}; {advice}") from exc
        lengths, near_ties = (*lengths, image_len), near_ties + tie
    report = SelfCheckReport(
        model_type=model_type,
        prompt_lengths=lengths,
        num_new_tokens=NUM_NEW_TOKENS,
        num_near_ties=near_ties,
        seconds=time.monotonic() - start,
    )
    logger.info(
        "self-check passed for '%s': greedy ids of prompts of %s tokens equal generate() "
        "(%d near-ties) in %.1f s",
        model_type,
        list(report.prompt_lengths),
        near_ties,
        report.seconds,
    )
    return report
