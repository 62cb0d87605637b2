"""Tiny random stand-ins (seeded, fp32, CPU) of the transformers model types the architecture tests sweep.

Each entry is ``model_type -> config overrides`` on top of ``COMMON``; windows and chunks are small
(16 tokens) so that a 40-token prompt crosses them.
"""

from __future__ import annotations

from typing import Any

import torch

WINDOW = 16

COMMON: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_MLA = {
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4,
}
_TWO = ["sliding_attention", "full_attention"]

SERVED: dict[str, dict[str, Any]] = {
    # full attention (already served before issue 15)
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 24},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma": {"head_dim": 16},
    "olmo2": {},
    "granite": {},
    "gpt_neox": {},
    "cohere": {},
    "gpt2": {},
    "smollm3": {},
    "glm4": {},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "stablelm": {},
    # sliding window, per layer
    "mistral_swa": {"model_type": "mistral", "sliding_window": WINDOW},
    "phi3_4k": {"model_type": "phi3", "sliding_window": WINDOW},
    "phi3_window_beyond_context": {"model_type": "phi3", "sliding_window": 262144},
    "starcoder2": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "head_dim": 16, "attn_logit_softcapping": 1.0,
               "query_pre_attn_scalar": 16},  # a cap that bites
    "gemma3_text": {"sliding_window": WINDOW, "head_dim": 16, "layer_types": _TWO},
    "olmo3": {"sliding_window": WINDOW, "layer_types": _TWO},
    "cohere2": {"sliding_window": WINDOW, "layer_types": _TWO},
    "exaone4": {"sliding_window": WINDOW, "layer_types": _TWO},
    "ministral": {"sliding_window": WINDOW, "layer_types": _TWO, "head_dim": 16},
    "gpt_oss": {"sliding_window": WINDOW, "layer_types": _TWO, "num_local_experts": 4,
                "num_experts_per_tok": 2, "head_dim": 16},
    "gemma4_text": {"sliding_window": WINDOW, "head_dim": 16, "num_hidden_layers": 4,
                    "layer_types": _TWO * 2, "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 97,
                    "hidden_size_per_layer_input": 8},
    "qwen2_swa": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": WINDOW,
                  "max_window_layers": 1},
    # chunked attention
    "llama4_text": {"attention_chunk_size": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1,
                    "intermediate_size_mlp": 128, "head_dim": 16, "interleave_moe_layer_step": 1,
                    "no_rope_layers": [1, 0], "layer_types": ["chunked_attention", "full_attention"]},
    # multi-head latent attention (K and V of their own widths)
    "deepseek_v2": dict(_MLA),
    "deepseek_v3": dict(_MLA),
    "glm4_moe_lite": dict(_MLA),
}
"""Served exactly: greedy ids equal ``generate()``."""

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "falcon": ({}, "AttentionInterface"),
    "granitemoehybrid": ({}, "Mamba"),
    "qwen3_next": ({}, "Mamba"),
    "qwen3_5_text": ({}, "Mamba"),
    "deepseek_v32": ({}, "sparse attention"),
}
"""Refused at load: ``model_type -> (overrides, a word of the reason)``."""


def build_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """The tiny config of a ``SERVED`` / ``REFUSED`` entry."""
    from transformers import AutoConfig

    extra = dict(SERVED[name] if name in SERVED else REFUSED[name][0])
    if overrides:
        extra.update(overrides)
    model_type = extra.pop("model_type", name)
    return AutoConfig.for_model(model_type, **{**COMMON, **extra})


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM (eager attention, eval mode), weights ~ N(0, 0.15) so logits are far from
    ties."""
    from transformers import AutoModelForCausalLM

    config = build_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model.eval()


def save_tiny_folder(name: str, folder: Any) -> Any:
    """:func:`build_model` of ``name`` saved as a Hugging Face folder with a 97-word tokenizer; returns
    ``folder``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, COMMON["vocab_size"])]
    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<pad>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    build_model(name).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
