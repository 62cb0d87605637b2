"""Test data that a fresh clone needs: the public cases (committed) and the tokenizer zoo (fetched once).

The cases live in ``tests/data/cases`` (copies of the project's public case files). The tokenizer zoo
is five real tokenizers (gpt-2, llama-bpe, llama-spm, phi-3, qwen2), too large to commit (38 MB). They
are obtained reproducibly: the vocabulary-only GGUF test files that llama.cpp ships
(``vendor/llama.cpp/models/ggml-vocab-<name>.gguf``) are taken from the ``llama-cpp-python`` source
distribution on PyPI (``pip download``), checked against pinned SHA-256 sums, and converted once with
transformers' GGUF tokenizer loader (``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` then
``save_pretrained``) into a cache folder. ``make setup`` runs ``python tests/testdata.py``; on a tree
that already has the zoo it only checks the files (well under a second).

Where the zoo lives: ``$STREAMPROXY_TOKENIZER_ZOO`` if set, else
``$STREAMPROXY_CACHE_DIR/tokenizers`` or ``~/.cache/streamproxy/tokenizers`` (beside the default model's
converted folder).

Tests never download: they call :func:`zoo_path` and fail (not skip) with the command to run when the
zoo is missing. ``tests/data/tokenizer_ids.json`` pins the ids of a corpus under every zoo tokenizer
(recorded from the zoo), so a conversion that drifts is caught by
``tests/test_tokenizer.py::test_zoo_ids_pinned``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DATA = TESTS / "data"
CASES = DATA / "cases"
CASES_PUBLIC = CASES / "cases_public.jsonl"
ROUND2_PUBLIC = CASES / "round2_public.jsonl"
TOKENIZER_IDS = DATA / "tokenizer_ids.json"

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGUF_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models"

ZOO_NAMES = ("gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2")
GGUF_SHA256 = {
    "gpt-2": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "llama-bpe": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "llama-spm": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "phi-3": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "qwen2": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
}
"""SHA-256 of ``ggml-vocab-<name>.gguf`` inside the pinned source distribution."""

FILES_SHA256 = {
    "gpt-2": {
        "tokenizer.json": "311f7262f89ffe8757683fda3c081a5cac5a885dc311264791a17d2a18499a4f",
        "tokenizer_config.json": "d31ba0c2f975231bf011f1bde2eb4a50f67344f2b3c4027eaf70657891a40b88",
    },
    "llama-bpe": {
        "tokenizer.json": "8817de1b42df409aa72048c851240ebec0664210deb047967781a776e7f7ebbb",
        "tokenizer_config.json": "b5e917f3a1337a6abbf92fe405ca55ded0fcc840991c511a91aaea248ab30b35",
    },
    "llama-spm": {
        "tokenizer.json": "9232e531bdc1c91d167fdc18ce1301302b28ceb18c7bca24b2abb29d10ea3306",
        "tokenizer_config.json": "20c8c4202b5999baa5a3e2b6049feb9e489418bdb0f68a3cdd5f873fc8f5d469",
    },
    "phi-3": {
        "chat_template.jinja": "268b6082ceb7176dc6ed80557a2f7837f9f0339592fbee677d405a553af15f88",
        "tokenizer.json": "f75c8bcc236681be92bb7ae30bddb32f650bf58da842d9cde05daa65d62e1c08",
        "tokenizer_config.json": "9e1f27d94496d54ee1fc139e18f230176ace3b2d97857c352d90a2d115a85b9e",
    },
    "qwen2": {
        "chat_template.jinja": "af9c0233881b083b52ff773580215222b5440ac3d0beeeca99b76329b048f8db",
        "tokenizer.json": "7d78af32f7dc988d01ab6d17a44b12e9bb0783ad61b3518109a8f057e4fec198",
        "tokenizer_config.json": "8d94b5ac2fda133009d03945b5f8c0bc240b074b64274cdcfe974c3c5e95a6fc",
    },
}
"""SHA-256 of the converted folders' files (transformers 5.x output)."""

MARKER = ".streamproxy-zoo"
"""Written into a zoo folder once its files are complete; holds how the folder was obtained."""


def zoo_root() -> Path:
    """The folder holding one subfolder per zoo tokenizer (see the module docstring)."""
    if os.environ.get("STREAMPROXY_TOKENIZER_ZOO"):
        return Path(os.environ["STREAMPROXY_TOKENIZER_ZOO"]).expanduser()
    cache = os.environ.get("STREAMPROXY_CACHE_DIR")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache" / "streamproxy"
    return base / "tokenizers"


