"""bench/serve_bench.py: the metric math (exact values) and a run against a fake OpenAI SSE server.

The fake server (starlette under uvicorn on 127.0.0.1, in a thread) streams a role-only chunk at once,
then content chunks at known delays, then a finish chunk and a usage chunk, like an OpenAI server with
``stream_options.include_usage``. TTFT must be measured to the first *content* chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import testdata

REPO = Path(__file__).resolve().parents[2]


def _load_module() -> Any:
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "bench" / "serve_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


sb = _load_module()

ROLE_DELAY_S = 0.12  # role chunk at once, first content this much later
GAP_S = 0.02  # between content chunks
PROMPT_TOKENS = 11
CACHED_LATER_TURNS = 7  # the fake reports this many cached prompt tokens on a conversation's later turns


# --------------------------------------------------------------------------------------------------
# metric math


def _res(start: float, ttft: float, latency: float, itl: list[float], out: int | None, **kw: Any) -> Any:
    return sb.RequestResult(
        success=True, start_time=start, ttft=ttft, latency=latency, itl=itl, output_tokens=out,
        prompt_tokens=kw.pop("prompt", 10), num_content_chunks=len(itl) + 1, **kw,
    )


def test_calculate_metrics_exact() -> None:
    results = [
        _res(0.0, 0.100, 1.100, [0.25, 0.25, 0.25, 0.25], 5),  # tpot (1.1-0.1)/4 = 0.25
        _res(0.5, 0.300, 2.300, [0.5, 0.5, 1.0], 3, prompt=20),  # tpot 2.0/2 = 1.0
        _res(3.0, 0.200, 0.200, [], 1),  # one token: no tpot, no itl
        sb.RequestResult(success=False, error="HTTP 500", start_time=4.0, latency=0.01, prompt_tokens=None),
    ]
    m = sb.calculate_metrics(results, duration_s=4.0, percentiles=(50, 90, 99))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 40
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(2.25)
    assert m["total_token_throughput"] == pytest.approx(49 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation between 200 and 300
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(2 / 3) * 100)
    assert m["mean_tpot_ms"] == pytest.approx(625.0)
    assert m["median_tpot_ms"] == pytest.approx(625.0)
    assert m["p99_tpot_ms"] == pytest.approx(250 + 0.99 * 750)
    assert m["mean_itl_ms"] == pytest.approx(3000 / 7)
    assert m["median_itl_ms"] == pytest.approx(250.0)
    assert m["p50_itl_ms"] == pytest.approx(250.0)
    assert m["mean_e2el_ms"] == pytest.approx(3600 / 3)
    assert m["p99_e2el_ms"] == pytest.approx(1100 + 0.98 * 1200)
    assert m["max_concurrent_requests"] == 2  # [0,1.1) and [0.5,2.8) overlap; [3,3.2) alone
    assert m["output_lens"] == [5, 3, 1, 0]
    assert m["input_lens"] == [10, 20, 10, 0]
    assert m["errors"] == ["", "", "", "HTTP 500"]


def test_output_tokens_fall_back_to_tokenizer_then_chunks() -> None:
    r = _res(0.0, 0.1, 0.5, [0.1, 0.1], None, generated_text="a b c d")
    assert sb.output_token_count(r) == 3  # content chunks
    assert sb.output_token_count(r, lambda t: len(t.split())) == 4
    r.output_tokens = 7
    assert sb.output_token_count(r, lambda t: len(t.split())) == 7


def test_empty_and_invalid() -> None:
    m = sb.calculate_metrics([sb.RequestResult(success=False, error="x")], 2.0)
    assert (m["completed"], m["failed"], m["mean_ttft_ms"], m["p99_itl_ms"]) == (0, 1, 0.0, 0.0)
    with pytest.raises(ValueError):
        sb.calculate_metrics([], 0.0)


def test_peak_concurrency_half_open() -> None:
    rs = [_res(0.0, 0.1, 1.0, [], 1), _res(1.0, 0.1, 1.0, [], 1), _res(1.5, 0.1, 1.0, [], 1)]
    assert sb.peak_concurrency(rs) == 2


def test_payload_eos_strategies() -> None:
    req = sb.SampleRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=32, fixed_output=True)
    cfg = sb.ClientConfig(base_url="http://x", model="m")
    body = sb.build_payload(cfg, req)
    assert body == {
        "model": "m", "max_tokens": 32, "temperature": 0.0, "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    cfg.eos_strategy, cfg.stream_options = "min_tokens", False
    assert sb.build_payload(cfg, req)["min_tokens"] == 32 and "stream_options" not in sb.build_payload(
        cfg, req
    )
    cfg.eos_strategy, cfg.eos_token_ids = "logit_bias", (0, 2)
    assert sb.build_payload(cfg, req)["logit_bias"] == {"0": -100, "2": -100}
    req.fixed_output = False
    assert not {"ignore_eos", "min_tokens", "logit_bias"} & set(sb.build_payload(cfg, req))
    cfg.endpoint = "/v1/completions"
    assert sb.build_payload(cfg, req)["prompt"] == "hi"


def test_random_requests_without_tokenizer() -> None:
    a = sb.random_requests(3, 20, 7, seed=1)
    b = sb.random_requests(3, 20, 7, seed=1)
    assert [r.messages for r in a] == [r.messages for r in b]
    assert len({r.messages[0]["content"] for r in a}) == 3
    assert all(
        len(r.messages[0]["content"].split()) == 19 and r.max_tokens == 7 and r.fixed_output for r in a
    )


def test_conversational_set_cycles() -> None:
    rows = (REPO / "bench" / "prompts" / "conversational.jsonl").read_text().splitlines()
    reqs = sb.conversational_requests(len(rows) + 2, 64)
    assert reqs[len(rows)].messages == reqs[0].messages
    assert all(r.max_tokens == 64 and not r.fixed_output for r in reqs)
    assert all(r.messages[-1]["role"] == "user" for r in reqs)


# --------------------------------------------------------------------------------------------------
# a fake OpenAI-compatible SSE server


def _make_app(received: list[dict[str, Any]]) -> Any:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(request: Any) -> Any:
        body = await request.json()
        received.append(body)
        content = body["messages"][0]["content"]
        if isinstance(content, str) and content.startswith("FAIL"):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = int(body["max_tokens"])
        usage = (body.get("stream_options") or {}).get("include_usage", False)

        def frame(delta: dict[str, Any], finish: str | None = None) -> str:
            chunk = {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(chunk)}\n\n"

        async def gen() -> Any:
            yield frame({"role": "assistant", "content": ""})
            await asyncio.sleep(ROLE_DELAY_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                yield frame({"content": f"t{i} "})
            yield frame({}, "length")
            if usage:
                u = {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": n,
                    "total_tokens": PROMPT_TOKENS + n,
                    "prompt_tokens_details": {
                        "cached_tokens": CACHED_LATER_TURNS if len(body["messages"]) > 2 else 0
                    },
                }
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])]
    )


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    import uvicorn

    received: list[dict[str, Any]] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_make_app(received), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(timeout=5)


def _args(base_url: str, tmp_path: Path, *extra: str) -> Any:
    return sb.build_parser().parse_args(
        ["--base-url", base_url, "--result-dir", str(tmp_path), "--label", "fake", "--no-progress",
         "--random-input-len", "8", "--random-output-len", "5", "--num-warmups", "1", *extra]
    )


def test_sweep_against_fake_server(fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    base_url, received = fake_server
    received.clear()
    args = _args(base_url, tmp_path, "--max-concurrency", "1,4", "--num-prompts", "4")
    summary = asyncio.run(sb.run_benchmark(args))
    # 1 warmup + 4 measured per load point
    assert len(received) == 10
    measured = [b for b in received if b.get("ignore_eos") is True]  # warmups do not fix the length
    assert len(measured) == 8
    assert all(b["max_tokens"] == 5 and b["stream_options"] == {"include_usage": True} for b in measured)
    assert all(b["model"] == "fake-model" for b in received)
    assert [r["max_concurrency"] for r in summary["runs"]] == [1, 4]
    for run in summary["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["total_output_tokens"] == 20
        assert run["total_input_tokens"] == 4 * PROMPT_TOKENS
        assert run["output_tokens_source"] == "usage"
        # TTFT runs to the first content chunk, after the role chunk's delay
        assert all(t >= ROLE_DELAY_S for t in run["ttfts"])
        assert all(len(gaps) == 4 for gaps in run["itls"])
        assert run["mean_itl_ms"] >= GAP_S * 1000 * 0.9
        assert run["mean_tpot_ms"] == pytest.approx(
            sum((lat - t) / 4 for lat, t in zip(run["latencies"], run["ttfts"])) / 4 * 1000
        )
        assert run["output_throughput"] == pytest.approx(20 / run["duration"])
        assert run["request_throughput"] == pytest.approx(4 / run["duration"])
        assert all(f == "length" for f in run["finish_reasons"])
    # closed loop at c=1 is serial: duration >= 4 requests x (role delay + 4 gaps)
    assert summary["runs"][0]["duration"] >= 4 * (ROLE_DELAY_S + 4 * GAP_S)
    assert summary["runs"][0]["max_concurrent_requests"] == 1
    assert summary["runs"][1]["max_concurrent_requests"] == 4
    assert summary["runs"][1]["duration"] < summary["runs"][0]["duration"]
    on_disk = json.loads((tmp_path / "fake-c4.json").read_text())
    for key in (
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "p90_ttft_ms",
        "std_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p90_e2el_ms",
        "p99_e2el_ms",
        "duration",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "errors",
        "max_concurrency",
        "request_rate",
        "num_prompts",
        "model_id",
    ):
        assert key in on_disk, key
    assert on_disk["request_rate"] == "inf"
    assert (tmp_path / "fake.json").exists()
    png = (tmp_path / "fake.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = sb.load_summary(tmp_path / "fake.json")
    assert math.isinf(loaded["runs"][0]["request_rate"])


def _user_texts(bodies: list[dict[str, Any]]) -> list[str]:
    return [b["messages"][-1]["content"] for b in bodies]


def test_fresh_prompts_per_load_point_unless_reused(fake_server, tmp_path: Path) -> None:
    base_url, received = fake_server
    received.clear()
    asyncio.run(sb.run_benchmark(_args(base_url, tmp_path, "--max-concurrency", "1,2", "--num-prompts", "3",
                                       "--no-plot")))
    texts = _user_texts(received)
    assert len(texts) == 8 and len(set(texts)) == 8  # 2 x (1 warm-up + 3 measured), all different
    received.clear()
    asyncio.run(sb.run_benchmark(_args(base_url, tmp_path, "--max-concurrency", "1,2", "--num-prompts", "3",
                                       "--no-plot", "--reuse-prompts")))
    texts = _user_texts(received)
    # the same prompts at both load points (at concurrency 2 the measured ones arrive in any order);
    # the warm-up is the first measured prompt
    assert texts[4] == texts[0] == texts[1] and sorted(texts[5:]) == sorted(texts[1:4])


def test_multiturn_conversations_grow_and_report_per_turn(fake_server, tmp_path: Path) -> None:
    base_url, received = fake_server
    received.clear()
    args = _args(base_url, tmp_path, "--dataset", "multiturn", "--max-concurrency", "2", "--num-prompts", "3",
                 "--multiturn-turns", "3", "--multiturn-system-len", "20", "--multiturn-user-len", "5",
                 "--num-warmups", "1", "--no-plot")
    summary = asyncio.run(sb.run_benchmark(args))
    warm, measured = received[:1], received[1:]
    assert len(warm[0]["messages"]) == 2 and warm[0]["max_tokens"] == 16
    assert len(measured) == 9
    systems = {b["messages"][0]["content"] for b in measured}
    assert len(systems) == 1 and warm[0]["messages"][0]["content"] not in systems
    assert len(systems.pop().split()) == 20 + 6  # "[seed] You are a helpful assistant." + 20 words
    by_len: dict[int, list[dict[str, Any]]] = {}
    for b in measured:
        by_len.setdefault(len(b["messages"]), []).append(b)
    assert sorted(by_len) == [2, 4, 6] and all(len(v) == 3 for v in by_len.values())
    for b in by_len[6]:  # the earlier replies are the server's own text, in order
        assert [m["role"] for m in b["messages"]] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
        ]
        assert b["messages"][2]["content"] == "t0 t1 t2 t3 t4 "
        assert b["messages"][1]["content"].split()[0].endswith(".1)")
        assert b["messages"][5]["content"].split()[0].endswith(".3)")
    run = summary["runs"][0]
    assert run["completed"] == 9 and run["turns"] == [1, 2, 3] * 3
    assert set(run["ttft_by_turn"]) == {1, 2, 3} and all(
        v["count"] == 3 for v in run["ttft_by_turn"].values()
    )
    assert run["mean_ttft_turn1_ms"] > 0 and run["ttft_later_over_turn1"] is not None
    assert run["prefix_cache_hit_rate"] == pytest.approx(6 * CACHED_LATER_TURNS / (9 * PROMPT_TOKENS))
    assert run["max_concurrent_requests"] == 2


def test_multiturn_unique_system_prompts() -> None:
    """``--multiturn-unique-system``: every conversation has a system prompt of its own (so turn 1
    computes it on any server); the user turns are the same as with the shared one."""
    shared = sb.multiturn_conversations(3, 2, 10, 4, 8, seed=5)
    unique = sb.multiturn_conversations(3, 2, 10, 4, 8, seed=5, shared_system=False)
    assert len({c.system for c in shared}) == 1 and len({c.system for c in unique}) == 3
    assert all(len(c.system.split()) == 10 + 6 for c in unique)
    assert [c.user_turns for c in unique] != [c.user_turns for c in shared]  # drawn after each prompt
    assert unique == sb.multiturn_conversations(3, 2, 10, 4, 8, seed=5, shared_system=False)
    args = sb.build_parser().parse_args(["--base-url", "http://x", "--multiturn-unique-system"])
    assert args.multiturn_unique_system is True


def test_turn_metrics_and_hit_rate_exact() -> None:
    rs = [
        _res(0, 1.0, 2.0, [], 1, turn=1, cached_tokens=0),
        _res(0, 0.2, 1.0, [], 1, turn=2, cached_tokens=8),
        _res(0, 0.4, 1.0, [], 1, turn=3, cached_tokens=None),
        _res(0, 3.0, 4.0, [], 1, turn=1, cached_tokens=2),
    ]
    m = sb.turn_metrics(rs)
    assert m["mean_ttft_turn1_ms"] == pytest.approx(2000.0)
    assert m["mean_ttft_later_turns_ms"] == pytest.approx(300.0)
    assert m["ttft_later_over_turn1"] == pytest.approx(0.15)
    assert (
        m["ttft_by_turn"][1]["median_ttft_ms"] == pytest.approx(2000.0) and m["ttft_by_turn"][3]["count"] == 1
    )
    assert sb.prefix_cache_hit_rate(rs) == pytest.approx(10 / 30)  # the turn without a report is left out
    assert sb.prefix_cache_hit_rate(rs[2:3]) is None
    assert sb.turn_metrics([_res(0, 1.0, 2.0, [], 1)]) == {}


def test_no_usage_poisson_and_failures(fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    base_url, received = fake_server
    received.clear()
    args = _args(base_url, tmp_path, "--request-rate", "50", "--max-concurrency", "2", "--num-prompts", "3",
                 "--no-stream-options", "--eos-strategy", "none", "--no-plot", "--num-warmups", "0")
    reqs_before = sb.random_requests
    try:  # make the second request fail with HTTP 500
        def patched(*a: Any, **k: Any) -> Any:
            rs = reqs_before(*a, **k)
            rs[1].messages = [{"role": "user", "content": "FAIL please"}]
            return rs
        sb.random_requests = patched
        summary = asyncio.run(sb.run_benchmark(args))
    finally:
        sb.random_requests = reqs_before
    run = summary["runs"][0]
    assert (run["completed"], run["failed"]) == (2, 1)
    assert run["errors"][1].startswith("HTTP 500")
    assert run["output_tokens_source"] == "chunks"
    assert run["total_output_tokens"] == 10  # 5 content chunks each, counted without usage
    assert run["total_input_tokens"] == 0  # no usage, no tokenizer
    assert run["request_rate"] == 50.0 and run["max_concurrency"] == 2
    assert all("ignore_eos" not in b and "stream_options" not in b for b in received)
    assert not (tmp_path / "fake.png").exists()


# --------------------------------------------------------------------------------------------------
# bench/compare.py: the ratio table and the EOS ids it sends to servers without ignore_eos


def _load_compare() -> Any:
    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "bench" / "compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_comparison_table_ratios() -> None:
    cmp = _load_compare()

    def run(c: int, tput: float, ttft: float) -> dict[str, Any]:
        return {
            "max_concurrency": c,
            "output_throughput": tput,
            "p99_ttft_ms": ttft,
            "mean_tpot_ms": 50.0,
            "p99_itl_ms": 60.0,
            "p90_e2el_ms": 900.0,
            "total_output_tokens": 256,
            "completed": 2,
            "failed": 0,
        }

    table = cmp.comparison_table(
        {"streamproxy": {"runs": [run(1, 40.0, 100.0), run(8, 200.0, 400.0)]},
         "llama-server": {"runs": [run(1, 80.0, 50.0), run(8, 100.0, 1000.0)]}},
        {"vllm": "not built\nmore"},
    )
    lines = table.splitlines()
    assert lines[2] == "| 1 | streamproxy | 40.0 | 1.00x | 100 | 1.00x | 50.0 | 60.0 | 900 | 128.0 | 0 |"
    assert lines[3] == "| 1 | llama-server | 80.0 | 2.00x | 50 | 0.50x | 50.0 | 60.0 | 900 | 128.0 | 0 |"
    assert lines[5] == "| 8 | llama-server | 100.0 | 0.50x | 1000 | 2.50x | 50.0 | 60.0 | 900 | 128.0 | 0 |"
    assert lines[-1] == "skipped vllm: not built"


def test_llama_isa_flags_never_enable_amx(tmp_path: Path) -> None:
    """ggml is built for the CPU's instruction sets but never AMX (a VM may list amx_tile and trap
    on it), and a CPU without some AVX-512 parts gets that option off."""
    cmp = _load_compare()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl "
                    "avx512dq avx512bw avx512_bf16 amx_tile amx_int8 amx_bf16\n")
    flags = cmp.llama_isa_flags(info)
    assert flags[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON", "-DGGML_AVX512_VNNI=OFF",
            "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any(f.endswith("=ON") and "AMX" in f for f in flags)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 avx512f avx512vl\n")
    assert "-DGGML_AVX512=OFF" in cmp.llama_isa_flags(info)  # avx512cd/dq/bw missing
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # not x86
    assert cmp.llama_isa_flags(info) == ["-DGGML_NATIVE=ON"]
    assert cmp.llama_isa_flags(tmp_path / "missing") == ["-DGGML_NATIVE=ON"]


def test_eos_token_ids_from_configs(tmp_path: Path) -> None:
    cmp = _load_compare()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert cmp.eos_token_ids(tmp_path) == [0, 2]


def test_random_requests_with_local_tokenizer() -> None:
    try:
        folder = testdata.zoo_path("gpt-2")
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    tok = sb.load_tokenizer(str(folder))
    reqs = sb.random_requests(4, 32, 8, seed=3, tokenizer=tok)
    for r in reqs:
        n = len(tok.encode(r.messages[0]["content"], add_special_tokens=False))
        assert r.prompt_len == n
        assert 28 <= n <= 32  # cut to 32 ids; decode/encode round trips may merge a few
    with pytest.raises(SystemExit):
        sb.load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id is refused, never fetched


def test_poisson_gaps() -> None:
    assert sb._arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = sb._arrival_gaps(20001, 4.0, 1.0, seed=7)
    assert gaps[0] == 0.0 and gaps == sb._arrival_gaps(20001, 4.0, 1.0, seed=7)
    assert sum(gaps[1:]) / 20000 == pytest.approx(0.25, rel=0.03)  # mean gap 1/rate
    cv = float(np.std(gaps[1:])) / 0.25
    assert cv == pytest.approx(1.0, rel=0.05)  # exponential gaps: std == mean (Poisson process)


def test_transformers_venv_sees_the_running_interpreters_packages(tmp_path: Path, monkeypatch) -> None:
    """compare.py run from the project's venv: the transformers-serve venv must import the same
    transformers (the base interpreter's --system-site-packages lack it)."""
    cmp = _load_compare()
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], logfile: Path, **kw: Any) -> None:
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:  # create it for real, without pip (fast); skip installs
            import subprocess

            subprocess.run([*cmd[:3], "--without-pip", *cmd[3:]], check=True)

    monkeypatch.setattr(cmp, "_run", fake_run)
    try:
        py = cmp.transformers_venv(tmp_path)
    except cmp.PeerUnavailable:  # fastapi/rich are not installed here: only the pip step was skipped
        py = cmp.venv_python(tmp_path / "venv-transformers-serve")
    assert any(c[1:3] == ["-m", "venv"] for c in calls)
    assert cmp._imports(py, "transformers")
    site = [p for p in cmp.parent_site_packages() if "site-packages" in p]
    assert site and all(Path(p).is_dir() for p in site)


