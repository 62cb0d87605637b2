"""``--engine-process`` with a grammar that waits for the end of the reasoning: the params (with
``reasoning_end_ids``) cross the pipe, the thinking is sampled as without the grammar, the answer
follows it; a thinking budget crosses it too and closes the thinking at its count."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .helpers import make_tiny_model, tiny_settings

END = 100  # a plain token of the tiny tokenizer standing in for ``</think>``


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-engine-proc-reasoning") / "tiny")


def test_the_grammar_starts_after_the_marker_in_the_engine_process(model_dir: Path) -> None:
    from proxy.engine.factory import build_engine_client
    from proxy.sampling import SamplingParams, StructuredOutputParams, ThinkingBudget

    client = build_engine_client(tiny_settings(model_dir, engine_process=True, self_check=False))
    so = StructuredOutputParams("choice", '["yes", "no"]', reasoning_end_ids=(END,))

    async def run(params: SamplingParams) -> tuple[list[int], str, str | None]:
        ids: list[int] = []
        text, reason = "", None
        async for deltas in client.generate(client.tokenizer.encode("Hello"), params):
            for d in deltas:
                ids += d.token_ids
                text += d.text
                reason = d.finish_reason or reason
        return ids, text, reason

    async def main() -> list[tuple[list[int], str, str | None]]:
        client.start()
        try:
            await client.prepare_structured_output(so, "response_format")
            out = []
            for seed in range(6):
                plain = SamplingParams(max_tokens=64, temperature=1.0, seed=seed, logit_bias={END: 3.5})
                out.append(await run(plain))
                out.append(await run(SamplingParams(**{**plain.__dict__, "structured_outputs": so})))
            greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={END: -100})
            budget = ThinkingBudget(5, (END,))
            budgeted = await run(SamplingParams(**{**greedy.__dict__, "thinking_budget": budget}))
            return [*out, await run(greedy), budgeted]
        finally:
            client.shutdown()

    *results, (free_ids, _, _), (capped_ids, _, _) = asyncio.run(main())
    assert capped_ids[:6] == free_ids[:5] + [END] and len(capped_ids) == 12  # forced across the pipe
    num_mid = 0
    for (free, free_text, free_reason), (ids, text, reason) in zip(results[::2], results[1::2]):
        if END not in free:  # no end of thinking: never constrained
            assert (ids, text, reason) == (free, free_text, free_reason)
            continue
        cut = free.index(END) + 1
        num_mid += cut > 1
        assert ids[:cut] == free[:cut]
        answer = client.tokenizer.decode(ids[cut:])
        assert answer in ("yes", "no") and reason == "stop", (answer, text)
        assert text.endswith(answer) and text == client.tokenizer.decode(ids)
    assert num_mid >= 3, num_mid
