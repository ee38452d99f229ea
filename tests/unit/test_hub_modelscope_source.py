"""`ms://org/name[@rev]` base-model sources through ModelScope's `snapshot_download` (faked at that boundary:
ModelScope is unreachable from here), including the bounded wait when the hub does not answer."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import modelscope
import pytest

from worker.models import sources
from worker.models.sources import ModelSourceError, resolve_model_source


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("CARPOOL_OFFLINE", raising=False)


def _real_signature_bind(*args: object, **kwargs: object) -> None:
    from modelscope.hub.snapshot_download import snapshot_download

    inspect.signature(snapshot_download).bind(*args, **kwargs)


def test_ms_source_downloads_through_snapshot_download(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def fake(*args: object, **kwargs: object) -> str:
        _real_signature_bind(*args, **kwargs)  # what we call must exist in the installed modelscope
        calls.append((args, kwargs))
        return str(tiny_model_dir)

    monkeypatch.setattr(modelscope, "snapshot_download", fake)
    assert resolve_model_source("ms://Qwen/Qwen3-0.6B@v1.0", tmp_path) == tiny_model_dir.resolve()
    assert calls == [(("Qwen/Qwen3-0.6B",), {"revision": "v1.0"})]
    resolve_model_source("ms://Qwen/Qwen3-0.6B", tmp_path)
    assert calls[-1] == (("Qwen/Qwen3-0.6B",), {"revision": None})


def test_ms_download_error_is_a_clear_source_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(*_: object, **__: object) -> str:
        raise ConnectionError("Max retries exceeded with url: https://modelscope.cn/api/v1/models/x/y")

    monkeypatch.setattr(modelscope, "snapshot_download", fake)
    with pytest.raises(ModelSourceError, match=r"ms://x/y: download from ModelScope failed \(ConnectionError"):
        resolve_model_source("ms://x/y", tmp_path)


def test_unreachable_modelscope_fails_within_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hanging(*_: object, **__: object) -> str:
        release.wait(60)  # a hub that never answers
        raise ConnectionError("gave up")

    monkeypatch.setattr(modelscope, "snapshot_download", hanging)
    monkeypatch.setattr(sources, "MODELSCOPE_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(ModelSourceError, match=r"did not answer within 0 s .*local model directory"):
            resolve_model_source("ms://x/y", tmp_path)
    finally:
        release.set()


def test_the_deadline_is_thirty_seconds() -> None:
    assert sources.MODELSCOPE_TIMEOUT_S == 30.0


def test_ms_download_that_is_not_a_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modelscope, "snapshot_download", lambda *_, **__: str(tmp_path))
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model_source("ms://x/y", tmp_path)
