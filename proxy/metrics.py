"""Prometheus metrics of streamproxy, named after vLLM's (``vllm:*`` -> ``streamproxy:*``).

Each ``Metrics`` owns its own ``CollectorRegistry`` so that several apps (tests) never clash.
Latencies are in seconds, as Prometheus and vLLM use them. Gauges that mirror engine state
(running, waiting, KV cache usage) are read at scrape time through callables, so they are never stale.

Names (vLLM ``vllm/v1/metrics/loggers.py``):
    streamproxy:time_to_first_token_seconds   histogram, arrival -> first token
    streamproxy:inter_token_latency_seconds   histogram, between consecutive tokens of a request
    streamproxy:e2e_request_latency_seconds   histogram, arrival -> finish
    streamproxy:request_queue_time_seconds    histogram, arrival -> first scheduled
    streamproxy:prompt_tokens_total           counter
    streamproxy:generation_tokens_total       counter
    streamproxy:request_success_total         counter, label finished_reason (stop, length, abort, error)
    streamproxy:num_requests_running          gauge
    streamproxy:num_requests_waiting          gauge
    streamproxy:kv_cache_usage_perc           gauge, 0..1
    streamproxy:request_rejected_total        counter, label reason (queue_full, ...)
    streamproxy:num_preemptions_total         counter, requests preempted (recompute) because the KV cache
                                              ran out; read from the scheduler at scrape time
    streamproxy:prefix_cache_queries_total    counter, prompt tokens looked up in the prefix cache (vLLM's
                                              ``vllm:prefix_cache_queries``); read from the engine at
                                              scrape time
    streamproxy:prefix_cache_hits_total       counter, of those, tokens found in the cache (vLLM's
                                              ``vllm:prefix_cache_hits``); hit rate = hits / queries
    streamproxy:engine_restarts_total         counter, engine processes restarted after dying
                                              (--engine-process)
    streamproxy:structured_output_requests_total  counter, label kind: constrained requests by what
                                              constrained them (json_schema, json_object, regex, choice,
                                              grammar, tool_required, tool_named); no vLLM equivalent
    streamproxy:api_requests_total            counter, label endpoint: generating requests received, by
                                              route (/v1/chat/completions, /v1/completions, /v1/responses,
                                              /v1/messages)
    streamproxy:responses_store_entries       gauge, stored Responses API responses (previous_response_id)
    streamproxy:responses_store_bytes         gauge, bytes of JSON they take
    streamproxy:embedding_requests_total      counter, served ``/v1/embeddings`` requests; label model_name is
                                              the embedding model's id (vLLM counts them in request_success)
    streamproxy:embedding_prompt_tokens_total counter, tokens embedded (vLLM: prompt_tokens of pooling
                                              requests)
    streamproxy:embedding_request_latency_seconds  histogram, arrival -> vectors ready (vLLM's
                                              e2e_request_latency of a pooling request)

A several-model server shows each loaded model's metrics above (``model_name`` tells them apart; an
unloaded model's go with its engine, and its counters start again from 0 at its next load, a reset
``rate()`` allows for) and :class:`ServerMetrics`, there also while no model is loaded:
    streamproxy:model_state                   gauge, labels model_name and state (unloaded, loading, loaded,
                                              failed): 1 for the state the model is in, 0 for the others
                                              (a Prometheus state set; llama.cpp's router's model states)
    streamproxy:responses_store_entries       gauge, as above, the server's one store (no model_name)
    streamproxy:responses_store_bytes         gauge
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

PREFIX = "streamproxy:"

# Buckets as vLLM uses them for TTFT / ITL / request latencies (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics registry and the observations the API layer records.

    Args:
        model_name: value of the ``model_name`` label on every metric (as vLLM labels them).
        num_running, num_waiting: callables returning the engine's current counts (requests).
        kv_cache_usage: callable returning the used fraction of KV blocks, in [0, 1].
        num_preemptions: callable returning the engine's preemptions so far (monotonic count), exported
            as the counter ``streamproxy:num_preemptions_total`` (vLLM's ``vllm:num_preemptions``).
        num_engine_restarts: callable returning how often the engine process died and was restarted,
            exported as the counter ``streamproxy:engine_restarts_total``.
        prefix_cache_queries, prefix_cache_hits: callables returning the engine's prompt tokens looked
            up in its prefix cache and found there, so far (monotonic token counts), exported as
            ``streamproxy:prefix_cache_queries_total`` / ``streamproxy:prefix_cache_hits_total``.
    """

    def __init__(
        self,
        model_name: str,
        *,
        num_running: Callable[[], float] = lambda: 0,
        num_waiting: Callable[[], float] = lambda: 0,
        kv_cache_usage: Callable[[], float] = lambda: 0.0,
        num_preemptions: Callable[[], float] = lambda: 0,
        num_engine_restarts: Callable[[], float] = lambda: 0,
        prefix_cache_queries: Callable[[], float] = lambda: 0,
        prefix_cache_hits: Callable[[], float] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (s).", labels,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency (s).", labels,
                             buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency (s).",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time waiting before first scheduled (s).",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish_reason.",
                                labels + ["finished_reason"], registry=reg)
        self._rejected = Counter(PREFIX + "request_rejected", "Requests refused before they ran, by reason.",
                                 labels + ["reason"], registry=reg)
        Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", labels,
              registry=reg).labels(model_name).set_function(num_running)
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels,
              registry=reg).labels(model_name).set_function(num_waiting)
        Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", labels,
              registry=reg).labels(model_name).set_function(kv_cache_usage)
        self._requests = Counter(PREFIX + "api_requests", "Generating requests received, by endpoint.",
                                 labels + ["endpoint"], registry=reg)
        self._structured = Counter(PREFIX + "structured_output_requests",
                                   "Requests with constrained (structured) output, by kind.",
                                   labels + ["kind"], registry=reg)
        self._embedding_requests = Counter(PREFIX + "embedding_requests", "Served embeddings requests.",
                                           labels, registry=reg)
        self._embedding_tokens = Counter(PREFIX + "embedding_prompt_tokens", "Tokens embedded.", labels,
                                         registry=reg)
        self._embedding_latency = Histogram(PREFIX + "embedding_request_latency_seconds",
                                            "Embeddings request latency (s).", labels,
                                            buckets=TTFT_BUCKETS, registry=reg)
        reg.register(_CallbackCounter(PREFIX + "num_preemptions",
                                      "Requests preempted (KV cache full; recomputed).", model_name,
                                      num_preemptions))
        reg.register(_CallbackCounter(PREFIX + "engine_restarts", "Engine processes restarted after dying.",
                                      model_name, num_engine_restarts))
        reg.register(_CallbackCounter(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", model_name,
                                      prefix_cache_queries))
        reg.register(_CallbackCounter(PREFIX + "prefix_cache_hits",
                                      "Prompt tokens found in the prefix cache.", model_name,
                                      prefix_cache_hits))

    def observe_request(self, endpoint: str) -> None:
        """Count one generating request received at ``endpoint`` (its route path)."""
        self._requests.labels(self.model_name, endpoint).inc()

    def watch_responses_store(self, num_entries: Callable[[], float], num_bytes: Callable[[], float]) -> None:
        """Export the Responses API store's size (entries, bytes), read at scrape time."""
        for name, doc, value in (("responses_store_entries", "Stored Responses API responses.", num_entries),
                                 ("responses_store_bytes", "Bytes of JSON the stored responses take.",
                                  num_bytes)):
            Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
                self.model_name).set_function(value)

    def observe_first_token(self, ttft_s: float) -> None:
        """Record one request's time to first token, in seconds."""
        self.ttft.observe(ttft_s)

    def observe_inter_token(self, itl_s: float, num_tokens: int = 1) -> None:
        """Record ``num_tokens`` inter-token gaps of ``itl_s`` seconds each."""
        for _ in range(num_tokens):
            self.itl.observe(itl_s)

    def observe_finished(
        self,
        finish_reason: str,
        *,
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        """Record a finished request: its latency (s), queue time (s), token counts and finish_reason."""
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        self._success.labels(self.model_name, finish_reason).inc()

    def observe_rejected(self, reason: str) -> None:
        """Count one request refused before it ran (e.g. ``queue_full``)."""
        self._rejected.labels(self.model_name, reason).inc()

    def observe_structured_output(self, kind: str) -> None:
        """Count one constrained request (``json_schema``, ``json_object``, ``regex``, ``choice``,
        ``grammar``, ``tool_required``, ``tool_named``)."""
        self._structured.labels(self.model_name, kind).inc()

    def observe_embedding(self, model_name: str, *, num_prompt_tokens: int, latency_s: float) -> None:
        """Record one served embeddings request of ``model_name``: tokens embedded and latency (s)."""
        self._embedding_requests.labels(model_name).inc()
        self._embedding_tokens.labels(model_name).inc(num_prompt_tokens)
        self._embedding_latency.labels(model_name).observe(latency_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


MODEL_STATES = ("unloaded", "loading", "loaded", "failed")
"""The ``state`` values of ``streamproxy:model_state`` (``proxy.api.registry.ModelSlot.status``)."""


class ServerMetrics:
    """A several-model server's own metrics (module docstring), read at scrape time.

    Args:
        model_states: returns ``(model id, state)`` of every known model, state one of
            :data:`MODEL_STATES`.
        store_entries, store_bytes: the Responses API store's size (entries, bytes).
    """

    def __init__(self, model_states: Callable[[], Iterable[tuple[str, str]]],
                 store_entries: Callable[[], float], store_bytes: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ModelStates(model_states))
        Gauge(PREFIX + "responses_store_entries", "Stored Responses API responses.",
              registry=self.registry).set_function(store_entries)
        Gauge(PREFIX + "responses_store_bytes", "Bytes of JSON the stored responses take.",
              registry=self.registry).set_function(store_bytes)


class _ModelStates(Collector):
    def __init__(self, states: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self.states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(PREFIX + "model_state", "Each known model's state (1: the one it is in).",
                                   labels=["model_name", "state"])
        for model_id, current in self.states():
            for state in MODEL_STATES:
                family.add_metric([model_id, state], float(state == current))
        yield family


def render_many(metrics: Sequence[Metrics], server: ServerMetrics | None = None) -> bytes:
    """One Prometheus text exposition of several models' metrics: each family once, with every
    model's samples (told apart by their ``model_name`` label), as one vLLM server shows its models;
    then the ``server``'s own families."""
    registries = [m.registry for m in metrics] + ([server.registry] if server is not None else [])
    return generate_latest(_Merged(registries))


class _Merged:
    """A registry look-alike whose ``collect`` merges same-named families of several registries."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


class _CallbackCounter(Collector):
    """A counter whose value is read from a callable at scrape time (a count the engine keeps itself)."""

    def __init__(self, name: str, documentation: str, model_name: str, value: Callable[[], float]) -> None:
        self.name, self.documentation, self.model_name, self.value = name, documentation, model_name, value

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], float(self.value()))
        yield family
