"""CLI: options and STREAMPROXY_* environment -> Settings."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from proxy.cli import build_parser, settings_from
from proxy.engine.scheduler import SchedulerConfig
from proxy.settings import ExecutionSwitches, Settings, execution_switches, export_execution_switches
from proxy.settings_groups import SETTINGS_GROUPS, attribute_docs, grouping_errors


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
    assert helps["max_num_seqs"].startswith("most requests in the running batch (>= 1). (env STREAMPROXY_")
    assert helps["num_kv_blocks"].startswith(
        "KV blocks on CPU; None: enough for max_num_seqs full contexts, capped by"
    )
    assert helps["keepalive_interval_s"].startswith("seconds between SSE comment lines")
    assert "a bare config: NO_CAP)" in helps["max_num_partial_prefills"]  # Sphinx roles reduced to the name
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


def _serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]


def test_every_settings_field_is_in_exactly_one_group() -> None:
    """A new Settings field needs a group: ``proxy/settings_groups.py`` (the message says so)."""
    names = [f.name for f in dataclasses.fields(Settings)]
    assert grouping_errors(names) == []
    assert grouping_errors([*names, "new_knob"]) == [
        ("Settings field 'new_knob' is in no group: list it in exactly one group of SETTINGS_GROUPS in "
         "proxy/settings_groups.py")]
    assert grouping_errors([n for n in names if n != "seed"]) == [
        "group 'server' lists 'seed', which is no Settings field"]


def test_help_prints_the_options_in_their_groups() -> None:
    serve = _serve_parser()
    titled = {g.title: [a.dest for a in g._group_actions] for g in serve._action_groups if g._group_actions}
    assert list(titled) == ["options", *(g.title for g in SETTINGS_GROUPS)]
    for group in SETTINGS_GROUPS:
        assert titled[group.title] == [n for n in group.fields if n != "extra_models"]
    assert titled["scheduler (proxy.engine.scheduler.SchedulerConfig)"][:2] == ["max_num_seqs",
                                                                               "max_num_batched_tokens"]
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    headings = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["options", *(g.title for g in SETTINGS_GROUPS)]


def test_a_field_in_no_group_is_still_an_option_under_other(monkeypatch) -> None:
    import proxy.cli

    monkeypatch.setattr(proxy.cli, "SETTINGS_GROUPS", SETTINGS_GROUPS[:-1])  # without the Responses API group
    groups = {g.title: [a.dest for a in g._group_actions] for g in _serve_parser()._action_groups}
    assert groups["other (add them to proxy/settings_groups.py)"] == list(SETTINGS_GROUPS[-1].fields)
    assert parse(["--responses-store-max-entries", "3"]).responses_store_max_entries == 3


def test_the_scheduler_knobs_are_described_once_in_scheduler_config() -> None:
    """Their --help is SchedulerConfig's docstring; Settings' docstring does not describe them; their
    server defaults are Settings' and stay what they were."""
    scheduler = next(g for g in SETTINGS_GROUPS if g.name == "scheduler").fields
    config_docs, settings_docs = attribute_docs(SchedulerConfig), attribute_docs(Settings)
    knobs = {f.name for f in dataclasses.fields(SchedulerConfig)}\
        & {f.name for f in dataclasses.fields(Settings)}
    assert set(scheduler) == knobs - {"max_model_len"}
    helps = {a.dest: a.help for a in _serve_parser()._actions}
    for name in scheduler:
        assert name not in settings_docs
        assert helps[name].startswith(config_docs[name].replace("%", "%%") + " (env STREAMPROXY_")
    assert {name: getattr(Settings(), name) for name in scheduler} == {
        "max_num_seqs": 32, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 128,
        "max_num_partial_prefills": 2, "max_prefill_step_ratio": 2.0, "max_long_gap_fraction": 0.01}
    described = set(settings_docs) | set(scheduler)
    assert described >= {f.name for f in dataclasses.fields(Settings)}


def test_execution_switches_are_settings_with_their_environment_names() -> None:
    assert (parse([]).amx_int4, parse([]).torch_ops) == (True, True)
    assert (parse(["--no-amx-int4"]).amx_int4, parse(["--no-torch-ops"]).torch_ops) == (False, False)
    env = {"STREAMPROXY_AMX_INT4": "0", "STREAMPROXY_TORCH_OPS": "false"}
    assert (parse([], env).amx_int4, parse([], env).torch_ops) == (False, False)
    assert parse(["--torch-ops"], env).torch_ops is True
    environ: dict[str, str] = {}
    export_execution_switches(Settings(torch_ops=False), environ)
    assert environ == {"STREAMPROXY_AMX_INT4": "1", "STREAMPROXY_TORCH_OPS": "0"}
    assert execution_switches(environ) == ExecutionSwitches(amx_int4=True, torch_ops=False)
    assert execution_switches(env) == ExecutionSwitches(amx_int4=False, torch_ops=False)
    assert execution_switches({"STREAMPROXY_AMX_INT4": ""}) == ExecutionSwitches()


def test_no_torch_ops_reaches_the_kernels_before_they_load() -> None:
    """``serve --no-torch-ops`` puts ``STREAMPROXY_TORCH_OPS=0`` into the environment before the app
    (and so ``proxy.quant.kernels``) is imported, even where the environment said 1."""
    code = ("import sys, proxy.cli as c\n"
            "class Stop(Exception): pass\n"
            "def stop(*a, **k):\n"
            "    import proxy.quant.kernels as k\n"
            "    raise Stop(k.TORCH_OPS_ERROR)\n"
            "c._server_class = lambda: stop\n"
            "try: c.main(['serve', '--no-torch-ops'])\n"
            "except Stop as e: print(e.args[0])\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "STREAMPROXY_TORCH_OPS": "1"},
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "turned off (STREAMPROXY_TORCH_OPS=0)"


@pytest.mark.parametrize("command", [["-m", "proxy", "models"], ["-m", "proxy.models"]])
def test_models_is_a_subcommand_and_python_m_proxy_models_its_alias(command: list[str]) -> None:
    out = subprocess.run([sys.executable, *command, "--help"], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    assert " ".join(out.split("\n\n")[0].split()) == \
        "usage: streamproxy models [-h] [--convert] [--model MODEL] [--mmproj MMPROJ] [--cache-dir CACHE_DIR]"
    args = build_parser().parse_args(["models", "--convert", "--model", "/m.gguf", "--cache-dir", "/c"])
    settings = settings_from(args, {"STREAMPROXY_DTYPE": "float32"})
    assert (args.command, args.convert) == ("models", True)
    assert settings == Settings(model="/m.gguf", cache_dir="/c", dtype="float32")


def test_models_subcommand_reports_a_bad_model_in_one_line(tmp_path, capsys):
    """``streamproxy models`` says why a model cannot be prepared in one line, as ``serve`` does (no
    traceback), and exits 1."""
    from proxy.cli import main

    missing = tmp_path / "missing.gguf"
    assert main(["models", "--convert", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err == (f"streamproxy: the model cannot be prepared: ModelLoadError: --model '{missing}': "
                   "not a Hugging Face folder or a .gguf file\n")
