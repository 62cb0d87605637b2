"""The models a server knows: repeated ``--model`` (``PATH`` or ``PATH=NAME``), ``--models-dir`` and a
``--models-file`` (TOML), gathered into :class:`ModelEntry` rows and checked before anything loads.

A server with one model (no ``--models-dir`` / ``--models-file``, at most one ``--model``) has an
empty catalog: it serves ``Settings.model`` as it always has (loaded at start). With more, each entry
is served by its own engine, loaded at its first request (``proxy.api.registry``), with the
server's settings overridden by the entry's own options (:func:`entry_settings`).

The models file, one table per model under ``models`` (the table's key is the id clients send)::

    [models.qwen]
    path = "/models/Qwen2.5-0.5B-Instruct"   # a Hugging Face folder or a .gguf file; relative to the file
    aliases = ["gpt-4o-mini"]
    max-model-len = 4096
    reasoning-parser = "none"

    [models.smolvlm]
    path = "/models/SmolVLM-256M-Instruct-Q8_0.gguf"
    mmproj = "/models/mmproj-SmolVLM-256M-Instruct-Q8_0.gguf"  # its vision tower (llama.cpp's --mmproj)

    [models.embed]
    path = "bge-small-en-v1.5"
    kind = "embedding"                        # served by POST /v1/embeddings only

Ids: ``NAME`` of ``PATH=NAME``, else the matching ``--served-model-name`` (in order), else the folder's
name or the ``.gguf`` file's stem (llama.cpp's router names them so too).

An ``mmproj`` GGUF is taken where it is named (``mmproj`` in the models file; ``--mmproj`` with one
``--model``) and, as llama.cpp's router does (``--models-dir``, ``common/preset.cpp``), in a
``--models-dir`` subfolder holding one model ``.gguf`` and a ``.gguf`` whose name has ``mmproj`` (the
entry takes the subfolder's name); a ``*mmproj*.gguf`` directly in the folder is not a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from proxy.settings import Settings

KINDS = ("generate", "embedding")
"""``kind`` of an entry: a chat/completions model, or one served by ``POST /v1/embeddings`` only."""
ENTRY_OPTIONS: dict[str, tuple[str, type]] = {
    "max-model-len": ("max_model_len", int),
    "dtype": ("dtype", str),
    "quantization": ("quantization", str),
    "reasoning-parser": ("reasoning_parser", str),
    "tool-call-parser": ("tool_call_parser", str),
}
"""A models file entry's engine options: key -> (``Settings`` field, type)."""
ENTRY_KEYS = ("path", "mmproj", "aliases", "kind", *ENTRY_OPTIONS)


class CatalogError(ValueError):
    """A model list that cannot be served: the message names the entry (the CLI's usage error)."""


@dataclass(frozen=True)
class ModelEntry:
    """One model the server knows.

    Attributes:
        id: the id clients send as ``model``.
        path: its Hugging Face folder or ``.gguf`` file.
        aliases: other ids that name it.
        options: ``Settings`` field -> value, the entry's own engine options (``ENTRY_OPTIONS``).
        kind: ``"generate"`` or ``"embedding"``.
    """

    id: str
    path: str
    aliases: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    kind: str = "generate"

    @property
    def names(self) -> tuple[str, ...]:
        """The id and the aliases."""
        return (self.id, *self.aliases)


