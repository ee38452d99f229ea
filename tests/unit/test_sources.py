"""Tests for base-model source resolution (`worker.models.sources`) and `carpool fetch-model`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from worker.models.devmodel import build_dev_model
from worker.models.sources import (
    BUILTIN_MODELS,
    CACHE_MARKER,
    ModelSourceError,
    builtin_gguf_path,
    default_cache_dir,
    resolve_model_source,
)


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dev_model(tmp_path_factory.mktemp("src") / "model", layers=1, hidden=32)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_local_dir_absolute_relative_and_file_url(
    dev_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model_source(str(dev_dir), tmp_path) == dev_dir.resolve()
    assert resolve_model_source(f"file://{dev_dir}", tmp_path) == dev_dir.resolve()
    monkeypatch.chdir(dev_dir.parent)
    assert resolve_model_source(dev_dir.name, tmp_path) == dev_dir.resolve()


def test_missing_dir_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source(f"file://{tmp_path / 'nope'}", tmp_path)
    with pytest.raises(ModelSourceError, match="neither an existing directory"):
        resolve_model_source(str(tmp_path / "nope"), tmp_path)


def test_dir_without_config_is_a_source_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model_source(str(tmp_path / "empty"), tmp_path)


@pytest.mark.usefixtures("offline")
def test_hf_offline_fails_fast_and_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="offline") as info:
        resolve_model_source("hf://carpool-test/definitely-not-a-real-model@main", tmp_path)
    assert "local model directory" in str(info.value)


@pytest.mark.usefixtures("offline")
def test_ms_offline_refuses_without_network(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="offline"):
        resolve_model_source("ms://Qwen/Qwen3-0.6B", tmp_path)


def test_ms_carpool_offline_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("CARPOOL_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="offline"):
        resolve_model_source("ms://Qwen/Qwen3-0.6B", tmp_path)


@pytest.mark.parametrize("source", ["hf://", "hf://a/b/c", "ms://bad name", "gguf://missing.gguf", "  "])
def test_malformed_sources_are_source_errors(tmp_path: Path, source: str) -> None:
    with pytest.raises(ModelSourceError):
        resolve_model_source(source, tmp_path)


def test_builtin_catalog_and_gguf_location() -> None:
    assert BUILTIN_MODELS["HuggingFaceTB/SmolLM2-135M-Instruct"] == "smollm2-135m"
    gguf = builtin_gguf_path()
    assert gguf.suffix == ".gguf" and gguf.is_file()


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CARPOOL_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "carpool"


def test_cli_fetch_model_local(dev_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fetch-model", str(dev_dir), "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(dev_dir.resolve())


@pytest.mark.usefixtures("offline")
def test_cli_fetch_model_error_exits_nonzero(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fetch-model", "hf://carpool-test/nope", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "error:" in result.output


@pytest.mark.slow
def test_smollm2_converts_once_and_generates(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    path = resolve_model_source("smollm2-135m", cache)
    assert (path / CACHE_MARKER).is_file() and path.parent == cache
    assert [p.name for p in cache.iterdir()] == [path.name], "no temp dirs left behind"
    marker_mtime = (path / CACHE_MARKER).stat().st_mtime_ns
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct", cache) == path
    assert (path / CACHE_MARKER).stat().st_mtime_ns == marker_mtime, "second resolve reused the cache"

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) == 49152
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4
