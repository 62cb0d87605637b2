"""The Prometheus metrics: vLLM-style names, values recorded exactly, gauges read at scrape time."""

from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import Metrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_names_and_values() -> None:
    state = {"running": 3, "waiting": 1, "kv": 0.25}
    m = Metrics("m", num_running=lambda: state["running"], num_waiting=lambda: state["waiting"],
                kv_cache_usage=lambda: state["kv"])
    m.observe_first_token(0.05)
    m.observe_inter_token(0.02, num_tokens=3)
    m.observe_finished("stop", e2e_s=1.5, queue_s=0.01, num_prompt_tokens=7, num_generation_tokens=4)
    m.observe_finished("length", e2e_s=2.0, queue_s=None, num_prompt_tokens=5, num_generation_tokens=16)
    m.observe_rejected("queue_full")
    state["running"] = 5
    s = _samples(m)
    lab = (("model_name", "m"),)
    assert s[("streamproxy:time_to_first_token_seconds_count", lab)] == 1
    assert s[("streamproxy:time_to_first_token_seconds_sum", lab)] == 0.05
    assert s[("streamproxy:inter_token_latency_seconds_count", lab)] == 3
    assert s[("streamproxy:e2e_request_latency_seconds_count", lab)] == 2
    assert s[("streamproxy:e2e_request_latency_seconds_sum", lab)] == 3.5
    assert s[("streamproxy:request_queue_time_seconds_count", lab)] == 1
    assert s[("streamproxy:prompt_tokens_total", lab)] == 12
    assert s[("streamproxy:generation_tokens_total", lab)] == 20
    assert s[("streamproxy:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert s[("streamproxy:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert s[("streamproxy:request_rejected_total", (("model_name", "m"), ("reason", "queue_full")))] == 1
    assert s[("streamproxy:num_requests_running", lab)] == 5  # read at scrape time, not at construction
    assert s[("streamproxy:num_requests_waiting", lab)] == 1
    assert s[("streamproxy:kv_cache_usage_perc", lab)] == 0.25


def test_registries_are_independent() -> None:
    a, b = Metrics("a"), Metrics("b")
    a.observe_first_token(1.0)
    assert ("streamproxy:time_to_first_token_seconds_count", (("model_name", "b"),)) in _samples(b)
    assert _samples(b)[("streamproxy:time_to_first_token_seconds_count", (("model_name", "b"),))] == 0


def test_num_preemptions_counter_read_at_scrape_time() -> None:
    """Issue 12 item 10: vLLM's preemption counter, as streamproxy:num_preemptions_total."""
    state = {"preemptions": 0}
    m = Metrics("m", num_preemptions=lambda: state["preemptions"])
    lab = (("model_name", "m"),)
    assert _samples(m)[("streamproxy:num_preemptions_total", lab)] == 0
    state["preemptions"] = 3
    assert _samples(m)[("streamproxy:num_preemptions_total", lab)] == 3
    assert b"# TYPE streamproxy:num_preemptions_total counter" in m.render()


def test_structured_output_counter_by_kind() -> None:
    m = Metrics("m")
    m.observe_structured_output("json_schema")
    m.observe_structured_output("json_schema")
    m.observe_structured_output("tool_required")
    text = m.render().decode()
    assert 'streamproxy:structured_output_requests_total{kind="json_schema",model_name="m"} 2.0' in text
    assert 'streamproxy:structured_output_requests_total{kind="tool_required",model_name="m"} 1.0' in text


def test_prefix_cache_counters_read_at_scrape_time() -> None:
    """vLLM's prefix_cache_queries / prefix_cache_hits (tokens), read from the engine when scraped."""
    state = {"queries": 0, "hits": 0}
    m = Metrics("m", prefix_cache_queries=lambda: state["queries"], prefix_cache_hits=lambda: state["hits"])
    lab = (("model_name", "m"),)
    assert _samples(m)[("streamproxy:prefix_cache_queries_total", lab)] == 0
    state.update(queries=300, hits=224)
    samples = _samples(m)
    assert samples[("streamproxy:prefix_cache_queries_total", lab)] == 300
    assert samples[("streamproxy:prefix_cache_hits_total", lab)] == 224
    assert b"# TYPE streamproxy:prefix_cache_hits_total counter" in m.render()


def test_requests_by_endpoint_and_responses_store_size() -> None:
    m = Metrics("m")
    m.observe_request("/v1/responses")
    m.observe_request("/v1/responses")
    m.observe_request("/v1/chat/completions")
    size = {"entries": 3, "bytes": 1234}
    m.watch_responses_store(lambda: size["entries"], lambda: size["bytes"])
    text = m.render().decode()
    assert 'streamproxy:api_requests_total{endpoint="/v1/responses",model_name="m"} 2.0' in text
    assert 'streamproxy:api_requests_total{endpoint="/v1/chat/completions",model_name="m"} 1.0' in text
    assert 'streamproxy:responses_store_entries{model_name="m"} 3.0' in text
    size["bytes"] = 99  # read at scrape time
    assert 'streamproxy:responses_store_bytes{model_name="m"} 99.0' in m.render().decode()