def test_comparison_table_multiturn_rows() -> None:
    cmp = _load_compare()
    run = {"max_concurrency": 4, "output_throughput": 10.0, "p99_ttft_ms": 900.0, "mean_tpot_ms": 50.0,
           "p99_itl_ms": 60.0, "p90_e2el_ms": 900.0, "total_output_tokens": 64, "completed": 2, "failed": 0,
           "mean_ttft_turn1_ms": 1000.0, "mean_ttft_later_turns_ms": 150.0, "ttft_later_over_turn1": 0.15,
           "ttft_by_turn": {"1": {"mean_ttft_ms": 1000.0}, "2": {"mean_ttft_ms": 150.0}},
           "prefix_cache_hit_rate": 0.8123}
    lines = cmp.comparison_table({"streamproxy": {"runs": [run]}}, {}).splitlines()
    assert lines[-1] == "| 4 | streamproxy | 1000 | 150 | 0.15 | 1000 / 150 | 81.2% |"


def test_compare_eos_logit_bias_overrides_each_peers_eos_strategy(tmp_path: Path) -> None:
    """``compare.py --eos-logit-bias``: serve_bench gets ``--eos-strategy logit_bias`` and the model's
    EOS ids after the peer's own strategy, and its parser keeps the last one."""
    cmp = _load_compare()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    peer = cmp.Peer("llama-server", ["llama-server"], "smollm2", {}, ["--eos-strategy", "ignore_eos"])
    for flag, strategy, ids in (([], "ignore_eos", []), (["--eos-logit-bias"], "logit_bias", [2, 7])):
        args = cmp.build_parser().parse_args(["--concurrency", "8", *flag])
        cmd = cmp.serve_bench_cmd(peer, args, tmp_path, tmp_path / "out", "http://127.0.0.1:1", "smollm2")
        parsed = sb.build_parser().parse_args(cmd[2:])
        assert (parsed.eos_strategy, parsed.eos_token_ids) == (strategy, ids)
        assert parsed.max_concurrency == [8] and parsed.tokenizer == str(tmp_path)


