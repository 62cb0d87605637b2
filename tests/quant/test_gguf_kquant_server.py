"""``streamproxy serve --model X.gguf`` on a tiny llama GGUF of Q4_K / Q6_K / Q5_K / Q5_1 / IQ4 / Q5_0
tensors: the load log says each type is served at its own precision, greedy completions through the real
server (uvicorn on 127.0.0.1) equal transformers' ``generate()`` on the GGUF's dequantized weights, and
the weights are read from the file alone (the cache holds the config and tokenizer only, issue 46)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from production.helpers import start_server

from proxy.engine.selfcheck import greedy_reference
from proxy.quant.int8_linear import kernel_available
from quant.test_gguf_kquant_model import EOS, LOSSLESS, write_gguf

VOCAB = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, 112))]


def _converted_folder(folder: Path, model: torch.nn.Module) -> None:
    """What ``proxy.models.source.convert_gguf`` caches for the GGUF (its config, generation config
    and tokenizer; no weights), written directly: the tiny GGUF has no tokenizer of its own."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model.config.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.mark.skipif(not kernel_available(), reason="Q6_K / Q5_K / Q5_1 run on the int8 kernel only")
def test_served_greedy_text_equals_generate_on_the_files_values(tmp_path: Path) -> None:
    path = tmp_path / "tiny-kquant.gguf"
    dense = write_gguf(path, LOSSLESS, norm_noise=0.1)
    folder = tmp_path / "cache" / "tiny-kquant"
    _converted_folder(folder, dense)
    before = sorted(p.name for p in folder.iterdir())
    server = start_server(tmp_path, ["--model", str(path), "--cache-dir", str(tmp_path / "cache"),
                                     "--num-threads", "1", "--max-model-len", "128", "--enforce-eager",
                                     "--kv-cache-bytes", str(16 << 20)])
    try:
        log = server.log()
        assert ("Q4_K -> int4 g32 x7, Q6_K -> int8 g16 x3, IQ4_NL -> int8 g32 x1, IQ4_XS -> int8 g32 x1, "
                "Q5_0 -> int8 g32 x1, Q5_1 -> int8 g32 x1, Q5_K -> int8 g32 x1, "
                "token_embd Q4_K -> int8 g32 x1") in log, log[-3000:]
        assert "not at its own precision" not in log
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(3, 112, (n,), generator=g).tolist() for n in (4, 13, 7)]
        distinct = set()
        for prompt in prompts:
            ref_ids, gaps = greedy_reference(dense, prompt, 12, EOS)
            body = {"model": "tiny-kquant", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            got = [VOCAB.index(w) for w in reply.json()["choices"][0]["text"].split()]
            for pos, (a, b) in enumerate(zip(got, ref_ids, strict=False)):
                if a != b:  # only at a near-tie of the reference (bf16 activations: logits within ~0.02)
                    assert gaps[pos] < 0.05, (prompt, pos, got, ref_ids, gaps[pos])
                    break
            else:
                assert got == [t for t in ref_ids if t != EOS], (got, ref_ids)
            distinct.add(tuple(ref_ids))
        assert len(distinct) > 1
        assert sorted(p.name for p in folder.iterdir()) == before  # no weights written beside them
        assert not [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
    finally:
        server.stop()
