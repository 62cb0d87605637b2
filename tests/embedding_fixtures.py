"""Tiny embedding-model folders the embedding tests build themselves (no hub downloads).

:func:`make_tiny_bert` writes a randomly initialised 2-layer BERT (hidden 32) with a WordPiece
tokenizer over :data:`WORDS` as a sentence-transformers folder (``modules.json``,
``1_Pooling/config.json``, optionally ``2_Normalize``, ``sentence_bert_config.json``), which both
streamproxy and ``sentence_transformers`` load.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "paris",
    "france", "capital", "city", "river", "rain", "sun", "moon", "cat", "bird", "tree", "book",
    "read", "write", "stream", "token", "model", "vector", "search", "query", "answer",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_POSITIONS = 64


def _modules(normalize: bool) -> list[dict[str, object]]:
    mods: list[dict[str, object]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize",
                     "type": "sentence_transformers.models.Normalize"})
    return mods


def pooling_config(mode: str, width: int = 32, legacy: bool = True) -> dict[str, object]:
    """A ``1_Pooling/config.json``: sentence-transformers' boolean flags (``legacy``) or its newer
    ``pooling_mode`` string; ``mode`` in sentence-transformers' names (``mean``, ``cls``, ``lasttoken``)."""
    if not legacy:
        return {"embedding_dimension": width, "pooling_mode": mode, "include_prompt": True}
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "max": "pooling_mode_max_tokens",
             "lasttoken": "pooling_mode_lasttoken"}
    config: dict[str, object] = {"word_embedding_dimension": width}
    config.update({flag: name == mode for name, flag in flags.items()})
    return config


def make_tiny_bert(folder: Path, *, pooling: str = "mean", normalize: bool = True, legacy: bool = True,
                   max_seq_length: int | None = 48, seed: int = 0) -> Path:
    """Write the tiny BERT sentence-transformer folder at ``folder``; returns it."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + sorted(set(WORDS)) + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + \
        list("abcdefghijklmnopqrstuvwxyz.,!?")
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True,
                                  model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=MAX_POSITIONS, pad_token_id=0)
    BertModel(config).eval().save_pretrained(str(folder))
    (folder / "modules.json").write_text(json.dumps(_modules(normalize)), encoding="utf-8")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config(pooling, legacy=legacy)))
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    return folder


def st_reference(folder: Path, texts: list[str]):
    """``sentence_transformers.SentenceTransformer(folder).encode(texts)`` as float32 numpy ``[n, dim]``."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=1)


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
