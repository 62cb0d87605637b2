"""Every swept architecture is served exactly or refused at load with its reason (issue 15).

Tiny random stand-ins (``arch_zoo``; windows and chunks of 16 tokens) of the transformers model
types users serve. Served types: greedy ids of the engine equal ``generate()`` (eager attention) of
each prompt alone -- solo, and batched with staggered arrivals under a 10-token budget (chunked
prefill) -- with a prompt (41 tokens) longer than every window / chunk. Refused types: the load-time
rules name the model type, what is unsupported and what to try. The load-time self-check passes on
the served ones and catches an attention that drops a window, a chunk, a soft-cap or the sinks.
The sweep over the types served before issue 15 is marked slow; the new ones run by default.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from proxy import models
from proxy.engine.core import EngineCore
from proxy.engine.execution import attention
from proxy.engine.execution.architectures import UnsupportedArchitectureError, check_config, check_supported
from proxy.engine.execution.attention import kernels
from proxy.engine.selfcheck import SelfCheckError, run_self_check
from proxy.sampling import SamplingParams
from proxy.settings import Settings

from ..arch_zoo import REFUSED, SERVED, WINDOW, build_config, build_model
from ..engine_helpers import assert_greedy_matches, reference_greedy, run_staggered

EOS = 2
MAX_NEW = 16
LENGTHS = [2 * WINDOW + 9, 5, 17, 30]
ARRIVALS = [0, 0, 3, 6]
NEW_TYPES = {
    "stablelm", "mistral_swa", "phi3_4k", "phi3_window_beyond_context", "starcoder2", "gemma2", "gemma3_text",
    "olmo3", "cohere2", "exaone4", "ministral", "gpt_oss", "llama4_text", "deepseek_v2", "deepseek_v3",
    "glm4_moe_lite", "gemma4_text", "qwen2_swa",
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


def _engine_model(ref: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(ref)
    model.set_attn_implementation(attention.register())
    return model.eval()


def _params(name: str) -> list:
    return [pytest.param(n, marks=() if n in NEW_TYPES else pytest.mark.slow) for n in name]


@pytest.mark.parametrize("name", _params(list(SERVED)))
def test_served_greedy_matches_generate(name: str) -> None:
    ref = build_model(name)
    model = _engine_model(ref)
    prompts = _prompts()
    references = [reference_greedy(ref, p, MAX_NEW, EOS) for p in prompts]
    # solo: the long prompt alone, one prefill
    solo = EngineCore(model, Settings(num_kv_blocks=64, block_size=4, max_num_batched_tokens=512), [EOS], 256)
    out = run_staggered(solo, prompts[:1], SamplingParams(max_tokens=MAX_NEW, temperature=0.0), [0])
    assert_greedy_matches(out["0"], *references[0], label=f"{name}/solo")
    # batched, staggered, prefill in chunks of at most 10 tokens shared with decodes
    core = EngineCore(model, Settings(num_kv_blocks=128, block_size=4, max_num_batched_tokens=10), [EOS], 256)
    results = run_staggered(core, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), ARRIVALS)
    for i, (ids, gaps) in enumerate(references):
        assert_greedy_matches(results[str(i)], ids, gaps, f"{name}/batched/prompt {i}")
    assert len({tuple(v) for v in results.values()}) == len(prompts), "degenerate outputs"


EXPECTED_LAYERS = {
    # name: per layer (sliding_window, chunk_size), key_dim, value_dim, num_kv_heads
    "mistral_swa": ([(WINDOW, None), (WINDOW, None)], 16, 16, 2),
    "phi3_window_beyond_context": ([(262144, None), (262144, None)], 16, 16, 2),
    "gemma3_text": ([(WINDOW, None), (None, None)], 16, 16, 2),
    "gpt_oss": ([(WINDOW, None), (None, None)], 16, 16, 2),
    "llama4_text": ([(None, WINDOW), (None, None)], 16, 16, 2),
    "deepseek_v3": ([(None, None), (None, None)], 24, 12, 4),
    "llama": ([(None, None), (None, None)], 16, 16, 2),
}


@pytest.mark.parametrize("name", list(EXPECTED_LAYERS))
def test_layer_specs_and_cache_shapes_come_from_the_layers(name: str) -> None:
    patterns, key_dim, value_dim, kv_heads = EXPECTED_LAYERS[name]
    core = EngineCore(_engine_model(build_model(name)), Settings(num_kv_blocks=8, block_size=4), [EOS], 256)
    layers = core.runner.layers
    assert [s.pattern for s in layers] == patterns
    assert {(s.key_dim, s.value_dim, s.num_kv_heads) for s in layers} == {(key_dim, value_dim, kv_heads)}
    cache = core.runner.kv_cache
    # 8 blocks of 4 slots, and the scratch slot of the decode graphs' padded rows
    assert cache.key_pools[0].shape == (33, kv_heads, key_dim)
    assert cache.value_pools[0].shape == (33, kv_heads, value_dim)
    assert core.runner.kv_bytes_per_token == 2 * kv_heads * (key_dim + value_dim) * 4
    if name == "gpt_oss":
        assert [s.has_sinks for s in layers] == [True, True]
    else:
        assert not any(s.has_sinks for s in layers)


def test_gemma2_layers_carry_their_softcap() -> None:
    core = EngineCore(
        _engine_model(build_model("gemma2")), Settings(num_kv_blocks=8, block_size=4), [EOS], 256
    )
    cap = build_config("gemma2").attn_logit_softcapping
    assert cap and [s.softcap for s in core.runner.layers] == [cap, cap]


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_at_load_with_reason(name: str) -> None:
    _overrides, word = REFUSED[name]
    config = build_config(name)
    with pytest.raises(models.ModelLoadError) as info:
        check_supported(config)
    message = str(info.value)
    assert f"model type '{config.model_type}'" in message
    assert word in message
    assert "vLLM or llama.cpp" in message  # what to try


def test_unknown_layer_kinds_are_refused() -> None:
    config = build_config("gemma3_text", {"layer_types": ["sliding_attention", "indexed_attention"]})
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"'gemma3_text' has attention layers of kind \['indexed_attention'\]",
    ):
        check_config(config)


def test_a_layer_without_attention_is_refused_when_the_engine_is_built() -> None:
    """A decoder layer that never reaches the attention function (as a Mamba layer) is found by the probe."""
    model = _engine_model(build_model("llama"))
    attn = model.model.layers[1].self_attn

    def no_attention(hidden_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        return torch.zeros_like(hidden_states), None

    attn.forward = no_attention
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"'llama' has decoder layers that do not use the attention function \(layers \[1\] of 2\)",
    ):
        EngineCore(model, Settings(num_kv_blocks=8, block_size=4), [EOS], 256)


def test_paged_attention_outside_the_engine_still_refuses() -> None:
    model = _engine_model(build_model("llama"))
    with pytest.raises(RuntimeError, match="needs the paged_attn_metadata keyword"):
        model(torch.tensor([[3, 4, 5]]))


@pytest.mark.parametrize(
    "name", ["gemma2", "gpt_oss", "llama4_text", "deepseek_v3", "phi3_window_beyond_context"]
)
def test_self_check_passes(name: str) -> None:
    model = _engine_model(build_model(name))
    report = run_self_check(model, Settings(block_size=4), 256)
    assert report.model_type == build_config(name).model_type
    assert report.prompt_lengths[0] > WINDOW and len(report.prompt_lengths) == 3
    assert report.num_near_ties == 0
    # the model is left on the paged attention, usable by the engine
    assert model.config._attn_implementation == attention.ATTN_IMPLEMENTATION


def _drop_window(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = attention.PagedAttentionMetadata
    decode, prefill = meta.decode_mask_for, meta.prefill_mask_for
    monkeypatch.setattr(meta, "decode_mask_for", lambda self, w, c: decode(self, None, c))
    monkeypatch.setattr(meta, "prefill_mask_for", lambda self, w, c, g: prefill(self, None, c, g))


def _drop_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = attention.PagedAttentionMetadata
    decode, prefill = meta.decode_mask_for, meta.prefill_mask_for
    monkeypatch.setattr(meta, "decode_mask_for", lambda self, w, c: decode(self, w, None))
    monkeypatch.setattr(meta, "prefill_mask_for", lambda self, w, c, g: prefill(self, w, None, g))


def _drop_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    attend = kernels.attend
    monkeypatch.setattr(
        kernels, "attend", lambda q, k, v, m, s, cap, sinks: attend(q, k, v, m, s, None, sinks)
    )


def _drop_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    attend = kernels.attend
    monkeypatch.setattr(
        kernels, "attend", lambda q, k, v, m, s, cap, sinks: attend(q, k, v, m, s, cap, None)
    )


@pytest.mark.parametrize(("name", "sabotage"), [
    ("mistral_swa", _drop_window), ("gemma3_text", _drop_window), ("llama4_text", _drop_chunk),
    ("gemma2", _drop_softcap), ("gpt_oss", _drop_sinks),
])
def test_self_check_refuses_an_attention_that_ignores_a_feature(name, sabotage, monkeypatch) -> None:
    """Each feature matters: without it the engine's text differs and the self-check says where."""
    model = _engine_model(build_model(name))
    sabotage(monkeypatch)
    model_type = build_config(name).model_type
    with pytest.raises(
        SelfCheckError,
        match=rf"self-check failed for model type '{model_type}': prompt \d \(\d+ tokens.*"
        r"first differs at generated token \d+",
    ):
        run_self_check(model, Settings(block_size=4), 256)


