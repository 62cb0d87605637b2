"""``python -m proxy.models [--convert] [--model X.gguf] [--cache-dir DIR]``: the same as
``streamproxy models ...`` (``proxy.cli.prepare_model``): resolve (and convert) the model ahead of
time; without ``--convert`` also load it and print what is served."""

from __future__ import annotations

import sys

from proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["models", *sys.argv[1:]]))
