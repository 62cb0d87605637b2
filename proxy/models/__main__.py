"""``python -m proxy.models [--convert] [--model X.gguf] [--cache-dir DIR]``: resolve (and
convert) the model ahead of time; without ``--convert`` also load it and print what is served."""

from __future__ import annotations

import argparse
import logging

from proxy.engine.loading import load_engine_model
from proxy.models.source import resolve_model_path
from proxy.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.models --convert``: convert (and cache) the model ahead of time."""
    parser = argparse.ArgumentParser(prog="python -m proxy.models")
    parser.add_argument("--convert", action="store_true", help="convert the GGUF model into the cache")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = Settings(model=args.model, cache_dir=args.cache_dir)
    folder, name = resolve_model_path(settings)
    print(f"{name}: {folder}")
    if not args.convert:
        loaded = load_engine_model(settings)
        print(f"max_model_len={loaded.max_model_len} eos={sorted(loaded.eos_token_ids)} "
              f"dtype={loaded.dtype} quantization={loaded.quantization}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