def test_self_check_tolerance_follows_the_packed_kernels_dtype() -> None:
    """An fp32 model whose packed linears run bf16 activations (the default GGUF on an AVX2 CPU)
    is checked at bf16's near-tie tolerance; a dense fp32 model at fp32's."""
    from proxy.engine.selfcheck import compute_dtype, tie_tolerance
    from proxy.quant import quantize_linears

    model = build_model("llama").float()
    assert compute_dtype(model) == torch.float32 and tie_tolerance(compute_dtype(model)) == 1e-3
    quantize_linears(model, "int4", 32, torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32
    assert compute_dtype(model) == torch.bfloat16 and tie_tolerance(compute_dtype(model)) == 1.0


def test_self_check_refuses_when_the_engine_raises(monkeypatch) -> None:
    model = _engine_model(build_model("llama"))

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise IndexError("index_copy_(): shape mismatch")

    monkeypatch.setattr(kernels, "attend", broken)
    with pytest.raises(
        SelfCheckError, match=r"'llama': the engine failed on prompt \d: engine step failed: IndexError"
    ):
        run_self_check(model, Settings(block_size=4), 256)


def test_engine_factory_runs_the_self_check_unless_disabled(tmp_path, monkeypatch) -> None:
    """The served engine is built only after the self-check passed; ``self_check=False`` skips it.
    (A patched function is no code change the record's key sees: the sabotaged run is forced.)"""
    from proxy.engine.factory import build_engine_client

    from ..arch_zoo import save_tiny_folder

    folder = str(save_tiny_folder("gemma2", tmp_path / "tiny-gemma2"))
    settings = Settings(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=256,
                        cache_dir=str(tmp_path / "cache"))
    assert settings.self_check is None  # on by default (unless a pass is recorded)
    assert build_engine_client(settings) is not None
    _drop_softcap(monkeypatch)  # an engine that would serve wrong text
    with pytest.raises(SelfCheckError, match=r"self-check failed for model type 'gemma2'.*first differs"):
        build_engine_client(dataclasses.replace(settings, self_check=True))
    assert build_engine_client(dataclasses.replace(settings, self_check=False)) is not None