# --------------------------------------------------------------------------------------------------
# long prompts: prefill alone and beside running streams


def test_gaps_overlapping_a_window_exact() -> None:
    stamps = [1.0, 1.5, 4.0, 4.25, 6.0]  # gaps 0.5, 2.5, 0.25, 1.75
    assert sb.gaps_overlapping(stamps, 2.0, 4.1) == [2.5, 0.25]  # the stretched gap, and the one ending after
    assert sb.gaps_overlapping(stamps, 1.5, 1.5) == []  # an empty window at a stamp overlaps nothing
    assert sb.gaps_overlapping(stamps, 0.0, 10.0) == [0.5, 2.5, 0.25, 1.75]
    assert sb.gaps_before(stamps, 4.0) == [0.5, 2.5]
    assert sb.gaps_before(stamps, 1.0) == []


def test_long_prompts_against_fake_server(
    fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    base_url, received = fake_server
    received.clear()
    args = _args(base_url, tmp_path, "--max-concurrency", "", "--long-prompt-lens", "40,60",
                 "--long-prompt-streams", "2", "--long-prompt-stream-len", "300", "--no-plot")
    summary = asyncio.run(sb.run_benchmark(args))
    assert summary["runs"] == []
    points = summary["long_prompts"]
    assert [p["prompt_len"] for p in points] == [40, 60]
    for p in points:
        assert p["errors"] == [] and p["streams"] == 2 and p["streams_outlasted"] is True
        assert p["prompt_tokens"] == PROMPT_TOKENS  # the server's usage
        assert p["alone_ttft_ms"] >= ROLE_DELAY_S * 1000 and p["beside_ttft_ms"] >= ROLE_DELAY_S * 1000
        assert p["alone_prefill_tok_s"] == pytest.approx(PROMPT_TOKENS / (p["alone_ttft_ms"] / 1000))
        assert p["stream_gaps_during"] >= 2 and p["stream_itl_during_max_ms"] >= p["stream_itl_during_p50_ms"]
    # a warm-up, then per length: the prompt alone, 2 streams, the prompt beside them
    assert [b["max_tokens"] for b in received] == [8, 4, 300, 300, 4, 4, 300, 300, 4]
    lengths = [len(b["messages"][0]["content"].split()) for b in received if b["max_tokens"] == 4]
    assert lengths == [39, 39, 59, 59]  # "<i>:" and length - 2 words: no tokenizer
    prompts = [b["messages"][0]["content"] for b in received if b["max_tokens"] == 4]
    assert len(set(prompts)) == 4  # fresh prompts: no prefix cache answers the second
    on_disk = json.loads((tmp_path / "fake.json").read_text())
    assert on_disk["long_prompts"][1]["prompt_len"] == 60


def test_wait_until_idle_reads_llama_server_slots_then_prometheus_gauges() -> None:
    """A cancelled stream may run on in the server (llama-server ran its cancelled streams to the end):
    the long-prompt point waits for ``/slots`` or ``*:num_requests_running`` to say 0."""
    import httpx

    busy_reads = {"slots": 2, "metrics": 2}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.host == "llama" and request.url.path == "/slots":
            busy_reads["slots"] -= 1
            return httpx.Response(200, json=[{"id": 0, "is_processing": busy_reads["slots"] > 0},
                                             {"id": 1, "is_processing": False}])
        if request.url.host == "prom" and request.url.path == "/metrics":
            busy_reads["metrics"] -= 1
            n = 3 if busy_reads["metrics"] > 0 else 0
            gauge = f'streamproxy:num_requests_running{{model_name="a"}} {n}.0'
            return httpx.Response(200, text=f"# HELP x\n{gauge}\nvllm:num_requests_waiting 5.0\n")
        return httpx.Response(404)

    async def run(host: str) -> tuple[int | None, bool]:
        cfg = sb.ClientConfig(base_url=f"http://{host}/v1", model="m")
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            first = await sb.running_requests(client, cfg)
            return first, await sb.wait_until_idle(client, cfg, 5.0)

    assert asyncio.run(run("llama")) == (1, True)
    assert busy_reads["slots"] == 0
    assert asyncio.run(run("prom")) == (3, True)
    assert busy_reads["metrics"] == 0 and "/slots" in seen  # /slots 404 there: the gauge answered
    assert asyncio.run(run("none")) == (None, True)  # a server that says neither: no wait


# --------------------------------------------------------------------------------------------------
# one image per request (--image-size)


def _png(url: str) -> Any:
    import base64
    import io

    from PIL import Image

    head, _, data = url.partition(",")
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_bench_image_is_a_fixed_png_and_variants_differ() -> None:
    url = sb.bench_image_url(512)
    assert sb.bench_image_url(512) == url  # the same bytes for every request and every server
    img = _png(url)
    assert (img.format, img.mode, img.size) == ("PNG", "RGB", (512, 512))
    # red: x, green: y (0..255 over the width), blue: a checkerboard of 32-pixel squares
    assert [img.getpixel(p) for p in ((0, 0), (511, 0), (32, 0), (0, 511), (40, 40))] == [
        (0, 0, 0), (255, 0, 255), (15, 0, 255), (0, 255, 255), (19, 19, 0)]
    five = _png(sb.bench_image_url(512, variant=5))  # bits 0 and 2: white, black, white squares
    assert [five.getpixel((x, 3)) for x in (0, 8, 16, 24)] == [(255,) * 3, (0,) * 3, (255,) * 3, (0,) * 3]
    assert five.getpixel((40, 40)) == (19, 19, 0) and sb.bench_image_url(512, variant=6) != url


def test_image_requests_against_fake_server(fake_server, tmp_path: Path) -> None:
    base_url, received = fake_server
    for unique, distinct in ((False, 1), (True, 6)):
        received.clear()
        extra = ["--image-size", "64", "--max-concurrency", "1,2", "--num-prompts", "2", "--no-plot"]
        summary = asyncio.run(sb.run_benchmark(_args(base_url, tmp_path, *extra,
                                                     *(["--image-unique"] if unique else []))))
        assert len(received) == 6  # 2 x (1 warm-up + 2 measured)
        urls = []
        for body in received:
            (message,) = body["messages"]
            text, image = message["content"]
            assert text["type"] == "text" and text["text"] and image["type"] == "image_url"
            urls.append(image["image_url"]["url"])
        assert len(set(urls)) == distinct and _png(urls[0]).size == (64, 64)
        assert [(r["image_size"], r["image_unique"], r["completed"]) for r in summary["runs"]] == [
            (64, unique, 2), (64, unique, 2)]
    with pytest.raises(SystemExit):
        sb.main(["--base-url", base_url, "--image-size", "64", "--dataset", "multiturn"])


def test_compare_sends_the_image_option_and_finds_the_mmproj(tmp_path: Path) -> None:
    cmp = _load_compare()
    peer = cmp.Peer("llama-server", ["llama-server"], "vlm", {}, ["--eos-strategy", "ignore_eos"])
    gguf = tmp_path / "vlm-BF16.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    config = {"eos_token_id": 2, "max_position_embeddings": 8192}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    args = cmp.build_parser().parse_args(["--model", str(gguf), "--image-size", "512", "--image-unique"])
    cmd = cmp.serve_bench_cmd(peer, args, None, tmp_path / "out", "http://127.0.0.1:1", "vlm")
    parsed = sb.build_parser().parse_args(cmd[2:])
    assert (parsed.image_size, parsed.image_unique) == (512, True)
    model = cmp.bench_model(args)
    with pytest.raises(cmp.PeerUnavailable, match="found 0 mmproj"):
        cmp.mmproj_file(args, model)
    (tmp_path / "mmproj-vlm-F16.gguf").write_bytes(b"GGUF")
    assert cmp.mmproj_file(args, model) == tmp_path / "mmproj-vlm-F16.gguf"
    with pytest.raises(cmp.PeerUnavailable, match="chat handler"):
        cmp.make_peer("llama-cpp-python", args, tmp_path, 1)


def test_a_request_the_server_never_answered_is_sent_again() -> None:
    """A keep-alive connection the server closed before answering (llama-server did so for 1-2 of 16
    one-stream requests): sent again, as the OpenAI SDKs do; a reply of any status is not. The SSE
    lines are split on \\n only."""
    calls: list[int] = []
    # raw UTF-8 with U+2028 and U+0085 in the content, as a server with ensure_ascii off sends it:
    # one SSE line each (httpx's aiter_lines would split them)
    sse = ('data: {"choices":[{"index":0,"delta":{"content":"h\u2028i\u0085"},"finish_reason":null}]}\r\n\n'
           .encode() +
           b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
           b'"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n')

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        calls.append(1)
        if len(calls) == 1:  # the first try: closed without a status line
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + sse)
        await writer.drain()
        writer.close()

    async def run() -> tuple[Any, Any]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = sb.ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m")
        req = sb.SampleRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=1, prompt_len=3)
        async with httpx.AsyncClient() as client:
            answered = await sb.send_request(client, cfg, req)
            calls.clear()
            calls.append(1)  # every later try is answered: a 200 is not sent again
            once = await sb.send_request(client, cfg, req)
        server.close()
        await server.wait_closed()
        return answered, once

    answered, once = asyncio.run(run())
    assert answered.success and answered.retries == 1 and answered.generated_text == "h\u2028i\u0085"
    assert once.success and once.retries == 0 and len(calls) == 2
    m = sb.calculate_metrics([answered, once], duration_s=1.0)
    assert m["retried"] == 1 and m["failed"] == 0
