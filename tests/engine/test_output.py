"""OutputProcessor + Mailbox: detokenize, stop strings, coalescing for a lagging consumer, errors."""

from __future__ import annotations

import asyncio

from api.fakes import make_tokenizer

from proxy.engine.mailbox import Mailbox
from proxy.engine.output import OutputProcessor
from proxy.engine.request import IMAGE_ENCODING_FAILED, RequestOutput, TokenLogprob
from proxy.sampling import SamplingParams


def out(rid, ids, finished=False, reason=None, lps=None, stop_reason=None, error=None):
    return RequestOutput(rid, list(ids), lps, finished, reason, 3, 0, error, stop_reason=stop_reason)


class Proc:
    """One output at a time through ``OutputProcessor.process_outputs``, collecting the ids to abort."""

    def __init__(self, inner: OutputProcessor, aborted: list[str]) -> None:
        self.inner, self.aborted = inner, aborted

    def process(self, output: RequestOutput) -> None:
        self.aborted.extend(self.inner.process_outputs([output]))

    @property
    def num_tracked(self) -> int:
        return self.inner.num_tracked

    def remove(self, request_id: str) -> None:
        self.inner.abort(request_id)


def setup(params=None, n=1):
    params = params or SamplingParams()
    tok = make_tokenizer()
    aborted: list[str] = []
    proc = Proc(OutputProcessor(tok), aborted)
    box = Mailbox(n)
    for i in range(n):
        proc.inner.add(f"r-{i}", box, i, params)
    return tok, proc, box, aborted


def test_lagging_consumer_gets_one_coalesced_delta():
    async def main():
        tok, proc, box, _ = setup()
        ids = tok.encode("Hello world! alpha beta")
        for t in ids:  # the consumer does not run in between: everything merges into the slot
            proc.process(out("r-0", [t]))
        first = box.take()
        proc.process(out("r-0", [], True, "length"))
        second = box.take()
        return ids, first, second, box

    ids, first, second, box = asyncio.run(main())
    assert [(d.index, d.text, d.finish_reason) for d in first] == [(0, "Hello world! alpha beta", None)]
    assert [(d.index, d.text, d.finish_reason) for d in second] == [(0, "", "length")]
    assert box.take() == [] and box.is_finished and box.num_output_tokens == len(ids)


def test_split_character_is_held_until_complete():
    async def main():
        tok, proc, box, _ = setup()
        ids = tok.encode("a 🤗")  # the emoji spans two byte-level tokens
        texts = []
        for t in ids:
            proc.process(out("r-0", [t]))
            texts.append("".join(d.text for d in box.take()))
        return texts

    texts = asyncio.run(main())
    assert "".join(texts) == "a 🤗"
    assert all("\ufffd" not in t for t in texts) and "" in texts  # the first half produced no text


def test_stop_string_finishes_and_aborts_once():
    async def main():
        tok, proc, box, aborted = setup(SamplingParams(stop=("END",)))
        for t in tok.encode("alpha END beta"):
            proc.process(out("r-0", [t]))
        return box.take(), aborted, proc.num_tracked

    deltas, aborted, tracked = asyncio.run(main())
    assert "".join(d.text for d in deltas) == "alpha "
    assert deltas[-1].finish_reason == "stop"
    assert aborted == ["r-0"] and tracked == 0


def test_stop_match_settled_at_the_end_finishes_with_stop():
    """Stops ["abcd", "bc"]: "bc" waits while "abcd" could still match from the earlier "a"; when
    max_tokens ends the request there, "bc" is the match: text "x a", finish_reason "stop"."""
    async def main():
        tok, proc, box, aborted = setup(SamplingParams(stop=("abcd", "bc")))
        ids = tok.encode("x abc")
        for t in ids:
            proc.process(out("r-0", [t]))
        proc.process(out("r-0", [], True, "length"))
        return box.take(), aborted, proc.num_tracked

    deltas, aborted, tracked = asyncio.run(main())
    assert "".join(d.text for d in deltas) == "x a"
    assert deltas[-1].finish_reason == "stop"
    assert aborted == [] and tracked == 0  # the engine had already finished it


def test_stop_token_text_is_excluded_and_its_logprob_has_no_bytes():
    async def main():
        tok, proc, box, _ = setup(SamplingParams(logprobs=True))
        a = tok.encode("alpha")[0]
        proc.process(out("r-0", [a], lps=[TokenLogprob(a, -0.1, [])]))
        proc.process(out("r-0", [a], True, "stop", lps=[TokenLogprob(a, float("-inf"), [])], stop_reason=a))
        return tok, box.take()

    tok, deltas = asyncio.run(main())
    text = tok.decode(tok.encode("alpha")[:1])
    assert "".join(d.text for d in deltas) == text
    entries = [e for d in deltas for e in d.logprobs]
    assert [(e.token_bytes, e.logprob) for e in entries] == [(text.encode(), -0.1), (b"", -9999.0)]


