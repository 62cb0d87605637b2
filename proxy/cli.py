"""Command line: ``streamproxy serve`` / ``python -m proxy serve``; the only module importing uvicorn.

Every :class:`~proxy.settings.Settings` field is an option ``--field-name`` and an environment
variable ``STREAMPROXY_FIELD_NAME``; the command line wins over the environment, which wins over
the default. List settings (``--api-key``, ``--allowed-origins``) repeat on the command line and
are comma-separated in the environment (``STREAMPROXY_API_KEYS``, ``STREAMPROXY_ALLOWED_ORIGINS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.settings import Settings

ENV_PREFIX = "STREAMPROXY_"
_OPTION_NAMES = {"api_keys": "--api-key"}
_HELP = {
    "model": "Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)",
    "served_model_name": "model id clients send (default: derived from --model)",
    "host": "interface to listen on",
    "port": "TCP port",
    "api_keys": "accepted bearer key (repeatable; env: comma-separated)",
    "allowed_origins": "CORS origin (repeatable or comma-separated)",
}


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
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw


def _option(field: dataclasses.Field[Any]) -> str:
    return _OPTION_NAMES.get(field.name, "--" + field.name.replace("_", "-"))


def build_parser() -> argparse.ArgumentParser:
    """The ``streamproxy`` argument parser (sub-command ``serve``)."""
    parser = argparse.ArgumentParser(prog="streamproxy", description="OpenAI-compatible streaming server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    for field in dataclasses.fields(Settings):
        kind = _kind(field)
        help_text = _HELP.get(field.name, field.name.replace("_", " "))
        env = ENV_PREFIX + field.name.upper()
        help_text = f"{help_text} (env {env}; default {field.default!r})"
        if kind == "list":
            serve.add_argument(_option(field), dest=field.name, action="append", default=None, help=help_text)
        else:
            def conv(raw: str, kind: str = kind) -> Any:
                return _convert(kind, raw)

            conv.__name__ = kind  # argparse names the type in "invalid int value" errors
            serve.add_argument(_option(field), dest=field.name, type=conv, default=None, help=help_text)
    return parser


def settings_from(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Merge command line, ``STREAMPROXY_*`` environment and defaults into :class:`Settings`.

    Raises:
        ValueError: an environment value of the wrong type.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        kind = _kind(field)
        value = getattr(args, field.name, None)
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
    return Settings(**values)


def serve(settings: Settings) -> None:
    """Run uvicorn with the app of ``settings`` until interrupted."""
    import uvicorn

    from proxy.api.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=int(settings.shutdown_grace_s), access_log=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``streamproxy`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "serve":
        serve(settings)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
