"""The model catalog (``proxy.catalog``) and the CLI that fills it: repeated ``--model``, ``PATH=NAME``,
``--models-dir``, ``--models-file``; bad lists refused at start naming the entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.catalog import (
    CatalogError,
    ModelEntry,
    build_catalog,
    entry_settings,
    is_multi_model,
)
from proxy.cli import build_parser, settings_from
from proxy.model_memory import ENGINE_PROCESS_BYTES, estimate_bytes, memory_budget
from proxy.settings import Settings


def model_dir(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(folder)


def cli(*argv: str) -> Settings:
    return settings_from(build_parser().parse_args(["serve", *argv]), {})


def test_one_model_is_no_catalog(tmp_path: Path) -> None:
    a = model_dir(tmp_path, "a")
    settings = cli("--model", a, "--served-model-name", "x")
    assert (settings.model, settings.served_model_name, settings.extra_models) == (a, "x", ())
    assert not is_multi_model(settings) and build_catalog(settings) == ()
    assert cli("--model", f"{a}=named").served_model_name == "named"
    assert build_catalog(cli()) == ()  # the default model, zero config


def test_repeated_model_names_in_order(tmp_path: Path) -> None:
    a, b, c = (model_dir(tmp_path, n) for n in ("a", "b", "c"))
    settings = cli("--model", a, "--model", f"{b}=bee", "--model", c, "--served-model-name", "ay",
                   "--served-model-name", "ignored-for-b", "--served-model-name", "see")
    assert settings.extra_models == (f"{b}=bee", f"{c}=see")
    assert [(e.id, e.path) for e in build_catalog(settings)] == [("ay", a), ("bee", b), ("see", c)]
    plain = cli("--model", a, "--model", b)
    assert [e.id for e in build_catalog(plain)] == ["a", "b"]


def test_models_dir_lists_folders_and_gguf_files(tmp_path: Path) -> None:
    root = tmp_path / "models"
    model_dir(root, "beta")
    model_dir(root, "alpha")
    (root / "notes").mkdir()
    (root / "tiny-q4.gguf").write_bytes(b"GGUF")
    (root / "readme.txt").write_text("x")
    entries = build_catalog(cli("--models-dir", str(root)))
    assert [e.id for e in entries] == ["alpha", "beta", "tiny-q4"]
    assert entries[2].path == str(root / "tiny-q4.gguf")


def test_models_dir_pairs_an_mmproj_in_a_subfolder_and_skips_a_loose_one(tmp_path: Path) -> None:
    """llama.cpp's router rule (``common/preset.cpp``): a subfolder with one model ``.gguf`` and a
    ``*mmproj*.gguf`` is one entry named after the subfolder; an mmproj beside the models is none."""
    root = tmp_path / "models"
    (root / "smolvlm").mkdir(parents=True)
    for name in ("smolvlm/SmolVLM-256M-Q8_0.gguf", "smolvlm/mmproj-SmolVLM-256M-F16.gguf", "text-q4.gguf",
                 "mmproj-other-F16.gguf"):
        (root / name).write_bytes(b"GGUF")
    (root / "two").mkdir()
    for name in ("two/a.gguf", "two/b.gguf"):  # two models: which one is meant is not said
        (root / name).write_bytes(b"GGUF")
    settings = cli("--models-dir", str(root))
    vlm, text = build_catalog(settings)
    assert vlm == ModelEntry("smolvlm", str(root / "smolvlm/SmolVLM-256M-Q8_0.gguf"),
                             options=(("mmproj", str(root / "smolvlm/mmproj-SmolVLM-256M-F16.gguf")),))
    assert (text.id, text.options) == ("text-q4", ())
    assert entry_settings(settings, vlm).mmproj == str(root / "smolvlm/mmproj-SmolVLM-256M-F16.gguf")
    assert entry_settings(settings, text).mmproj is None


def test_models_file_entries_and_options(tmp_path: Path) -> None:
    model_dir(tmp_path, "qwen")
    embed = model_dir(tmp_path, "bge")
    file = tmp_path / "models.toml"
    file.write_text(f'''
[models.chat]
path = "qwen"
aliases = ["gpt-4o-mini", "default"]
max-model-len = 4096
dtype = "float32"
reasoning-parser = "none"
tool-call-parser = "hermes"
quantization = "int8"

[models.embed]
path = "{embed}"
kind = "embedding"

[models.vlm]
path = "vlm.gguf"
mmproj = "mmproj-vlm.gguf"
''')
    for name in ("vlm.gguf", "mmproj-vlm.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    settings = cli("--models-file", str(file), "--max-model-len", "2048")
    chat, emb, vlm = build_catalog(settings)
    assert vlm.options == (("mmproj", str(tmp_path / "mmproj-vlm.gguf")),)
    assert entry_settings(settings, vlm).mmproj == str(tmp_path / "mmproj-vlm.gguf")
    assert chat == ModelEntry("chat", str(tmp_path / "qwen"), ("gpt-4o-mini", "default"),
                              (("max_model_len", 4096), ("dtype", "float32"), ("quantization", "int8"),
                               ("reasoning_parser", "none"), ("tool_call_parser", "hermes")))
    assert (emb.id, emb.kind) == ("embed", "embedding")
    s = entry_settings(settings, chat)
    assert (s.model, s.served_model_name, s.max_model_len, s.dtype, s.quantization, s.engine_process) == (
        str(tmp_path / "qwen"), "chat", 4096, "float32", "int8", True)
    assert (s.extra_models, s.models_file) == ((), None)
    e = entry_settings(settings, emb)
    assert (e.embedding_model, e.served_embedding_model_name, e.max_model_len) == (embed, "embed", 2048)
    assert entry_settings(replace_engine(settings), chat).engine_process is False


def replace_engine(settings: Settings) -> Settings:
    from dataclasses import replace

    return replace(settings, engine_process=False)


@pytest.mark.parametrize("toml, message", [
    ('[models.a]\npath = "a"\ncolour = "red"\n', "[models.a]: unknown key 'colour'"),
    ('[models.a]\npath = "nowhere"\n', "[models.a]: '"),
    ('[models.a]\n', "[models.a]: 'path' (a string) is required"),
    ('[models.a]\npath = "a"\nmax-model-len = "long"\n', "[models.a]: 'max-model-len' must be a int"),
    ('[models.a]\npath = "a"\nkind = "vision"\n', "[models.a]: 'kind' must be one of"),
    ('[models.a]\npath = "a"\n[settings]\nport = 1\n', "unknown key 'settings'"),
    ('[models.a]\npath = "a"\naliases = ["b"]\n[models.b]\npath = "a"\n', "two models are named 'b'"),
    ('[models.a\n', "--models-file"),
    ('[models.a]\npath = "a"\nmmproj = "a"\n', "[models.a]: 'mmproj' must name the mmproj .gguf file of a"),
    ('[models.a]\npath = "m.gguf"\nmmproj = "nowhere.gguf"\n', "[models.a]: 'mmproj' must name"),
])
def test_bad_models_file_is_refused_naming_the_entry(tmp_path: Path, toml: str, message: str) -> None:
    model_dir(tmp_path, "a")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    file = tmp_path / "models.toml"
    file.write_text(toml)
    with pytest.raises(CatalogError) as err:
        build_catalog(Settings(models_file=str(file)))
    assert message in str(err.value)


def test_bad_model_lists_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = model_dir(tmp_path, "a")
    other = model_dir(tmp_path / "x", "a")
    cases = [
        (["--model", a, "--model", other], f"two models are named 'a': '{a}' and '{other}'"),
        (["--model", a, "--model", str(tmp_path / "missing")], "is not a model (not found"),
        (["--model", a, "--model", str(tmp_path)], "is not a model (a folder without config.json"),
        (["--models-dir", str(tmp_path / "none")], "--models-dir"),
        (["--model", a, "--models-max", "-1"], "--models-max"),
        (["--served-model-name", "x", "--models-dir", str(tmp_path)], "--served-model-name names a --model"),
        (["--model", a, "--model", f"{a}=b", "--embedding-model", a], "with several models give it its own"),
        (["--model", a, "--model", f"{a}=b", "--mmproj", a], "--mmproj goes with one --model"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError) as err:
            cli(*argv)
        assert message in str(err.value)
    from proxy.cli import main

    with pytest.raises(SystemExit) as exited:  # main() makes it a usage error: exit 2, before any load
        main(["serve", "--model", a, "--model", other])
    assert exited.value.code == 2
    assert "two models are named 'a'" in capsys.readouterr().err


def test_a_models_estimate_is_its_weight_files_and_its_kv_pool(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 256}))
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    (folder / "tokenizer.json").write_text("{}")  # not weights
    fp32 = Settings(model=str(folder), dtype="float32")
    per_token = 2 * 2 * 2 * 8 * 4  # keys and values x layers x KV heads x head size x 4 bytes
    blocks = Settings(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert estimate_bytes(blocks) == 1000 + per_token * 16 * 64
    in_a_process = Settings(model=str(folder), dtype="float32", num_kv_blocks=64, engine_process=True)
    assert estimate_bytes(in_a_process) == 1000 + per_token * 16 * 64 + ENGINE_PROCESS_BYTES
    assert estimate_bytes(fp32) == 1000 + per_token * 32 * 256  # max_num_seqs full contexts
    assert estimate_bytes(Settings(model=str(folder), max_model_len=128)) == 1000 + per_token // 2 * 32 * 128
    capped = Settings(model=str(folder), dtype="float32", kv_cache_bytes=5000)
    assert estimate_bytes(capped) == 6000  # the cap
    unreadable = tmp_path / "m.gguf"
    unreadable.write_bytes(b"g" * 300)
    assert estimate_bytes(Settings(model=str(unreadable), kv_cache_bytes=1 << 30)) == 300 + (1 << 30)
    (tmp_path / "mmproj.gguf").write_bytes(b"v" * 40)  # its vision tower counts too
    mmproj = str(tmp_path / "mmproj.gguf")
    paired = Settings(model=str(unreadable), mmproj=mmproj, kv_cache_bytes=1 << 30)
    assert estimate_bytes(paired) == 340 + (1 << 30)


def test_a_gguf_models_kv_pool_comes_from_its_metadata(tmp_path: Path) -> None:
    """A GGUF's layers, heads and context are its metadata (llama.cpp's keys), so its estimate is the
    pool the engine will size, not the whole budget."""
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(3)
    writer.add_embedding_length(64)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_context_length(512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    per_token = 2 * 3 * 2 * 8 * 2  # keys and values x layers x KV heads x head size x 2 bytes (bf16)
    size = path.stat().st_size
    assert estimate_bytes(Settings(model=str(path))) == size + per_token * 32 * 512
    assert estimate_bytes(Settings(model=str(path), max_model_len=100)) == size + per_token * 32 * 100
    assert estimate_bytes(Settings(model=str(path), kv_cache_bytes=1000)) == size + 1000


def test_without_kv_cache_bytes_the_pool_is_half_the_available_memory(tmp_path: Path) -> None:
    from proxy.model_memory import kv_pool_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    1000 kB\n")
    assert kv_pool_bytes(Settings(), tmp_path / "none.gguf", meminfo) == 1000 * 1024 // 2
    assert kv_pool_bytes(Settings(), tmp_path / "none.gguf", tmp_path / "no-meminfo") == 1 << 30


def test_the_memory_budget_defaults_to_most_of_the_available_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000 kB\nMemFree:  100 kB\nMemAvailable:    1000 kB\n")
    assert memory_budget(Settings(), meminfo) == 1000 * 1024 * 9 // 10
    assert memory_budget(Settings(models_memory_bytes=5), meminfo) == 5
    assert memory_budget(Settings(models_memory_bytes=0), meminfo) == 0
    assert memory_budget(Settings(), tmp_path / "none") == 0