def test_engine_error_and_abort_fail_the_mailbox():
    async def main():
        _, proc, box, _ = setup(n=2)
        proc.process(out("r-1", [], True, "error", error="boom"))
        proc.process(out("r-0", [], True, "abort"))
        return box

    box = asyncio.run(main())
    assert box.error is not None and box.error.message == "boom" and box.error.code == "engine_error"
    assert box.is_finished


def test_outputs_after_remove_are_dropped():
    async def main():
        tok, proc, box, _ = setup()
        proc.remove("r-0")
        proc.remove("r-0")
        proc.process(out("r-0", tok.encode("alpha"), True, "length"))
        return box.take()

    assert asyncio.run(main()) == []


def test_wait_wakes_on_text_and_not_on_held_back_bytes():
    async def main():
        tok, proc, box, _ = setup()
        half = tok.encode("🤗")[0]
        proc.process(out("r-0", [half]))
        try:
            await asyncio.wait_for(box.wait(), 0.05)
            woke = True
        except asyncio.TimeoutError:
            woke = False
        proc.process(out("r-0", tok.encode("🤗")[1:]))
        await asyncio.wait_for(box.wait(), 1)
        return woke, box.take()

    woke, deltas = asyncio.run(main())
    assert not woke and deltas[0].text == "🤗"


def test_cached_tokens_come_from_choice_zero():
    """``usage`` counts the prompt once, so its ``cached_tokens`` is choice 0's prefix-cache hit; a
    later choice reusing the blocks choice 0 computed does not change it."""
    async def main():
        _, proc, box, _ = setup(n=2)
        assert box.num_cached_tokens == 0
        proc.process(RequestOutput("r-1", [5], None, False, None, 40, 1, num_cached_tokens=32))
        proc.process(RequestOutput("r-0", [5], None, False, None, 40, 1, num_cached_tokens=16))
        proc.process(RequestOutput("r-1", [6], None, False, None, 40, 2, num_cached_tokens=32))
        return box.num_cached_tokens

    assert asyncio.run(main()) == 16


def test_every_request_handed_to_the_engine_is_counted_once_however_it_ends():
    """``request_success_total`` sums to the requests the engine took: aborted while still queued
    (no output yet: no queue time), aborted mid-generation (queue time from its first scheduling),
    finished; a request refused before it ran (``observe=False``, counted as rejected) is not."""
    from prometheus_client.parser import text_string_to_metric_families

    from proxy.engine.stats import MetricsRecorder
    from proxy.metrics import Metrics

    metrics = Metrics("m")
    proc = OutputProcessor(make_tokenizer(), MetricsRecorder(metrics))
    box = Mailbox(4)
    for i in range(4):
        proc.add(f"r-{i}", box, i, SamplingParams(), num_prompt_tokens=5)
    tok = make_tokenizer().encode("Hello")[0]
    proc.abort("r-0")  # queued, never scheduled
    running = RequestOutput("r-1", [tok], None, False, None, 5, 1, arrival_time=10.0,
                            first_scheduled_time=10.25, first_token_time=10.5)
    proc.process_outputs([running])
    proc.abort("r-1")  # mid-generation
    proc.process_outputs([RequestOutput("r-2", [tok], None, True, "length", 5, 1, arrival_time=10.0,
                                        first_scheduled_time=10.5, first_token_time=10.75)])
    proc.abort("r-3", observe=False)  # refused before it ran
    assert proc.num_tracked == 0
    def scrape() -> dict[tuple[str, str | None], float]:
        return {(s.name, s.labels.get("finished_reason")): s.value
                for family in text_string_to_metric_families(metrics.render().decode())
                for s in family.samples}

    samples = scrape()
    assert samples[("streamproxy:request_success_total", "abort")] == 2
    assert samples[("streamproxy:request_success_total", "length")] == 1
    assert samples[("streamproxy:request_queue_time_seconds_count", None)] == 2
    assert samples[("streamproxy:request_queue_time_seconds_sum", None)] == 0.75
    assert samples[("streamproxy:prompt_tokens_total", None)] == 15
    assert samples[("streamproxy:generation_tokens_total", None)] == 2
    proc.abort("r-0")  # idempotent: a closed response is not counted twice
    assert scrape()[("streamproxy:request_success_total", "abort")] == 2


def test_an_image_the_encoder_failed_on_is_a_400():
    async def main():
        _, proc, box, _ = setup()
        failed = out("r-0", [], True, "error", error="the encoder failed")
        failed.error_code = IMAGE_ENCODING_FAILED
        proc.process(failed)
        return box

    error = asyncio.run(main()).error
    assert error is not None and (error.status, error.type, error.code, error.message) == (
        400, "invalid_request_error", IMAGE_ENCODING_FAILED, "the encoder failed")
