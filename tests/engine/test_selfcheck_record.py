"""A passed load-time self-check is remembered per weights, code, versions and settings
(``proxy.engine.selfcheck_record``): the same inputs skip it, changed ones rerun it, a failure is never
recorded, ``self_check=True`` forces it. Runs are counted through ``run_self_check`` and the record
folder, not timed."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from proxy.engine import selfcheck
from proxy.engine.execution.attention import kernels
from proxy.engine.loading import load_engine_model as load_model
from proxy.engine.selfcheck import SelfCheckError
from proxy.engine.selfcheck_record import RECORD_DIR, check_at_load, key_inputs, self_check_key
from proxy.models.loaded import LoadedModel
from proxy.settings import Settings

from .arch_zoo import save_tiny_folder

MAX_LEN = 128
SKIPPED = "self-check passed earlier for these weights/settings"


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[LoadedModel, Settings]:
    folder = save_tiny_folder("gemma2", tmp_path / "tiny-gemma2")
    settings = Settings(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=64,
                        max_model_len=MAX_LEN, cache_dir=str(tmp_path / "cache"))
    return load_model(settings), settings


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each real ``run_self_check`` call's report (or the error it raised)."""
    seen: list[Any] = []
    real = selfcheck.run_self_check

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            report = real(*args, **kwargs)
        except SelfCheckError as exc:
            seen.append(exc)
            raise
        seen.append(report)
        return report

    monkeypatch.setattr(selfcheck, "run_self_check", counted)
    return seen


def _drop_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that drops gemma2's logit soft-cap: it serves wrong text."""
    attend = kernels.attend
    monkeypatch.setattr(
        kernels, "attend", lambda q, k, v, m, s, cap, sinks: attend(q, k, v, m, s, None, sinks)
    )


def _records(settings: Settings) -> list[Path]:
    assert settings.cache_dir is not None
    return sorted((Path(settings.cache_dir) / RECORD_DIR).glob("*.json"))


def test_same_inputs_skip_the_check(tiny, runs, caplog) -> None:
    loaded, settings = tiny
    caplog.set_level(logging.INFO, logger="proxy.engine.selfcheck_record")
    report = check_at_load(loaded, settings, MAX_LEN)
    assert report is not None and len(runs) == 1
    (record,) = _records(settings)
    assert record.name == self_check_key(key_inputs(loaded, settings, MAX_LEN)) + ".json"
    assert not any(SKIPPED in r.getMessage() for r in caplog.records)
    # a second engine build over the same weights and settings
    assert check_at_load(loaded, dataclasses.replace(settings, port=9999, api_keys=("k",)), MAX_LEN) is None
    assert len(runs) == 1 and _records(settings) == [record]
    (skip,) = [r.getMessage() for r in caplog.records if SKIPPED in r.getMessage()]
    assert str(record) in skip and "skipped" in skip


@pytest.mark.parametrize("change", [
    {"block_size": 8}, {"quantization_group_size": 64}, {"max_num_seqs": 4}, {"dense_prefill": True},
])
def test_a_changed_setting_reruns_it(tiny, runs, change) -> None:
    loaded, settings = tiny
    check_at_load(loaded, settings, MAX_LEN)
    check_at_load(loaded, dataclasses.replace(settings, **change), MAX_LEN)
    assert len(runs) == 2 and len(_records(settings)) == 2


def test_a_changed_context_or_dtype_reruns_it(tiny, runs) -> None:
    loaded, settings = tiny
    check_at_load(loaded, settings, MAX_LEN)
    check_at_load(loaded, settings, MAX_LEN - 32)
    check_at_load(dataclasses.replace(loaded, quantization="int8 g32 x1"), settings, MAX_LEN)
    assert len(runs) == 3 and len(_records(settings)) == 3


def test_changed_weights_rerun_it(tiny, runs) -> None:
    loaded, settings = tiny
    check_at_load(loaded, settings, MAX_LEN)
    (weights,) = Path(loaded.model_path).glob("*.safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place
    check_at_load(loaded, settings, MAX_LEN)
    assert len(runs) == 2 and len(_records(settings)) == 2


def test_a_failed_check_writes_no_record(tiny, runs, monkeypatch) -> None:
    loaded, settings = tiny
    _drop_softcap(monkeypatch)
    with pytest.raises(SelfCheckError, match="first differs"):
        check_at_load(loaded, settings, MAX_LEN)
    with pytest.raises(SelfCheckError):  # and the next start checks again
        check_at_load(loaded, settings, MAX_LEN)
    assert len(runs) == 2 and all(isinstance(r, SelfCheckError) for r in runs)
    assert _records(settings) == []


def test_forced_reruns_it_and_a_forced_failure_forgets_the_pass(tiny, runs, monkeypatch) -> None:
    loaded, settings = tiny
    forced = dataclasses.replace(settings, self_check=True)
    check_at_load(loaded, settings, MAX_LEN)
    (record,) = _records(settings)
    assert check_at_load(loaded, forced, MAX_LEN) is not None  # same key: the record is rewritten
    assert len(runs) == 2 and _records(settings) == [record]
    _drop_softcap(monkeypatch)
    with pytest.raises(SelfCheckError):
        check_at_load(loaded, forced, MAX_LEN)
    assert len(runs) == 3 and _records(settings) == []


def test_off_never_runs_nor_records(tiny, runs) -> None:
    loaded, settings = tiny
    assert check_at_load(loaded, dataclasses.replace(settings, self_check=False), MAX_LEN) is None
    assert runs == [] and _records(settings) == []


def test_a_damaged_record_is_ignored(tiny, runs) -> None:
    loaded, settings = tiny
    check_at_load(loaded, settings, MAX_LEN)
    (record,) = _records(settings)
    record.write_text("{not json", encoding="utf-8")
    check_at_load(loaded, settings, MAX_LEN)
    assert len(runs) == 2 and '"passed": true' in record.read_text(encoding="utf-8")
