"""The model files the API process keeps (``proxy.engine.model_files``): read once per folder, kept
across loads while unchanged, read again when changed, bounded, read ahead for the models a
several-model server knows; and the EOS ids a load adds to a kept tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from api.fakes import make_tiny_model

from proxy.engine.factory import read_model_files_ahead
from proxy.engine.model_files import MODEL_FILES, ModelFilesCache, files_signature
from proxy.settings import Settings
from proxy.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("files")
    return make_tiny_model(root / "a", seed=0), make_tiny_model(root / "b", seed=1)


def test_a_folder_is_read_once_and_its_files_are_kept(folders: tuple[Path, Path]) -> None:
    cache = ModelFilesCache(2)
    first = cache.get(folders[0])
    link = folders[0].parent / "a-link"
    link.symlink_to(folders[0])
    assert cache.get(folders[0]) is first and cache.get(link) is first  # one entry per real folder
    assert cache.num_reads == 1
    assert cache.kept() == [os.path.realpath(folders[0])]
    assert first.vocab_size == len(first.hf_tokenizer) == 400
    assert first.vision is None and first.images_refused is None
    assert first.config.model_type == "llama"


def test_a_changed_tokenizer_file_is_read_again(folders: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(folders[0], tmp_path / "m"))
    cache = ModelFilesCache(2)
    first = cache.get(folder)
    (folder / "model.safetensors").write_bytes(b"weights are not read here")
    assert cache.get(folder) is first  # the weights are the child's
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_end|>", "<|endoftext|>", 1))
    again = cache.get(folder)
    assert again is not first and cache.num_reads == 2
    assert again.signature == files_signature(folder) != first.signature


def test_the_least_recently_used_folder_is_forgotten_past_the_bound(folders: tuple[Path, Path]) -> None:
    a, b = (os.path.realpath(f) for f in folders)
    cache = ModelFilesCache(1)
    cache.get(a)
    cache.get(b)
    assert cache.kept() == [b]
    cache.get(a)
    assert cache.kept() == [a] and cache.num_reads == 3


def test_preread_skips_missing_and_broken_folders_and_reads_at_most_the_bound(
        folders: tuple[Path, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cache = ModelFilesCache(2)
    cache.preread([None, broken, folders[0], folders[0], folders[1]])
    assert cache.kept() == [os.path.realpath(folders[0])]  # broken took a place: at most 2 tried
    cache = ModelFilesCache(2)
    cache.preread([folders[1], None, folders[0]])
    assert cache.kept() == [os.path.realpath(folders[1]), os.path.realpath(folders[0])]


def test_a_kept_tokenizer_with_the_models_eos_ids_equals_one_built_with_them(
        folders: tuple[Path, Path]) -> None:
    files = ModelFilesCache(1).get(folders[0])
    vocab = files.hf_tokenizer.get_vocab()
    own = {vocab["<|im_end|>"], vocab["<|endoftext|>"]}  # its EOS and its end-of-turn tokens
    built = Tokenizer(files.hf_tokenizer, generation_eos_ids=[7, 9])
    kept = files.tokenizer.with_generation_eos([7, 9])
    assert kept.eos_token_ids == built.eos_token_ids == own | {7, 9}
    assert files.tokenizer.eos_token_ids == own  # the kept one is unchanged
    assert kept.decode_table is files.tokenizer.decode_table and kept.decode_path == built.decode_path


def test_read_ahead_reads_the_engine_process_models_only(folders: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = folders
    forked = Settings(model=str(a), engine_process=True, device="cpu")
    threaded = Settings(model=str(b), engine_process=False, device="cpu")
    gguf = tmp_path / "never.gguf"
    gguf.write_bytes(b"")  # its folder would be written at its first load
    not_converted = Settings(model=str(gguf), engine_process=True, device="cpu", cache_dir=str(tmp_path))
    before = MODEL_FILES.kept()
    read_model_files_ahead([threaded, not_converted, forked])
    added = [k for k in MODEL_FILES.kept() if k not in before]
    assert os.path.realpath(a) in MODEL_FILES.kept() and os.path.realpath(b) not in added
    assert not (tmp_path / "never").exists()  # nothing converted ahead of its load
