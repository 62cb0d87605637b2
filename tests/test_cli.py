"""CLI: options and STREAMPROXY_* environment -> Settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.cli import build_parser, settings_from
from proxy.settings import Settings


def parse(argv, env=None):
    return settings_from(build_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_are_the_settings_defaults():
    assert parse([]) == Settings()


def test_options():
    s = parse(
        [
            "--model",
            "/m",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--served-model-name",
            "x",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "10",
            "--block-size",
            "8",
            "--max-waiting",
            "3",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--allowed-origins",
            "http://x,http://y",
            "--log-level",
            "debug",
            "--keepalive-interval-s",
            "2.5",
        ]
    )
    assert s == Settings(
        model="/m",
        host="0.0.0.0",
        port=9000,
        served_model_name="x",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        dtype="float32",
        device="cpu",
        num_kv_blocks=10,
        block_size=8,
        max_waiting=3,
        api_keys=("a", "b"),
        allowed_origins=("http://x", "http://y"),
        log_level="debug",
        keepalive_interval_s=2.5,
    )


def test_environment_and_precedence():
    env = {"STREAMPROXY_PORT": "8123", "STREAMPROXY_MODEL": "/env", "STREAMPROXY_API_KEYS": "k1, k2",
           "STREAMPROXY_MAX_MODEL_LEN": "512"}
    s = parse(["--model", "/cli"], env)
    assert (s.port, s.model, s.api_keys, s.max_model_len) == (8123, "/cli", ("k1", "k2"), 512)


def test_boolean_settings_are_flag_pairs():
    assert parse([]).enable_prefix_caching is True
    assert parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(
        ["--enable-prefix-caching"], {"STREAMPROXY_ENABLE_PREFIX_CACHING": "0"}
    ).enable_prefix_caching
    assert parse([], {"STREAMPROXY_ENABLE_PREFIX_CACHING": "false"}).enable_prefix_caching is False
    s = parse(["--long-prefill-token-threshold", "32", "--max-num-partial-prefills", "2"])
    assert (s.long_prefill_token_threshold, s.max_num_partial_prefills) == (32, 2)


def test_self_check_is_auto_unless_forced_or_off():
    """Unset: run unless a pass is recorded; --self-check forces it; --no-self-check turns it off."""
    assert parse([]).self_check is None
    assert parse(["--self-check"]).self_check is True
    assert parse(["--no-self-check"]).self_check is False
    assert parse([], {"STREAMPROXY_SELF_CHECK": "0"}).self_check is False
    assert parse([], {"STREAMPROXY_SELF_CHECK": "1"}).self_check is True


def test_bad_environment_value_is_an_error():
    with pytest.raises(ValueError, match="STREAMPROXY_PORT"):
        parse([], {"STREAMPROXY_PORT": "abc"})


@pytest.mark.parametrize("argv", [["--max-prefill-step-ratio", "0.5"], ["--max-long-gap-fraction", "1"],
                                  ["--max-long-gap-fraction", "-0.1"]])
def test_scheduling_ratios_no_engine_could_use_are_a_usage_error(argv: list[str], capsys) -> None:
    """Refused before a model is loaded, as argparse refuses a bad value (exit status 2)."""
    from proxy.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err
    assert parse(["--max-long-gap-fraction", "0"]).max_long_gap_fraction == 0.0  # 0: never lifted


def test_python_m_proxy_help():
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"], check=False, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for opt in ("--model", "--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                "--dtype", "--device", "--api-key", "STREAMPROXY_PORT"):
        assert opt in out.stdout


def test_help_describes_each_option_from_the_settings_docstring() -> None:
    from proxy.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in serve._actions}
    assert helps["max_num_seqs"].startswith("most requests in the running batch.")
    assert helps["num_kv_blocks"].startswith(
        "KV blocks on CPU; None: enough for max_num_seqs full contexts, capped by"
    )
    assert helps["keepalive_interval_s"].startswith("seconds between SSE comment lines")
    assert all(h and "(env STREAMPROXY_" in h for d, h in helps.items() if d != "help")


def test_serve_leaves_openmp_waiting_to_the_environment() -> None:
    """``serve`` sets no ``OMP_WAIT_POLICY`` (libgomp's default spin: PASSIVE made batch-1 decode
    2.3x slower, ``proxy.engine.core_proc.child``) and keeps one the environment sets; torch is not
    loaded before the app."""
    code = ("import os, sys, proxy.cli as c\n"
            "class Stop(Exception): pass\n"
            "def stop(*a, **k): raise Stop(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
            "c._server_class = lambda: stop\n"
            "try: c.serve(c.Settings())\n"
            "except Stop as e: print(*e.args)\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "PASSIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "False"]
