"""Command line: ``streamproxy serve`` / ``python -m proxy serve``, and ``streamproxy models``
(``python -m proxy.models``: resolve, convert and load the model ahead of time); the only module
importing uvicorn.

Every :class:`~proxy.settings.Settings` field is an option ``--field-name`` and an environment
variable ``STREAMPROXY_FIELD_NAME``; the command line wins over the environment, which wins over
the default. ``--help`` prints them in the groups of :data:`proxy.settings_groups.SETTINGS_GROUPS`,
each described by the one docstring of its knob (``Settings``', or ``SchedulerConfig``'s for the
scheduler group). A boolean setting is a pair ``--field-name`` / ``--no-field-name`` (environment:
``1``/``true``/``yes``/``on`` or anything else for false). List settings (``--api-key``,
``--allowed-origins``) repeat on the command line and are comma-separated in the environment
(``STREAMPROXY_API_KEYS``, ``STREAMPROXY_ALLOWED_ORIGINS``).

Shutdown: on SIGTERM/SIGINT :class:`DrainingServer` tells the app to drain
(``ServerState.begin_drain``: new requests and ``/health`` 503, open streams get
``shutdown_grace_s`` to finish, then an SSE error event + ``[DONE]``) and keeps listening until
no request is left, so a router or client that connects meanwhile reads the 503 ``draining`` /
``server_shutdown`` answers instead of a refused connection; then uvicorn's graceful shutdown
closes the sockets (its ``timeout_graceful_shutdown``, grace + :data:`SHUTDOWN_BACKSTOP_S`, stays
as a backstop), and the process exits 0. A second signal skips the wait (uvicorn's force exit).

``STREAMPROXY_TEST_FAULTS=1`` (environment only, for tests) mounts the fault-injection route
``POST /_test/fault`` (``proxy.api.faults``). API keys are never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.catalog import build_catalog, split_model_spec
from proxy.engine.scheduler.config import SchedulerConfig
from proxy.reasoning import check_reasoning_parser_setting
from proxy.settings import TRUE_WORDS, Settings, export_execution_switches
from proxy.settings_groups import SETTINGS_GROUPS, SettingsGroup, attribute_docs

ENV_PREFIX = "STREAMPROXY_"
TEST_FAULTS_ENV = "STREAMPROXY_TEST_FAULTS"
SHUTDOWN_BACKSTOP_S = 5.0
"""Seconds uvicorn waits past the grace period before it cancels what is left."""
DRAIN_POLL_S = 0.05
"""Seconds between two looks at the open requests while a shutdown drains."""
_OPTION_NAMES = {"api_keys": "--api-key"}
_REPEATED = ("model", "served_model_name")
"""Scalar settings whose option repeats: the second and later values are more models (``extra_models``)."""
_NOT_OPTIONS = ("extra_models",)


def _kind(field: dataclasses.Field[Any]) -> str:
    t = str(field.type)
    if t.startswith("tuple"):
        return "list"
    for name in ("bool", "int", "float"):
        if t.split(" ")[0] == name:
            return name
    return "str"


def _convert(kind: str, raw: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        return raw.strip().lower() in TRUE_WORDS
    return raw


def _option(field: dataclasses.Field[Any]) -> str:
    return _OPTION_NAMES.get(field.name, "--" + field.name.replace("_", "-"))


def option_help() -> dict[str, str]:
    """Each option's description: the scheduler group's from ``SchedulerConfig``'s docstring, every
    other field's from ``Settings``' (``proxy.settings_groups.attribute_docs``)."""
    scheduler = next(g.fields for g in SETTINGS_GROUPS if g.name == "scheduler")
    from_config = attribute_docs(SchedulerConfig)
    return {**attribute_docs(Settings), **{name: from_config[name] for name in scheduler}}


def _add_option(group: Any, field: dataclasses.Field[Any], help_text: str) -> None:
    """``field``'s option in the argument group ``group``: a repeated option for lists and for
    ``_REPEATED``, a ``--name`` / ``--no-name`` pair for booleans (vLLM's spelling, e.g.
    ``--no-enable-prefix-caching``), else one value converted as the field's type."""
    kind = _kind(field)
    if kind == "list" or field.name in _REPEATED:
        group.add_argument(_option(field), dest=field.name, action="append", default=None, help=help_text)
    elif kind == "bool":
        group.add_argument(_option(field), dest=field.name, action=argparse.BooleanOptionalAction,
                           default=None, help=help_text)
    else:
        def conv(raw: str) -> Any:
            return _convert(kind, raw)

        conv.__name__ = kind  # argparse names the type in "invalid int value" errors
        group.add_argument(_option(field), dest=field.name, type=conv, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The ``streamproxy`` argument parser: sub-commands ``serve`` (options in the argument groups of
    ``SETTINGS_GROUPS``, then a group "other" of any field not yet in one) and ``models``."""
    parser = argparse.ArgumentParser(prog="streamproxy", description="OpenAI-compatible streaming server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API", usage="%(prog)s [options]")
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    ungrouped = tuple(n for n in fields if not any(n in g.fields for g in SETTINGS_GROUPS))  # test_cli fails
    other = SettingsGroup("other", "other (add them to proxy/settings_groups.py)", ungrouped)
    described = option_help()
    for grouped in (*SETTINGS_GROUPS, other):
        group = serve.add_argument_group(grouped.title)
        for name in grouped.fields:
            if name not in _NOT_OPTIONS:
                env = ENV_PREFIX + name.upper()
                help_text = described.get(name, name.replace("_", " ")).replace("%", "%%")
                _add_option(group, fields[name], f"{help_text} (env {env}; default {fields[name].default!r})")
    models = sub.add_parser("models", help="resolve (and convert) the model ahead of time; without "
                            "--convert also load it and print what is served (python -m proxy.models)")
    models.add_argument("--convert", action="store_true", help="only resolve and convert it into the cache")
    models.add_argument("--model", help="Hugging Face folder or .gguf file (env STREAMPROXY_MODEL; default: "
                        "SmolLM2-135M-Instruct)")
    models.add_argument("--mmproj", help="the mmproj GGUF of a .gguf --model (env STREAMPROXY_MMPROJ)")
    models.add_argument("--cache-dir", dest="cache_dir",
                        help="the conversion cache (env STREAMPROXY_CACHE_DIR)")
    return parser


def settings_from(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Merge command line, ``STREAMPROXY_*`` environment and defaults into :class:`Settings`.

    Raises:
        ValueError: an environment value of the wrong type, an unknown ``--reasoning-parser`` (the
            message lists the names), a model list ``proxy.catalog.build_catalog`` refuses.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        kind = _kind(field)
        value = getattr(args, field.name, None)
        if field.name in _REPEATED and value is not None:
            values[field.name] = value  # lists, split by _models below
            continue
        if value is None:
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is None or raw == "":
                continue
            try:
                value = [raw] if kind == "list" else _convert(kind, raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{field.name.upper()}={raw!r} is not a valid {kind}") from None
        if kind == "list":
            value = tuple(item.strip() for v in value for item in v.split(",") if item.strip())
        values[field.name] = value
    values.update(_models(values.get("model"), values.get("served_model_name")))
    settings = Settings(**values)
    check_reasoning_parser_setting(settings.reasoning_parser)
    build_catalog(settings)  # a bad model list is refused now, naming the entry
    return settings


def _models(paths: str | list[str] | None, names: str | list[str] | None) -> dict[str, Any]:
    """``model``, ``served_model_name`` and ``extra_models`` of the ``--model`` values (``PATH`` or
    ``PATH=NAME``) and the ``--served-model-name`` values, which name the models in order.

    Raises:
        ValueError: more ``--served-model-name`` values than ``--model`` values (beyond the first).
    """
    paths = [paths] if isinstance(paths, str) else list(paths or [])
    names = [names] if isinstance(names, str) else list(names or [])
    if len(names) > max(1, len(paths)):
        raise ValueError(f"{len(names)} --served-model-name values for {len(paths)} --model values")
    specs = [split_model_spec(p) for p in paths]
    named = [(path, own or (names[i] if i < len(names) else None)) for i, (path, own) in enumerate(specs)]
    out: dict[str, Any] = {"model": None, "served_model_name": names[0] if names else None}
    if named:
        out["model"], out["served_model_name"] = named[0]
    out["extra_models"] = tuple(f"{path}={name}" if name else path for path, name in named[1:])
    return out


def _server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """``uvicorn.Server`` that drains the app before uvicorn's graceful shutdown and exits 0.

        uvicorn >= 0.29 re-raises the captured SIGTERM after a graceful shutdown (the process
        would die by the signal, status -15); a drained streamproxy exits 0 instead.
        """

        async def shutdown(self, sockets: Any = None) -> None:
            state = getattr(getattr(self.config.app, "state", None), "server", None)
            if state is not None:
                state.begin_drain()
                await self.drain_requests(state.settings.shutdown_grace_s + SHUTDOWN_BACKSTOP_S)
            await super().shutdown(sockets)

        async def drain_requests(self, limit_s: float) -> None:
            """Keep accepting (new requests are answered 503 by the draining app) until no request
            task is left, ``limit_s`` has passed, or a second signal asked for a force exit."""
            deadline = time.monotonic() + limit_s
            while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return DrainingServer


def serve(settings: Settings, *, enable_test_faults: bool = False) -> int:
    """Run uvicorn with the app of ``settings`` until SIGTERM/SIGINT, then drain and return 0; 1 when
    the one model cannot be loaded (its one-line reason logged; vLLM exits so too, for a supervisor)."""
    # OpenMP waiting is libgomp's default (workers spin a while between parallel regions) unless
    # OMP_WAIT_POLICY is set: PASSIVE made batch-1 decode 2.3x slower on an idle machine (see
    # proxy.engine.core_proc.child and proxy.api.app.in_own_thread).
    export_execution_switches(settings, os.environ)  # before proxy.quant.kernels is imported
    import uvicorn

    from proxy.api.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failed: list[str] = []
    server: Any = None

    def load_failed(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, enable_test_faults=enable_test_faults, on_load_failed=load_failed)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(settings.shutdown_grace_s + SHUTDOWN_BACKSTOP_S + 0.999),
        access_log=False,
    )
    server = _server_class()(config)
    server.run()
    if failed:
        print(f"streamproxy: the model cannot be served: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def prepare_model(settings: Settings, *, convert_only: bool) -> int:
    """``streamproxy models``: resolve the model of ``settings`` (converting a GGUF into the cache)
    and print ``NAME: FOLDER``; unless ``convert_only``, also load it as the engine does and print
    its context length, EOS ids, dtype and quantization. Returns 0.

    Raises:
        proxy.models.ModelLoadError: the model cannot be resolved, converted or loaded.
    """
    export_execution_switches(settings, os.environ)  # before proxy.quant.kernels is imported
    from proxy.engine.loading import load_engine_model
    from proxy.models.source import resolve_model_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    folder, name = resolve_model_path(settings)
    print(f"{name}: {folder}")
    if not convert_only:
        loaded = load_engine_model(settings)
        print(f"max_model_len={loaded.max_model_len} eos={sorted(loaded.eos_token_ids)} "
              f"dtype={loaded.dtype} quantization={loaded.quantization}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamproxy`` console script (and of ``python -m proxy`` /
    ``python -m proxy.models``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "models":
        try:
            return prepare_model(settings, convert_only=args.convert)
        except Exception as exc:  # noqa: BLE001 (one line, as serve reports a model it cannot load)
            print(f"streamproxy: the model cannot be prepared: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return serve(settings, enable_test_faults=os.environ.get(TEST_FAULTS_ENV, "") in ("1", "true", "yes"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