def zoo_path(name: str) -> Path:
    """The Hugging Face tokenizer folder of zoo tokenizer ``name`` (one of :data:`ZOO_NAMES`).

    Raises:
        KeyError: ``name`` is not a zoo tokenizer.
        FileNotFoundError: the zoo was not fetched; the message names the command that fetches it.
            Inside pytest the callers turn this into a failure, never a skip.
    """
    if name not in FILES_SHA256:
        raise KeyError(name)
    folder = zoo_root() / name
    if (folder / MARKER).is_file():
        return folder
    raise FileNotFoundError(
        f"tokenizer zoo folder {folder} is missing: run `make setup` (or `.venv/bin/python "
        f"tests/testdata.py`)"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _install(src: Path, name: str, how: str) -> None:
    """Copy a complete folder into the zoo atomically (temp folder + rename)."""
    root = zoo_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    tmp.chmod(0o755)
    for f in FILES_SHA256[name]:
        shutil.copyfile(src / f, tmp / f)
    (tmp / MARKER).write_text(how + "\n")
    dest = root / name
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the pinned source distribution (pip shows its progress bar) and check its sum."""
    print(
        f"[testdata] downloading the {SDIST} {SDIST_VERSION} source distribution (77 MB, once) ...",
        flush=True,
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--progress-bar", "on",
         "-d", str(dest), f"{SDIST}=={SDIST_VERSION}"],
        check=True,
    )
    sdist = dest / SDIST_FILE
    got = _sha256(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"[testdata] {sdist}: sha256 {got}, expected {SDIST_SHA256}")
    return sdist


def _convert(names: list[str]) -> None:
    # Loading a local GGUF needs no network. HF_HUB_OFFLINE is left as it is: with it set, transformers
    # writes "local_files_only": true into tokenizer_config.json (the pinned sum has false).
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="streamproxy-zoo-") as tmpdir:
        tmp = Path(tmpdir)
        sdist = _download_sdist(tmp)
        ggufs = tmp / "gguf"
        ggufs.mkdir()
        with tarfile.open(sdist) as tar:
            for name in names:
                member = tar.getmember(f"{GGUF_DIR}/ggml-vocab-{name}.gguf")
                src = tar.extractfile(member)
                assert src is not None
                target = ggufs / f"ggml-vocab-{name}.gguf"
                target.write_bytes(src.read())
                got = _sha256(target)
                if got != GGUF_SHA256[name]:
                    raise SystemExit(f"[testdata] {target.name}: sha256 {got}, expected {GGUF_SHA256[name]}")
        for i, name in enumerate(names, 1):
            print(f"[testdata] converting {name} ({i}/{len(names)}) with transformers' GGUF loader ...",
                  end="", flush=True)
            start = time.monotonic()
            tok = AutoTokenizer.from_pretrained(str(ggufs), gguf_file=f"ggml-vocab-{name}.gguf")
            out = tmp / "out" / name
            tok.save_pretrained(str(out))
            for f, want in FILES_SHA256[name].items():
                got = _sha256(out / f) if (out / f).is_file() else "missing"
                if got != want:
                    # Another transformers version may serialize differently; the pinned ids of
                    # tests/data/tokenizer_ids.json then decide whether it still behaves the same.
                    print(
                        f"\n[testdata] note: {name}/{f} differs from the pinned file (sha256 {got})", end=""
                    )
            _install(out, name, f"converted from {SDIST_FILE}:{GGUF_DIR}/ggml-vocab-{name}.gguf")
            print(f" {time.monotonic() - start:.0f} s", flush=True)


def ensure_zoo() -> Path:
    """Make every zoo folder present: keep complete ones, convert the others.

    Returns the zoo root. Raises ``SystemExit`` when a downloaded file's checksum does not match its pin
    and ``subprocess.CalledProcessError`` when ``pip download`` fails (no network).
    """
    root = zoo_root()
    missing = []
    for name in ZOO_NAMES:
        if not (root / name / MARKER).is_file():
            missing.append(name)
    if missing:
        _convert(missing)
    return root


ID_CORPUS = [
    "你是谁？请用中文详细介绍你自己，至少三句话。帮助各种",
    "请原样重复下面这句话，不要添加任何内容：我很感动，遐迩闻名的𠮷野家和龘字。",
    "Reply with exactly this line and nothing else: 🤗😄🙂 👨‍👩‍👧‍👦 🇯🇵 삼겹살 감사합니다",
    ("vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs. Don't stop; "
     "it's 3.5x faster , really ."),
    "The quick brown fox jumps over the lazy dog.",
    " leading space, double  space,\ttab and\nnewlines\n\n\nend ",
    "def f(x):\n    return x ** 2  # comment\n\nprint(f(12345678901234567890))",
    "naïve café Ωμέγα Привет мир مرحبا بالعالم नमस्ते दुनिया",
    "<|endoftext|> <|im_start|>user\nhi<|im_end|> <s> </s> <|end|>",
    "abcdefghijklmnopqrstuvwxyz" * 4,
    "",
]
"""Texts whose ids every zoo tokenizer must reproduce (``tests/data/tokenizer_ids.json``)."""


def record_ids(root: Path) -> dict:
    """Ids of :data:`ID_CORPUS` under the zoo folders in ``root``, without and with special tokens."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    out: dict = {"corpus": ID_CORPUS, "ids": {}, "ids_with_special_tokens": {}}
    for name in ZOO_NAMES:
        tok = AutoTokenizer.from_pretrained(str(root / name))
        out["ids"][name] = [tok.encode(t, add_special_tokens=False) for t in ID_CORPUS]
        out["ids_with_special_tokens"][name] = [tok.encode(t, add_special_tokens=True) for t in ID_CORPUS]
    return out


def main() -> None:
    """``python tests/testdata.py``: fetch the zoo. ``--record-ids DIR``: rewrite tokenizer_ids.json from
    DIR."""
    if len(sys.argv) == 3 and sys.argv[1] == "--record-ids":
        import json

        data = record_ids(Path(sys.argv[2]))
        TOKENIZER_IDS.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
        print(f"[testdata] wrote {TOKENIZER_IDS}")
        return
    start = time.monotonic()
    root = ensure_zoo()
    print(f"[testdata] tokenizer zoo ready in {root} ({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