def model_id_of(path: str) -> str:
    """The id of a model path: a ``.gguf`` file's stem, else the folder's name."""
    p = Path(path).expanduser()
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def check_model_path(path: str, where: str) -> None:
    """Raises CatalogError unless ``path`` is a folder with ``config.json`` or a ``.gguf`` file."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return
    if p.is_file() and p.suffix.lower() == ".gguf":
        return
    what = ("a folder without config.json" if p.is_dir() else "not found" if not p.exists()
            else "not a .gguf file")
    raise CatalogError(f"{where}: {path!r} is not a model ({what}; a Hugging Face folder or a .gguf file)")


def split_model_spec(spec: str) -> tuple[str, str | None]:
    """``PATH=NAME`` -> ``(PATH, NAME)``; a ``PATH`` (also one that exists with an ``=`` in it) ->
    ``(PATH, None)``."""
    if "=" in spec and not Path(spec).expanduser().exists():
        path, _, name = spec.rpartition("=")
        if path and name:
            return path, name
    return spec, None


def is_mmproj_file(path: Path) -> bool:
    """A ``.gguf`` whose name has ``mmproj``: a vision tower, not a model (llama.cpp's rule)."""
    return path.suffix.lower() == ".gguf" and "mmproj" in path.name.lower()


def _gguf_pair(folder: Path) -> ModelEntry | None:
    """The entry of a subfolder holding one model ``.gguf`` and at most one mmproj (module docstring)."""
    ggufs = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    models = [p for p in ggufs if not is_mmproj_file(p)]
    mmprojs = [p for p in ggufs if is_mmproj_file(p)]
    if len(models) != 1 or len(mmprojs) > 1:
        return None
    return ModelEntry(folder.name, str(models[0]), options=tuple(("mmproj", str(p)) for p in mmprojs))


def scan_models_dir(folder: str) -> list[ModelEntry]:
    """Every Hugging Face folder (with ``config.json``) and model ``.gguf`` file directly in ``folder``,
    by name, and each subfolder with one model ``.gguf`` (and its mmproj: module docstring); other
    files are skipped.

    Raises:
        CatalogError: ``folder`` is not a folder.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise CatalogError(f"--models-dir {folder!r} is not a folder")
    entries = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not (child / "config.json").is_file():
            pair = _gguf_pair(child)
            entries += [pair] if pair is not None else []
        elif child.is_dir() or (child.suffix.lower() == ".gguf" and not is_mmproj_file(child)):
            entries.append(ModelEntry(model_id_of(str(child)), str(child)))
    return entries


def _entry_from_table(model_id: str, table: Any, base: Path) -> ModelEntry:
    where = f"--models-file: [models.{model_id}]"
    if not isinstance(table, dict):
        raise CatalogError(f"{where} must be a table")
    unknown = sorted(set(table) - set(ENTRY_KEYS))
    if unknown:
        raise CatalogError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(ENTRY_KEYS)})")
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise CatalogError(f"{where}: 'path' (a string) is required")
    full = Path(path).expanduser()
    if not full.is_absolute():
        full = base / full
    check_model_path(str(full), where)
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise CatalogError(f"{where}: 'aliases' must be a list of strings")
    kind = table.get("kind", "generate")
    if kind not in KINDS:
        raise CatalogError(f"{where}: 'kind' must be one of {KINDS}, got {kind!r}")
    options: list[tuple[str, Any]] = []
    mmproj = table.get("mmproj")
    if mmproj is not None:
        mm = Path(mmproj).expanduser() if isinstance(mmproj, str) and mmproj else None
        mm = mm if mm is None or mm.is_absolute() else base / mm
        if mm is None or not mm.is_file() or full.suffix.lower() != ".gguf":
            raise CatalogError(f"{where}: 'mmproj' must name the mmproj .gguf file of a .gguf 'path'")
        options.append(("mmproj", str(mm)))
    for key, (field, typ) in ENTRY_OPTIONS.items():
        if key in table:
            value = table[key]
            if not isinstance(value, typ) or isinstance(value, bool):
                raise CatalogError(f"{where}: {key!r} must be a {typ.__name__}")
            options.append((field, value))
    return ModelEntry(model_id, str(full), tuple(aliases), tuple(options), kind)


def read_models_file(path: str) -> list[ModelEntry]:
    """The entries of a models file (TOML, module docstring), in file order.

    Raises:
        CatalogError: unreadable or not TOML, a top-level key other than ``models``, an entry with
            an unknown key, a missing or non-model ``path``, a bad option type.
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise CatalogError("--models-file needs Python 3.11 or later (tomllib)") from None
    file = Path(path).expanduser()
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CatalogError(f"--models-file {path!r}: {exc}") from None
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise CatalogError(f"--models-file {path!r}: unknown key {unknown[0]!r} (only [models.ID] tables)")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise CatalogError(f"--models-file {path!r}: 'models' must be tables [models.ID]")
    return [_entry_from_table(model_id, table, file.parent) for model_id, table in models.items()]


def is_multi_model(settings: Settings) -> bool:
    """Several models (each loaded on demand), rather than one loaded at start."""
    return bool(settings.extra_models or settings.models_dir or settings.models_file)


def build_catalog(settings: Settings) -> tuple[ModelEntry, ...]:
    """The models of ``settings`` in order: ``--model`` (first ``model``, then ``extra_models``),
    ``--models-dir``, ``--models-file``; empty for a single-model server (:func:`is_multi_model`).

    Raises:
        CatalogError: a path that is not a model, two entries with one id or alias (naming both),
            a bad models file or folder, ``--served-model-name`` without ``--model``,
            ``--embedding-model`` (an embedding model is an entry of its own here).
    """
    if not is_multi_model(settings):
        return ()
    if settings.mmproj:
        raise CatalogError("--mmproj goes with one --model; with several models give each its own "
                           "(mmproj = \"...\" in --models-file)")
    if settings.model is None and settings.served_model_name:
        raise CatalogError("--served-model-name names a --model, and none is given (--models-dir and "
                           "--models-file name their own)")
    if settings.embedding_model or settings.served_embedding_model_name:
        raise CatalogError("--embedding-model serves one embedding model beside one chat model; with several "
                           "models give it its own entry (kind = \"embedding\" in --models-file)")
    entries: list[ModelEntry] = []
    if settings.model is not None:
        entries.append(_cli_entry(settings.model, settings.served_model_name))
    entries += [_cli_entry(*split_model_spec(spec)) for spec in settings.extra_models]
    if settings.models_dir:
        entries += scan_models_dir(settings.models_dir)
    if settings.models_file:
        entries += read_models_file(settings.models_file)
    seen: dict[str, ModelEntry] = {}
    for entry in entries:
        for name in entry.names:
            if name in seen:
                raise CatalogError(f"two models are named {name!r}: {seen[name].path!r} and {entry.path!r}; "
                                   "give one another id (--model PATH=NAME or the models file's table key)")
            seen[name] = entry
    if not entries:
        raise CatalogError("--models-dir / --models-file list no model")
    return tuple(entries)


def _cli_entry(path: str, name: str | None) -> ModelEntry:
    check_model_path(path, "--model")
    return ModelEntry(name or model_id_of(path), path)


def entry_settings(settings: Settings, entry: ModelEntry) -> Settings:
    """The settings one entry's engine runs with: the server's, with the entry's path, id and
    options; an embedding entry is the ``embedding_model`` of that engine. Engines run in their own
    process unless ``--no-engine-process`` (an unloaded model's memory then goes back to the OS)."""
    engine_process = True if settings.engine_process is None else settings.engine_process
    base = replace(settings, model=entry.path, served_model_name=entry.id, extra_models=(),
                   models_dir=None, models_file=None, engine_process=engine_process, mmproj=None)
    if entry.kind == "embedding":
        base = replace(base, embedding_model=entry.path, served_embedding_model_name=entry.id)
    return replace(base, **dict(entry.options))
