"""An embedding model: a Hugging Face folder loaded with ``AutoModel`` (the base model, no LM head)
plus its pooling (:mod:`proxy.models.pooling`): :func:`load_embedding_model` -> :class:`EmbeddingModel`.

- Encoders (BERT, XLM-R, ModernBERT, ...: any architecture transformers implements) and decoder
  embedding models (Qwen3-Embedding style, ``last`` pooling) load the same way; an encoder-decoder
  model is refused.
- Pooling: the folder's sentence-transformers ``modules.json``, else ``default_pooling``
  (``--embedding-pooling``) with L2 normalisation.
- Length: the smallest of sentence-transformers' ``max_seq_length``, the config's
  ``max_position_embeddings`` (less RoBERTa's 2 offset positions) and ``max_len``.
- Device and dtype: the server's (``--device``, ``--dtype`` with ``auto`` resolved as for the chat
  model); vectors are pooled and returned in float32.
- A batch is right-padded; attention masks keep each input's vector equal to its vector alone (up to
  float rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from proxy.models.loaded import ModelLoadError
from proxy.models.pooling import POOLING_MODES, PoolingConfig, normalized, pool, read_pooling_config

logger = logging.getLogger(__name__)

_OFFSET_POSITIONS = {"roberta": 2, "xlm-roberta": 2, "camembert": 2, "xlm-roberta-xl": 2}
"""Position embeddings these architectures reserve for padding (``padding_idx + 1``)."""


@dataclass
class EmbeddingModel:
    """A loaded embedding model.

    Attributes:
        model: the transformers base model, eval mode, on ``device``.
        hf_tokenizer: its tokenizer.
        pooling: how token states become a vector.
        dimensions: the vector width (the config's ``hidden_size``).
        max_model_len: the most tokens one input may have.
        vocab_size: token ids accepted as input are ``[0, vocab_size)``.
        device, dtype: where and how the weights are held.
    """

    model: Any
    hf_tokenizer: Any
    pooling: PoolingConfig
    dimensions: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def tokenize(self, texts: Sequence[str], max_tokens: int | None = None) -> list[list[int]]:
        """Token ids of each text with the tokenizer's special tokens (``[CLS] ... [SEP]``).

        Args:
            max_tokens: truncate each text to this many tokens (the tokenizer's own truncation side,
                special tokens kept; vLLM's ``truncate_prompt_tokens`` for text), or None.
        """
        if max_tokens is None:
            encoded = self.hf_tokenizer(list(texts), add_special_tokens=True)
        else:
            encoded = self.hf_tokenizer(list(texts), add_special_tokens=True, truncation=True,
                                        max_length=max_tokens)
        return [list(ids) for ids in encoded["input_ids"]]

    @torch.inference_mode()
    def embed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward pass over ``batch`` (right-padded), pooled and, when the pooling says so,
        L2-normalised.

        Args:
            batch: token ids of each input, each non-empty, ids in ``[0, vocab_size)``.

        Returns:
            ``[len(batch), dimensions]`` float32 on the CPU.
        """
        lengths = torch.tensor([len(ids) for ids in batch], dtype=torch.long)
        width = int(lengths.max())
        pad = self.hf_tokenizer.pad_token_id
        input_ids = torch.full((len(batch), width), pad if isinstance(pad, int) else 0, dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
        vectors = pool(out.last_hidden_state, lengths, self.pooling.mode)
        if self.pooling.normalize:
            vectors = normalized(vectors)
        return vectors.cpu()


def _max_len(config: Any, pooling: PoolingConfig, max_len: int | None) -> int:
    limits = [n for n in (pooling.max_seq_length, max_len) if n]
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        limits.append(int(positions) - _OFFSET_POSITIONS.get(str(getattr(config, "model_type", "")), 0))
    if not limits:
        raise ModelLoadError("the embedding model's length is unknown: its config has no "
                             "max_position_embeddings and no max_seq_length is set")
    return min(limits)


def load_embedding_model(folder: Path, device: torch.device, dtype: torch.dtype, *,
                         default_pooling: str = "last", max_len: int | None = None,
                         gguf: Path | None = None) -> EmbeddingModel:
    """Load ``folder`` as an embedding model (the rules: this module's docstring).

    Args:
        default_pooling: the pooling of a folder without ``modules.json`` (one of ``POOLING_MODES``).
        max_len: a cap on the input length (the chat model's ``--max-model-len``), or None.
        gguf: the GGUF whose config and tokenizer ``folder`` holds: its weights are dequantized from
            the file (:func:`proxy.models.packed_load.load_gguf_dense`; the causal LM's base model).

    Raises:
        ModelLoadError: no config, an encoder-decoder model, an unserved pooling or module, or
            transformers cannot load it.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    if default_pooling not in POOLING_MODES:
        raise ModelLoadError(f"unknown pooling {default_pooling!r}; served: {POOLING_MODES}")
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder: {exc}") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{folder}: encoder-decoder models ({config.model_type}) are not served as "
                             "embedding models")
    pooling = read_pooling_config(folder) or PoolingConfig(default_pooling, normalize=True)
    try:
        if gguf is not None:
            from proxy.models.packed_load import load_gguf_dense

            causal = load_gguf_dense(folder, config, gguf, device, dtype, "sdpa")
            model = getattr(causal, causal.base_model_prefix)
        else:
            model = AutoModel.from_pretrained(str(folder), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"transformers cannot load {folder} as an embedding model: {exc}") from exc
    model.to(device)
    model.eval()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    loaded = EmbeddingModel(model, tokenizer, pooling, dimensions=int(text.hidden_size),
                            max_model_len=_max_len(text, pooling, max_len),
                            vocab_size=int(text.vocab_size), device=device, dtype=dtype)
    logger.info("embedding model %s: %s pooling%s, %d dimensions, %d tokens, %s", folder.name, pooling.mode,
                " + normalize" if pooling.normalize else "", loaded.dimensions, loaded.max_model_len,
                str(dtype).removeprefix("torch."))
    return loaded
