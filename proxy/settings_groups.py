"""The groups of :class:`~proxy.settings.Settings`' fields (``streamproxy serve --help`` prints one
argument group each, in this order) and the reader of a dataclass docstring's ``Attributes:``.

A new ``Settings`` field goes into exactly one group of :data:`SETTINGS_GROUPS` below
(``tests/test_cli.py`` fails otherwise and names the field; until then ``--help`` lists it under
"other"). The scheduler group's knobs are
described once, in ``proxy.engine.scheduler.SchedulerConfig``'s docstring; every other field in
``Settings``' own.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SettingsGroup:
    """One argument group of ``--help``: ``name`` (a word), ``title`` (the heading) and the
    ``Settings`` field names in it, in the order listed."""

    name: str
    title: str
    fields: tuple[str, ...]


SETTINGS_GROUPS: tuple[SettingsGroup, ...] = (
    SettingsGroup("server", "server (HTTP, auth, streams, shutdown)", (
        "host", "port", "api_keys", "allowed_origins", "keepalive_interval_s", "stream_headers_timeout_s",
        "max_body_bytes", "max_waiting", "shutdown_grace_s", "ui", "log_level", "seed")),
    SettingsGroup("models", "models (what is served, under which ids; several models)", (
        "model", "mmproj", "served_model_name", "extra_models", "models_dir", "models_file", "models_max",
        "model_ttl_s", "models_memory_bytes")),
    SettingsGroup("model", "model loading (precision, device, parsers, checks)", (
        "device", "dtype", "quantization", "quantization_group_size", "max_model_len", "cache_dir",
        "self_check", "tool_call_parser", "reasoning_parser")),
    SettingsGroup("cache", "KV cache", (
        "block_size", "num_kv_blocks", "kv_cache_bytes", "enable_prefix_caching", "gpu_memory_utilization")),
    SettingsGroup("scheduler", "scheduler (proxy.engine.scheduler.SchedulerConfig)", (
        "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "max_num_partial_prefills",
        "max_prefill_step_ratio", "max_long_gap_fraction")),
    SettingsGroup("execution", "execution (threads, compiled steps, kernels; docs/execution.md)", (
        "num_threads", "adaptive_threads", "enforce_eager", "compile_decode", "dense_prefill",
        "engine_process", "amx_int4", "torch_ops")),
    SettingsGroup("embeddings", "embeddings (POST /v1/embeddings)", (
        "embedding_model", "served_embedding_model_name", "embedding_pooling",
        "embedding_max_num_batched_tokens", "embedding_num_threads")),
    SettingsGroup("responses", "Responses API (stored responses)", (
        "responses_store_max_entries", "responses_store_max_bytes")),
    SettingsGroup("media", "images (where image URLs may be fetched from)", (
        "allowed_media_domains", "allowed_local_media_path", "media_fetch_timeout_s")),
)
"""Every ``Settings`` field in exactly one group; a new field is added to the group it belongs to
(or a new group, placed where ``--help`` should print it)."""


def grouping_errors(field_names: list[str] | tuple[str, ...]) -> list[str]:
    """What is wrong with :data:`SETTINGS_GROUPS` for these ``Settings`` field names: a field in no
    group or in several, a grouped name that is no field (one message each; empty when right)."""
    errors = []
    for name in field_names:
        holders = [g.name for g in SETTINGS_GROUPS if name in g.fields]
        if len(holders) != 1:
            where = f"in groups {holders}" if holders else "in no group"
            errors.append(f"Settings field {name!r} is {where}: list it in exactly one group of "
                          "SETTINGS_GROUPS in proxy/settings_groups.py")
    known = set(field_names)
    errors += [f"group {g.name!r} lists {n!r}, which is no Settings field" for g in SETTINGS_GROUPS
               for n in g.fields if n not in known]
    return errors


def attribute_docs(cls: type) -> dict[str, str]:
    """Each attribute's description from the ``Attributes:`` section of ``cls``' docstring, its
    lines joined, ````code```` marks and Sphinx roles (``:func:`x```) reduced to the name; an entry
    ``a, b: text`` describes both."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    names: list[str] = []
    section = doc.split("Attributes:", 1)[-1].split("\n\nRaises:", 1)[0]
    for line in section.splitlines():
        entry = re.match(r"^ {4}([a-z_][a-z0-9_, ]*):\s*(.*)$", line)
        if entry:
            names = [n.strip() for n in entry.group(1).split(",")]
            for name in names:
                out[name] = entry.group(2).replace("``", "")
        elif names and line.strip():
            for name in names:
                out[name] += " " + line.strip().replace("``", "")
    return {name: re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text) for name, text in out.items()}
